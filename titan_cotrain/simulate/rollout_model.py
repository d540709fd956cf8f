"""The rollout's schedule and a roofline estimate of its time, for the scale simulator.

The engine's schedule is host logic (``engine.kv_blocks``): which sequences run, when blocks run
out, who is preempted. ``model_rollout`` drives the engine's own ``Scheduler`` over its own
pool with the lengths a rollout would have: prompts at their budget (the simulator's worst
case) and responses drawn from a stated long-tailed law, advancing each decoding round by
a stated acceptance law. It reports the concurrency the pool allows and a *model* of the
rollout's time on the config's GPU, not a measurement:

* a decoding round costs ``max(bytes / HBM bandwidth, FLOPs / peak bf16)``: bytes are the
  engine's weights on the rank (the policy's once, the draft's once per draft step) and the
  KV the round reads (every live sequence's target KV once, its draft trunk once per draft
  step); FLOPs are ``2 x`` the matmul parameters per token processed plus attention
  (``4 x context x heads x head_dim`` per query token and layer). An EAGLE-3 draft takes
  ``k + 1`` steps a round (``2k + 1`` tokens through it); a block drafter one forward (its
  weights and context KV read once; ``B`` block positions and the ``k + 1`` committed tokens'
  context through it) and the policy's head on its ``k`` drafted positions;
* a prefill (new groups, and the recompute of preempted sequences) costs the same way over
  its tokens, attention causal;
* not modeled: kernel launch overhead, the tensor-parallel all-reduces, sampling, and every
  kernel's distance from its roofline. It is a lower bound that moves with the schedule.

Concurrency is reported for the engine-bound part of the rollout, the rounds while some
sequence waits for a row or for blocks (``concurrent_median``, ``concurrent_min``); once the
queue is empty the batch drains at the pace of the length law (the long tail), which
``concurrent_median_all_rounds`` includes.
"""

from __future__ import annotations

import math
import random
import statistics
from dataclasses import dataclass


from titan_cotrain.components.shards import local_shard
from titan_cotrain.engine.kv_blocks import BlockAllocator, Scheduler
from titan_cotrain.engine.kv_budget import kv_bytes_per_position
from titan_cotrain.engine.rollout import RolloutEngine
from titan_cotrain.models.block_draft import BlockDrafter

__all__ = ["GPU_MODELS", "GpuModel", "LengthLaw", "gpu_model", "model_rollout"]

GIB = 2**30


@dataclass(frozen=True)
class GpuModel:
    """The roofline constants of one GPU: HBM bandwidth (bytes/s) and dense bf16 peak (FLOP/s)."""

    name: str
    hbm_bytes_per_s: float
    bf16_flops: float


# Keyed by the simulated budget ([simulate] gpu_memory_gib) the shipped configs use.
GPU_MODELS = {
    80: GpuModel("H100 SXM 80 GiB", 3.35e12, 989e12),
    141: GpuModel("H200 141 GiB", 4.8e12, 989e12),
}


def gpu_model(memory_gib: float) -> GpuModel:
    """The roofline of the GPU a config's budget stands for: an H200 above 80 GiB, else an H100."""
    return GPU_MODELS[141] if memory_gib > 80 else GPU_MODELS[80]


@dataclass(frozen=True)
class LengthLaw:
    """Response lengths: log-normal with median ``median_fraction x max_new_tokens`` and shape
    ``sigma``, capped at ``max_new_tokens``, drawn from ``seed``; each drafted token accepted
    with probability ``acceptance`` (independently, up to ``k``), so a decoding round commits
    ``1 + a`` tokens of a sequence."""

    median_fraction: float = 0.25
    sigma: float = 1.0
    acceptance: float = 0.7
    seed: int = 0

    def describe(self, max_new_tokens: int, k: int) -> dict:
        a = self.acceptance
        return {"law": "lognormal, capped at max_new_tokens", "median_tokens": self.median_fraction * max_new_tokens,
                "sigma": self.sigma, "seed": self.seed, "draft_tokens": k, "acceptance_per_token": a,
                "tokens_per_round": (1 - a ** (k + 1)) / (1 - a) if k else 1.0}


def _weights(model) -> tuple[int, int]:
    """``(bytes, matmul parameters)`` of a model's parameters on this rank (the token
    embedding is a gather, not a matmul)."""
    params = [(name, local_shard(p)) for name, p in model.named_parameters()]
    nbytes = sum(p.numel() * p.element_size() for _, p in params)
    matmul = sum(p.numel() for name, p in params if p.dim() == 2 and "embed" not in name)
    return nbytes, matmul


