"""Peak memory of branch attention (forward + backward) against a dense masked baseline, on CPU
or a CUDA GPU, in two row layouts: packed documents, and one document as long as the row.

Claim checked (docs/DESIGN.md section 3): at a fixed number of TTT passes ``D`` (``P = D - 1``
branch key sets), branch attention's memory grows linearly in the row length ``S``, while an
implementation that scores every query against the concatenated keys ``[trunk (S) ;
branches (P * S)]`` under a dense ``[S, S + P*S]`` mask grows as ``D * S^2``. All tensors fp32
on CPU, bf16 on a GPU (the flash kernels' dtype).

Two layouts, because a packed row of ``--doc-len``-token documents makes any per-document
attention linear in ``S`` by construction (more documents, not longer ones):
* ``packed``: rows of ``--doc-len`` (1024) token documents;
* ``one_doc``: one ``S``-token document: the trunk is causal attention over the whole row.
Three implementations per layout:
* ``branch``: ``branch_attention`` with ``P`` branch key sets (the whole op);
* ``trunk``: the same op with ``P = 0``: the document-causal trunk attention alone, the CPU
  flash kernel (fused: no ``S x S`` scores, so O(S) memory even for one S-token document);
* ``naive``: the dense baseline below, under the same document mask.
``added = branch - trunk`` (per S, medians) is what the branch key sets add on top of the
trunk: the branch K/V gradients, the ``[S, H, P]`` branch scores and the merge, O(S * P).

How memory is measured: every run of one (layout, implementation, S) point is a fresh
subprocess. After the imports, one warm-up call on a short row (so one-time setup such as the
thread pool is not counted) and the inputs, the child hands the heap's free memory back to
the OS (``malloc_trim``: memory the warm-up freed would otherwise absorb a small measured
call unseen), then resets the kernel's peak-RSS counter
(writing ``5`` to ``/proc/self/clear_refs`` resets ``VmHWM``; Linux >= 4.0) and reads
``VmRSS`` as its baseline. It then runs forward + backward once and reports ``VmHWM -
baseline``: everything the op and its autograd made resident at the worst moment (outputs,
saved activations, gradients, kernel scratch, allocator slack), and nothing the inputs
already held. RSS because it is what the machine must provide, tensor or not, and torch
keeps no peak statistics for CPU memory; a fresh process per run keeps one run's
freed-but-cached heap out of the next one's numbers. The allocator's heap-versus-mmap
choices move a run by up to ~10%; the thresholds below leave room for that (a linear
doubling read with 10% error at both ends is still below x2.5), and ``--repeats N`` keeps the
median of N runs per point. Memory only: the one-document trunk's *time* is quadratic (causal
attention over S tokens), the packed one's linear.

Exits non-zero when (checked first: correctness):
* branch attention disagrees with the dense implementation (fp64, a small packed row and a
  one-document row, P and P = 0, the output and all five input gradients);
* in either layout, ``branch`` or ``trunk`` does not grow linearly over the sizes from
  ``--fit-from`` on (below it, fixed costs of a few MiB, kernel scratch and allocator
  rounding, dominate the small peaks): every doubling of S must multiply the peak by less
  than 3 (halfway between x2, linear, and x4, quadratic), and the log-log slope of peak vs S
  must lie in [0.8, 1.25] for ``branch``; for the trunk, a smaller peak whose fixed share
  bends the fit below 1, in [0.5, 1.25]. ``added`` is reported, not checked: it is at most
  ``branch``, so linear whenever the whole op is, and as a difference of two separate runs'
  peaks (each within ~10%) its own doublings are too noisy to test at small S;
* the control fails: in either layout every doubling must multiply the dense baseline's peak
  by more than 3 (a method that cannot see quadratic growth cannot vouch for linear growth).

On a GPU (``--device cuda``) a point is measured in this process, by the caching allocator's
own statistics: one untimed call at the same shape first (the kernels' workspaces then belong
to the baseline), the inputs' gradients dropped, then ``torch.cuda.max_memory_allocated()``
after one forward + backward minus ``torch.cuda.memory_allocated()`` before it: every tensor
the op and its autograd held at the worst moment, above the inputs (not the allocator's
cached slack). ``seconds`` is the median over ``--repeats`` calls timed by CUDA events. The
correctness check runs on the host in fp64 in both modes.

Writes ``--json`` (records, checks per layout, configuration) and ``--png`` (log-log plot,
one panel per layout; ``--replot`` redraws it from the JSON).

    .venv/bin/python scripts/bench_branch_memory.py     # a few minutes on one thread
    .venv/bin/python scripts/bench_branch_memory.py --device cuda --seq-lens 2048 4096 8192 16384 32768 65536 131072 \
        --fit-from 8192 --naive-budget-gb 40               # 8K-128K on one GPU
"""

