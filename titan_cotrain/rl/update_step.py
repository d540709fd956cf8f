"""The trainer's update: one ``UpdateStep`` per job, single-stage or pipeline, with its
``UpdateSettings`` read from the job config once.

``UpdateStep.step(batch, loss_fn, train_draft=..., warm_start=...)`` turns a packed host batch
into ``rl.updates_per_step`` optimizer updates (one for a warm-start batch): the rows are cut
into that many consecutive minibatches, and each minibatch is one forward-backward over its
microbatches (``gradients``, the one thing the two implementations do differently), one
clipping of the two gradient norms, one host read of the metrics and the non-finite verdicts,
and the optimizer steps, each model's skipped when its loss or gradient norm is not finite on
any rank (``rl.nonfinite``). The metrics returned are means over the minibatches;
``nonfinite/*`` is the fraction of updates skipped.

* ``SingleStageUpdate``: ``forward_backward`` in microbatches of ``training.local_batch_size``
  rows (FSDP and CP inside the models, the forward-backward in ``forward_scope``: under CP
  torch's CP dispatcher is on for it only; a mixture of experts' load-balancing loss added
  with ``[model] moe_aux_loss_weight``), then ``cotrain.step.clip_grad_norms``.
* ``PipelineUpdate``: the minibatch padded with empty rows (loss mask 0) to whole schedule
  steps, ``pipeline_step`` over them (a mixture of experts' load-balancing loss pooled over
  the stages, ``parallel.pipeline.stage``), then the same clipping over this PP rank's
  parameters.
"""

from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass

import torch

from titan_cotrain.cotrain.step import clip_grad_norms, forward_backward, step_optimizers
from titan_cotrain.data.batch import PackedBatch, PolicyLossFn
from titan_cotrain.parallel.pipeline import clip_pipeline_grad_norms
from titan_cotrain.parallel.pipeline import pipeline_step
from titan_cotrain.rl.nonfinite import nonfinite_flags

__all__ = ["PipelineUpdate", "SingleStageUpdate", "UpdateSettings", "UpdateStep", "build_update_step"]

# Device metrics -> host floats, in one transfer (``RealRun.host_values``).
HostValues = Callable[[dict[str, torch.Tensor]], dict[str, float]]


@dataclass(frozen=True)
class UpdateSettings:
    """What an update reads of the job config, resolved once (``from_config``)."""

    updates_per_step: int
    """Optimizer updates per RL batch, over consecutive minibatches (``[rl] updates_per_step``)."""
    microbatch_rows: int
    """Rows per forward-backward of a single-stage update (``[training] local_batch_size``)."""
    ttt_steps: int
    """TTT passes of the draft (``[draft] ttt_steps``)."""
    pass_decay: float
    """gamma: the draft loss weighs TTT pass ``d`` by ``gamma ** (d - 1)`` (``[draft] pass_decay``)."""
    draft_loss_weight: float
    """lambda of the draft loss (``[draft] loss_weight``)."""
    draft_loss_on: str
    """The tokens the draft loss counts, ``"response"`` or ``"all"`` (``[draft] loss_on``)."""
    moe_aux_loss_weight: float
    """Weight of a mixture-of-experts policy's load-balancing loss (``[model] moe_aux_loss_weight``)."""
    policy_max_norm: float
    """The policy's gradient-norm clip (``[training] max_norm``)."""
    draft_max_norm: float
    """The draft's gradient-norm clip (``[draft] grad_clip``)."""
    blocks_per_doc: int = 8
    """A block drafter's training blocks per sequence (``[draft] blocks_per_doc``)."""

    @classmethod
    def from_config(cls, config) -> "UpdateSettings":
        d = config.draft
        # A block drafter's positions 1 .. B - 1 take the TTT passes' place in the sums and metrics.
        ttt_steps = d.block_size - 1 if d.kind == "dflash" else d.ttt_steps
        return cls(updates_per_step=config.rl.updates_per_step, microbatch_rows=config.training.local_batch_size,
                   ttt_steps=ttt_steps, pass_decay=d.pass_decay, blocks_per_doc=d.blocks_per_doc, draft_loss_weight=d.loss_weight,
                   draft_loss_on=d.loss_on, moe_aux_loss_weight=config.model.moe_aux_loss_weight,
                   policy_max_norm=config.training.max_norm, draft_max_norm=d.grad_clip)