def model_rollout(engine: RolloutEngine, *, requested_groups: int, samples: int, prompt_tokens: int,
                  max_new_tokens: int, draft_tokens: int, gpu: GpuModel, law: LengthLaw = LengthLaw()) -> dict:
    """Drive ``engine``'s scheduler over its pool for ``requested_groups`` prompts of
    ``prompt_tokens`` tokens and ``samples`` responses each (lengths from ``law``), as
    ``generate`` does, and price every round and prefill on ``gpu``. Returns the report's
    ``"rollout"`` object (without the fields the simulator adds: ``offloaded_gib``,
    ``tp_group_nodes``)."""
    k, bs = draft_tokens, engine.block_size
    rng = random.Random(law.seed)
    mu = math.log(law.median_fraction * max_new_tokens)
    n = requested_groups * samples
    target_len = [min(max(1, round(rng.lognormvariate(mu, law.sigma))), max_new_tokens) for _ in range(n)]
    scheduler = Scheduler(BlockAllocator(engine.target_pool.n_blocks, scratch=engine.paged), bs,
                          engine.max_batch_size, [prompt_tokens] * requested_groups, samples, max_new_tokens, k,
                          waves=not engine.paged)

    policy, draft = engine.policy, engine.draft
    a = policy.args
    policy_bytes, policy_matmul = _weights(policy)
    draft_bytes, draft_matmul = _weights(draft) if draft is not None and k else (0, 0)
    dtype = policy.embed_tokens.weight.dtype
    per_position = kv_bytes_per_position(a, None, dtype, engine.tensor_parallel)
    trunk_per_position = (kv_bytes_per_position(a, draft.args, dtype, engine.tensor_parallel) - per_position
                          if draft is not None and k else 0)
    heads = a.n_heads // engine.tensor_parallel
    attention = 4 * heads * a.head_dim * a.n_layers  # FLOPs per query token per context position
    head_matmul = a.vocab_size * a.dim // engine.tensor_parallel
    if isinstance(draft, BlockDrafter):
        steps = 1  # one drafter forward a round
        draft_tokens_per_row = draft.args.block_size + k + 1  # the block, then the committed tokens' context
        head_per_row = head_matmul * k  # the drafted positions' logits, through the policy's head
    else:
        steps = k + 1  # draft steps per round: k drafts and the catch-up (0 when plain)
        draft_tokens_per_row, head_per_row = 2 * k + 1, 0

    def seconds(nbytes: float, flops: float) -> float:
        return max(nbytes / gpu.hbm_bytes_per_s, flops / gpu.bf16_flops)

    def prefill_s(lengths: list[int]) -> float:
        tokens = sum(lengths)
        flops = 2 * (policy_matmul + draft_matmul) * tokens + attention / 2 * sum(p * p for p in lengths)
        return seconds(policy_bytes + draft_bytes + tokens * (per_position + trunk_per_position), flops)

    length: dict[int, int] = {}  # output row -> committed tokens
    live_per_round, waiting_live = [], []
    modeled_s = 0.0
    while not scheduler.done():
        admitted = scheduler.admit()
        scheduler.fork(admitted)
        recompute = [r.length - 1 for r in admitted.resumed]
        if admitted.lengths or recompute:
            modeled_s += prefill_s(list(admitted.lengths) + recompute)
        for p, slots in zip(admitted.lengths, admitted.slots):
            for s in slots:
                length[scheduler.rows[s].seq] = p + 1
        scheduler.grow()
        scheduler.compact()
        rows = [(s, row) for s, row in enumerate(scheduler.rows) if row is not None]
        live_per_round.append(len(rows))
        if scheduler.waiting or scheduler.preempted:
            waiting_live.append(len(rows))
        context = sum(length[row.seq] for _, row in rows)
        queries = len(rows) * (k + 1)
        flops = 2 * policy_matmul * queries + attention * context * (k + 1)
        nbytes = policy_bytes + context * per_position
        if draft_matmul:
            flops += 2 * (draft_matmul * draft_tokens_per_row + head_per_row) * len(rows)
            nbytes += steps * (draft_bytes + context * trunk_per_position)
        modeled_s += seconds(nbytes, flops)
        active, lengths = [False] * len(scheduler.rows), [1] * len(scheduler.rows)
        for s, row in rows:
            accepted = 0
            while accepted < k and rng.random() < law.acceptance:
                accepted += 1
            end = prompt_tokens + target_len[row.seq]
            length[row.seq] = min(length[row.seq] + 1 + accepted, end)
            active[s], lengths[s] = length[row.seq] < end, length[row.seq]
        scheduler.retire(lengths, active)
    engine_bound = waiting_live or [n]
    return {
        "requested_rows": n,
        "rows": engine.max_batch_size,
        "concurrent_median": statistics.median(engine_bound),
        "concurrent_min": min(engine_bound),
        "concurrent_median_all_rounds": statistics.median(live_per_round),
        "rounds": len(live_per_round),
        "preemptions": scheduler.preemptions,
        "recomputed_tokens": scheduler.recomputed,
        "kv_pool_gib": engine.kv_pool_bytes / GIB,
        "kv_blocks": engine.target_pool.n_blocks - int(engine.paged),
        "block_size": bs,
        "prompt_tokens": prompt_tokens,
        "length_law": law.describe(max_new_tokens, k),
        "modeled_rollout_s": modeled_s,
        "roofline": {"gpu": gpu.name, "hbm_tb_per_s": gpu.hbm_bytes_per_s / 1e12,
                     "bf16_tflops": gpu.bf16_flops / 1e12,
                     "model": "per round max(bytes / HBM, FLOPs / peak); no launch overhead, TP all-reduce "
                              "or sampling"},
    }