from __future__ import annotations

import argparse
import ctypes
import json
import math
import subprocess
import sys
import time
from pathlib import Path

import torch

from titan_cotrain.ops import branch_attention

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchtools import command_line, optional_plot, plain_ticks, pyplot  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
N_HEADS, N_KV_HEADS, HEAD_DIM = 4, 2, 64
SCALE = HEAD_DIM**-0.5
MAX_ABS_ERROR_FP64 = 1e-9
SLOPE_RANGE = (0.8, 1.25)
# The trunk alone is a smaller peak with a fixed part (kernel scratch, allocator rounding)
# that bends a log-log fit below 1: it must not grow faster than linearly, and must visibly
# grow (the method sees it).
TRUNK_SLOPE_RANGE = (0.5, 1.25)
# Halfway between linear (a doubling of S doubles the peak) and quadratic (quadruples it).
DOUBLING_SPLIT = 3.0
WARMUP_TOKENS = 256
# Dense peak / one fp32 score matrix [Hq, S, S + P*S] (measured 3.1-3.3: scores, masked scores,
# probabilities and their gradients overlap). Only used to skip sizes beyond the budget.
DENSE_PEAK_PER_SCORE_MATRIX = 3.5


def dense_branch_attention(q, k, v, branch_k, branch_v, cu_seqlens, scale):
    """The naive baseline: one softmax over ``[trunk keys (S) ; branch keys (P*S)]`` under a
    dense ``[S, S + P*S]`` mask (document-causal on the trunk, ``t == t'`` on each branch).
    Shapes as in ``branch_attention``; GQA by repeating the kv heads."""
    s, n_rep = q.shape[0], q.shape[1] // k.shape[1]
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long().to(q.device)
    doc = torch.repeat_interleave(torch.arange(lengths.numel(), device=q.device), lengths)
    pos = torch.arange(s, device=q.device)
    trunk_mask = (doc[:, None] == doc[None, :]) & (pos[None, :] <= pos[:, None])
    branch_mask = (pos[:, None] == pos[None, :]).repeat(1, branch_k.shape[0])
    mask = torch.cat([trunk_mask, branch_mask], dim=1)
    keys = torch.cat([k, branch_k.flatten(0, 1)]).repeat_interleave(n_rep, dim=1)
    values = torch.cat([v, branch_v.flatten(0, 1)]).repeat_interleave(n_rep, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, keys) * scale
    probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
    return torch.einsum("hqk,khd->qhd", probs, values)


IMPLS = {"branch": branch_attention, "trunk": branch_attention, "naive": dense_branch_attention}
LAYOUTS = ("packed", "one_doc")


def doc_lens(layout: str, seq_len: int, doc_len: int) -> list[int]:
    return packed_docs(seq_len, doc_len) if layout == "packed" else [seq_len]


