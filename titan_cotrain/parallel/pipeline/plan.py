"""Where everything goes: the layers of each pipeline stage and the PP rank that runs it.

Stage ``i`` runs on PP rank ``i % pp`` ("loop": GPipe, 1F1B, Interleaved1F1B, LoopedBFS,
InterleavedZeroBubble) or zigzags ("v": ZBVZeroBubble, DualPipeV: rank ``r`` holds stages
``r`` and ``2 pp - 1 - r``, so the first and the last stage share rank 0).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from torch.distributed.pipelining import ScheduleDualPipeV, ScheduleZBVZeroBubble
from torch.distributed.pipelining.schedules import PipelineScheduleSingle, get_schedule_class

from titan_cotrain.parallel.tap_channel import EMBEDDINGS

__all__ = ["PipelinePlan", "layers_per_stage_from_fqns", "plan_pipeline"]


@dataclass(frozen=True)
class PipelinePlan:
    """Which layers each stage holds and which PP rank runs it, for ``schedule`` (a torch
    schedule name) on ``pp`` ranks.

    ``layer_ranges[i]``: the decoder layers of stage ``i`` (contiguous, covering
    ``0..L-1`` in order; a stage may hold none); ``stage_ranks[i]``: its PP rank.
    """

    schedule: str
    pp: int
    layer_ranges: tuple[range, ...]
    stage_ranks: tuple[int, ...]

    @property
    def num_stages(self) -> int:
        return len(self.layer_ranges)

    def stages_of(self, pp_rank: int) -> list[int]:
        return [i for i, r in enumerate(self.stage_ranks) if r == pp_rank]

    def stage_of(self, fqn: str) -> int:
        """The stage holding the whole policy's parameter or buffer ``fqn``."""
        module, *rest = fqn.split(".")
        if module == "layers":
            layer = int(rest[0])
            return next(i for i, r in enumerate(self.layer_ranges) if layer in r)
        return 0 if module == "embed_tokens" else self.num_stages - 1

    def tap_owners(self, tap_layers: Sequence[int]) -> dict[int, int]:
        """``{source: PP rank}`` for the embedding output and every tap layer."""
        owners = {EMBEDDINGS: self.stage_ranks[0]}
        for layer in tap_layers:
            owners[layer] = next(self.stage_ranks[i] for i, r in enumerate(self.layer_ranges) if layer in r)
        return owners


def _stage_ranks(num_stages: int, pp: int, v_shape: bool) -> tuple[int, ...]:
    """Loop: stage i on rank i % pp. V: zigzag, rank r holds stages r, 2pp-1-r, 2pp+r, ..."""
    if not v_shape:
        return tuple(i % pp for i in range(num_stages))
    return tuple(i % pp if (i // pp) % 2 == 0 else pp - 1 - i % pp for i in range(num_stages))


def plan_pipeline(
    n_layers: int,
    pp: int,
    schedule: str,
    *,
    layers_per_stage: Sequence[int] | None = None,
    stages_per_rank: int | None = None,
    first_stage_less_layers: int = 1,
    last_stage_less_layers: int = 1,
) -> PipelinePlan:
    """Split ``n_layers`` decoder layers into stages for ``schedule`` on ``pp`` ranks.

    ``layers_per_stage`` is the explicit split (its length is the number of stages);
    otherwise ``stages_per_rank`` (default: 1 for single-stage schedules, 2 for looped and V
    schedules) stages share the layers evenly, counting the embedding and the head as
    ``first/last_stage_less_layers`` layers (torchtitan's split).
    """
    schedule_cls = get_schedule_class(schedule)
    single = issubclass(schedule_cls, PipelineScheduleSingle)
    if layers_per_stage is not None:
        counts = [int(n) for n in layers_per_stage]
        if sum(counts) != n_layers or min(counts) < 0:
            raise ValueError(f"layers per stage {counts} must be >= 0 and add up to the {n_layers} layers")
    else:
        from titan_cotrain.components import titan

        v = stages_per_rank or (1 if single else 2)
        counts = titan.pipeline_layer_split(pp * v, n_layers, first_stage_less_layers, last_stage_less_layers)
    if len(counts) % pp:
        raise ValueError(f"{len(counts)} stages cannot be spread evenly over {pp} PP ranks")
    v = len(counts) // pp
    if single and v != 1:
        raise ValueError(f"schedule {schedule} runs one stage per rank, but the split has {v} per rank")
    if not single and v < 2:
        raise ValueError(f"schedule {schedule} needs at least 2 stages per rank, the split has {v}")
    if 0 in counts[1:-1]:
        raise ValueError(f"layers per stage {counts}: a middle stage must hold at least one layer")
    starts = [sum(counts[:i]) for i in range(len(counts))]
    ranges = tuple(range(s, s + n) for s, n in zip(starts, counts))
    v_shape = schedule_cls in (ScheduleZBVZeroBubble, ScheduleDualPipeV)
    stage_ranks = _stage_ranks(len(counts), pp, v_shape)
    return PipelinePlan(schedule=schedule, pp=pp, layer_ranges=ranges, stage_ranks=stage_ranks)


def layers_per_stage_from_fqns(module_fqns_per_model_part: Sequence[Sequence[str]], n_layers: int) -> list[int]:
    """Read torchtitan's ``[parallelism] module_fqns_per_model_part`` with our module names
    (``embed_tokens``, ``layers.N``, ``norm``, ``lm_head``) as layers per stage."""
    parts = [list(p) for p in module_fqns_per_model_part]
    layers = [[int(n.split(".")[1]) for n in p if n.startswith("layers.")] for p in parts]
    flat = [i for part in layers for i in part]
    problems = []
    if flat != list(range(n_layers)):
        problems.append(f"the layers must be layers.0 .. layers.{n_layers - 1}, each once, in order")
    if "embed_tokens" not in parts[0]:
        problems.append("the first part must hold embed_tokens")
    if not {"norm", "lm_head"} <= set(parts[-1]):
        problems.append("the last part must hold norm and lm_head")
    known = {"embed_tokens", "norm", "lm_head"}
    unknown = [n for p in parts for n in p if not n.startswith("layers.") and n not in known]
    if unknown:
        problems.append(f"unknown module names {unknown}")
    if problems:
        raise ValueError("parallelism.module_fqns_per_model_part: " + "; ".join(problems))
    return [len(p) for p in layers]
