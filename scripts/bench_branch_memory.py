"""Peak memory of branch attention (forward + backward) against a dense masked baseline, on CPU.

Claim checked (docs/DESIGN.md section 3): at a fixed number of TTT passes ``D`` (``P = D - 1``
branch key sets), the memory branch attention adds grows linearly in the row length ``S``,
while an implementation that scores every query against the concatenated keys
``[trunk (S) ; branches (P * S)]`` under a dense ``[S, S + P*S]`` mask grows as ``D * S^2``.
Rows are packed with documents of ``--doc-len`` tokens; all tensors are fp32.

How memory is measured: every run of one (implementation, S) point is a fresh subprocess. After
the imports, the inputs, and one warm-up call on a short row (so one-time setup such as the
thread pool is not counted), the child resets the kernel's peak-RSS counter (writing ``5`` to
``/proc/self/clear_refs`` resets ``VmHWM``; Linux >= 4.0) and reads ``VmRSS`` as its
baseline. It then runs forward + backward once and reports ``VmHWM - baseline``: everything
the op and its autograd made resident at the worst moment (outputs, saved activations,
gradients, kernel scratch, allocator slack), and nothing the inputs already held. RSS
because it is what the machine must provide, tensor or not, and torch keeps no peak
statistics for CPU memory; a fresh process per run keeps one run's freed-but-cached heap
out of the next one's numbers. The allocator's heap-versus-mmap choices move a run by up to
~10%; the thresholds below leave room for that (a linear doubling read with 10% error at
both ends is still below x2.5), and ``--repeats N`` keeps the median of N runs per point.

Exits non-zero when:
* branch attention disagrees with the dense implementation (fp64, a small packed row,
  the output and all five input gradients);
* branch memory does not grow linearly: the log-log slope of peak vs S over the sizes from
  ``--fit-from`` on must lie in [0.8, 1.25], and every doubling of S must multiply the peak
  by less than 3 (halfway between x2, linear, and x4, quadratic);
* the control fails: every doubling must multiply the dense baseline's peak by more than 3
  (a method that cannot see quadratic growth cannot vouch for linear growth).

Writes ``--json`` (records, checks, configuration) and ``--png`` (log-log plot, drawn by the
small PNG writer below: matplotlib is not a project dependency).

    .venv/bin/python scripts/bench_branch_memory.py     # about a minute on one thread
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time
from pathlib import Path

import torch

from titan_cotrain.ops import branch_attention

sys.path.insert(0, str(Path(__file__).resolve().parent))
from pngplot import BLACK, BLUE, GREY, GRID, RED, Canvas  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
N_HEADS, N_KV_HEADS, HEAD_DIM = 4, 2, 64
SCALE = HEAD_DIM**-0.5
MAX_ABS_ERROR_FP64 = 1e-9
SLOPE_RANGE = (0.8, 1.25)
# Halfway between linear (a doubling of S doubles the peak) and quadratic (quadruples it).
DOUBLING_SPLIT = 3.0
# Dense peak / one fp32 score matrix [Hq, S, S + P*S] (measured 3.1-3.3: scores, masked scores,
# probabilities and their gradients overlap). Only used to skip sizes beyond the budget.
DENSE_PEAK_PER_SCORE_MATRIX = 3.5


def dense_branch_attention(q, k, v, branch_k, branch_v, cu_seqlens, scale):
    """The naive baseline: one softmax over ``[trunk keys (S) ; branch keys (P*S)]`` under a
    dense ``[S, S + P*S]`` mask (document-causal on the trunk, ``t == t'`` on each branch).
    Shapes as in ``branch_attention``; GQA by repeating the kv heads."""
    s, n_rep = q.shape[0], q.shape[1] // k.shape[1]
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    doc = torch.repeat_interleave(torch.arange(lengths.numel()), lengths)
    pos = torch.arange(s)
    trunk_mask = (doc[:, None] == doc[None, :]) & (pos[None, :] <= pos[:, None])
    branch_mask = (pos[:, None] == pos[None, :]).repeat(1, branch_k.shape[0])
    mask = torch.cat([trunk_mask, branch_mask], dim=1)
    keys = torch.cat([k, branch_k.flatten(0, 1)]).repeat_interleave(n_rep, dim=1)
    values = torch.cat([v, branch_v.flatten(0, 1)]).repeat_interleave(n_rep, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, keys) * scale
    probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
    return torch.einsum("hqk,khd->qhd", probs, values)


IMPLS = {"branch": branch_attention, "naive": dense_branch_attention}


def make_inputs(seq_len: int, doc_lens: list[int], branch_sets: int, dtype: torch.dtype, seed: int = 0):
    """``(q, k, v, branch_k, branch_v)`` requiring grad, ``cu_seqlens``, and a fixed ``grad_out``."""
    g = torch.Generator().manual_seed(seed)
    shapes = [
        (seq_len, N_HEADS, HEAD_DIM),
        (seq_len, N_KV_HEADS, HEAD_DIM),
        (seq_len, N_KV_HEADS, HEAD_DIM),
        (branch_sets, seq_len, N_KV_HEADS, HEAD_DIM),
        (branch_sets, seq_len, N_KV_HEADS, HEAD_DIM),
    ]
    tensors = [torch.randn(shape, generator=g, dtype=dtype).requires_grad_() for shape in shapes]
    cu_seqlens = torch.tensor([0, *torch.tensor(doc_lens).cumsum(0).tolist()], dtype=torch.int32)
    return tensors, cu_seqlens, torch.randn(shapes[0], generator=g, dtype=dtype)


def packed_docs(seq_len: int, doc_len: int) -> list[int]:
    return [doc_len] * (seq_len // doc_len) + ([seq_len % doc_len] if seq_len % doc_len else [])


def check_correctness(branch_sets: int) -> dict:
    """Max abs difference, fp64, of the output and the five gradients on an uneven packed row."""
    tensors, cu_seqlens, grad_out = make_inputs(96, [40, 1, 31, 24], branch_sets, torch.float64)
    results = {}
    for name, fn in IMPLS.items():
        inputs = [t.detach().clone().requires_grad_() for t in tensors]
        out = fn(*inputs, cu_seqlens, SCALE)
        results[name] = [out, *torch.autograd.grad(out, inputs, grad_out)]
    labels = ["out", "dq", "dk", "dv", "dbranch_k", "dbranch_v"]
    return {label: (got - want).abs().max().item() for label, got, want in zip(labels, results["branch"], results["naive"])}


def _status_bytes(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {key}")


def measure(impl: str, seq_len: int, doc_len: int, branch_sets: int) -> dict:
    """One point, in this (fresh) process: peak RSS of one forward + backward above the baseline."""
    fn = IMPLS[impl]
    # One-time costs (thread pool, kernel dispatch caches) belong to the baseline, not the op.
    warm_tensors, warm_cu, warm_grad = make_inputs(2 * doc_len, packed_docs(2 * doc_len, doc_len), branch_sets, torch.float32)
    fn(*warm_tensors, warm_cu, SCALE).backward(warm_grad)
    del warm_tensors, warm_grad
    tensors, cu_seqlens, grad_out = make_inputs(seq_len, packed_docs(seq_len, doc_len), branch_sets, torch.float32, seed=1)
    input_bytes = sum(t.numel() * t.element_size() for t in (*tensors, grad_out))

    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    baseline = _status_bytes("VmRSS")
    start = time.perf_counter()
    fn(*tensors, cu_seqlens, SCALE).backward(grad_out)
    seconds = time.perf_counter() - start
    peak = _status_bytes("VmHWM") - baseline
    return {"baseline_rss_bytes": baseline, "input_bytes": input_bytes, "peak_bytes": peak, "seconds": round(seconds, 3)}


def run_point(impl: str, seq_len: int, args: argparse.Namespace) -> dict:
    """``measure`` in ``args.repeats`` fresh interpreters; the record keeps the median peak and every run's."""
    command = [
        sys.executable, __file__, "--child", impl, str(seq_len),
        "--doc-len", str(args.doc_len), "--ttt-steps", str(args.ttt_steps), "--threads", str(args.threads),
    ]
    runs = []
    for _ in range(args.repeats):
        proc = subprocess.run(command, capture_output=True, text=True, check=False)
        if proc.returncode:
            raise SystemExit(f"measuring {impl} at S={seq_len} failed:\n{proc.stderr}")
        runs.append(json.loads(proc.stdout.splitlines()[-1]))
    median = sorted(runs, key=lambda run: run["peak_bytes"])[len(runs) // 2]
    return {
        "impl": impl, "seq_len": seq_len, "ttt_steps": args.ttt_steps, "branch_sets": args.ttt_steps - 1,
        "doc_len": args.doc_len, **median, "peak_bytes_runs": [run["peak_bytes"] for run in runs],
    }


def least_squares_slope(xs: list[float], ys: list[float]) -> float:
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)


def doubling_ratios(points: list[tuple[int, int]]) -> list[float]:
    return [round(p2 / p1, 3) for (s1, p1), (s2, p2) in zip(points, points[1:]) if s2 == 2 * s1]


def check_growth(records: list[dict], fit_from: int) -> tuple[dict, list[str]]:
    """The linear-growth checks and the dense control; returns (numbers, failures)."""
    series = {impl: [(r["seq_len"], r["peak_bytes"]) for r in records if r["impl"] == impl] for impl in IMPLS}
    sizes, peaks = zip(*[(s, p) for s, p in series["branch"] if s >= fit_from])
    slope = least_squares_slope([math.log(s) for s in sizes], [math.log(p) for p in peaks])
    numbers = {
        "branch_loglog_slope": round(slope, 3),
        "branch_fit_from_seq_len": fit_from,
        "branch_bytes_per_token": round(least_squares_slope(sizes, peaks)),
        "branch_doubling_ratios": doubling_ratios(series["branch"]),
        "naive_doubling_ratios": doubling_ratios(series["naive"]),
    }
    failures = []
    if not SLOPE_RANGE[0] <= slope <= SLOPE_RANGE[1]:
        failures.append(f"branch peak grows as S^{slope:.2f} over S >= {fit_from}, not linearly")
    if any(r >= DOUBLING_SPLIT for r in numbers["branch_doubling_ratios"]):
        failures.append(f"a doubling of S multiplied the branch peak by {DOUBLING_SPLIT} or more")
    if not numbers["naive_doubling_ratios"]:
        failures.append("the dense control needs two sizes a doubling apart within the budget")
    elif any(r <= DOUBLING_SPLIT for r in numbers["naive_doubling_ratios"]):
        failures.append("control: the dense baseline's peak did not grow quadratically, so the method is suspect")
    return numbers, failures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--child", nargs=2, metavar=("IMPL", "S"), help=argparse.SUPPRESS)
    parser.add_argument("--ttt-steps", type=int, default=7, help="D; the op sees P = D - 1 branch key sets")
    parser.add_argument("--doc-len", type=int, default=1024, help="tokens per packed document")
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384, 32768])
    parser.add_argument("--fit-from", type=int, default=4096, help="smallest S in the linearity fit")
    parser.add_argument("--naive-budget-gb", type=float, default=3.0, help="skip dense sizes estimated above this")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=1, help="fresh processes per point; the median is kept")
    parser.add_argument("--json", type=Path, default=ROOT / "assets" / "bench_branch_memory.json")
    parser.add_argument("--png", type=Path, default=ROOT / "assets" / "bench_branch_memory.png")
    args = parser.parse_args()
    if sum(s >= args.fit_from for s in args.seq_lens) < 2:
        parser.error("the linearity fit needs at least two --seq-lens from --fit-from on")
    torch.set_num_threads(args.threads)
    branch_sets = args.ttt_steps - 1
    if args.child:
        impl, seq_len = args.child
        print(json.dumps(measure(impl, int(seq_len), args.doc_len, branch_sets)))
        return 0

    start = time.perf_counter()
    errors = check_correctness(branch_sets)
    if max(errors.values()) > MAX_ABS_ERROR_FP64:
        print(f"FAIL: branch attention differs from the dense implementation: {errors}", file=sys.stderr)
        return 1
    records, skipped = [], []
    for impl in IMPLS:
        for seq_len in args.seq_lens:
            dense_estimate = DENSE_PEAK_PER_SCORE_MATRIX * N_HEADS * seq_len * (seq_len + branch_sets * seq_len) * 4
            if impl == "naive" and dense_estimate > args.naive_budget_gb * 2**30:
                skipped.append({"impl": impl, "seq_len": seq_len, "estimated_peak_bytes": int(dense_estimate)})
                continue
            record = run_point(impl, seq_len, args)
            records.append(record)
            print(f"{impl:>6}  S={seq_len:>6}  peak {record['peak_bytes'] / 2**20:9.1f} MiB  ({record['seconds']:.2f} s)")
    numbers, failures = check_growth(records, args.fit_from)

    result = {
        "description": __doc__.split("\n\n")[1].replace("\n", " "),
        "config": {
            "ttt_steps": args.ttt_steps, "branch_sets": branch_sets, "doc_len": args.doc_len, "n_heads": N_HEADS,
            "n_kv_heads": N_KV_HEADS, "head_dim": HEAD_DIM, "dtype": "float32", "threads": args.threads,
            "repeats": args.repeats,
            "naive_budget_bytes": int(args.naive_budget_gb * 2**30), "torch": torch.__version__,
        },
        "method": "fresh process per run; peak_bytes = VmHWM after one forward+backward minus VmRSS right "
                  "after resetting VmHWM (/proc/self/clear_refs), with inputs allocated and one warm-up call done; "
                  "median of the runs",
        "records": records,
        "skipped": skipped,
        "checks": {
            "correctness_max_abs_error_fp64": errors, **numbers, "passed": not failures, "failures": failures,
        },
        "runtime_seconds": round(time.perf_counter() - start, 1),
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2) + "\n")
    plot(records, numbers, args).save(args.png)
    print(json.dumps(result["checks"], indent=2))
    for failure in failures:
        print(f"FAIL: {failure}", file=sys.stderr)
    return 1 if failures else 0


