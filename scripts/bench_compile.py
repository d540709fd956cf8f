"""Eager vs ``torch.compile`` step time: the co-training step and decoding, on this machine's CPU or a GPU.

What runs (the llama3 debug model with an EAGLE-3 draft, fp32 on CPU with one thread by default,
bf16 on a GPU with ``--device cuda``: the flash kernels' dtype):
* ``cotrain_step``: one ``forward_backward`` of the co-training objective (policy next-token
  loss + the draft's TTT loss) over packed rows whose document layout changes every step,
  eager vs ``[compile] enable`` (``titan_cotrain.parallel.compile``: every decoder block and
  the draft's TTT pass, ``fullgraph=True``, inductor);
* ``decode``: ``RolloutEngine.generate`` of greedy responses, plain (k = 0) and speculative
  (k = 3), eager vs ``[rollout] compile`` (the decode / verify / draft steps, one graph per
  ``k``: compiled, every round runs every row over whole-sequence block tables; eager, over
  the blocks the rows have reached, what each mode does in a job);
* ``draft_overhead`` (not in the default ``--parts``): what co-training the draft adds to the
  policy's step, eager: the co-training step against the same ``forward_backward`` with no
  draft, alternating on the same batches; ``overhead`` = with / without - 1. At a real shape
  with ``--model qwen3/0.6B --vocab 151936`` (``scripts/gpu_check.sh`` on a GPU).

Correctness first: the compiled co-training step must give the eager one's losses and
gradients (rtol 1e-4), and compiled decoding the eager tokens, or the script exits 1 before
timing. In bf16 two correct implementations round differently: the losses must agree within
2e-2 and each gradient's difference be under 5e-2 of its norm; and greedy paths, which part
for good at the first token where they choose differently, may part only at a near tie: where
the policy's own forward (of the prompt and the tokens both chose) puts the two chosen tokens'
logits within ``TIE`` x (top - median logit) of each other (a wrong graph parts where one
token clearly wins). Times: the first call (which compiles) is reported apart as ``first_s``, with
inductor's on-disk cache in a fresh folder (a cold compile; ``--warm-cache`` keeps the
user's cache, as a second run of a job would); then
``--repeats`` timed calls of each, alternating eager and compiled, and the median counts.
``ratio`` = eager median / compiled median (> 1: compiled is faster). The goal: compiled is
no slower than eager in steady state (ratio >= 1).

    .venv/bin/python scripts/bench_compile.py             # a few minutes, most of it compiling
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from benchtools import command_line, optional_plot, pyplot  # noqa: E402

from titan_cotrain.cotrain.step import forward_backward
from titan_cotrain.data.batch import PackedBatch  # noqa: E402
from titan_cotrain.models.args import model_args_for  # noqa: E402
from titan_cotrain.models.draft import Draft, DraftArgs  # noqa: E402
from titan_cotrain.models.transformer import Transformer  # noqa: E402
from titan_cotrain.parallel.compile import apply_compile  # noqa: E402
from titan_cotrain.engine.rollout import RolloutEngine  # noqa: E402
from titan_cotrain.engine.sampling import SamplingParams  # noqa: E402
from titan_cotrain.rl.grpo import next_token_loss  # noqa: E402

STEP = dict(ttt_steps=3, pass_decay=0.8, draft_loss_weight=0.1)
TIE = 0.05  # bf16 greedy paths may part where the two tokens' logits are this close (of the spread)


def _models(vocab: int, device: str = "cpu", model: str = "llama3/debugmodel") -> tuple[Transformer, Draft]:
    """The policy (``architecture/flavor``) and draft on ``device``: fp32 on CPU, bf16 on a GPU."""
    args = model_args_for(*model.split("/")).replace(vocab_size=vocab)
    policy = Transformer(args)
    policy.init_weights(std=0.1, generator=torch.Generator().manual_seed(0))
    draft = Draft(DraftArgs.from_target(args, n_taps=3))
    draft.init_weights(std=0.1, generator=torch.Generator().manual_seed(1))
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    return policy.to(device, dtype), draft.to(device, dtype)


def _batch(rows: int, seq_len: int, vocab: int, seed: int) -> PackedBatch:
    """Packed rows of random documents: every seed its own layout."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (rows, seq_len), generator=g)
    document_ids = torch.zeros(rows, seq_len, dtype=torch.long)
    for row in range(rows):
        cuts = torch.randint(1, seq_len, (int(torch.randint(2, 8, (), generator=g)),), generator=g).unique()
        document_ids[row] = torch.bucketize(torch.arange(seq_len), cuts, right=True)
    return PackedBatch(tokens, document_ids, torch.ones(rows, seq_len, dtype=torch.bool))


