"""The KV pool's size and layout. ``KVPoolLayout``: its blocks, rows and bytes, from the engine's
shapes and a budget (``kv_bytes_per_sequence`` bytes hold one sequence at its longest).
``[rollout] kv_cache_gib = "auto"``: the pool takes what the GPU has left.

On one rank, while the pool exists::

    pool = (1 - KV_MARGIN_FRACTION) x GPU memory - training state - engine weights - transient

"auto" needs ``[rollout] release_between_rollouts``: the pool then lives from the weight
refresh to the end of the rollout and is freed, with the engine's weights, for the update,
whose activations and gradients no count made at start knows. The refresh reads the
parameters, so the fp32 shards and buffers of every trained module are counted (from the
storages); the optimizers' state (not yet created at start: two fp32 moments per trainable
element for Adam and AdamW, the only optimizers "auto" accepts) is counted unless
``offload_training_state`` moves it to the host before the refresh (``rl.offload``), which
it does: then the pool takes its room. The engine's
weights are counted from its copy; the transient is estimated (``transient_bytes``: the
larger of the rollout's activations and the refresh's gathered tensors). The scale simulator
runs this same resolution and then measures every phase: it is the check that the estimate
holds at a config's shapes.

``KV_MARGIN_FRACTION`` of the GPU is kept for what neither the count nor the simulator
sees: the CUDA context and the kernels' workspaces, NCCL's buffers, and the caching
allocator's fragmentation.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from titan_cotrain.components.shards import local_shard
from titan_cotrain.models.args import ModelArgs
from titan_cotrain.models.draft import DraftArgs
from titan_cotrain.parallel.engine_tp import kv_heads_per_rank
from titan_cotrain.parallel.storage import device_storages

__all__ = ["KV_MARGIN_FRACTION", "KVBudget", "KVPoolLayout", "OPTIMIZER_MOMENTS", "device_bytes",
           "gpu_total_bytes", "kv_bytes_per_position", "kv_bytes_per_sequence", "kv_pool_line",
           "optimizer_state_bytes", "transient_bytes"]

KV_MARGIN_FRACTION = 0.10
"""Share of the GPU's memory "auto" leaves unused: CUDA context, NCCL buffers, fragmentation."""

OPTIMIZER_MOMENTS = {"Adam": 2, "AdamW": 2}
"""fp32 state tensors per trainable parameter element, by ``[optimizer] name``."""

GIB = 2**30


@dataclass(frozen=True)
class KVBudget:
    """What one rank's GPU holds beside the KV pool, in bytes: ``total`` memory, the
    ``training_state`` and the largest ``transient`` (rollout or refresh). The engine adds its
    own weights (``pool_bytes``) once its copy exists."""

    total: int
    training_state: int
    transient: int

    def pool_bytes(self, engine_weights: int) -> int:
        """The pool's bytes (possibly negative: nothing fits)."""
        return int((1 - KV_MARGIN_FRACTION) * self.total) - self.training_state - engine_weights - self.transient

    def agreed(self, group, device: torch.device) -> KVBudget:
        """The budget every rank of ``group`` (a tensor-parallel engine's) can hold: its
        ranks' largest training state and transient. Their pools, and so their schedules,
        must be the same (a collective over ``group``)."""
        values = torch.tensor([self.training_state, self.transient], dtype=torch.int64, device=device)
        torch.distributed.all_reduce(values, op=torch.distributed.ReduceOp.MAX, group=group)
        state, transient = values.tolist()
        return KVBudget(self.total, state, transient)

    def describe(self, engine_weights: int) -> str:
        """The sum, in GiB, for messages."""
        return (f"{1 - KV_MARGIN_FRACTION:g} x {self.total / GIB:.1f} GiB - training state {self.training_state / GIB:.2f}"
                f" - engine weights {engine_weights / GIB:.2f} - transient {self.transient / GIB:.2f}"
                f" = {self.pool_bytes(engine_weights) / GIB:.2f} GiB")


def _cache_slots(max_seq_len: int, max_draft_tokens: int, draft=None) -> tuple[int, int]:
    """``(positions, chain slots)`` of the engine's caches. A round writes ``k + 1`` positions
    past the last committed one, even for a sequence that is finished and no longer moves;
    an EAGLE-3 draft's chain holds passes ``2..k`` (a block drafter has none)."""
    chain = max(max_draft_tokens - 1, 0) if draft is not None and draft.chain_cache else 0
    return max_seq_len + max_draft_tokens + 1, chain


def kv_bytes_per_position(policy: ModelArgs, draft: DraftArgs | None, dtype: torch.dtype,
                          tensor_parallel: int = 1) -> int:
    """KV bytes of one position of one sequence on one rank: keys and values of every target
    layer (``1 / tensor_parallel`` of its KV heads, at least one) and, with a draft, of its
    cached layers (an EAGLE-3 draft's trunk; every layer's context of a block drafter)."""
    elements = policy.n_layers * kv_heads_per_rank(policy.n_kv_heads, tensor_parallel) * policy.head_dim
    if draft is not None:
        elements += draft.cache_layers * draft.n_kv_heads * draft.head_dim
    return 2 * elements * dtype.itemsize