class UpdateStep:
    """What the trainer calls to update the policy (and the co-trained draft) on a batch.

    ``max_updates`` (None: all): stop after that many minibatches (the simulator's bound:
    every update's memory is the first's)."""

    def __init__(self, settings: UpdateSettings, policy_opt, draft_opt, device: torch.device,
                 host_values: HostValues, max_updates: int | None = None) -> None:
        self.settings, self.policy_opt, self.draft_opt, self.device = settings, policy_opt, draft_opt, device
        self.host_values, self.max_updates = host_values, max_updates

    def gradients(self, minibatch: PackedBatch, loss_fn: PolicyLossFn, train_draft: bool,
                  seed: int = 0) -> dict[str, torch.Tensor]:
        """One update's final (normalised, clipped) gradients over ``minibatch``; its metrics,
        device tensors (``loss/*``, the loss's own, ``draft/*``, ``grad_norm/*``). ``seed``: of
        a block drafter's random anchors."""
        raise NotImplementedError

    def step(self, batch: PackedBatch, loss_fn: PolicyLossFn, *, train_draft: bool,
             warm_start: bool, train_policy: bool = True, seed: int = 0) -> dict[str, float]:
        """``batch``'s updates: one for the warm start (and the draft's prefit), ``updates_per_step``
        for an RL batch. ``train_policy`` False (the prefit): the policy's optimizer does not step
        (its gradients are zeroed), so its weights and optimizer state stay what they were.
        ``seed``: a block drafter's anchors (``Trainer.draft_seed``: the job's seed, the step and
        the rank), so a resumed step draws the uninterrupted one's."""
        n = 1 if warm_start else self.settings.updates_per_step
        rows = batch.tokens.shape[0]
        metrics: dict[str, float] = {}
        for chunk in range(n)[:self.max_updates]:
            part = slice(chunk * rows // n, (chunk + 1) * rows // n)
            out = self.gradients(batch.map(lambda t, part=part: t[part]), loss_fn, train_draft, seed * 64 + chunk)
            host = self.host_values(out | nonfinite_flags(out, self.device))
            step_optimizers(self.policy_opt, self.draft_opt if train_draft else None,
                            step_policy=train_policy and not host["nonfinite/policy"],
                            step_draft=not host["nonfinite/draft"])
            for key, value in host.items():  # the mean over minibatches
                metrics[key] = metrics.get(key, 0.0) + value / n
        return metrics


class SingleStageUpdate(UpdateStep):
    """The whole policy on every rank (FSDP, CP applied to its modules): ``forward_backward``
    in microbatches of ``training.local_batch_size`` rows, each made this rank's inputs by
    ``prepare`` (``parallelize``'s ``prepare_microbatch``), the first ``max_microbatches`` of
    them only when given (the simulator's bound)."""

    def __init__(self, settings: UpdateSettings, policy, draft, prepare, policy_opt, draft_opt, device,
                 host_values: HostValues, *, max_updates: int | None = None,
                 max_microbatches: int | None = None, forward_scope=nullcontext) -> None:
        super().__init__(settings, policy_opt, draft_opt, device, host_values, max_updates)
        self.policy, self.draft, self.prepare, self.max_microbatches = policy, draft, prepare, max_microbatches
        self.forward_scope = forward_scope

    def gradients(self, minibatch: PackedBatch, loss_fn: PolicyLossFn, train_draft: bool,
                  seed: int = 0) -> dict[str, torch.Tensor]:
        s = self.settings
        draft = self.draft if train_draft else None
        with self.forward_scope():
            out = forward_backward(self.policy, draft, minibatch, loss_fn, ttt_steps=s.ttt_steps,
                                   pass_decay=s.pass_decay, draft_loss_weight=s.draft_loss_weight,
                                   draft_loss_on=s.draft_loss_on, prepare=self.prepare, device=self.device,
                                   microbatch_rows=s.microbatch_rows, max_microbatches=self.max_microbatches,
                                   moe_aux_loss_weight=s.moe_aux_loss_weight, blocks_per_doc=s.blocks_per_doc,
                                   anchor_seed=seed)
        return out | clip_grad_norms(self.policy.parameters(), draft.parameters() if draft is not None else None,
                                     s.policy_max_norm, s.draft_max_norm)


class PipelineUpdate(UpdateStep):
    """This rank's pipeline stages: a minibatch padded to whole schedule steps (``n_microbatches
    * microbatch_size`` rows each), which accumulate into its update; the first
    ``max_schedule_steps`` of them only when given (the simulator's bound: memory repeats from
    one to the next)."""

    def __init__(self, settings: UpdateSettings, pipeline, policy_opt, draft_opt, device, host_values: HostValues, *,
                 max_updates: int | None = None, max_schedule_steps: int | None = None) -> None:
        super().__init__(settings, policy_opt, draft_opt, device, host_values, max_updates)
        self.pipeline, self.max_schedule_steps = pipeline, max_schedule_steps

    def gradients(self, minibatch: PackedBatch, loss_fn: PolicyLossFn, train_draft: bool,
                  seed: int = 0) -> dict[str, torch.Tensor]:
        p, s = self.pipeline, self.settings
        per_step = p.n_microbatches * p.microbatch_size
        extra = -minibatch.tokens.shape[0] % per_step
        if extra:
            minibatch = minibatch.map(lambda t: torch.cat([t, t.new_zeros(extra, t.shape[1])]))
        if self.max_schedule_steps is not None:
            minibatch = minibatch.map(lambda t: t[:self.max_schedule_steps * per_step])
        out = pipeline_step(p, minibatch, policy_loss_fn=loss_fn, train_draft=train_draft, anchor_seed=seed)
        return out | clip_pipeline_grad_norms(p, s.policy_max_norm, s.draft_max_norm, train_draft=train_draft)


def build_update_step(config, models, policy_opt, draft_opt, device, run) -> UpdateStep:
    """The job's ``UpdateStep``: ``PipelineUpdate`` under PP, else ``SingleStageUpdate``, over
    ``parallelize``'s ``models``, bounded as ``run`` (a ``RealRun``) says."""
    def host_values(values):
        return run.host_values(values, device)

    settings = UpdateSettings.from_config(config)
    if models.pipeline is not None:
        return PipelineUpdate(settings, models.pipeline, policy_opt, draft_opt, device, host_values,
                              max_updates=run.max_updates, max_schedule_steps=run.max_schedule_steps)
    return SingleStageUpdate(settings, models.policy, models.draft, models.prepare_microbatch, policy_opt, draft_opt,
                             device, host_values, max_updates=run.max_updates, max_microbatches=run.max_microbatches,
                             forward_scope=models.forward_scope)
