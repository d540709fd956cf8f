"""The rollout engine built from the job config: the one module of ``engine`` that reads it.

``build_rollout_engine`` resolves what the engine takes from ``[rollout]`` once (its running
batch, the KV pool's budget: ``kv_cache_setting``) and makes the engine's copies of the
trainer's models; the engine itself is given plain values.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from titan_cotrain.engine.kv_budget import (
    KVBudget,
    device_bytes,
    gpu_total_bytes,
    optimizer_state_bytes,
    transient_bytes,
)
from titan_cotrain.engine.block_rollout import BlockDraftEngine
from titan_cotrain.engine.rollout import RolloutEngine
from titan_cotrain.models.args import ModelArgs
from titan_cotrain.models.block_draft import BlockDrafter
from titan_cotrain.parallel.parallelize import ParallelModels

__all__ = ["Run", "build_rollout_engine", "engine_class", "kv_cache_setting"]


class Run(Protocol):
    """What the builder asks of the job's run object (``rl.run_mode.RealRun``, or the scale
    simulator's): the accelerator's memory when it is simulated, and the budget a
    tensor-parallel engine group agrees on."""

    gpu_memory_gib: float | None

    def agreed_kv_budget(self, budget: KVBudget, group, device: torch.device) -> KVBudget: ...


def engine_class(draft) -> type[RolloutEngine]:
    """The engine that speculates with ``draft``: ``BlockDraftEngine`` for a block drafter,
    else ``RolloutEngine`` (an EAGLE-3 draft, or none)."""
    return BlockDraftEngine if isinstance(draft, BlockDrafter) else RolloutEngine


def build_rollout_engine(config, models: ParallelModels, device: torch.device, run: Run, *, prompts: int,
                         max_seq_len: int, draft_tokens: int, tp_mesh: DeviceMesh | None = None
                         ) -> tuple[RolloutEngine, float | KVBudget]:
    """The job's rollout engine and what ``[rollout] kv_cache_gib`` resolved to (for the
    start-up line, ``kv_budget.kv_pool_line``).

    ``models``: what ``parallel.parallelize`` built; the engine copies ``engine_policy`` and
    ``engine_draft`` (their weights too when ``engine_loadable``), and an "auto" pool counts
    the trained modules beside it. ``prompts``: the most prompts this rank's engine generates
    in a step, its running batch their ``rl.group_size`` samples each; ``max_seq_len``: its
    positions per sequence; ``draft_tokens``: the most tokens a round drafts (0: plain
    decoding). ``tp_mesh``: this rank's engine group (``parallel.engine_tp``), whose ranks
    agree on one pool through ``run.agreed_kv_budget`` (a collective)."""
    ro = config.rollout
    rows = max(prompts * config.rl.group_size, 1)
    trained = [models.policy, models.draft, models.reference,
               *(models.pipeline.model_parts if models.pipeline is not None else [])]
    kv_cache = kv_cache_setting(
        config, trained, device, models.engine_policy.args, rows=rows, prompts=prompts,
        prompt_tokens=max_seq_len - ro.max_new_tokens, draft_tokens=draft_tokens,
        n_taps=len(models.engine_policy.tap_layers) if models.engine_draft is not None else 0,
        simulated_gib=run.gpu_memory_gib)
    if tp_mesh is not None and isinstance(kv_cache, KVBudget):
        # One schedule per engine group: the pool its fullest rank can hold.
        kv_cache = run.agreed_kv_budget(kv_cache, tp_mesh.get_group(), device)
    engine = engine_class(models.engine_draft).from_models(
        models.engine_policy, models.engine_draft, device=device, max_batch_size=rows, max_seq_len=max_seq_len,
        max_draft_tokens=draft_tokens, kv_cache_gib=kv_cache, block_size=ro.kv_block_size, paged=ro.paged,
        load=models.engine_loadable, tp_mesh=tp_mesh, compile=ro.compile)
    return engine, kv_cache


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