def kv_bytes_per_sequence(policy: ModelArgs, draft: DraftArgs | None, max_seq_len: int, max_draft_tokens: int,
                          dtype: torch.dtype, tensor_parallel: int = 1) -> int:
    """KV-cache bytes of one sequence at its longest on one rank of a ``RolloutEngine``:
    ``kv_bytes_per_position`` over ``L = max_seq_len + k + 1`` positions, plus the draft's
    ``k - 1`` chain slots (``k = max_draft_tokens``), in ``dtype``."""
    positions, chain = _cache_slots(max_seq_len, max_draft_tokens, draft)
    chain_bytes = 2 * draft.n_kv_heads * draft.head_dim * chain * dtype.itemsize if draft is not None else 0
    return positions * kv_bytes_per_position(policy, draft, dtype, tensor_parallel) + chain_bytes


@dataclass(frozen=True)
class KVPoolLayout:
    """How one rank's KV pool is laid out (``models.kv_cache``): each pool (the target's and,
    with a draft, its trunk's) is ``n_blocks`` blocks of ``block_size`` positions,
    ``block_bytes`` of KV per block over both, ``blocks_per_sequence`` covering a sequence at
    its longest; the running batch has ``max_batch_size`` rows, each with ``chain_slots``
    positions of the draft's chain. ``paged``: block 0 is the scratch block and sequences
    take blocks as they grow; else (the static layout) a block is one row's whole sequence."""

    n_blocks: int
    block_size: int
    max_batch_size: int
    block_bytes: int
    blocks_per_sequence: int
    chain_slots: int
    paged: bool

    @classmethod
    def from_budget(cls, kv_cache_gib: float | KVBudget, policy: ModelArgs, draft: DraftArgs | None,
                    dtype: torch.dtype, *, engine_weights: int, max_batch_size: int, max_seq_len: int,
                    max_draft_tokens: int, block_size: int, paged: bool, tensor_parallel: int = 1) -> KVPoolLayout:
        """The layout of a ``RolloutEngine``'s pool (its arguments, ``max_draft_tokens`` 0
        without a draft): ``kv_cache_gib`` GiB (0: ``max_batch_size`` sequences at their
        longest), or what a ``KVBudget`` ("auto") leaves beside the engine's weights of
        ``engine_weights`` bytes. A budget for fewer sequences at their longest than rows
        lowers the static layout's rows and the paged layout's blocks (its rows stay: they
        hold sequences as they grow). Refused when the budget holds no sequence at its
        longest."""
        if max_batch_size < 1 or block_size < 1:
            raise ValueError(f"max_batch_size ({max_batch_size}) and block_size ({block_size}) must be >= 1")
        positions, chain = _cache_slots(max_seq_len, max_draft_tokens, draft)
        per_sequence = kv_bytes_per_sequence(policy, draft, max_seq_len, max_draft_tokens, dtype, tensor_parallel)
        per_position = kv_bytes_per_position(policy, draft, dtype, tensor_parallel)
        budget = _pool_bytes(kv_cache_gib, engine_weights, per_sequence)
        block_size = block_size if paged else positions
        per_block = block_size * per_position
        blocks_per_sequence = -(-positions // block_size)
        if not paged:
            if budget:
                max_batch_size = min(max_batch_size, budget // per_sequence)
            n_blocks = max_batch_size
        else:
            chain_bytes = per_sequence - positions * per_position
            n_blocks = max_batch_size * blocks_per_sequence + 1  # + the scratch block
            if budget:
                n_blocks = min(n_blocks, (budget - max_batch_size * chain_bytes) // per_block)
        if budget and (max_batch_size < 1 or n_blocks - paged < blocks_per_sequence):
            stated = f'"auto" ({budget / 2**30:.3f} GiB)' if isinstance(kv_cache_gib, KVBudget) else kv_cache_gib
            raise ValueError(
                f"[rollout] kv_cache_gib = {stated} holds no sequence: one needs "
                f"{per_sequence / 2**30:.4f} GiB ({per_sequence} bytes: max_seq_len {max_seq_len} + "
                f"{max_draft_tokens} draft tokens + 1 positions in {dtype})"
                + (f", with {max_batch_size} rows' draft chains beside it" if paged else ""))
        return cls(n_blocks=n_blocks, block_size=block_size, max_batch_size=max_batch_size, block_bytes=per_block,
                   blocks_per_sequence=blocks_per_sequence, chain_slots=chain, paged=paged)


def _pool_bytes(kv_cache_gib: float | KVBudget, engine_weights: int, per_sequence: int) -> int:
    """The pool's bytes: ``kv_cache_gib`` GiB, or what a ``KVBudget`` ("auto") leaves beside
    the engine's weights, refused when that is not one sequence at its longest."""
    if not isinstance(kv_cache_gib, KVBudget):
        return int(kv_cache_gib * 2**30)
    budget = kv_cache_gib.pool_bytes(engine_weights)
    if budget < per_sequence:
        raise ValueError(f'[rollout] kv_cache_gib = "auto" leaves no room for one sequence '
                         f"({per_sequence / 2**30:.3f} GiB at its longest): "
                         f"{kv_cache_gib.describe(engine_weights)}")
    return budget


def gpu_total_bytes(device: torch.device, simulated_gib: float | None = None) -> int | None:
    """Memory of this rank's accelerator: the CUDA device's, or ``simulated_gib`` on the
    scale simulator's; None on the CPU (where "auto" has nothing to measure)."""
    if simulated_gib is not None:
        return int(simulated_gib * GIB)
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return None


def device_bytes(modules: Iterable[nn.Module | None], device: torch.device) -> int:
    """Bytes of the distinct storages of ``modules``' parameters and buffers on ``device``'s
    type (this rank's shards; meta and host tensors do not count)."""
    tensors = [t for m in modules if m is not None for t in (*m.parameters(), *m.buffers())]
    return sum(storage.nbytes() for storage in device_storages(tensors, device.type))


def optimizer_state_bytes(modules: Iterable[nn.Module | None], optimizer: str) -> int:
    """The optimizer's state for ``modules``' trainable local elements, before it exists."""
    if optimizer not in OPTIMIZER_MOMENTS:
        raise ValueError(f'[rollout] kv_cache_gib = "auto" counts the optimizer state of '
                         f'{" or ".join(OPTIMIZER_MOMENTS)}, not of [optimizer] name = {optimizer!r}: '
                         "set a size in GiB")
    # Each parameter once: a pipeline's local policy holds its stages, which are listed too.
    params = {id(p): p for m in modules if m is not None for p in m.parameters()}.values()
    elements = sum(local_shard(p).numel() for p in params if p.requires_grad and local_shard(p).device.type != "meta")
    return OPTIMIZER_MOMENTS[optimizer] * 4 * elements


def transient_bytes(policy: ModelArgs, *, rows: int, prompts: int, prompt_tokens: int, draft_tokens: int,
                    n_taps: int, dtype: torch.dtype, tensor_parallel: int = 1) -> int:
    """An estimate of the largest transient beside the pool, the largest of

    * a prefill: one target forward over ``prompts`` right-padded prompts of
      ``prompt_tokens``; per token a layer holds the residual, its norm, q / k / v and the
      attention output (``~6 x dim``, ``1 / tensor_parallel`` of the heads), the MLP's gate,
      up and product (``3 x ffn_dim / tensor_parallel``), and the draft's taps
      (``n_taps x dim``) stay for its pass over the prompt;
    * a verify round: ``rows x (k + 1)`` positions of fp32 logits over the vocabulary and
      the sampler's work on them (processed logits, probabilities, a top-p sort's values
      and int64 indices, the draft's: ``~6`` fp32-sized copies);
    * the refresh: one whole parameter gathered in ``dtype`` (the largest, ``vocab x dim``
      or ``ffn_dim x dim``), the all-gather's buffer, the copy a pipeline broadcasts or the
      engine slices it from, and the cast shard it was gathered from: ``4`` of it (the
      32B simulation measured 3.5).
    """
    per_token = 6 * policy.dim + 3 * policy.ffn_dim // tensor_parallel + n_taps * policy.dim
    prefill = prompts * prompt_tokens * per_token * dtype.itemsize
    verify = rows * (draft_tokens + 1) * policy.vocab_size * 4 * 6
    refresh = 4 * max(policy.vocab_size, policy.ffn_dim) * policy.dim * dtype.itemsize
    return max(prefill, verify, refresh)


def kv_pool_line(engine, setting: float | KVBudget) -> str:
    """The start-up line of an "auto" pool: its size and what it holds, or the CPU's fallback."""
    if not isinstance(setting, KVBudget):
        return ('note: [rollout] kv_cache_gib = "auto" has no GPU to measure on the CPU: the pool holds the whole '
                f"batch at its longest ({engine.kv_pool_bytes / GIB:.3f} GiB)")
    blocks = engine.target_pool.n_blocks - engine.paged  # less the scratch block
    return (f'[rollout] kv_cache_gib = "auto": {engine.kv_pool_bytes / GIB:.2f} GiB, {blocks} blocks of '
            f"{engine.block_size} positions, {blocks // engine.blocks_per_sequence} sequences at their longest "
            f"({setting.describe(engine.weight_bytes)})")
