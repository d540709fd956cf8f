"""The scale simulator: the real job, rank by rank, on the simulated accelerator.

``python -m titan_cotrain.train --job.config_file F --simulate.enable [--simulate.gpu_memory_gib 80]``

For each simulated rank (``[simulate] ranks``; default rank 0 and, under PP, the first
rank of every other pipeline role: the head's, and the middle rank with the most layers)
the real ``Trainer`` runs at the config's world size and shapes on ``simgpu``
(``titan_cotrain.simulate.device``) with torch's fake process group: construction; the
optimizers' state made first, as a running job holds it from its first step on; then the
trainer's own ``rl_step``, twice (the first RL step, and one that starts after an update, as
every later step does), each of its phases measured as the trainer enters it, a phase's peak
the higher of the two: ``offload``, ``refresh``, ``rollout`` (the real engine: the sequences
its KV pool admits at once, then ``[simulate] decode_rounds`` decoding rounds at their
longest), ``release``, ``restore``, ``pack``, ``update`` (one update over the first
``[simulate] microbatches`` of the real microbatches, or one schedule step under PP: memory
repeats from one to the next; and the optimizer step); then the checkpoint's state dicts. Rollout
*contents* are unknown on fake tensors, so the rank trains on the worst case: every
response is ``rollout.max_new_tokens`` long.

The report is ``{"config", "world_size", "gpu_memory_gib", "ranks": [{"rank", "role",
"peak_gib", "by_category_gib", "peak_phase", "largest_at_peak", "phase_peak_gib",
"after_step_gib", "attention_kernels", "offloaded_gib", "kv_pool_gib"}], "rollout", "host_collectives"}`` (``after_step_gib``:
what stays alive between steps, by category; ``attention_kernels``: per phase (both steps'
calls together), the flash kernels the accelerator path called, whose fake implementations
gave the shapes;
``offloaded_gib``: the training state ``[rollout] offload_training_state`` keeps on the host
during the rollout, not counted on the device then; ``kv_pool_gib``: the engine's KV pool,
``[rollout] kv_cache_gib`` or what ``"auto"`` made of it; ``rollout``: the engine's schedule
over one rollout of a rank's share with its concurrency, preemptions, the most nodes an
engine group spans and a roofline estimate of its time, ``simulate.rollout_model``; under expert
parallelism ``expert_parallel_dispatch``, the routing assumed: ``BALANCED_DISPATCH``); the job is refused (non-zero exit,
naming the rank and its biggest category) when a rank's peak exceeds the budget, or when any collective was handed a host
tensor.
"""

from __future__ import annotations

import collections
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist

from titan_cotrain.components import titan
from titan_cotrain.parallel.storage import device_storages
from titan_cotrain.simulate.device import SIM_BACKEND, SIM_DEVICE_TYPE, SimulatedDevice, register_simulated_device
from titan_cotrain.simulate.memory import MemoryTracker

__all__ = ["SimulationFailed", "simulate", "world_size_of"]

GIB = 2**30

# The modelling assumption behind an expert-parallel report (``components.titan._balanced_dispatch``):
# the dispatch's split sizes are routing decisions, which fake tensors do not make.
BALANCED_DISPATCH = ("balanced routing: each rank sends an equal share of its routed rows (tokens x top_k) to "
                     "every expert-parallel rank and receives as many from each")


class SimulationFailed(RuntimeError):
    """A simulated rank does not fit its budget, or the job handed a collective a host tensor."""


def world_size_of(config) -> int:
    """The job's world size: the product of its parallel degrees (``data_parallel_shard_degree
    = -1``: what the launch's ``WORLD_SIZE`` leaves for it, 1 when unset)."""
    p = config.parallelism
    others = p.data_parallel_replicate_degree * p.context_parallel_degree * p.pipeline_parallel_degree
    shard = p.data_parallel_shard_degree
    if shard < 1:
        return max(int(os.environ.get("WORLD_SIZE", "1")), others)
    return others * shard


def _default_ranks(config, world_size: int) -> list[int]:
    """Rank 0 and, under PP, one rank of every other pipeline role: the PP rank of the head
    (and the draft), and of the middle ranks (no embedding, no head) the one holding the
    most layers (each PP rank's rank at data-parallel and CP coordinate 0 in the job's rank
    layout)."""
    pp = config.parallelism.pipeline_parallel_degree
    if pp == 1:
        return [0]
    from titan_cotrain.models.build import resolve_model_args
    from titan_cotrain.parallel.pipeline.build import plan_from_config
    from titan_cotrain.parallel.rank_layout import rank_layout

    plan = plan_from_config(config, resolve_model_args(config).n_layers)
    last = plan.num_stages - 1
    ends = {plan.stage_ranks[0], plan.stage_ranks[last]}  # the embedding's and the head's PP ranks
    middle = [r for r in range(pp) if r not in ends]
    layers = [sum(len(plan.layer_ranges[s]) for s in plan.stages_of(r)) for r in range(pp)]
    # Middle ranks differ only in layers: the one holding the most stands for them all.
    chosen = sorted(ends | ({max(middle, key=lambda r: layers[r])} if middle else set()))
    layout = rank_layout(config, world_size)
    return [layout.rank(r, 0, 0) for r in chosen]


