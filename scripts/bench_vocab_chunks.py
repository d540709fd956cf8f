"""Peak device memory of the vocabulary-sized losses, whole vs chunked, at Qwen3-8B scale.

What it shows: ``titan_cotrain.cotrain.vocab`` keeps at most one chunk of ``[c, V]``
tensors alive, so the chunked peaks are the outputs and gradients plus a few chunks, where
the whole paths hold several ``[T, V]`` at once.

What runs, forward + backward, bf16 hidden states and head weights as on the GPU:
* ``policy``: ``ppo_loss`` (kl_coef > 0) of ``hidden [T, H] @ lm_head [V, H]``, plus the
  draft's teacher. ``whole``: today's path, the fp32 logits ``[1, T, V]`` handed to the
  loss, the teacher ``log_softmax(logits[:, draft_ids])`` kept in fp32 ``[T, V_d]``; the
  logits die after the loss's forward (the step as it was, holding ``Transformer.forward``'s
  logits to its end, held another ``[T, V]`` fp32, 9.3 GiB). ``chunked``:
  ``chunked_policy_head`` (teacher in bf16).
* ``draft``: one pass's soft CE of the pass output ``[T, H]`` through the draft's norm +
  ``lm_head [V_d, H]`` against the teacher, at every anchor weighted by the mask.
  ``whole``: the draft logits ``[T, V_d]`` fp32 at once, teacher fp32; ``chunked``:
  ``chunked_soft_ce``, teacher bf16.

Memory: on the simulated accelerator (``titan_cotrain.simulate``: fake tensors, shapes and
storages real, no memory used), every storage an op creates is counted until it dies,
rounded to 512 bytes like the CUDA caching allocator (``MemoryTracker``). Per path:
``inputs`` (hidden, weights, rows, teacher), ``peak`` (everything live at the worst
moment, inputs included), ``peak_above_inputs``, and ``kept_for_backward`` (live after the
forward, above the inputs; for the draft, what each of the 7 TTT passes holds until the
one backward).
Not counted: kernel scratch, fragmentation.

Correctness first: at a small shape on the CPU in fp32 the chunked paths must give the
whole paths' values, teacher and gradients within 1e-5 (``--check-chunk`` tokens a chunk,
uneven), or the script exits 1 before measuring.

    .venv/bin/python scripts/bench_vocab_chunks.py      # ~10 s on one thread
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from titan_cotrain.cotrain.vocab import DEFAULT_CHUNK_TOKENS, chunked_policy_head, chunked_soft_ce
from titan_cotrain.data.batch import LabelRows
from titan_cotrain.models.transformer import RMSNorm
from titan_cotrain.rl.grpo import ppo_loss
from titan_cotrain.simulate.device import SimulatedDevice, register_simulated_device, sim_device
from titan_cotrain.simulate.memory import MemoryTracker

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
from benchtools import command_line  # noqa: E402

GIB = 2**30
TOLERANCE = 1e-5
LOSS_FN = ppo_loss(0.2, 0.28, kl_coef=0.05, temperature=1.0)


def _normal(shape, std, dtype, device) -> torch.Tensor:
    """In place: no temporary the size of the tensor to inflate the peak."""
    return torch.empty(shape, dtype=dtype, device=device).normal_(0.0, std)


def policy_inputs(t: int, h: int, v: int, v_d: int, dtype, device) -> dict:
    rows = LabelRows(
        next_tokens=torch.randint(0, v, (1, t), device=device),
        next_token_mask=torch.empty(1, t, device=device).bernoulli_(0.7).bool(),
        next_advantages=_normal((1, t), 1.0, torch.float32, device),
        next_old_logprobs=_normal((1, t), 0.3, torch.float32, device) - math.log(v),
        next_ref_logprobs=_normal((1, t), 0.3, torch.float32, device) - math.log(v),
    )
    draft_ids = torch.randperm(v, device=device)[:v_d].sort().values
    t2d = torch.zeros(v, dtype=torch.bool, device=device)
    t2d[draft_ids] = True
    return dict(hidden=_normal((t, h), 1.0, dtype, device).requires_grad_(),
                weight=_normal((v, h), h**-0.5, dtype, device).requires_grad_(),
                rows=rows, draft_ids=draft_ids, t2d=t2d)


def policy_whole(hidden, weight, rows, draft_ids, t2d):
    logits = (hidden @ weight.T).float()  # lm_head(x).float(), [T, V]
    part = LOSS_FN(logits[None], rows)
    teacher = F.log_softmax(logits.detach()[:, draft_ids], dim=-1)
    return part.loss_sum, dict(count=part.count, **part.metric_sums, teacher=teacher,
                               in_vocab=t2d[logits.detach().argmax(-1)])


def policy_chunked(hidden, weight, rows, draft_ids, t2d, chunk_tokens, teacher_dtype=torch.bfloat16):
    out = chunked_policy_head(hidden, weight, rows, LOSS_FN, chunk_tokens=chunk_tokens, draft_ids=draft_ids,
                              t2d=t2d, teacher_dtype=teacher_dtype)
    return out.policy.loss_sum, dict(count=out.policy.count, **out.policy.metric_sums,
                                     teacher=out.teacher_logprobs, in_vocab=out.teacher_in_vocab)


def draft_inputs(t: int, h: int, v_d: int, dtype, device, teacher_dtype) -> dict:
    head = nn.Sequential(RMSNorm(h, 1e-6), nn.Linear(h, v_d, bias=False)).to(device, dtype)
    with torch.no_grad():
        head[1].weight.normal_(0.0, h**-0.5)
    # Log-probs up to a per-row constant, which the soft CE's softmax removes.
    teacher = _normal((t, v_d), 2.0, teacher_dtype, device)
    return dict(hidden=_normal((t, h), 1.0, dtype, device).requires_grad_(), head=head, teacher=teacher,
                index=torch.randint(0, t, (t,), device=device),
                mask=torch.empty(t, device=device).bernoulli_(0.7).bool())


def draft_whole(hidden, head, teacher, index, mask):
    logits = head(hidden).float()  # Draft.logits, [T, V_d]
    target = teacher[index].float()
    ce = -(F.softmax(target, dim=-1) * F.log_softmax(logits, dim=-1)).sum(-1)
    correct = ((logits.argmax(-1) == target.argmax(-1)) & mask).sum()
    return torch.where(mask, ce, 0.0).sum(), dict(correct=correct, count=mask.sum())


def draft_chunked(hidden, head, teacher, index, mask, chunk_tokens):
    ce_sum, correct, count, _ = chunked_soft_ce(hidden, head, teacher, index, mask, chunk_tokens=chunk_tokens)
    return ce_sum, dict(correct=correct, count=count)


def _leaves(inputs: dict) -> list[torch.Tensor]:
    head = inputs.get("head")
    return [inputs["hidden"], *([inputs["weight"]] if head is None else head.parameters())]


def check(chunk: int) -> dict:
    """Chunked vs whole on the CPU, fp32: ``max |a - b| / (1 + |b|)`` of every value and gradient."""
    torch.manual_seed(0)
    t, h, v, v_d = 37, 24, 300, 64
    cases = {
        "policy": (policy_inputs(t, h, v, v_d, torch.float32, "cpu"), policy_whole,
                   partial(policy_chunked, chunk_tokens=chunk, teacher_dtype=torch.float32)),
        "draft": (draft_inputs(t, h, v_d, torch.float32, "cpu", torch.float32), draft_whole,
                  partial(draft_chunked, chunk_tokens=chunk)),
    }
    errors = {}
    for name, (inputs, whole, chunked) in cases.items():
        got_loss, got = chunked(**inputs)
        want_loss, want = whole(**inputs)
        pairs = {"loss": (got_loss, want_loss), **{key: (got[key], want[key]) for key in want}}
        grads = zip(torch.autograd.grad(got_loss, _leaves(inputs)), torch.autograd.grad(want_loss, _leaves(inputs)))
        pairs |= {f"grad{i}": pair for i, pair in enumerate(grads)}
        for key, (a, b) in pairs.items():
            a, b = a.detach().double(), b.detach().double()
            errors[f"{name}/{key}"] = ((a - b).abs() / (b.abs() + 1)).max().item()
    return {"max_error": max(errors.values()), "errors": errors, "tolerance": TOLERANCE,
            "passed": max(errors.values()) <= TOLERANCE}


def measure(make_inputs, run) -> dict:
    """Forward + backward of ``run`` on the simulated device; byte counts in GiB."""
    tracker = MemoryTracker()
    with SimulatedDevice(on_alloc=tracker):
        inputs = make_inputs(sim_device())
        base = tracker.live_bytes()
        loss, outputs = run(**inputs)
        kept = tracker.live_bytes() - base
        loss.backward()
        del outputs  # alive through the backward, as the teacher is until the draft's
    return {"inputs_gib": base / GIB, "peak_gib": tracker.peak_bytes / GIB,
            "peak_above_inputs_gib": (tracker.peak_bytes - base) / GIB, "kept_for_backward_gib": kept / GIB}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=16384, help="local tokens T")
    parser.add_argument("--hidden", type=int, default=4096, help="H (Qwen3-8B)")
    parser.add_argument("--vocab", type=int, default=151936, help="V (Qwen3)")
    parser.add_argument("--draft-vocab", type=int, default=32000, help="V_d")
    parser.add_argument("--chunk-tokens", type=int, default=DEFAULT_CHUNK_TOKENS)
    parser.add_argument("--check-chunk", type=int, default=8, help="chunk of the CPU correctness check")
    parser.add_argument("--json", type=Path, default=ROOT / "assets" / "bench_vocab_chunks.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    start = time.monotonic()
    # Before the check's backward: autograd sizes its device queues at the first one.
    register_simulated_device()

    correctness = check(args.check_chunk)
    print(f"correctness: max error {correctness['max_error']:.2e} (tolerance {TOLERANCE:.0e}) "
          f"{'ok' if correctness['passed'] else 'FAILED'}")
    if not correctness["passed"]:
        print(json.dumps(correctness["errors"], indent=2))
        return 1

    t, h, v, v_d, c = args.tokens, args.hidden, args.vocab, args.draft_vocab, args.chunk_tokens
    bf16 = torch.bfloat16
    def policy(device):
        return policy_inputs(t, h, v, v_d, bf16, device)

    records = {
        "policy": {"whole": measure(policy, policy_whole),
                   "chunked": measure(policy, partial(policy_chunked, chunk_tokens=c))},
        "draft": {"whole": measure(lambda d: draft_inputs(t, h, v_d, bf16, d, torch.float32), draft_whole),
                  "chunked": measure(lambda d: draft_inputs(t, h, v_d, bf16, d, bf16),
                                     partial(draft_chunked, chunk_tokens=c))},
    }
    for name, rec in records.items():
        rec["peak_above_inputs_ratio"] = rec["whole"]["peak_above_inputs_gib"] / rec["chunked"]["peak_above_inputs_gib"]
        rec["peak_ratio"] = rec["whole"]["peak_gib"] / rec["chunked"]["peak_gib"]
    result = {
        "description": __doc__.split("\n\n")[0],
        "shapes": {"tokens": t, "hidden": h, "vocab": v, "draft_vocab": v_d, "dtype": "bfloat16"},
        "chunk_tokens": c,
        "one_chunk_fp32_logits_gib": {"policy": c * v * 4 / GIB, "draft": c * v_d * 4 / GIB},
        "records": records,
        "correctness": correctness,
        "command": command_line(),
        "runtime_seconds": round(time.monotonic() - start, 1),
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2) + "\n")

    print(f"T={t} H={h} V={v} V_d={v_d} chunk={c} (one chunk's fp32 logits: "
          f"{c * v * 4 / GIB:.2f} GiB policy, {c * v_d * 4 / GIB:.2f} GiB draft)")
    print(f"{'':8}{'path':9}{'inputs':>9}{'peak':>9}{'above in':>10}{'kept fwd':>10}   GiB")
    for name, rec in records.items():
        for path in ("whole", "chunked"):
            r = rec[path]
            print(f"{name:8}{path:9}{r['inputs_gib']:9.2f}{r['peak_gib']:9.2f}"
                  f"{r['peak_above_inputs_gib']:10.2f}{r['kept_for_backward_gib']:10.2f}")
        print(f"{name:8}whole / chunked: peak x{rec['peak_ratio']:.1f}, "
              f"above inputs x{rec['peak_above_inputs_ratio']:.1f}")
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
