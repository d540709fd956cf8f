"""Building a pipeline: this rank's stages, the draft on the last one, the TapChannel, the schedule.

Every stage module holds its layers under their whole-model names (``layers.5.mlp.up_proj``
stays that name on whichever stage holds it), so checkpoints and gradients map one to one.
Data parallelism shards the stages: ``shard`` (FSDP2 over the data-parallel x CP mesh, as
torchtitan composes PP and FSDP) is applied to the draft and to every stage module before
the schedule is built; gradients then reduce-scatter in backward like everywhere else.

This is the one module of ``parallel.pipeline`` that reads the job config: ``build_pipeline``
resolves it once into ``PipelineSettings`` (and the ``PipelinePlan``), which ``make_pipeline``
and everything after it take.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from datetime import timedelta
from functools import partial

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import PipelineScheduleMulti, PipelineScheduleSingle, get_schedule_class

from titan_cotrain.cotrain.step import prepare_microbatch
from titan_cotrain.data.batch import PolicyLossFn, PrepareMicrobatch
from titan_cotrain.models.draft import Draft
from titan_cotrain.models.transformer import Transformer
from titan_cotrain.parallel.context_parallel import apply_context_parallel, cp_forward_scope, prepare_cp_microbatch
from titan_cotrain.parallel.pipeline.loss import CotrainLoss
from titan_cotrain.parallel.pipeline.plan import PipelinePlan, layers_per_stage_from_fqns, plan_pipeline
from titan_cotrain.parallel.pipeline.stage import LocalPolicy, MicrobatchIndexedStage, TransformerStage
from titan_cotrain.parallel.tap_channel import TapChannel

__all__ = ["Pipeline", "PipelineSettings", "build_pipeline", "build_schedule", "make_pipeline", "plan_from_config"]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# Zero-bubble schedules: their weight passes do not compose with FSDP-sharded stages (yet).
_WEIGHT_PASS_SCHEDULES = ("InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")


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


@dataclass(frozen=True)
class PipelineSettings:
    """How a pipeline is built and stepped, resolved from the job config once
    (``PipelineSettings.from_config``); the tests build it directly."""

    microbatch_size: int
    """Rows per microbatch (``[parallelism] pipeline_parallel_microbatch_size``)."""
    n_microbatches: int
    """Microbatches per run of the schedule (``[training] local_batch_size`` over
    ``microbatch_size``); a batch is a whole number of runs."""
    seq_len: int
    """Host row length (``[training] seq_len``)."""
    ttt_steps: int
    """The draft's TTT passes (``[draft] ttt_steps``; a block drafter's ``block_size - 1``
    drafted positions)."""
    pass_decay: float
    """Weight decay of the draft's later passes (``[draft] pass_decay``)."""
    draft_loss_weight: float
    """The draft loss's weight ``lambda`` (``[draft] loss_weight``)."""
    draft_loss_on: str = "response"
    """Tokens the draft learns on (``[draft] loss_on``)."""
    cp_row_len: int | None = None
    """Under context parallelism, the fixed padded row length every microbatch is sharded to
    (``parallel.context_parallel.plan_padded_rows``); None without it."""
    tap_prefetch: int = 2
    """Microbatches of TapChannel receives posted ahead."""
    tap_timeout: timedelta | None = None
    """Bound on every TapChannel wait (``[comm] train_timeout_seconds``; None: the process
    group's default)."""
    activation_dtype: torch.dtype | None = None
    """The dtype the stages compute and pass activations in: FSDP's mixed precision
    (``[training] mixed_precision_param``) when the stages are sharded; None: the parameters'."""
    moe_aux_loss_weight: float = 0.0
    """A mixture of experts' load-balancing loss weight (``[model] moe_aux_loss_weight``)."""
    blocks_per_doc: int = 8
    """A block drafter's anchors per sequence (``[draft] blocks_per_doc``)."""

    @classmethod
    def from_config(cls, config, *, sharded: bool, cp_row_len: int | None = None) -> PipelineSettings:
        """From ``[parallelism]``, ``[training]``, ``[draft]``, ``[comm]`` and ``[model]``;
        ``sharded``: the stages are FSDP-sharded (their activations then take the mixed
        precision dtype); ``cp_row_len`` as the field says."""
        p, t, d = config.parallelism, config.training, config.draft
        mb = p.pipeline_parallel_microbatch_size
        return cls(microbatch_size=mb, n_microbatches=t.local_batch_size // mb, seq_len=t.seq_len,
                   ttt_steps=d.block_size - 1 if d.kind == "dflash" else d.ttt_steps, pass_decay=d.pass_decay,
                   draft_loss_weight=d.loss_weight, blocks_per_doc=d.blocks_per_doc,
                   draft_loss_on=d.loss_on, cp_row_len=cp_row_len,
                   tap_timeout=timedelta(seconds=config.comm.train_timeout_seconds),
                   activation_dtype=_DTYPES[t.mixed_precision_param] if sharded else None,
                   moe_aux_loss_weight=config.model.moe_aux_loss_weight)


