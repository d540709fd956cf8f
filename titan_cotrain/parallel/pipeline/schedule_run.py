"""One pipeline update: runs of the schedule, the gradients' normalisation, and their clipping.

Normalisation is the one-stage step's (``titan_cotrain.cotrain.step``): every microbatch
backpropagates its loss *sums*; once the last run of the schedule is done, the last stage's
sums are all-reduced over the data-parallel x CP ranks, turned into the two gradient scales
(``1 / N_policy`` for the policy, ``lambda / sum_d w_d N_d`` for the draft) and the metrics,
and broadcast to the whole PP column as one device tensor (so rank 0, which holds no loss,
scales its gradients and logs the same numbers). The schedule is built with
``scale_grads=False``; its own recorded ``losses`` are therefore sums.

A run of the schedule gets everything it needs passed in (``step_context``): the stages and
the loss hold nothing of a step between calls.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from titan_cotrain.components.shards import local_shard
from titan_cotrain.cotrain.step import (
    CotrainSums,
    clip_grad_norms,
    metric_names,
    scale_gradients,
    scales_and_metrics,
)
from titan_cotrain.data.batch import LabelRows, PackedBatch, PolicyLossFn
from titan_cotrain.parallel.pipeline.build import Pipeline
from titan_cotrain.parallel.pipeline.step_context import PipelineStepContext

__all__ = ["clip_pipeline_grad_norms", "pipeline_step"]


def pipeline_step(
    pipeline: Pipeline,
    batch: PackedBatch,
    *,
    policy_loss_fn: PolicyLossFn | None = None,
    train_draft: bool = True,
    anchor_seed: int = 0,
) -> dict[str, torch.Tensor]:
    """Forward and backward one batch of host rows through the pipeline; every PP rank calls
    it with the whole batch (under CP, every CP rank too).

    ``batch`` has ``k`` times the rows of one run of the schedule (``n_microbatches *
    microbatch_size``): ``k`` runs accumulate the gradients of their loss sums, normalised once
    by the counts over all of them, so one call is one optimizer update over the whole batch.
    ``policy_loss_fn`` (default: the one the pipeline was built with) and ``train_draft``
    (False: no taps sent, no draft step) hold for this call; every rank must pass the same.
    ``anchor_seed``: a block drafter's anchors' (the one-stage step's ``anchor_seed``).

    On return every rank's gradients are final (normalised exactly as ``forward_backward``'s
    over the whole global batch) and every rank holds the same metrics (the same keys as
    ``forward_backward``'s, device tensors).
    """
    p, s = pipeline, pipeline.settings
    per_run = s.n_microbatches * s.microbatch_size
    n_rows = batch.tokens.shape[0]
    if n_rows == 0 or n_rows % per_run:
        raise ValueError(f"batch has {n_rows} rows; the pipeline takes a positive multiple of "
                         f"{s.n_microbatches} microbatches of {s.microbatch_size}")
    loss_fn = p.policy_loss_fn if policy_loss_fn is None else policy_loss_fn
    draft_on = train_draft and p.channel is not None
    sums = CotrainSums()
    with p.forward_scope():  # under CP, torch's CP dispatcher on for the schedule's runs only
        for start in range(0, n_rows, per_run):
            _run_schedule(p, batch.map(lambda t: t[start:start + per_run]), loss_fn, draft_on, sums, anchor_seed)
    names = _metric_names(p, loss_fn, draft_on)
    flat = torch.zeros(2 + len(names), dtype=torch.float32, device=p.device)
    if p.has_last_stage:
        summed = sums.all_reduce(p.loss_group) if p.loss_group is not None else dict(sums.sums)
        policy_scale, draft_scale, metrics = scales_and_metrics(summed, s.ttt_steps, s.pass_decay,
                                                                s.draft_loss_weight)
        values = [policy_scale, draft_scale if draft_scale is not None else torch.zeros(())]
        flat = torch.stack([v.to(flat) for v in values + [metrics[k] for k in names]])
    dist.broadcast(flat, group=p.pp_group, group_src=p.plan.stage_ranks[-1])
    _normalise_gradients(p, flat[0], flat[1])
    return dict(zip(names, flat[2:]))


def _metric_names(p: Pipeline, policy_loss_fn: PolicyLossFn, draft_on: bool) -> list[str]:
    """The metric keys of a step, known on every rank without communication: the policy
    loss's (from a call on zero tokens), a mixture of experts' load-balancing loss and, with
    the draft, its per-pass ones."""
    empty = torch.zeros(1, 0)
    rows = LabelRows(empty.long(), empty.bool(), empty, empty, empty, empty, empty)
    metric_sums = policy_loss_fn(torch.zeros(1, 0, 1), rows).metric_sums
    return metric_names(metric_sums, p.settings.ttt_steps if draft_on else None, moe_aux=p.loss.moe)


def _run_schedule(p: Pipeline, batch: PackedBatch, policy_loss_fn: PolicyLossFn, draft_on: bool,
                  sums: CotrainSums, anchor_seed: int = 0) -> None:
    """One run of the schedule over ``batch`` (exactly one run's host rows); gradients
    accumulate unscaled, the loss sums into ``sums``. Every microbatch's metadata is prepared
    here, once, into the run's context, which ``schedule.step`` hands every stage forward (a
    keyword argument) and the loss (``loss_kwargs``); the loss's target is the microbatch's
    index."""
    s = p.settings
    rows = s.microbatch_size
    microbatches = [p.prepare(batch.map(lambda t, i=i: t[i * rows:(i + 1) * rows]), p.device,
                              ttt_steps=s.ttt_steps, draft_loss_on=s.draft_loss_on)
                    for i in range(s.n_microbatches)]
    context = PipelineStepContext(microbatches, policy_loss_fn, train_draft=draft_on, sums=sums,
                                  anchor_seed=anchor_seed)
    args = (torch.cat([mb.tokens for mb in microbatches]),) if p.has_first_stage else ()
    target = torch.arange(s.n_microbatches) if p.has_last_stage else None  # split into one index per microbatch
    if draft_on:
        p.channel.begin_step(s.n_microbatches)
    p.schedule.step(*args, target=target, return_outputs=False, loss_kwargs={"context": context}, context=context)
    if draft_on:
        p.channel.finish_step()


def _normalise_gradients(p: Pipeline, policy_scale: torch.Tensor, draft_scale: torch.Tensor) -> None:
    tied = p.tied_weight()
    if tied is not None:
        # This rank holds the first stage (the embedding) or the last (the head), not both.
        grad = tied.grad
        dist.all_reduce(local_shard(grad), group=p.tied_group)
    scale_gradients(p.policy_parameters(), policy_scale)
    scale_gradients(p.draft_parameters(), draft_scale)


def clip_pipeline_grad_norms(
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
    return clip_grad_norms(p.policy_parameters(), p.draft_parameters() if train_draft and p.channel is not None
                           else None, policy_max_norm, draft_max_norm, pp_mesh=p.pp_mesh, clipped_alike=second_copy)