# ---- a log-log plot, written as a PNG with zlib ----

def _decimal_units(n: float) -> str:
    for unit, size in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:g}{unit}"
    return f"{n:g}"


def plot(records: list[dict], numbers: dict, args: argparse.Namespace) -> Canvas:
    """Peak bytes against S, log-log: branch, dense measured, the dense quadratic fit, a linear guide."""
    series = {impl: [(r["seq_len"], r["peak_bytes"]) for r in records if r["impl"] == impl] for impl in IMPLS}
    sizes = sorted({s for s, _ in series["branch"]} | {s for s, _ in series["naive"]})
    s_max = sizes[-1]
    dense_fit = []
    if series["naive"]:
        # Dense extrapolation: c * S^2 through the largest measured dense point.
        ns, npk = series["naive"][-1]
        dense_fit = [(s, npk * (s / ns) ** 2) for s in sizes if s >= ns]
    bs, bpk = series["branch"][-1]
    linear_guide = [(sizes[0], bpk * sizes[0] / bs), (s_max, bpk * s_max / bs)]
    values = [p for _, p in series["branch"] + series["naive"] + dense_fit]
    y_lo, y_hi = math.floor(math.log10(min(values))), math.ceil(math.log10(max(values)))

    canvas = Canvas(900, 600)
    left, right, top, bottom = 100, 880, 70, 520
    x_lo, x_hi = math.log2(sizes[0]) - 0.3, math.log2(s_max) + 0.3

    def xy(s: float, p: float) -> tuple[float, float]:
        x = left + (math.log2(s) - x_lo) / (x_hi - x_lo) * (right - left)
        y = bottom - (math.log10(p) - y_lo) / (y_hi - y_lo) * (bottom - top)
        return x, y

    for s in sizes:
        x, _ = xy(s, 10**y_lo)
        canvas.line(x, top, x, bottom, GRID)
        label = f"{s // 1024}K" if s % 1024 == 0 else str(s)
        canvas.text(round(x - canvas.text_width(label) / 2), bottom + 12, label)
    for e in range(y_lo, y_hi + 1):
        _, y = xy(sizes[0], 10**e)
        canvas.line(left, y, right, y, GRID)
        label = _decimal_units(10**e)
        canvas.text(left - 12 - canvas.text_width(label), round(y - 7), label)
    canvas.line(left, top, left, bottom, BLACK, 2)
    canvas.line(left, bottom, right, bottom, BLACK, 2)

    def polyline(points, color, width=3, dash=0, marker=False):
        pixels = [xy(s, p) for s, p in points]
        for (x0, y0), (x1, y1) in zip(pixels, pixels[1:]):
            canvas.line(x0, y0, x1, y1, color, width, dash)
        if marker:
            for x, y in pixels:
                canvas.rect(round(x) - 5, round(y) - 5, 11, 11, color)

    polyline(linear_guide, GREY, 2, dash=8)
    polyline(dense_fit, RED, 2, dash=8)
    polyline(series["naive"], RED, marker=True)
    polyline(series["branch"], BLUE, marker=True)

    title = f"PEAK MEMORY ABOVE INPUTS, FORWARD + BACKWARD, D={args.ttt_steps} (CPU, FP32)"
    canvas.text((canvas.width - canvas.text_width(title)) // 2, 20, title)
    canvas.text(left, 50, "BYTES", GREY)
    x_label = f"TOKENS PER PACKED ROW, S (DOCUMENTS OF {args.doc_len})"
    canvas.text((left + right - canvas.text_width(x_label)) // 2, bottom + 45, x_label)
    legend = [
        (BLUE, 0, f"BRANCH ATTENTION (LOG-LOG SLOPE {numbers['branch_loglog_slope']:.2f})"),
        (RED, 0, f"DENSE MASKED SCORES, S X {args.ttt_steps}S"),
        (RED, 8, "DENSE, QUADRATIC FROM ITS LAST POINT"),
        (GREY, 8, "LINEAR GUIDE"),
    ]
    canvas.legend(left + 20, top + 18, legend, step=26)
    return canvas


if __name__ == "__main__":
    sys.exit(main())