def _step(models, batch) -> tuple[dict, dict]:
    policy, draft = models
    metrics = forward_backward(policy, draft, batch, next_token_loss, **STEP)
    grads = {f"{i}.{name}": p.grad.clone() for i, m in enumerate(models) for name, p in m.named_parameters()}
    for m in models:
        m.zero_grad(set_to_none=True)
    return {k: float(v) for k, v in metrics.items()}, grads


def _timed(fn) -> float:
    return _timed_call(fn)[0]


def _timed_call(fn):
    """``(seconds, fn())``, the device's queued work included."""
    start = time.perf_counter()
    out = fn()
    if torch.cuda.is_initialized():
        torch.cuda.synchronize()
    return time.perf_counter() - start, out


def _record(eager: list[float], compiled: list[float], first: dict[str, float], **extra) -> dict:
    ratio = statistics.median(eager) / statistics.median(compiled)
    return {"eager_s": eager, "compiled_s": compiled, "first_s": first, "eager_median_s": statistics.median(eager),
            "compiled_median_s": statistics.median(compiled), "ratio": ratio, "met": ratio >= 1.0, **extra}


def bench_cotrain(args) -> dict:
    eager = _models(args.vocab, args.device, args.model)
    compiled = copy.deepcopy(eager)
    apply_compile(*compiled, ["model", "draft"])
    batches = [_batch(args.rows, args.seq_len, args.vocab, seed).to(args.device)
               for seed in range(args.repeats + 1)]
    first_eager, (m_eager, g_eager) = _timed_call(lambda: _step(eager, batches[0]))
    first_compiled, (m_comp, g_comp) = _timed_call(lambda: _step(compiled, batches[0]))
    first = {"eager": first_eager, "compiled": first_compiled}
    bf16 = args.device != "cpu"
    for key, value in m_eager.items():
        if abs(m_comp[key] - value) > (2e-2 if bf16 else 1e-4) * max(1.0, abs(value)):
            raise SystemExit(f"compiled co-training step: {key} {m_comp[key]} != eager {value}")
    for name, grad in g_eager.items():
        if bf16:
            same = float((g_comp[name] - grad).float().norm()) <= 5e-2 * float(grad.float().norm()) + 1e-6
        else:
            same = torch.allclose(g_comp[name], grad, rtol=1e-4, atol=1e-6)
        if not same:
            raise SystemExit(f"compiled co-training step: the gradient of {name} differs from eager")
    times = {"eager": [], "compiled": []}
    for batch in batches[1:]:  # new layouts: a recompile would show here
        times["eager"].append(_timed(lambda: _step(eager, batch)))
        times["compiled"].append(_timed(lambda: _step(compiled, batch)))
    return _record(times["eager"], times["compiled"], first, rows=args.rows, seq_len=args.seq_len)


def bench_draft_overhead(args) -> dict:
    policy, draft = _models(args.vocab, args.device, args.model)
    batches = [_batch(args.rows, args.seq_len, args.vocab, seed).to(args.device)
               for seed in range(args.repeats + 1)]

    def step(arm: str, batch: PackedBatch) -> None:
        forward_backward(policy, draft if arm == "with_draft" else None, batch, next_token_loss, **STEP)
        policy.zero_grad(set_to_none=True)
        draft.zero_grad(set_to_none=True)

    arms = ("with_draft", "policy_only")
    first = {arm: _timed(lambda arm=arm: step(arm, batches[0])) for arm in arms}
    times = {arm: [] for arm in arms}
    for batch in batches[1:]:
        for arm in arms:
            times[arm].append(_timed(lambda arm=arm: step(arm, batch)))
    median = {arm: statistics.median(times[arm]) for arm in arms}
    return {"model": args.model, "vocab": args.vocab, "rows": args.rows, "seq_len": args.seq_len, "first_s": first,
            **{f"{arm}_s": times[arm] for arm in arms}, **{f"{arm}_median_s": median[arm] for arm in arms},
            "overhead": median["with_draft"] / median["policy_only"] - 1}


def _parted_clearly(policy: Transformer, prompts: list[torch.Tensor], eager: torch.Tensor,
                    compiled: torch.Tensor) -> list[int]:
    """Rows of two greedy decodings ``[B, N]`` whose paths part where the policy clearly
    prefers one of the two tokens (more than ``TIE`` of its logits' top - median apart)."""
    rows, device = [], policy.embed_tokens.weight.device
    for row in range(eager.shape[0]):
        differ = (eager[row] != compiled[row]).nonzero()
        if not len(differ):
            continue
        at = int(differ[0])
        prefix = torch.cat([prompts[row], eager[row, :at].cpu()]).to(device)
        with torch.no_grad():
            logits = policy(prefix[None])[0, -1].float()
        gap = abs(float(logits[eager[row, at]] - logits[compiled[row, at]]))
        if gap > TIE * float(logits.max() - logits.median()):
            rows.append(row)
    return rows


