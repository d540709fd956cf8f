"""Pipeline parallelism for co-training: the target split into stages, the draft on the last.

Layout, for ``pp`` ranks and ``v`` stages per rank (``pp * v`` stages)::

    stage 0                 stage 1 .. n-2          stage n-1
    embed_tokens            layers [a, b)           layers [c, L), norm, lm_head,
    layers [0, a)                                   draft (a submodule), CotrainLoss
      |  taps of the layers a stage owns (and the embedding output) --TapChannel--> |

* Each stage module (``TransformerStage``) holds a contiguous range of the policy's decoder
  layers, under their whole-model names (``layers.5.mlp.up_proj.weight`` stays that name on
  whichever stage holds it), so checkpoints and gradients map one to one.
* Stage ``i`` runs on PP rank ``i % pp`` ("loop": GPipe, 1F1B, Interleaved1F1B, LoopedBFS,
  InterleavedZeroBubble) or zigzags ("v": ZBVZeroBubble, DualPipeV: rank ``r`` holds stages
  ``r`` and ``2 pp - 1 - r``, so the first and the last stage share rank 0).
* Every PP rank gets the whole batch: the first stage reads the tokens, every stage reads the
  ``document_ids`` (a kwarg the schedule splits per microbatch) to build its attention
  layout, and the loss reads the microbatch's rows of the batch (the schedule's ``target``
  is the row indices).
* The draft is a submodule of the last stage's module, so checkpointing and
  ``Pipeline.draft_parameters`` find it there, but the schedule never runs its backward:
  ``CotrainLoss`` runs the draft's forward *and* backward for microbatch ``m``
  inside the last stage's loss function (its inputs are detached, its graph is its own).
  The taps' landing slots and the draft's activations are free when the loss returns,
  whatever the schedule, and zero-bubble weight passes (which only find parameters reached
  from the stage's inputs) have nothing to miss.

Normalisation. Both losses divide by *global* token counts (every microbatch, every
data-parallel rank), as on a single device. The draft's count depends on the policy's
logits (a masked anchor needs the teacher's argmax in the draft vocabulary), so it is only
known after the last microbatch. torch's schedules handle the same problem for their
microbatch mean after the fact (``scale_grads`` divides every gradient by the number of
microbatches once the step is done); we build the schedule with ``scale_grads=False`` and
do the same with the true counts: each microbatch backpropagates its loss *sums*, and
``pipeline_step`` scales the policy's gradients by ``1 / N_policy`` and the draft's by
``lambda / sum_d w_d N_d`` once every count is in. This is exact because no gradient mixes
the two (the draft reads only detached tensors of the policy). The per-microbatch values
the schedule itself records (its ``losses``) are therefore sums; the metrics come from the
loss's own side channel, reduced over the data-parallel group and broadcast to every PP
rank (so rank 0, which holds no loss, logs the right numbers).

Context parallelism composes: with a CP group, every stage zigzag-shards its microbatch's
rows over it (``shard_packed_rows``, the same cut on every stage) and attends over the
ring; the TapChannel runs per PP column, so the taps of (stage s, CP rank c) go to (last
stage, CP rank c) already sharded; the loss runs the CP policy loss and TTT (halo
included). CP needs a fixed padded row length (``cp_row_len``) so that every microbatch
has the same shapes (the trainer packs rows in the CP layout, so that length is
``seq_len``). Gradients are then partial per CP rank, as in ``forward_backward``.

Data parallelism replicates the stages. The ranks of ``loss_group`` (data-parallel x CP, the
same PP coordinate) hold the same stages and train other rows (or other CP shards of the
same rows); ``pipeline_step`` sums their normalised gradients over that group, DDP-style, so
every replica ends the step with the gradient of the whole global batch (the losses already
divide by global counts) and takes the same optimizer step. The draft's gradients are summed
the same way: its replicas are exactly the last stage's ranks of that group.

Tied embeddings (Qwen-3's small sizes): the first and the last stage hold the same weight;
its two gradient halves are summed over a two-rank group after the step, and clipping
counts it once (``clip_and_step``). Not here yet: FSDP on the stage modules (the draft's
backward runs in the loss, outside the schedule's switch of FSDP's gradient sync), so a
stage's parameters and optimizer state are whole on each of its data-parallel replicas.

What a trainer uses besides the step: ``Pipeline.local_policy`` (this rank's policy
modules under the whole model's names: its optimizer and checkpoint), ``Pipeline.draft``
(on the last stage's rank), ``clip_and_step`` (the norms global over the PP column) and
``gather_state_dict`` (whole-model weights on every PP rank, for the rollout engine and
the export).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage, ScheduleDualPipeV, ScheduleZBVZeroBubble
from torch.distributed.pipelining.schedules import PipelineScheduleMulti, PipelineScheduleSingle, get_schedule_class

from titan_cotrain.cotrain.step import PackedBatch, PolicyLossFn, labels_of
from titan_cotrain.cotrain.ttt import pass_weights, tau, ttt_unroll
from titan_cotrain.data.packing import PackedLayout, layout_from_document_ids
from titan_cotrain.models.draft import Draft
from titan_cotrain.models.transformer import Transformer, rope_cos_sin
from titan_cotrain.parallel.context_parallel import CPShard, shard_batch_for_cp, shard_packed_rows
from titan_cotrain.parallel.tap_channel import EMBEDDINGS, TapChannel

__all__ = [
    "CotrainLoss",
    "LocalPolicy",
    "Pipeline",
    "PipelinePlan",
    "TransformerStage",
    "build_pipeline",
    "build_schedule",
    "clip_and_step",
    "gather_state_dict",
    "layers_per_stage_from_fqns",
    "make_pipeline",
    "pipeline_step",
    "plan_pipeline",
]


# -- where everything goes ---------------------------------------------------------------


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


def packing(document_ids: torch.Tensor, cp_group, cp_row_len: int | None) -> PackedLayout | CPShard:
    """The attention layout of rows ``document_ids [b, S]``: ``cu_seqlens`` and ``positions
    [b, S_local]``; with a CP group, this rank's zigzag ``CPShard`` of the rows, padded to
    ``cp_row_len``."""
    if cp_group is None:
        return layout_from_document_ids(document_ids)
    return shard_packed_rows(document_ids, cp_group, row_len=cp_row_len)


# -- the stage module --------------------------------------------------------------------


class TransformerStage(nn.Module):
    """One pipeline stage of the target: ``layers`` (a contiguous range), plus the embedding
    on the first stage and the final norm, head and draft on the last.

    ``forward(x, *, document_ids, rows)``: ``x`` is ``tokens: int64 [mb, S]`` on the first
    stage (under CP: this rank's shard, ``[mb, S_local]``), the packed hidden stream
    ``[mb * S_local, H]`` elsewhere (the layers' own layout, so a
    stage's output is a fresh tensor and never a view, which zero-bubble schedules detach
    in place); ``document_ids [mb, S]`` give the packing; ``rows [mb]`` are the
    microbatch's row indices in the batch (their first entry names the microbatch).
    Returns the hidden stream, or ``logits [mb, S, V]`` (fp32) on the last stage. The ops
    are ``Transformer.forward``'s, so hidden states and taps are bitwise the single-device
    ones. With a ``channel``, the detached ``[mb, S, H]`` output of every tapped layer it
    holds (and the embedding output) is sent the moment it is computed.
    """

    def __init__(
        self,
        policy: Transformer,
        layers: range,
        *,
        first: bool,
        last: bool,
        draft: Draft | None = None,
        channel: TapChannel | None = None,
        cp_group: dist.ProcessGroup | None = None,
        cp_row_len: int | None = None,
    ) -> None:
        super().__init__()
        self.embed_tokens = policy.embed_tokens if first else None
        self.layers = nn.ModuleDict({str(i): policy.layers[i] for i in layers})
        self.norm = policy.norm if last else None
        self.lm_head = policy.lm_head if last else None
        self.draft = draft if last else None
        self.register_buffer("rope_inv_freq", policy.rope_inv_freq, persistent=False)
        self.channel = channel
        self.cp_group, self.cp_row_len = cp_group, cp_row_len
        sources = ({EMBEDDINGS} if first else set()) | (set(layers) & set(policy.tap_layers))
        self.tap_sources = frozenset(sources) if channel is not None else frozenset()
        self.send_taps = True  # off in a step that does not train the draft (``pipeline_step``)

    def forward(self, x: torch.Tensor, *, document_ids: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        microbatch = int(rows[0]) // rows.numel()
        layout = packing(document_ids, self.cp_group, self.cp_row_len)
        cp = layout if self.cp_group is not None else None
        b, s = layout.positions.shape
        if self.embed_tokens is not None:
            x = self.embed_tokens(x.reshape(-1))
            self._tap(microbatch, EMBEDDINGS, x, b, s)
        cos, sin = rope_cos_sin(self.rope_inv_freq, layout.positions.reshape(-1), x.dtype)
        for name, layer in self.layers.items():
            x = layer(x, cos, sin, layout.cu_seqlens, cp)
            self._tap(microbatch, int(name), x, b, s)
        if self.lm_head is None:
            return x
        return self.lm_head(self.norm(x.view(b, s, -1))).float()

    def _tap(self, microbatch: int, source: int, x: torch.Tensor, b: int, s: int) -> None:
        if self.send_taps and source in self.tap_sources:
            self.channel.send(microbatch, source, x.detach().view(b, s, -1))


class LocalPolicy(nn.Module):
    """The policy modules of one PP rank's stages under the whole model's names
    (``embed_tokens``, ``layers.<i>``, ``norm``, ``lm_head``; those of other ranks' stages
    absent), without the draft: what the policy's optimizer, clipping and checkpoint hold,
    so checkpoint keys are the whole model's FQNs. It shares the stages' modules and is
    never called itself."""

    def __init__(self, parts: Sequence[TransformerStage]) -> None:
        super().__init__()
        self.embed_tokens = next((p.embed_tokens for p in parts if p.embed_tokens is not None), None)
        self.layers = nn.ModuleDict({name: layer for p in parts for name, layer in p.layers.items()})
        self.norm = next((p.norm for p in parts if p.norm is not None), None)
        self.lm_head = next((p.lm_head for p in parts if p.lm_head is not None), None)


# -- the last stage's loss ---------------------------------------------------------------


class CotrainLoss:
    """The schedule's ``loss_fn(logits, rows)``: policy loss and the draft's TTT step for one
    microbatch (called on the last stage only, in microbatch order).

    Returns the microbatch's policy loss *sum* (the schedule backpropagates it); runs the
    draft's forward and backward on the taps of that microbatch from ``channel``
    (``lambda`` and the global normalisation are applied to the gradients after the step,
    see the module docstring); keeps the step's detached sums for the metrics (``sums``).
    ``policy_loss_fn`` and ``train_draft`` may change between steps (``pipeline_step``
    sets them): a trainer's warm start and RL phases share one pipeline.
    """

    def __init__(
        self,
        policy_loss_fn: PolicyLossFn,
        draft: Draft | None,
        channel: TapChannel | None,
        tap_layers: Sequence[int],
        *,
        ttt_steps: int,
        pass_decay: float,
        draft_loss_on: str = "response",
        cp_group: dist.ProcessGroup | None = None,
        cp_row_len: int | None = None,
    ) -> None:
        if draft_loss_on not in ("response", "all"):
            raise ValueError(f"draft_loss_on must be 'response' or 'all', got {draft_loss_on!r}")
        self.policy_loss_fn, self.draft, self.channel = policy_loss_fn, draft, channel
        self.cp_group, self.cp_row_len = cp_group, cp_row_len
        self.tap_layers = tuple(tap_layers)
        self.ttt_steps, self.pass_decay, self.draft_loss_on = ttt_steps, pass_decay, draft_loss_on
        self.train_draft = True
        self._batch: PackedBatch | None = None
        self._sums: dict[str, torch.Tensor] = {}
        self._next = 0

    def begin_step(self) -> None:
        """Start a ``pipeline_step`` (one or more schedule steps): the sums restart."""
        self._sums = {}

    def begin_schedule_step(self, batch: PackedBatch) -> None:
        """The rows of the next schedule step (``n_microbatches`` microbatches)."""
        self._batch, self._next = batch, 0

    def sums(self) -> dict[str, torch.Tensor]:
        """The step's detached fp64 sums over microbatches: ``policy/sum``, ``policy/count``,
        ``metric/<name>`` (the policy loss's ``metric_sums``) and, with the draft, the
        per-pass ``draft/ce_sum``, ``draft/count``, ``draft/correct`` (``[D]`` each)."""
        return self._sums

    def _add(self, name: str, value: torch.Tensor) -> None:
        value = value.detach().double()
        self._sums[name] = self._sums[name] + value if name in self._sums else value

    def __call__(self, logits: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        lo, n = int(rows[0]), rows.numel()
        microbatch = lo // n
        if microbatch != self._next:
            raise RuntimeError(f"CotrainLoss: got microbatch {microbatch}, expected {self._next} (in-order losses)")
        self._next += 1
        batch = PackedBatch(**{f.name: None if getattr(self._batch, f.name) is None
                               else getattr(self._batch, f.name)[lo:lo + n] for f in fields(PackedBatch)})
        # The microbatch as the policy loss and the draft see it: label-aligned rows, the
        # tokens, the attention layout and the draft's loss region (local shards under CP).
        if self.cp_group is None:
            labels, layout = labels_of(batch), layout_from_document_ids(batch.document_ids)
            tokens, response, everything = batch.tokens, batch.loss_mask, torch.ones_like(batch.loss_mask)
        else:
            labels, layout = shard_batch_for_cp(batch, self.cp_group, row_len=self.cp_row_len)
            tokens, response, everything = labels.tokens, labels.loss_mask, layout.valid
        policy = self.policy_loss_fn(logits, labels)
        self._add("policy/sum", policy.loss_sum)
        self._add("policy/count", policy.count)
        for name, value in policy.metric_sums.items():
            self._add(f"metric/{name}", value)
        if self.draft is not None and self.train_draft:
            region = response if self.draft_loss_on == "response" else everything
            self._draft_step(microbatch, logits, tokens, layout, region)
        return policy.loss_sum

    def _draft_step(self, microbatch: int, logits: torch.Tensor, tokens: torch.Tensor,
                    layout: PackedLayout | CPShard, region: torch.Tensor) -> None:
        b, s = tokens.shape
        taps = self.channel.receive(microbatch)
        stats = ttt_unroll(
            self.draft,
            taps=torch.cat([taps[layer] for layer in self.tap_layers], dim=-1).reshape(b * s, -1),
            embeddings=taps[EMBEDDINGS].reshape(b * s, -1),
            tokens=tokens.reshape(-1),
            positions=layout.positions.reshape(-1),
            cu_seqlens=layout.cu_seqlens,
            teacher_logits=logits.reshape(b * s, -1),
            loss_region=region.reshape(-1),
            ttt_steps=self.ttt_steps,
            cp=layout if self.cp_group is not None else None,
        )
        weights = pass_weights(self.ttt_steps, self.pass_decay, device=stats.ce_sum.device)
        (weights * stats.ce_sum).sum().backward()
        self.channel.release(microbatch)
        self._add("draft/ce_sum", stats.ce_sum)
        self._add("draft/count", stats.count)
        self._add("draft/correct", stats.correct)


# -- schedule and pipeline ---------------------------------------------------------------


def build_schedule(
    schedule: str, stages: list[PipelineStage], n_microbatches: int, loss_fn: Callable
) -> PipelineScheduleSingle | PipelineScheduleMulti:
    """torch's schedule ``schedule`` over this rank's ``stages``, with gradient scaling off
    (``pipeline_step`` normalises by the true token counts instead)."""
    schedule_cls = get_schedule_class(schedule)
    if issubclass(schedule_cls, PipelineScheduleSingle):
        if len(stages) != 1:
            raise ValueError(f"schedule {schedule} runs one stage per rank, got {len(stages)}")
        return schedule_cls(stages[0], n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=False)
    return schedule_cls(stages, n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=False)


@dataclass
class Pipeline:
    """Everything one PP rank needs to run a co-training step.

    ``model_parts``: this rank's stage modules (one per stage, the draft inside the last);
    ``local_policy``: their policy modules without the draft, under the whole model's names
    (what the policy's optimizer and checkpoint wrap); ``stages``: torch's
    ``PipelineStage`` around each part; ``loss``: the last stage's loss (present on every
    rank, only called where the last stage runs); ``channel``: None when the draft is off.
    """

    schedule: PipelineScheduleSingle | PipelineScheduleMulti
    stages: list[PipelineStage]
    model_parts: list[TransformerStage]
    local_policy: LocalPolicy
    loss: CotrainLoss
    channel: TapChannel | None
    plan: PipelinePlan
    pp_mesh: DeviceMesh  # this rank's PP column
    pp_group: dist.ProcessGroup
    microbatch_size: int
    n_microbatches: int
    draft_loss_weight: float
    loss_group: dist.ProcessGroup | None = None
    cp_group: dist.ProcessGroup | None = None
    cp_row_len: int | None = None
    tied_group: dist.ProcessGroup | None = field(default=None, repr=False)

    @property
    def has_last_stage(self) -> bool:
        return any(stage.is_last for stage in self.stages)

    @property
    def has_first_stage(self) -> bool:
        return any(stage.is_first for stage in self.stages)

    @property
    def draft(self) -> Draft | None:
        """The draft, on the last stage's rank (None elsewhere, and when the draft is off)."""
        return next((part.draft for part in self.model_parts if part.draft is not None), None)

    def draft_parameters(self) -> list[nn.Parameter]:
        """The draft's parameters (none off the last stage's rank)."""
        return list(self.draft.parameters()) if self.draft is not None else []

    def policy_parameters(self) -> list[nn.Parameter]:
        """This rank's policy parameters: ``local_policy``'s. Optimizers and clipping take
        these and ``draft_parameters`` apart (torchtitan's optimizer builder over
        ``model_parts`` would put the draft in the policy's optimizer)."""
        return list(self.local_policy.parameters())

    def tied_weight(self) -> nn.Parameter | None:
        """The embedding tied to the head, on the first and the last stage's ranks."""
        if self.tied_group is None:
            return None
        return next(m.weight for m in (self.local_policy.embed_tokens, self.local_policy.lm_head) if m is not None)


def _example(shape, dtype, requires_grad: bool) -> torch.Tensor:
    """Static stage metadata (no memory, no shape inference run through the model)."""
    return torch.empty(shape, dtype=dtype, device="meta", requires_grad=requires_grad)


def _tied_group(policy: Transformer, plan: PipelinePlan, pp_ranks: list[int], pp_rank: int):
    """A two-rank group over the first and last stage when the head is tied to the
    embedding, so the tied weight's two gradient halves can be summed."""
    if policy.lm_head.weight is not policy.embed_tokens.weight:
        return None
    first, last = plan.stage_ranks[0], plan.stage_ranks[-1]
    if first == last:
        raise NotImplementedError(
            "tied embeddings with a V schedule put the embedding and the head on one rank in two model parts "
            "(one parameter, two optimizers); use a looped schedule or an untied model"
        )
    if pp_rank not in (first, last):
        return None
    return dist.new_group([pp_ranks[first], pp_ranks[last]], use_local_synchronization=True)


def make_pipeline(
    policy: Transformer,
    draft: Draft | None,
    pp_mesh,
    plan: PipelinePlan,
    *,
    microbatch_size: int,
    n_microbatches: int,
    seq_len: int,
    policy_loss_fn: PolicyLossFn,
    ttt_steps: int,
    pass_decay: float,
    draft_loss_weight: float,
    draft_loss_on: str = "response",
    loss_group: dist.ProcessGroup | None = None,
    cp_mesh=None,
    cp_row_len: int | None = None,
    tap_prefetch: int = 2,
    tap_timeout: timedelta | None = None,
) -> Pipeline:
    """Split ``policy`` (built whole on every PP rank) into this rank's stages as ``plan``
    says, put ``draft`` on the last stage, and build the TapChannel and the schedule.

    ``pp_mesh``: the 1-D ``pp`` device mesh of this rank's PP column. Batches must be
    ``[n_microbatches * microbatch_size, seq_len]``. ``loss_group``: the data-parallel
    ranks (dp x cp) that hold replicas of this rank's stages: they share the global token
    counts and sum their gradients (None: no data or context parallelism).
    ``cp_mesh``: this rank's 1-D ``cp`` mesh for context parallelism, with ``cp_row_len``,
    the fixed padded row length every microbatch is sharded to (see
    ``titan_cotrain.parallel.context_parallel.plan_padded_rows``). The
    stage modules reference the policy's modules (no copy); the layers of other stages
    are not referenced and go away with the caller's ``policy``. ``tap_prefetch`` and
    ``tap_timeout``: the TapChannel's receives posted ahead and bound on every wait.
    """
    pp, pp_rank = pp_mesh.size(), pp_mesh.get_local_rank()
    pp_ranks = pp_mesh.mesh.flatten().tolist()
    pp_group = pp_mesh.get_group()
    if plan.pp != pp:
        raise ValueError(f"the plan is for {plan.pp} PP ranks, the mesh has {pp}")
    cp_group, local_len = None, seq_len
    if cp_mesh is not None:
        if not cp_row_len or cp_row_len % (2 * cp_mesh.size()):
            raise ValueError(f"context parallelism needs a fixed cp_row_len, a multiple of 2 x cp = "
                             f"{2 * cp_mesh.size()}; got {cp_row_len}")
        cp_group, local_len = cp_mesh.get_group(), cp_row_len // cp_mesh.size()
    tied_group = _tied_group(policy, plan, pp_ranks, pp_rank)
    param = policy.embed_tokens.weight
    device, dtype = param.device, param.dtype
    hidden_shape = (microbatch_size * local_len, policy.args.dim)
    channel = None
    if draft is not None:
        channel = TapChannel(pp_ranks=pp_ranks, pp_rank=pp_rank, consumer=plan.stage_ranks[-1],
                             owners=plan.tap_owners(policy.tap_layers),
                             shape=(microbatch_size, local_len, policy.args.dim), dtype=dtype,
                             device=device, prefetch=tap_prefetch, timeout=tap_timeout)
    loss = CotrainLoss(policy_loss_fn, draft if pp_rank == plan.stage_ranks[-1] else None, channel,
                       policy.tap_layers, ttt_steps=ttt_steps, pass_decay=pass_decay, draft_loss_on=draft_loss_on,
                       cp_group=cp_group, cp_row_len=cp_row_len)
    stages, parts = [], []
    last = plan.num_stages - 1
    for i in plan.stages_of(pp_rank):
        part = TransformerStage(policy, plan.layer_ranges[i], first=i == 0, last=i == last,
                                draft=draft, channel=channel, cp_group=cp_group, cp_row_len=cp_row_len)
        inputs = (_example((microbatch_size, local_len), torch.int64, False) if i == 0
                  else _example(hidden_shape, dtype, True))
        outputs = (_example((microbatch_size, local_len, policy.args.vocab_size), torch.float32, True) if i == last
                   else _example(hidden_shape, dtype, True))
        stages.append(PipelineStage(part, i, plan.num_stages, device, input_args=inputs, output_args=outputs,
                                    group=pp_group))
        parts.append(part)
    sched = build_schedule(plan.schedule, stages, n_microbatches, loss)
    expected = dict(enumerate(plan.stage_ranks))
    if getattr(sched, "stage_index_to_group_rank", expected) != expected:
        raise RuntimeError(f"schedule {plan.schedule} places stages as {sched.stage_index_to_group_rank}, "
                           f"the plan as {expected}")
    return Pipeline(schedule=sched, stages=stages, model_parts=parts, local_policy=LocalPolicy(parts), loss=loss,
                    channel=channel, plan=plan, pp_mesh=pp_mesh, pp_group=pp_group, microbatch_size=microbatch_size, n_microbatches=n_microbatches,
                    draft_loss_weight=draft_loss_weight, loss_group=loss_group, cp_group=cp_group,
                    cp_row_len=cp_row_len, tied_group=tied_group)


def build_pipeline(
    policy: Transformer,
    draft: Draft | None,
    config,
    pp_mesh,
    *,
    policy_loss_fn: PolicyLossFn,
    loss_group: dist.ProcessGroup | None = None,
    cp_mesh=None,
    cp_row_len: int | None = None,
) -> Pipeline:
    """``make_pipeline`` from a job config: ``[parallelism] pipeline_parallel_schedule``,
    ``pipeline_parallel_microbatch_size``, ``module_fqns_per_model_part`` (explicit split,
    our module names) or ``pipeline_parallel_layers_per_stage``, the first/last stage
    weights; ``[training] local_batch_size, seq_len``; ``[draft]`` TTT settings;
    ``[comm] train_timeout_seconds`` bounds the TapChannel's waits. With
    ``context_parallel_degree > 1``, pass the ``cp`` mesh and the CP row length."""
    p, t, d = config.parallelism, config.training, config.draft
    if p.pipeline_parallel_schedule_csv:
        raise NotImplementedError("parallelism.pipeline_parallel_schedule_csv is not supported")
    if (p.context_parallel_degree > 1) != (cp_mesh is not None):
        raise ValueError(f"parallelism.context_parallel_degree is {p.context_parallel_degree}: pass cp_mesh "
                         "(and cp_row_len) exactly when it is above 1")
    n_layers = policy.args.n_layers
    layers_per_stage = stages_per_rank = None
    if p.module_fqns_per_model_part:
        layers_per_stage = layers_per_stage_from_fqns(p.module_fqns_per_model_part, n_layers)
    elif p.pipeline_parallel_layers_per_stage:
        weight = p.pipeline_parallel_first_stage_less_layers + p.pipeline_parallel_last_stage_less_layers
        n_stages = math.ceil((n_layers + weight) / p.pipeline_parallel_layers_per_stage)
        if n_stages % p.pipeline_parallel_degree:
            raise ValueError(f"parallelism.pipeline_parallel_layers_per_stage gives {n_stages} stages, "
                             f"not a multiple of pipeline_parallel_degree {p.pipeline_parallel_degree}")
        stages_per_rank = n_stages // p.pipeline_parallel_degree
    plan = plan_pipeline(
        n_layers, p.pipeline_parallel_degree, p.pipeline_parallel_schedule, layers_per_stage=layers_per_stage,
        stages_per_rank=stages_per_rank, first_stage_less_layers=p.pipeline_parallel_first_stage_less_layers,
        last_stage_less_layers=p.pipeline_parallel_last_stage_less_layers,
    )
    mb = p.pipeline_parallel_microbatch_size
    return make_pipeline(
        policy, draft, pp_mesh, plan, microbatch_size=mb, n_microbatches=t.local_batch_size // mb,
        seq_len=t.seq_len, policy_loss_fn=policy_loss_fn, ttt_steps=d.ttt_steps, pass_decay=d.pass_decay,
        draft_loss_weight=d.loss_weight, draft_loss_on=d.loss_on, loss_group=loss_group, cp_mesh=cp_mesh,
        cp_row_len=cp_row_len, tap_timeout=timedelta(seconds=config.comm.train_timeout_seconds),
    )


# -- one step ----------------------------------------------------------------------------


def pipeline_step(
    pipeline: Pipeline,
    batch: PackedBatch,
    *,
    policy_loss_fn: PolicyLossFn | None = None,
    train_draft: bool = True,
) -> dict[str, torch.Tensor]:
    """Forward and backward one batch through the pipeline; every PP rank calls it with the
    whole batch (under CP, every CP rank too).

    ``batch`` has ``k`` times the rows of one schedule step (``n_microbatches *
    microbatch_size``): ``k`` schedule steps accumulate the gradients of their loss sums,
    normalised once by the counts over all of them, so one call is one optimizer update
    over the whole batch. ``policy_loss_fn`` (default: the one the pipeline was built
    with, or the last one given) and ``train_draft`` (False: no taps sent, no draft step)
    hold from this call on; every rank must pass the same.

    On return every rank's gradients are final: normalised exactly as
    ``titan_cotrain.cotrain.step.forward_backward``'s over the whole (global) batch and
    summed over ``loss_group``'s replicas; and every rank holds the same metrics (the same
    keys as ``forward_backward``'s, detached).
    """
    p = pipeline
    per_step = p.n_microbatches * p.microbatch_size
    n_rows = batch.tokens.shape[0]
    if n_rows == 0 or n_rows % per_step:
        raise ValueError(f"batch has {n_rows} rows; the pipeline takes a positive multiple of "
                         f"{p.n_microbatches} microbatches of {p.microbatch_size}")
    if policy_loss_fn is not None:
        p.loss.policy_loss_fn = policy_loss_fn
    draft_on = train_draft and p.channel is not None
    p.loss.train_draft = draft_on
    for part in p.model_parts:
        part.send_taps = draft_on
    p.loss.begin_step()
    rows = torch.arange(per_step)
    for start in range(0, n_rows, per_step):
        _schedule_step(p, batch.map(lambda t: t[start:start + per_step]), rows, draft_on)
    # The metrics side channel: the last stage's sums, reduced over the data-parallel ranks,
    # turned into gradient scales and metrics, and broadcast to the whole PP column.
    payload = [None]
    if p.has_last_stage:
        sums = p.loss.sums()
        if p.loss_group is not None:
            sums = _all_reduce(sums, p.loss_group)
        payload = [_scales_and_metrics(sums, p)]
    dist.broadcast_object_list(payload, group=p.pp_group, group_src=p.plan.stage_ranks[-1])
    policy_scale, draft_scale, metrics = payload[0]
    _normalise_gradients(p, policy_scale, draft_scale)
    if p.loss_group is not None:
        _sum_gradients(p.policy_parameters() + p.draft_parameters(), p.loss_group)
    return {name: torch.tensor(value) for name, value in metrics.items()}


def _schedule_step(p: Pipeline, batch: PackedBatch, rows: torch.Tensor, draft_on: bool) -> None:
    """One run of the schedule over ``batch`` (exactly one schedule step's rows); gradients
    accumulate unscaled."""
    if draft_on:
        p.channel.begin_step(p.n_microbatches)
    p.loss.begin_schedule_step(batch)
    args = ()
    if p.has_first_stage:
        tokens = batch.tokens
        if p.cp_group is not None:
            tokens = packing(batch.document_ids, p.cp_group, p.cp_row_len).shard(batch.tokens)
        args = (tokens,)
    p.schedule.step(*args, target=rows if p.has_last_stage else None, return_outputs=False,
                    document_ids=batch.document_ids, rows=rows)
    if draft_on:
        p.channel.finish_step()


def _all_reduce(sums: dict[str, torch.Tensor], group) -> dict[str, torch.Tensor]:
    names = sorted(sums)
    flat = torch.cat([sums[k].reshape(-1) for k in names])
    dist.all_reduce(flat, group=group)
    out, i = {}, 0
    for k in names:
        out[k] = flat[i:i + sums[k].numel()].view_as(sums[k])
        i += sums[k].numel()
    return out


def _scales_and_metrics(sums: dict[str, torch.Tensor], p: Pipeline) -> tuple[float, float, dict[str, float]]:
    """``(policy gradient scale, draft gradient scale, metrics)`` from the global sums."""
    count = max(float(sums["policy/count"]), 1.0)
    metrics = {"loss/policy": float(sums["policy/sum"]) / count}
    metrics |= {name[len("metric/"):]: float(v) / count for name, v in sums.items() if name.startswith("metric/")}
    draft_scale = 0.0
    if "draft/count" in sums:
        d = p.loss.ttt_steps
        ce, counts = sums["draft/ce_sum"].cpu(), sums["draft/count"].cpu()
        weights = pass_weights(d, p.loss.pass_decay).double()
        weighted_count = max(float((weights * counts).sum()), 1e-12)
        draft_scale = p.draft_loss_weight / weighted_count
        metrics["loss/draft"] = float((weights * ce).sum()) / weighted_count
        accuracy = sums["draft/correct"].cpu() / counts.clamp(min=1)
        for i in range(d):
            metrics[f"draft/loss_pass{i + 1}"] = float(ce[i] / counts[i].clamp(min=1))
            metrics[f"draft/acc_pass{i + 1}"] = float(accuracy[i])
        metrics["draft/tau"] = float(tau(accuracy))
    return 1.0 / count, draft_scale, metrics


def _normalise_gradients(p: Pipeline, policy_scale: float, draft_scale: float) -> None:
    tied = p.tied_weight()
    if tied is not None:
        # This rank holds the first stage (the embedding) or the last (the head), not both.
        dist.all_reduce(tied.grad, group=p.tied_group)
    for params, scale in ((p.policy_parameters(), policy_scale), (p.draft_parameters(), draft_scale)):
        for param in params:
            if param.grad is not None:
                param.grad.mul_(scale)


def _sum_gradients(params: list[nn.Parameter], group, bucket_bytes: int = 2**28) -> None:
    """Sum the gradients of ``params`` over ``group`` in place (the stages' data-parallel
    replicas, which hold the same parameters in the same order: the same ones have
    gradients), in flat buckets of one dtype of at most ``bucket_bytes`` (or one gradient)."""
    grads = [param.grad for param in params if param.grad is not None]
    bucket: list[torch.Tensor] = []

    def flush() -> None:
        flat = torch.cat([g.reshape(-1) for g in bucket])
        dist.all_reduce(flat, group=group)
        for grad, summed in zip(bucket, flat.split([g.numel() for g in bucket])):
            grad.copy_(summed.view_as(grad))
        bucket.clear()

    for grad in grads:
        if bucket and (grad.dtype != bucket[0].dtype or
                       (sum(g.numel() for g in bucket) + grad.numel()) * grad.element_size() > bucket_bytes):
            flush()
        bucket.append(grad)
    if bucket:
        flush()


# -- after the step: clipping and whole-model weights --------------------------------------


def clip_and_step(
    pipeline: Pipeline,
    policy_optimizers,
    draft_optimizers,
    policy_max_norm: float,
    draft_max_norm: float,
    *,
    train_draft: bool = True,
) -> dict[str, torch.Tensor]:
    """``titan_cotrain.cotrain.step.clip_and_step`` for one PP rank: clip the policy's and
    the draft's gradient norms separately, each the *global* norm over the PP column (the
    same value on every rank, returned as the metrics), step both optimizers, zero grads.

    Every PP rank calls it; ``draft_optimizers`` exist on the last stage's rank only (None
    elsewhere). ``train_draft`` says whether the draft was trained this step (as in
    ``pipeline_step``). A tied embedding is counted once in the norm (on the first stage)
    and clipped on both ranks by the same factor, so its two copies stay equal.
    """
    from titan_cotrain.components import titan

    p = pipeline
    tied = p.tied_weight()
    counted = p.policy_parameters()
    if tied is not None and not p.has_first_stage:
        counted = [param for param in counted if param is not tied]
    norm = titan.clip_grad_norm_(counted, policy_max_norm, pp_mesh=p.pp_mesh)
    if tied is not None and not p.has_first_stage:
        torch.nn.utils.clip_grads_with_norm_([tied], policy_max_norm, norm)
    metrics = {"grad_norm/policy": norm}
    policy_optimizers.step()
    policy_optimizers.zero_grad()
    if train_draft and p.channel is not None:
        metrics["grad_norm/draft"] = titan.clip_grad_norm_(p.draft_parameters(), draft_max_norm, pp_mesh=p.pp_mesh)
        if draft_optimizers is not None:
            draft_optimizers.step()
            draft_optimizers.zero_grad()
    return metrics


@torch.no_grad()
def gather_state_dict(
    pipeline: Pipeline, policy_like: nn.Module, draft_like: nn.Module | None = None
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor] | None]:
    """The whole policy's and draft's trained state on every PP rank: ``(policy state,
    draft state or None)``, keyed and shaped like ``policy_like.state_dict()`` and
    ``draft_like``'s (whole-model copies, e.g. the rollout engine's).

    Each tensor is broadcast over the PP group from the rank of the stage that holds it
    (the draft's from the last stage's), in ``*_like``'s order: a collective, every PP
    rank calls it. The result is fresh tensors in ``*_like``'s dtypes.
    """
    p = pipeline
    pp_rank = dist.get_rank(p.pp_group)
    local = {name: t for part in p.model_parts for name, t in part.state_dict().items()}

    def gather(like: nn.Module, stage_of, prefix: str) -> dict[str, torch.Tensor]:
        out = {}
        for name, template in like.state_dict().items():
            owner = p.plan.stage_ranks[stage_of(name)]
            t = torch.empty_like(template)
            if owner == pp_rank:
                t.copy_(local[prefix + name])
            dist.broadcast(t, group=p.pp_group, group_src=owner)
            out[name] = t
        return out

    policy_state = gather(policy_like, p.plan.stage_of, "")
    draft_state = None
    if draft_like is not None:
        draft_state = gather(draft_like, lambda _: p.plan.num_stages - 1, "draft.")
    return policy_state, draft_state