def make_inputs(seq_len: int, doc_lens: list[int], branch_sets: int, dtype: torch.dtype, seed: int = 0,
                device: torch.device | str = "cpu"):
    """``(q, k, v, branch_k, branch_v)`` on ``device`` requiring grad, ``cu_seqlens`` (host), and a
    fixed ``grad_out``."""
    g = torch.Generator().manual_seed(seed)
    shapes = [
        (seq_len, N_HEADS, HEAD_DIM),
        (seq_len, N_KV_HEADS, HEAD_DIM),
        (seq_len, N_KV_HEADS, HEAD_DIM),
        (branch_sets, seq_len, N_KV_HEADS, HEAD_DIM),
        (branch_sets, seq_len, N_KV_HEADS, HEAD_DIM),
    ]
    tensors = [torch.randn(shape, generator=g, dtype=dtype).to(device).requires_grad_() for shape in shapes]
    cu_seqlens = torch.tensor([0, *torch.tensor(doc_lens).cumsum(0).tolist()], dtype=torch.int32)
    return tensors, cu_seqlens, torch.randn(shapes[0], generator=g, dtype=dtype).to(device)


def packed_docs(seq_len: int, doc_len: int) -> list[int]:
    return [doc_len] * (seq_len // doc_len) + ([seq_len % doc_len] if seq_len % doc_len else [])


def check_correctness(branch_sets: int) -> dict:
    """Max abs difference, fp64, of the output and the five gradients against the dense
    implementation, per case: an uneven packed row and one document, with P and P = 0 sets."""
    labels = ["out", "dq", "dk", "dv", "dbranch_k", "dbranch_v"]
    errors = {}
    for layout, docs in (("packed", [40, 1, 31, 24]), ("one_doc", [96])):
        for p in (branch_sets, 0):
            tensors, cu_seqlens, grad_out = make_inputs(96, docs, p, torch.float64)
            results = {}
            for fn in (branch_attention, dense_branch_attention):
                inputs = [t.detach().clone().requires_grad_() for t in tensors]
                out = fn(*inputs, cu_seqlens, SCALE)
                results[fn] = [out, *torch.autograd.grad(out, inputs, grad_out, allow_unused=True)]
            errors[f"{layout}, P={p}"] = {
                label: 0.0 if got is None or not got.numel() else (got - want).abs().max().item()
                for label, got, want in zip(labels, results[branch_attention], results[dense_branch_attention])}
    return errors


def _status_bytes(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {key}")


def measure(impl: str, layout: str, seq_len: int, doc_len: int, branch_sets: int) -> dict:
    """One point, in this (fresh) process: peak RSS of one forward + backward above the baseline."""
    fn = IMPLS[impl]
    branch_sets = 0 if impl == "trunk" else branch_sets
    # One-time costs (thread pool, kernel dispatch caches) belong to the baseline, not the op;
    # a short warm-up row, and its freed heap handed back to the OS, so that the measured call
    # cannot hide in memory the warm-up left resident.
    warm_len = WARMUP_TOKENS
    warm_tensors, warm_cu, warm_grad = make_inputs(warm_len, doc_lens(layout, warm_len, min(doc_len, warm_len // 2)),
                                                   branch_sets, torch.float32)
    fn(*warm_tensors, warm_cu, SCALE).backward(warm_grad)
    del warm_tensors, warm_grad
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    tensors, cu_seqlens, grad_out = make_inputs(seq_len, doc_lens(layout, seq_len, doc_len), branch_sets,
                                                torch.float32, seed=1)
    input_bytes = sum(t.numel() * t.element_size() for t in (*tensors, grad_out))
    ctypes.CDLL("libc.so.6").malloc_trim(0)

    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    baseline = _status_bytes("VmRSS")
    start = time.perf_counter()
    fn(*tensors, cu_seqlens, SCALE).backward(grad_out)
    seconds = time.perf_counter() - start
    peak = _status_bytes("VmHWM") - baseline
    return {"baseline_rss_bytes": baseline, "input_bytes": input_bytes, "peak_bytes": peak, "seconds": round(seconds, 3)}


def measure_cuda(impl: str, layout: str, seq_len: int, doc_len: int, branch_sets: int, repeats: int) -> dict:
    """One point on the current GPU, in this process (see the module docstring)."""
    fn = IMPLS[impl]
    branch_sets = 0 if impl == "trunk" else branch_sets
    tensors, cu_seqlens, grad_out = make_inputs(seq_len, doc_lens(layout, seq_len, doc_len), branch_sets,
                                                torch.bfloat16, seed=1, device="cuda")
    input_bytes = sum(t.numel() * t.element_size() for t in (*tensors, grad_out))

    def call() -> None:
        for t in tensors:
            t.grad = None
        fn(*tensors, cu_seqlens, SCALE).backward(grad_out)

    call()  # untimed: workspaces and first-call setup belong to the baseline
    for t in tensors:
        t.grad = None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    baseline = torch.cuda.memory_allocated()
    call()
    peak = torch.cuda.max_memory_allocated() - baseline
    times = []
    for _ in range(repeats):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        call()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop) / 1e3)
    del tensors, grad_out
    torch.cuda.empty_cache()
    return {"baseline_allocated_bytes": baseline, "input_bytes": input_bytes, "peak_bytes": peak,
            "seconds": round(sorted(times)[len(times) // 2], 5), "seconds_runs": [round(t, 5) for t in times]}


def run_point(impl: str, layout: str, seq_len: int, args: argparse.Namespace) -> dict:
    """``measure`` in ``args.repeats`` fresh interpreters (CPU), or ``measure_cuda`` (one
    peak, the median of ``args.repeats`` times); the record keeps the median peak and every run's."""
    if args.device == "cuda":
        run = measure_cuda(impl, layout, seq_len, args.doc_len, args.ttt_steps - 1, args.repeats)
        return {
            "impl": impl, "layout": layout, "seq_len": seq_len, "ttt_steps": args.ttt_steps,
            "branch_sets": 0 if impl == "trunk" else args.ttt_steps - 1,
            "doc_len": args.doc_len if layout == "packed" else seq_len, **run, "peak_bytes_runs": [run["peak_bytes"]],
        }
    command = [
        sys.executable, __file__, "--child", impl, layout, str(seq_len),
        "--doc-len", str(args.doc_len), "--ttt-steps", str(args.ttt_steps), "--threads", str(args.threads),
    ]
    runs = []
    for _ in range(args.repeats):
        proc = subprocess.run(command, capture_output=True, text=True, check=False)
        if proc.returncode:
            raise SystemExit(f"measuring {impl} ({layout}) at S={seq_len} failed:\n{proc.stderr}")
        runs.append(json.loads(proc.stdout.splitlines()[-1]))
    median = sorted(runs, key=lambda run: run["peak_bytes"])[len(runs) // 2]
    return {
        "impl": impl, "layout": layout, "seq_len": seq_len, "ttt_steps": args.ttt_steps,
        "branch_sets": 0 if impl == "trunk" else args.ttt_steps - 1,
        "doc_len": args.doc_len if layout == "packed" else seq_len, **median,
        "peak_bytes_runs": [run["peak_bytes"] for run in runs],
    }


def least_squares_slope(xs: list[float], ys: list[float]) -> float:
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)


def doubling_ratios(points: list[tuple[int, int]]) -> list[float]:
    return [round(p2 / p1, 3) for (s1, p1), (s2, p2) in zip(points, points[1:]) if s2 == 2 * s1]


def series_of(records: list[dict], layout: str) -> dict[str, list[tuple[int, int]]]:
    """Per implementation, ``(S, peak)`` in S order; plus ``added`` = branch - trunk at every S both have."""
    series = {impl: sorted((r["seq_len"], r["peak_bytes"]) for r in records if r["impl"] == impl and r["layout"] == layout)
              for impl in IMPLS}
    trunk = dict(series["trunk"])
    series["added"] = [(s, p - trunk[s]) for s, p in series["branch"] if s in trunk]
    return series


def check_growth(records: list[dict], layout: str, fit_from: int) -> tuple[dict, list[str]]:
    """One layout's linear-growth checks and its dense control; returns (numbers, failures)."""
    series = series_of(records, layout)
    numbers, failures = {}, []
    for name in ("branch", "trunk", "added"):
        points = [(s, p) for s, p in series[name] if s >= fit_from]
        if len(points) < 2 or min(p for _, p in points) <= 0:
            if name == "added":  # reported only
                continue
            failures.append(f"{layout}: {name} has fewer than two positive peaks from S = {fit_from} on")
            continue
        sizes, peaks = zip(*points)
        slope = least_squares_slope([math.log(s) for s in sizes], [math.log(p) for p in peaks])
        numbers[name] = {"loglog_slope": round(slope, 3), "bytes_per_token": round(least_squares_slope(sizes, peaks)),
                         "doubling_ratios": doubling_ratios(points)}
        if name == "added":  # reported only: added <= branch (see the docstring)
            continue
        low, high = SLOPE_RANGE if name == "branch" else TRUNK_SLOPE_RANGE
        if not low <= slope <= high:
            failures.append(f"{layout}: the {name} peak grows as S^{slope:.2f} over S >= {fit_from}, not linearly "
                            f"(slope outside [{low}, {high}])")
        if any(r >= DOUBLING_SPLIT for r in numbers[name]["doubling_ratios"]):
            failures.append(f"{layout}: a doubling of S multiplied the {name} peak by {DOUBLING_SPLIT} or more")
    numbers["naive"] = {"doubling_ratios": doubling_ratios(series["naive"])}
    if not numbers["naive"]["doubling_ratios"]:
        failures.append(f"{layout}: the dense control needs two sizes a doubling apart within the budget")
    elif any(r <= DOUBLING_SPLIT for r in numbers["naive"]["doubling_ratios"]):
        failures.append(f"{layout}: control: the dense baseline's peak did not grow quadratically, so the method "
                        "is suspect")
    # The same S on both: how much of the op's peak the branch key sets are, and branch vs dense.
    branch, naive = dict(series["branch"]), dict(series["naive"])
    common = [s for s in naive if s in branch]
    if common:
        s = max(common)
        numbers["naive_over_branch_at_largest_common_s"] = {"seq_len": s, "ratio": round(naive[s] / branch[s], 2)}
    s_max = max(branch)
    numbers["at_largest_s"] = {"seq_len": s_max, "branch_bytes": branch[s_max],
                               "trunk_bytes": dict(series["trunk"]).get(s_max),
                               "added_bytes": dict(series["added"]).get(s_max)}
    numbers["fit_from_seq_len"] = fit_from
    return numbers, failures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--child", nargs=3, metavar=("IMPL", "LAYOUT", "S"), help=argparse.SUPPRESS)
    parser.add_argument("--ttt-steps", type=int, default=7, help="D; the op sees P = D - 1 branch key sets")
    parser.add_argument("--doc-len", type=int, default=1024, help="tokens per document of the packed layout")
    parser.add_argument("--layouts", nargs="+", choices=LAYOUTS, default=list(LAYOUTS))
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384, 32768])
    parser.add_argument("--fit-from", type=int, default=4096, help="smallest S in the linearity fit")
    parser.add_argument("--naive-budget-gb", type=float, default=3.0, help="skip dense sizes estimated above this")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=1,
                        help="fresh processes per point, the median peak kept (CPU); timed calls per point (GPU)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="cuda: bf16 on the current GPU, measured by the caching allocator")
    parser.add_argument("--json", type=Path, default=ROOT / "assets" / "bench_branch_memory.json")
    parser.add_argument("--png", type=Path, default=ROOT / "assets" / "bench_branch_memory.png")
    parser.add_argument("--replot", action="store_true", help="only redraw --png from an existing --json")
    parser.add_argument("--recheck", action="store_true",
                        help="re-evaluate the growth checks on an existing --json's records (they are a function of "
                             "the records alone), rewrite its checks and redraw --png")
    args = parser.parse_args()
    if args.recheck:
        result = json.loads(args.json.read_text())
        fit_from = next(iter(result["checks"]["layouts"].values()))["fit_from_seq_len"]
        numbers, failures = {}, []
        for layout in result["config"]["layouts"]:
            numbers[layout], layout_failures = check_growth(result["records"], layout, fit_from)
            failures += layout_failures
        result["checks"] |= {"layouts": numbers, "passed": not failures, "failures": failures,
                             "rechecked_by": command_line()}
        args.json.write_text(json.dumps(result, indent=2) + "\n")
        plot(result["records"], numbers, result["config"], args.png)
        for failure in failures:
            print(f"FAIL: {failure}", file=sys.stderr)
        return 1 if failures else 0
    if args.replot:
        result = json.loads(args.json.read_text())
        plot(result["records"], result["checks"]["layouts"], result["config"], args.png)
        return 0
    if sum(s >= args.fit_from for s in args.seq_lens) < 2:
        parser.error("the linearity fit needs at least two --seq-lens from --fit-from on")
    torch.set_num_threads(args.threads)
    branch_sets = args.ttt_steps - 1
    if args.child:
        impl, layout, seq_len = args.child
        print(json.dumps(measure(impl, layout, int(seq_len), args.doc_len, branch_sets)))
        return 0

    start = time.perf_counter()
    errors = check_correctness(branch_sets)
    if max(e for case in errors.values() for e in case.values()) > MAX_ABS_ERROR_FP64:
        print(f"FAIL: branch attention differs from the dense implementation: {errors}", file=sys.stderr)
        return 1
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    records, skipped = [], []
    for layout in args.layouts:
        for impl in IMPLS:
            for seq_len in args.seq_lens:
                dense_estimate = (DENSE_PEAK_PER_SCORE_MATRIX * N_HEADS * seq_len * (seq_len + branch_sets * seq_len)
                                  * dtype.itemsize)
                if impl == "naive" and dense_estimate > args.naive_budget_gb * 2**30:
                    skipped.append({"impl": impl, "layout": layout, "seq_len": seq_len,
                                    "estimated_peak_bytes": int(dense_estimate)})
                    continue
                record = run_point(impl, layout, seq_len, args)
                records.append(record)
                print(f"{layout:>7} {impl:>6}  S={seq_len:>6}  peak {record['peak_bytes'] / 2**20:9.1f} MiB  "
                      f"({record['seconds']:.2f} s)", flush=True)
    numbers, failures = {}, []
    for layout in args.layouts:
        numbers[layout], layout_failures = check_growth(records, layout, args.fit_from)
        failures += layout_failures

    result = {
        "description": __doc__.split("\n\n")[1].replace("\n", " "),
        "config": {
            "ttt_steps": args.ttt_steps, "branch_sets": branch_sets, "doc_len": args.doc_len, "layouts": args.layouts,
            "seq_lens": args.seq_lens, "n_heads": N_HEADS,
            "n_kv_heads": N_KV_HEADS, "head_dim": HEAD_DIM, "dtype": str(dtype).removeprefix("torch."),
            "device": torch.cuda.get_device_name() if args.device == "cuda" else "CPU", "threads": args.threads,
            "repeats": args.repeats,
            "naive_budget_bytes": int(args.naive_budget_gb * 2**30), "torch": torch.__version__,
        },
        "method": ("in process, after one untimed call at the same shape: peak_bytes = "
                   "torch.cuda.max_memory_allocated() after one forward+backward minus memory_allocated() before; "
                   "seconds = median over the timed calls (CUDA events)" if args.device == "cuda" else
                   "fresh process per run; peak_bytes = VmHWM after one forward+backward minus VmRSS right "
                   "after resetting VmHWM (/proc/self/clear_refs), with inputs allocated and one warm-up call done; "
                   "median of the runs"),
        "records": records,
        "skipped": skipped,
        "command": command_line(),
        "checks": {
            "correctness_max_abs_error_fp64": errors, "layouts": numbers, "passed": not failures, "failures": failures,
        },
        "runtime_seconds": round(time.perf_counter() - start, 1),
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2) + "\n")
    plot(records, numbers, result["config"], args.png)
    print(json.dumps(result["checks"], indent=2))
    for failure in failures:
        print(f"FAIL: {failure}", file=sys.stderr)
    return 1 if failures else 0


# ---- the plot ----

@optional_plot
def plot(records: list[dict], numbers: dict, config: dict, path: Path) -> None:
    """Peak bytes against S, log-log, one panel per layout: branch, trunk, added (branch - trunk),
    dense measured, the dense quadratic from its last point, a linear guide."""
    plt = pyplot()
    layouts = list(numbers)
    fig, axes = plt.subplots(1, len(layouts), figsize=(7 * len(layouts), 5.5), sharey=True, squeeze=False)
    for ax, layout in zip(axes[0], layouts):
        series = series_of(records, layout)
        slopes = {name: numbers[layout].get(name, {}).get("loglog_slope", float("nan"))
                  for name in ("branch", "trunk", "added")}
        styles = {"branch": ("tab:blue", "-", f"branch attention, P = {config['branch_sets']}"),
                  "trunk": ("tab:green", "-", "trunk alone (P = 0, flash kernel)"),
                  "added": ("tab:purple", ":", "added by the branch sets (branch - trunk)"),
                  "naive": ("tab:red", "-", f"dense masked scores, S x {config['ttt_steps']}S")}
        for name, (color, ls, label) in styles.items():
            if series[name]:
                sizes, peaks = zip(*series[name])
                ax.plot(sizes, [p / 2**20 for p in peaks], color=color, ls=ls, marker="o", label=label)
        all_sizes = sorted({s for pts in series.values() for s, _ in pts})
        if series["naive"]:
            ns, npk = series["naive"][-1]
            fit = [(s, npk * (s / ns) ** 2) for s in all_sizes if s >= ns]
            ax.plot(*zip(*[(s, p / 2**20) for s, p in fit]), color="tab:red", ls="--", label="dense, quadratic from its last point")
        bs, bpk = series["branch"][-1]
        ax.plot([all_sizes[0], bs], [bpk * all_sizes[0] / bs / 2**20, bpk / 2**20], color="grey", ls="--", lw=1,
                label="linear guide")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(all_sizes, [f"{s // 1024}K" for s in all_sizes])
        plain_ticks(ax.yaxis)
        ax.set_xlabel("tokens per row, S")
        ax.set_title({"packed": f"packed: documents of {config['doc_len']} tokens",
                      "one_doc": "one document of S tokens"}[layout])
        ax.grid(alpha=0.3, which="both")
        fit_from = numbers[layout]["fit_from_seq_len"]
        ax.text(0.02, 0.98, f"log-log slopes from S = {fit_from}:\n" + "\n".join(
            f"{name} {slope:.2f}" for name, slope in slopes.items()), transform=ax.transAxes, va="top", fontsize="small")
    measured = "allocated" if config.get("device", "CPU") != "CPU" else "RSS"
    axes[0][0].set_ylabel(f"peak MiB above the inputs ({measured}), forward + backward")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=3, fontsize="small")
    fig.suptitle(f"branch attention memory, D = {config['ttt_steps']}, {config.get('device', 'CPU')}, "
                 f"{config.get('dtype', 'float32')}")
    fig.tight_layout(rect=(0, 0.1, 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