def bench_decode(args) -> dict:
    policy, draft = _models(args.vocab, args.device, args.model)
    engines = {mode: RolloutEngine(copy.deepcopy(policy), copy.deepcopy(draft), max_batch_size=args.batch,
                                   max_seq_len=args.prompt_len + args.new_tokens, max_draft_tokens=3,
                                   compile=mode == "compiled") for mode in ("eager", "compiled")}
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, args.vocab, (args.prompt_len,), generator=g) for _ in range(args.batch)]
    params = SamplingParams(temperature=0, max_new_tokens=args.new_tokens)
    out = {}
    for k in (0, 3):
        def run(mode, k=k):
            return engines[mode].generate(prompts, params, draft_tokens=k)

        first, tokens = {}, {}
        for mode in engines:
            first[mode], rollouts = _timed_call(lambda mode=mode: run(mode))
            tokens[mode] = rollouts.tokens
        if args.device == "cpu":
            if not torch.equal(tokens["eager"], tokens["compiled"]):
                raise SystemExit(f"compiled decoding (k = {k}) gave other tokens than eager")
        elif parted := _parted_clearly(policy, prompts, tokens["eager"], tokens["compiled"]):
            raise SystemExit(f"compiled decoding (k = {k}): rows {parted} part from eager away from a near tie")
        times = {"eager": [], "compiled": []}
        for _ in range(args.repeats):
            for mode in engines:
                times[mode].append(_timed(lambda mode=mode: run(mode)))
        out[f"k{k}"] = _record(times["eager"], times["compiled"], first, batch=args.batch,
                               new_tokens=args.new_tokens)
    return out


def _flat(records: dict) -> list[tuple[str, dict]]:
    """``(name, record)`` of every measured call: ``cotrain_step``, ``decode k=0``, ``decode k=3``."""
    flat = [("cotrain_step", records["cotrain_step"])] if "cotrain_step" in records else []
    return flat + [(f"decode k={k.removeprefix('k')}", r) for k, r in records.get("decode", {}).items()]


@optional_plot
def plot(result: dict, path: Path) -> None:
    if not _flat(result["records"]):  # draft_overhead alone: nothing eager vs compiled to draw
        return
    plt = pyplot()
    names, recs = zip(*_flat(result["records"]))
    fig, ax = plt.subplots(figsize=(6, 3.5))
    x = range(len(names))
    ax.bar([i - 0.2 for i in x], [r["eager_median_s"] for r in recs], 0.4, label="eager")
    ax.bar([i + 0.2 for i in x], [r["compiled_median_s"] for r in recs], 0.4, label="compiled")
    ax.set_xticks(list(x), names)
    ax.set_ylabel("median seconds per call")
    ax.set_title(f"torch.compile vs eager ({result['hardware']})")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)


PARTS = {"cotrain_step": bench_cotrain, "decode": bench_decode, "draft_overhead": bench_draft_overhead}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--model", default="llama3/debugmodel",
                        help="architecture/flavor of the policy (its vocabulary set by --vocab)")
    parser.add_argument("--batch", type=int, default=8, help="sequences decoded at once")
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cpu", help="cpu, or cuda (bf16)")
    parser.add_argument("--parts", nargs="+", choices=PARTS, default=["cotrain_step", "decode"],
                        help="what to measure (compiling each on a few CPU cores takes about a minute)")
    parser.add_argument("--warm-cache", action="store_true",
                        help="keep inductor's on-disk cache (first calls then time a cached compile)")
    parser.add_argument("--json", type=Path, default=ROOT / "assets" / "bench_compile.json")
    parser.add_argument("--png", type=Path, default=ROOT / "assets" / "bench_compile.png")
    args = parser.parse_args()
    if not args.warm_cache:  # before anything compiles: inductor reads it when it first caches
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="bench_compile_inductor_")
    torch.set_num_threads(args.threads)
    hardware = (f"{os.cpu_count()}-core CPU, {args.threads} thread(s)" if args.device == "cpu"
                else f"{torch.cuda.get_device_name(args.device)}, bf16")
    result = {"hardware": f"{hardware}, torch {torch.__version__}",
              "command": command_line(), "backend": "inductor", "cold_compile": not args.warm_cache,
              "records": {name: PARTS[name](args) for name in args.parts}}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=1) + "\n")
    plot(result, args.png)
    for name, rec in _flat(result["records"]):
        print(f"{name}: eager {rec['eager_median_s']:.3f} s, compiled {rec['compiled_median_s']:.3f} s, "
              f"ratio {rec['ratio']:.2f} (first calls: {rec['first_s']['eager']:.1f} s / "
              f"{rec['first_s']['compiled']:.1f} s)")
    if overhead := result["records"].get("draft_overhead"):
        print(f"draft co-training: {overhead['with_draft_median_s']:.3f} s a step with it, "
              f"{overhead['policy_only_median_s']:.3f} s without: +{100 * overhead['overhead']:.0f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
