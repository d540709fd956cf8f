"""``[rollout] kv_cache_gib = "auto"``: the KV pool takes what the GPU has left.

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
from titan_cotrain.parallel.storage import device_storages

__all__ = ["KV_MARGIN_FRACTION", "KVBudget", "OPTIMIZER_MOMENTS", "device_bytes", "gpu_total_bytes",
           "kv_cache_setting", "kv_pool_line", "optimizer_state_bytes", "transient_bytes"]

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


def kv_cache_setting(config, modules: list[nn.Module | None], device: torch.device, policy: ModelArgs, *,
                     rows: int, prompts: int, prompt_tokens: int, draft_tokens: int, n_taps: int,
                     simulated_gib: float | None = None) -> float | KVBudget:
    """What the engine is given for ``[rollout] kv_cache_gib``: its GiB, or for "auto" the
    ``KVBudget`` beside ``modules`` (the trainer's policy, draft, reference and pipeline
    stages, all on the device) and the optimizer state they will have; on a CPU, 0 (the
    whole batch). ``rows`` / ``prompts``: the engine's running batch and the prompts of one
    of its prefills; ``prompt_tokens``: the longest prompt; the engine's copy of ``policy``
    is bf16 (an accelerator's)."""
    ro = config.rollout
    if ro.kv_cache_gib != "auto":
        return ro.kv_cache_gib
    total = gpu_total_bytes(device, simulated_gib)
    if total is None:
        return 0.0
    state = device_bytes(modules, device)
    if not ro.offload_training_state:  # else it is on the host while the pool exists
        state += optimizer_state_bytes(modules, config.optimizer.name)
    transient = transient_bytes(policy, rows=rows, prompts=prompts, prompt_tokens=prompt_tokens,
                                draft_tokens=draft_tokens, n_taps=n_taps, dtype=torch.bfloat16,
                                tensor_parallel=ro.tensor_parallel_degree)
    return KVBudget(total, state, transient)


def kv_pool_line(engine, setting: float | KVBudget) -> str:
    """The start-up line of an "auto" pool: its size and what it holds, or the CPU's fallback."""
    if not isinstance(setting, KVBudget):
        return ('note: [rollout] kv_cache_gib = "auto" has no GPU to measure on the CPU: the pool holds the whole '
                f"batch at its longest ({engine.kv_pool_bytes / GIB:.3f} GiB)")
    blocks = engine.target_pool.n_blocks - engine.paged  # less the scratch block
    return (f'[rollout] kv_cache_gib = "auto": {engine.kv_pool_bytes / GIB:.2f} GiB, {blocks} blocks of '
            f"{engine.block_size} positions, {blocks // engine.blocks_per_sequence} sequences at their longest "
            f"({setting.describe(engine.weight_bytes)})")