def _storages(tensors, category: str, out: dict[int, str]) -> None:
    for storage in device_storages(tensors, SIM_DEVICE_TYPE, empty=True):
        out.setdefault(storage._cdata, category)


def _owners(trainer) -> dict[int, str]:
    """Storage key -> category for everything the trainer owns right now."""
    if trainer is None:
        return {}
    out: dict[int, str] = {}
    models = [m for m in (trainer.policy, trainer.draft) if m is not None]
    for model in models:
        _storages((p.grad for p in model.parameters()), "gradients", out)
        _storages(model.parameters(), "parameters", out)
        _storages(model.buffers(), "buffers", out)
    for container in (trainer.policy_opt, trainer.draft_opt):
        for optimizer in getattr(container, "optimizers", []) if container is not None else []:
            for state in optimizer.state.values():
                _storages((v for v in state.values() if isinstance(v, torch.Tensor)), "optimizer state", out)
    if trainer.reference is not None:
        _storages(trainer.reference.parameters(), "reference", out)
    engine = trainer.engine
    _storages(engine.cache_tensors(), "KV cache", out)
    for model in (engine.policy, engine.draft):
        if model is not None:
            _storages(model.parameters(), "engine weights", out)
            _storages(model.buffers(), "engine weights", out)
    return out


@torch.no_grad()
def _warm_optimizers(trainer) -> None:
    """Create the optimizers' state now, as a job holds it from its first step on: torch
    creates it lazily in the first ``step()``, so a simulated first update would otherwise
    miss it at its peak (one step on zero gradients; the values are fake anyway)."""
    for container in (trainer.policy_opt, trainer.draft_opt):
        for optimizer in getattr(container, "optimizers", []) if container is not None else []:
            for group in optimizer.param_groups:
                for param in group["params"]:
                    param.grad = torch.zeros_like(param)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)


class _KernelsByPhase:
    """The flash kernels the accelerator path called, per phase (``SimulatedDevice.attention_kernels``
    counted from each phase's start); ``calls``: the phases that called any."""

    def __init__(self, device: SimulatedDevice) -> None:
        self.device, self.calls = device, {}
        self._phase, self._start = None, collections.Counter()

    def enter(self, phase: str | None) -> None:
        """Close the current phase's count and start ``phase``'s (None: stop counting)."""
        now = collections.Counter(self.device.attention_kernels)
        if self._phase is not None and now - self._start:
            calls = collections.Counter(self.calls.get(self._phase, {})) + (now - self._start)
            self.calls[self._phase] = dict(calls)
        self._phase, self._start = phase, now


def simulate_rank(config, rank: int, world_size: int) -> tuple[dict, list[str]]:
    """Run one rank's step on the simulated device; returns its report and host collectives.

    The step is the trainer's own ``rl_step``: the simulation is told each phase as the
    trainer enters it (``RealRun.phase``) and measures it, so the phases reported are the
    phases the trainer takes, in its order."""
    from titan_cotrain.rl.trainer import Trainer
    from titan_cotrain.simulate.simulation import Simulation

    register_simulated_device()
    titan.use_device_type(SIM_DEVICE_TYPE)
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group(SIM_BACKEND, store=FakeStore(), rank=rank, world_size=world_size)
    holder: dict = {"trainer": None}
    tracker = MemoryTracker(owners=lambda: _owners(holder["trainer"]))
    try:
        with SimulatedDevice(on_alloc=tracker) as device:
            kernels = _KernelsByPhase(device)

            def enter(phase: str) -> None:
                kernels.enter(phase)
                tracker.phase(phase)

            enter("construction")
            trainer = holder["trainer"] = Trainer(config, world_size, rank,
                                                  mode=Simulation(config.simulate, on_phase=enter))
            enter("optimizer state")
            # A job creates it in its first update, where release_between_rollouts has freed the engine.
            if config.rollout.release_between_rollouts:
                trainer.engine.release()
            _warm_optimizers(trainer)
            # The first RL step, then one as every later step meets the rank: after an update,
            # with what updates leave alive (a pipeline stage's buffers, for one).
            if trainer.prefit is not None:  # a step of the draft's prefit, as the last before RL
                trainer.prefit_step(trainer.rl_offset)
            for step in (1, 2):
                trainer.rl_step(trainer.rl_offset + step)
            host_bytes = trainer.offload.host_bytes if trainer.offload is not None else 0
            enter("checkpoint")
            trainer.checkpoint_state_dicts()
            kernels.enter(None)
            role = trainer.role
            kv_pool = trainer.engine.kv_pool_bytes
            rollout = _rollout_model(trainer, config)
            after_step = tracker.breakdown()
    finally:
        dist.destroy_process_group()
        titan.use_device_type(None)
    report = {
        "rank": rank,
        "role": role,
        "peak_gib": tracker.peak_bytes / GIB,
        "by_category_gib": {k: v / GIB for k, v in sorted(tracker.peak_by_category.items(), key=lambda kv: -kv[1])},
        "peak_phase": tracker.peak_phase,
        "largest_at_peak": [{"gib": b / GIB, "category": c, "site": w} for b, c, w in tracker.peak_largest],
        "phase_peak_gib": {k: v / GIB for k, v in tracker.phase_peaks.items()},
        "after_step_gib": {k: v / GIB for k, v in sorted(after_step.items(), key=lambda kv: -kv[1])},
        "attention_kernels": kernels.calls,
        "offloaded_gib": host_bytes / GIB,
        "kv_pool_gib": kv_pool / GIB,
        "rollout": rollout,
    }
    return report, device.host_collectives


