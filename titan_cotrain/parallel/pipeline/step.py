"""One pipeline update, its clipping, and the whole-model weights for the rollout engine.

Normalisation is the one-stage step's (``titan_cotrain.cotrain.step``): every microbatch
backpropagates its loss *sums*; once the last schedule step is done, the last stage's sums
are all-reduced over the data-parallel x CP ranks, turned into the two gradient scales
(``1 / N_policy`` for the policy, ``lambda / sum_d w_d N_d`` for the draft) and the metrics,
and broadcast to the whole PP column as one device tensor (so rank 0, which holds no loss,
scales its gradients and logs the same numbers). The schedule is built with
``scale_grads=False``; its own recorded ``losses`` are therefore sums.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from titan_cotrain.cotrain.step import (
    metric_names,
    clip_grad_norms as shared_clip_grad_norms,
    scale_gradients,
    scales_and_metrics,
)
from titan_cotrain.data.batch import LabelRows, PackedBatch, PolicyLossFn
from titan_cotrain.parallel.engine_tp import whole_tensor
from titan_cotrain.parallel.pipeline.build import Pipeline

__all__ = ["clip_grad_norms", "gather_state_dict", "pipeline_step"]


def pipeline_step(
    pipeline: Pipeline,
    batch: PackedBatch,
    *,
    policy_loss_fn: PolicyLossFn | None = None,
    train_draft: bool = True,
) -> dict[str, torch.Tensor]:
    """Forward and backward one batch of host rows through the pipeline; every PP rank calls
    it with the whole batch (under CP, every CP rank too).

    ``batch`` has ``k`` times the rows of one schedule step (``n_microbatches *
    microbatch_size``): ``k`` schedule steps accumulate the gradients of their loss sums,
    normalised once by the counts over all of them, so one call is one optimizer update
    over the whole batch. ``policy_loss_fn`` (default: the one the pipeline was built
    with, or the last one given) and ``train_draft`` (False: no taps sent, no draft step)
    hold from this call on; every rank must pass the same.

    On return every rank's gradients are final (normalised exactly as ``forward_backward``'s
    over the whole global batch) and every rank holds the same metrics (the same keys as
    ``forward_backward``'s, device tensors).
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
    for start in range(0, n_rows, per_step):
        _schedule_step(p, batch.map(lambda t: t[start:start + per_step]), draft_on)
    names = _metric_names(p, draft_on)
    flat = torch.zeros(2 + len(names), dtype=torch.float32, device=p.device)
    if p.has_last_stage:
        sums = p.loss.sums.all_reduce(p.loss_group) if p.loss_group is not None else dict(p.loss.sums.sums)
        policy_scale, draft_scale, metrics = scales_and_metrics(sums, p.loss.ttt_steps, p.loss.pass_decay,
                                                                p.draft_loss_weight)
        values = [policy_scale, draft_scale if draft_scale is not None else torch.zeros(())]
        flat = torch.stack([v.to(flat) for v in values + [metrics[k] for k in names]])
    dist.broadcast(flat, group=p.pp_group, group_src=p.plan.stage_ranks[-1])
    _normalise_gradients(p, flat[0], flat[1])
    return dict(zip(names, flat[2:]))


def _metric_names(p: Pipeline, draft_on: bool) -> list[str]:
    """The metric keys of a step, known on every rank without communication: the policy
    loss's (from a call on zero tokens), a mixture of experts' load-balancing loss and, with
    the draft, its per-pass ones."""
    empty = torch.zeros(1, 0)
    rows = LabelRows(empty.long(), empty.bool(), empty, empty, empty)
    metric_sums = p.loss.policy_loss_fn(torch.zeros(1, 0, 1), rows).metric_sums
    return metric_names(metric_sums, p.loss.ttt_steps if draft_on else None, moe_aux=p.loss.moe)


def _schedule_step(p: Pipeline, batch: PackedBatch, draft_on: bool) -> None:
    """One run of the schedule over ``batch`` (exactly one schedule step's host rows);
    gradients accumulate unscaled. Every microbatch's metadata is prepared here, once."""
    mb_rows = p.microbatch_size
    microbatches = [p.prepare(batch.map(lambda t, i=i: t[i * mb_rows:(i + 1) * mb_rows]), p.device,
                              ttt_steps=p.loss.ttt_steps, draft_loss_on=p.draft_loss_on)
                    for i in range(p.n_microbatches)]
    if draft_on:
        p.channel.begin_step(p.n_microbatches)
    p.loss.begin_schedule_step(microbatches)
    for part in p.model_parts:
        part.begin_schedule_step(microbatches)
    args = (torch.cat([mb.tokens for mb in microbatches]),) if p.has_first_stage else ()
    rows = torch.arange(p.n_microbatches * mb_rows)
    p.schedule.step(*args, target=rows if p.has_last_stage else None, return_outputs=False)
    if draft_on:
        p.channel.finish_step()


def _normalise_gradients(p: Pipeline, policy_scale: torch.Tensor, draft_scale: torch.Tensor) -> None:
    tied = p.tied_weight()
    if tied is not None:
        # This rank holds the first stage (the embedding) or the last (the head), not both.
        grad = tied.grad
        dist.all_reduce(grad.to_local() if isinstance(grad, DTensor) else grad, group=p.tied_group)
    scale_gradients(p.policy_parameters(), policy_scale)
    scale_gradients(p.draft_parameters(), draft_scale)


def clip_grad_norms(
    pipeline: Pipeline,
    policy_max_norm: float,
    draft_max_norm: float,
    *,
    train_draft: bool = True,
) -> dict[str, torch.Tensor]:
    """``titan_cotrain.cotrain.step.clip_grad_norms`` over one PP rank's parameters: the
    policy's and the draft's gradient norms clipped separately, each the *global* norm over
    the PP column (the same value on every rank, returned as the metrics). The optimizers are
    stepped by ``titan_cotrain.cotrain.step.step_optimizers``.

    Every PP rank calls it. ``train_draft`` says whether the draft was trained this step (as in
    ``pipeline_step``). A tied embedding is counted once in the norm (on the first stage)
    and clipped on both ranks by the same factor, so its two copies stay equal.
    """
    p = pipeline
    tied = p.tied_weight()
    second_copy = [tied] if tied is not None and not p.has_first_stage else []
    return shared_clip_grad_norms(p.policy_parameters(), p.draft_parameters() if train_draft and p.channel is not None
                                  else None, policy_max_norm, draft_max_norm, pp_mesh=p.pp_mesh,
                                  clipped_alike=second_copy)


class _BroadcastState(Mapping):
    """A state dict whose entries arrive on demand: reading ``name`` broadcasts it over the
    PP group from the rank of the stage that holds it (gathering its FSDP shards there
    first). Every PP rank (and every data-parallel peer) must read the same names in the
    same order; a reader that copies each entry and drops it holds one tensor at a time."""

    def __init__(self, p: Pipeline, like: nn.Module, stage_of, prefix: str) -> None:
        self.p, self.stage_of, self.prefix = p, stage_of, prefix
        self.templates = {name: (t.shape, t.dtype) for name, t in like.state_dict().items()}
        self.local = {name: t for part in p.model_parts for name, t in part.state_dict().items()}
        if p.draft is not None:
            self.local |= {f"draft.{name}": t for name, t in p.draft.state_dict().items()}
        self.pp_rank = dist.get_rank(p.pp_group)

    def __getitem__(self, name: str) -> torch.Tensor:
        owner = self.p.plan.stage_ranks[self.stage_of(name)]
        shape, dtype = self.templates[name]
        if owner == self.pp_rank:
            # Cast before the FSDP gather: the engine's bytes move, not fp32 (70B: 2 x 3.9 GiB
            # for the embedding and the output head gathered whole).
            t = whole_tensor(self.local[self.prefix + name], dtype).to(self.p.device, dtype).contiguous()
        else:
            t = torch.empty(shape, dtype=dtype, device=self.p.device)
        dist.broadcast(t, group=self.p.pp_group, group_src=owner)
        return t

    def __iter__(self) -> Iterator[str]:
        return iter(self.templates)

    def __len__(self) -> int:
        return len(self.templates)


def gather_state_dict(
    pipeline: Pipeline, policy_like: nn.Module, draft_like: nn.Module | None = None
) -> tuple[Mapping[str, torch.Tensor], Mapping[str, torch.Tensor] | None]:
    """The whole policy's and draft's trained state on every PP rank: ``(policy state,
    draft state or None)``, keyed and shaped like ``policy_like.state_dict()`` and
    ``draft_like``'s (whole-model copies, e.g. the rollout engine's), as mappings whose
    entries are broadcast when read (a collective per entry: every rank reads them all, in
    ``*_like``'s order, as ``RolloutEngine.load_weights`` does). Values are fresh tensors
    in ``*_like``'s dtypes."""
    p = pipeline
    policy_state = _BroadcastState(p, policy_like, p.plan.stage_of, "")
    draft_state = None
    if draft_like is not None:
        draft_state = _BroadcastState(p, draft_like, lambda _: p.plan.num_stages - 1, "draft.")
    return policy_state, draft_state