@dataclass
class Pipeline:
    """Everything one PP rank needs to run a co-training step.

    ``model_parts``: this rank's stage modules (one per stage, the draft inside the last);
    ``local_policy``: their policy modules without the draft, under the whole model's names
    (what the policy's optimizer and checkpoint wrap); ``stages``: the
    ``MicrobatchIndexedStage`` (torch's ``PipelineStage``) around each part; ``loss``: the last stage's loss (present on every
    rank, only called where the last stage runs); ``channel``: None when the draft is off.
    ``policy_loss_fn``: the policy loss of a step that names none (``pipeline_step``).
    ``loss_group``: the data-parallel x CP ranks of this PP coordinate, which share the global
    token counts (None: neither); ``device``: where microbatches go; ``prepare``: how a
    microbatch's host rows become this rank's inputs (under CP: its zigzag shard).
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
    settings: PipelineSettings
    policy_loss_fn: PolicyLossFn
    device: torch.device
    loss_group: dist.ProcessGroup | None = None
    prepare: PrepareMicrobatch = prepare_microbatch
    forward_scope: Callable[[], AbstractContextManager] = nullcontext
    tied_group: dist.ProcessGroup | None = field(default=None, repr=False)

    @property
    def microbatch_size(self) -> int:
        return self.settings.microbatch_size

    @property
    def n_microbatches(self) -> int:
        return self.settings.n_microbatches

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
    pp_mesh: DeviceMesh,
    plan: PipelinePlan,
    settings: PipelineSettings,
    *,
    policy_loss_fn: PolicyLossFn,
    loss_group: dist.ProcessGroup | None = None,
    cp_mesh: DeviceMesh | None = None,
    device: torch.device | str | None = None,
    shard: Callable[[nn.Module], None] | None = None,
) -> Pipeline:
    """Split ``policy`` (whole, or built on the meta device) into this rank's stages as
    ``plan`` says, put ``draft`` on the last stage, and build the TapChannel and the schedule.

    ``pp_mesh``: the 1-D ``pp`` device mesh of this rank's PP column. Batches must be
    ``[k * n_microbatches * microbatch_size, seq_len]`` host rows (``settings``).
    ``policy_loss_fn``: the policy loss of a step that names none. ``loss_group``: the
    data-parallel x CP ranks of this PP coordinate, which share the global token counts; with
    more than one data-parallel rank, ``shard`` must shard the stages over them
    (``shard(module)`` is applied to the draft, then to every stage module: FSDP2).
    ``cp_mesh``: this rank's 1-D ``cp`` mesh for context parallelism, applied here to the
    policy's and the draft's attention (``parallel.context_parallel.apply_context_parallel``),
    with ``settings.cp_row_len``. ``device``: where microbatches and taps live (default: the
    policy's; pass it when the policy is on meta). The stage modules reference the policy's
    modules (no copy); the layers of other stages are not referenced and go away with the
    caller's ``policy``.
    """
    pp, pp_rank = pp_mesh.size(), pp_mesh.get_local_rank()
    pp_ranks = pp_mesh.mesh.flatten().tolist()
    pp_group = pp_mesh.get_group()
    if plan.pp != pp:
        raise ValueError(f"the plan is for {plan.pp} PP ranks, the mesh has {pp}")
    local_len, cp_size, prepare, scope = settings.seq_len, 1, prepare_microbatch, nullcontext
    if cp_mesh is not None:
        row_len = settings.cp_row_len
        if not row_len or row_len % (2 * cp_mesh.size()):
            raise ValueError(f"context parallelism needs a fixed cp_row_len, a multiple of 2 x cp = "
                             f"{2 * cp_mesh.size()}; got {row_len}")
        local_len, cp_size = row_len // cp_mesh.size(), cp_mesh.size()
        apply_context_parallel(cp_mesh, policy, draft)  # every stage's attention, and the draft's
        prepare, scope = partial(prepare_cp_microbatch, group=cp_mesh, row_len=row_len), cp_forward_scope
    if loss_group is not None and dist.get_world_size(loss_group) > cp_size and shard is None:
        raise ValueError("data parallelism under PP shards the stages: pass shard (FSDP over the data-parallel "
                         "x CP mesh)")
    if shard is not None and plan.schedule in _WEIGHT_PASS_SCHEDULES:
        raise ValueError(f"schedule {plan.schedule} runs the weight-gradient passes apart from backward, after "
                         "FSDP's reduce-scatter of the stage; with data or context parallelism under PP use GPipe, "
                         "1F1B, Interleaved1F1B or LoopedBFS")
    tied_group = _tied_group(policy, plan, pp_ranks, pp_rank)
    param = policy.embed_tokens.weight
    device = torch.device(device) if device is not None else param.device
    dtype = settings.activation_dtype or param.dtype
    microbatch_size = settings.microbatch_size
    hidden_shape = (microbatch_size * local_len, policy.args.dim)
    channel = None
    if draft is not None:
        channel = TapChannel(pp_ranks=pp_ranks, pp_rank=pp_rank, consumer=plan.stage_ranks[-1],
                             owners=plan.tap_owners(policy.tap_layers),
                             shape=(microbatch_size, local_len, policy.args.dim), dtype=dtype,
                             device=device, prefetch=settings.tap_prefetch, timeout=settings.tap_timeout)
    last_rank = pp_rank == plan.stage_ranks[-1]
    loss = CotrainLoss(draft if last_rank else None, channel, policy.tap_layers, ttt_steps=settings.ttt_steps,
                       pass_decay=settings.pass_decay, moe=policy.args.n_sparse_layers > 0,
                       moe_aux_loss_weight=settings.moe_aux_loss_weight, blocks_per_doc=settings.blocks_per_doc)
    if shard is not None and draft is not None and last_rank:
        shard(draft)
    stages, parts = [], []
    last = plan.num_stages - 1
    for i in plan.stages_of(pp_rank):
        part = TransformerStage(policy, plan.layer_ranges[i], first=i == 0, last=i == last, draft=draft,
                                channel=channel, head=loss.head if i == last else None)
        if shard is not None:
            shard(part)
        hidden = _example(hidden_shape, dtype, True)
        if part.n_experts:  # and the routers' load so far (``TransformerStage``)
            hidden = (hidden, _example((2, part.n_experts), torch.float32, True))
        inputs = _example((microbatch_size, local_len), torch.int64, False) if i == 0 else hidden
        outputs = _example((), torch.float32, True) if i == last else hidden
        stages.append(MicrobatchIndexedStage(part, i, plan.num_stages, device, input_args=inputs,
                                             output_args=outputs, group=pp_group))
        parts.append(part)
    sched = build_schedule(plan.schedule, stages, settings.n_microbatches, loss)
    expected = dict(enumerate(plan.stage_ranks))
    if getattr(sched, "stage_index_to_group_rank", expected) != expected:
        raise RuntimeError(f"schedule {plan.schedule} places stages as {sched.stage_index_to_group_rank}, "
                           f"the plan as {expected}")
    return Pipeline(schedule=sched, stages=stages, model_parts=parts, local_policy=LocalPolicy(parts), loss=loss,
                    channel=channel, plan=plan, pp_mesh=pp_mesh, pp_group=pp_group, settings=settings,
                    policy_loss_fn=policy_loss_fn, device=device, loss_group=loss_group, prepare=prepare, forward_scope=scope,
                    tied_group=tied_group)


def build_pipeline(
    policy: Transformer,
    draft: Draft | None,
    config,
    pp_mesh: DeviceMesh,
    *,
    policy_loss_fn: PolicyLossFn,
    loss_group: dist.ProcessGroup | None = None,
    cp_mesh: DeviceMesh | None = None,
    cp_row_len: int | None = None,
    device: torch.device | str | None = None,
    shard: Callable[[nn.Module], None] | None = None,
) -> Pipeline:
    """``make_pipeline`` from a job config: the plan from ``[parallelism]``
    (``plan_from_config``), the settings from the sections ``PipelineSettings.from_config``
    reads (under mixed precision, ``[training] mixed_precision_param``, the stages pass
    activations in that dtype). With ``context_parallel_degree > 1``, pass the ``cp`` mesh
    and the CP row length; ``device`` and ``shard`` as in ``make_pipeline``."""
    p = config.parallelism
    if p.pipeline_parallel_schedule_csv:
        raise NotImplementedError("parallelism.pipeline_parallel_schedule_csv is not supported")
    if (p.context_parallel_degree > 1) != (cp_mesh is not None):
        raise ValueError(f"parallelism.context_parallel_degree is {p.context_parallel_degree}: pass cp_mesh "
                         "(and cp_row_len) exactly when it is above 1")
    settings = PipelineSettings.from_config(config, sharded=shard is not None, cp_row_len=cp_row_len)
    return make_pipeline(policy, draft, pp_mesh, plan_from_config(config, policy.args.n_layers), settings,
                         policy_loss_fn=policy_loss_fn, loss_group=loss_group, cp_mesh=cp_mesh, device=device,
                         shard=shard)


def plan_from_config(config, n_layers: int) -> PipelinePlan:
    """The job's stages over its PP ranks: ``[parallelism] module_fqns_per_model_part``
    (explicit split, our module names), ``pipeline_parallel_layers_per_stage``, or the even
    split of ``pipeline_parallel_schedule``'s stages with the first/last stage weights."""
    p = config.parallelism
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
    return plan_pipeline(
        n_layers, p.pipeline_parallel_degree, p.pipeline_parallel_schedule, layers_per_stage=layers_per_stage,
        stages_per_rank=stages_per_rank, first_stage_less_layers=p.pipeline_parallel_first_stage_less_layers,
        last_stage_less_layers=p.pipeline_parallel_last_stage_less_layers,
    )