def _rollout_model(trainer, config) -> dict:
    """The engine's schedule over one rollout of this rank's share (``simulate.rollout_model``):
    its GRPO groups, prompts at their budget, responses from the stated length law."""
    from titan_cotrain.simulate.rollout_model import gpu_model, model_rollout

    engine, ro = trainer.engine, config.rollout
    drafting = ro.speculative and config.draft.enable
    return model_rollout(engine, requested_groups=trainer.generation.max_share(trainer.prompts_per_rank),
                         samples=config.rl.group_size, prompt_tokens=engine.max_seq_len - ro.max_new_tokens,
                         max_new_tokens=ro.max_new_tokens, draft_tokens=engine.max_draft_tokens if drafting else 0,
                         gpu=gpu_model(config.simulate.gpu_memory_gib))


def _rank_from_args(args: list[str], world: int | str | None, rank: int, world_size: int):
    """In the child: the rank's report, or the traceback of what stopped it (as text: torch's
    exceptions do not all pickle)."""
    import traceback

    from titan_cotrain.config import load_job_config

    try:
        return simulate_rank(load_job_config(args, world_size=world), rank, world_size), None
    except Exception:
        return None, traceback.format_exc()


def _in_fresh_process(args: list[str], world: int | str | None, rank: int, world_size: int):
    """``simulate_rank`` in a spawned process of its own, the config read again from ``args``:
    torch keeps process-wide state per process-group world (meshes, group names) that a
    second fake world in one process trips on."""
    import multiprocessing

    with multiprocessing.get_context("spawn").Pool(1) as pool:
        result, failure = pool.apply(_rank_from_args, (args, world, rank, world_size))
    if failure is not None:
        raise RuntimeError(f"simulating rank {rank} failed:\n{failure}")
    return result


def simulate(config, config_path: str, *, output: str | None = None,
             args: tuple[list[str], int | str | None] | None = None) -> dict:
    """Simulate the ranks of ``config`` and write the JSON report; raise ``SimulationFailed``
    (after writing it) when a rank is over budget or a collective saw a host tensor.

    ``args``: ``(command line, world_size for load_job_config)`` the config was read from;
    with it every rank runs in a fresh process (needed for more than one rank), without it
    in this one."""
    world_size = world_size_of(config)
    if dist.is_initialized():
        raise RuntimeError("the simulator runs its own fake process group: call it before the job's is initialised")
    budget = config.simulate.gpu_memory_gib
    ranks = list(config.simulate.ranks) or _default_ranks(config, world_size)
    reports, host_collectives = [], []
    for rank in ranks:
        report, host = (_in_fresh_process(*args, rank, world_size) if args is not None
                        else simulate_rank(config, rank, world_size))
        reports.append(report)
        host_collectives += [f"rank {rank}: {h}" for h in host]
        print(f"simulate: rank {rank} ({report['role']}) peak {report['peak_gib']:.1f} GiB of {budget:g} "
              f"({', '.join(f'{k} {v:.1f}' for k, v in report['by_category_gib'].items())})", flush=True)
    from titan_cotrain.parallel.rank_layout import engine_group_nodes

    # The engine and its share are the same on every rank: one schedule stands for all.
    rollout = [r.pop("rollout") for r in reports][0]
    rollout["offloaded_gib"] = max(r["offloaded_gib"] for r in reports)
    rollout["tp_group_nodes"] = engine_group_nodes(config, world_size, config.simulate.gpus_per_node)
    result = {"config": Path(config_path).name, "world_size": world_size, "gpu_memory_gib": budget,
              "ranks": reports, "rollout": rollout, "host_collectives": sorted(set(host_collectives))}
    if config.parallelism.expert_parallel_degree > 1:
        result["expert_parallel_dispatch"] = BALANCED_DISPATCH
    path = output or config.simulate.output or os.path.join("assets", "scale", Path(config_path).stem + ".json")
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print(f"simulate: wrote {path}", flush=True)
    problems = [f"collective on a host tensor: {h}" for h in result["host_collectives"]]
    for r in reports:
        if r["peak_gib"] > budget:
            biggest, gib = next(iter(r["by_category_gib"].items()))
            problems.append(f"rank {r['rank']} ({r['role']}) needs {r['peak_gib']:.1f} GiB, over the "
                            f"{budget:g} GiB budget; the biggest category is {biggest} ({gib:.1f} GiB)")
    if problems:
        raise SimulationFailed("; ".join(problems))
    return result
