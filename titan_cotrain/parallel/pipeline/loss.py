"""The last stage's half of the co-training objective (``titan_cotrain.cotrain.step``).

The last stage's forward calls ``CotrainLoss.head`` in place of its ``lm_head``: the chunked
policy loss and the draft's teacher of microbatch ``m`` (the same ``policy_head`` a one-stage
step runs), whose policy *sum* is the stage's output. The schedule then calls the loss
function on it, which runs the draft's TTT forward *and* backward for microbatch ``m`` on
the taps the TapChannel brought (``draft_sums``, the one-stage step's; a block drafter's
``block_sums``, on the head's input and weight its ``head`` call kept): the draft's inputs are
detached, its graph is its own, so the schedule never runs its backward, zero-bubble weight
passes have nothing to miss, and the taps' landing slots are free when the loss returns. The
loss returns the policy sum, which the schedule backpropagates. All sums go to the
``CotrainSums`` of the run's context; ``pipeline_step`` turns them into gradient scales after
the last microbatch.

A mixture of experts' head also gets the routers' load pooled over every stage
(``TransformerStage``) and adds ``moe_aux_loss_weight x n_policy x aux`` to the policy sum,
as the one-stage step does; its backward reaches every stage's routers.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from titan_cotrain.cotrain.step import (
    CotrainSums,
    add_moe_aux_sums,
    add_policy_sums,
    block_sums,
    draft_sums,
    policy_head,
)
from titan_cotrain.components.private_torch import in_backward
from titan_cotrain.models.block_draft import BlockDrafter
from titan_cotrain.models.draft import Draft
from titan_cotrain.models.moe import RouterLoad, pooled_loss
from titan_cotrain.parallel.pipeline.step_context import PipelineStepContext
from titan_cotrain.parallel.tap_channel import EMBEDDINGS, TapChannel

__all__ = ["CotrainLoss"]


class CotrainLoss:
    """``head`` (called inside the last stage's forward) and the schedule's loss function
    (``loss_fn(policy_sum, microbatch, context=...)``, called after it, in microbatch order).
    What changes from one run of the schedule to the next (the policy loss, whether the draft
    trains, the microbatches, where the sums go) comes in with each call, in the run's
    ``PipelineStepContext``: a trainer's warm start and RL phases share one pipeline. ``moe``:
    the policy is a mixture of experts (its load-balancing loss is logged, and added with
    ``moe_aux_loss_weight``). A block drafter (``draft`` a ``BlockDrafter``) trains on
    ``blocks_per_doc`` anchors per sequence drawn from the run's ``anchor_seed``."""

    def __init__(self, draft: Draft | BlockDrafter | None, channel: TapChannel | None, tap_layers: Sequence[int], *,
                 ttt_steps: int, pass_decay: float, chunk_tokens: int = 2048, moe: bool = False,
                 moe_aux_loss_weight: float = 0.0, blocks_per_doc: int = 8) -> None:
        self.draft, self.channel = draft, channel
        self.block, self.blocks_per_doc = isinstance(draft, BlockDrafter), blocks_per_doc
        self.moe, self.moe_aux_loss_weight = moe, moe_aux_loss_weight
        self.tap_layers = tuple(tap_layers)
        self.ttt_steps, self.pass_decay, self.chunk_tokens = ttt_steps, pass_decay, chunk_tokens
        self._heads: dict[int, object] = {}  # a microbatch's head outputs, from its head call to its loss call
        self._keeps: dict[int, dict] = {}  # a block drafter's: the head's input and weight, likewise

    def head(self, hidden: torch.Tensor, weight: torch.Tensor, *, microbatch: int, context: PipelineStepContext,
             router_load: RouterLoad | None = None) -> torch.Tensor:
        """Microbatch ``microbatch``'s policy sum (plus the weighted load-balancing loss of
        ``router_load``), recorded in ``context.sums``. A rerun inside the backward (activation
        checkpointing of the stage) recomputes the same values and records nothing."""
        draft = self.draft if context.train_draft else None
        keep = {} if self.block and draft is not None else None
        head_out = policy_head(context.microbatches[microbatch], context.policy_loss_fn,
                               None if self.block else draft, self.chunk_tokens, keep)(hidden, weight)
        rerun = in_backward()
        if keep is not None and not rerun:
            self._keeps[microbatch] = keep
        sums = CotrainSums() if rerun else context.sums  # a rerun's go nowhere
        if not rerun:
            self._heads[microbatch] = head_out
        loss = add_policy_sums(sums, head_out)
        if router_load is not None:
            weighted = add_moe_aux_sums(sums, pooled_loss(router_load), head_out.policy)
            if self.moe_aux_loss_weight:  # 0: logged only
                loss = loss + self.moe_aux_loss_weight * weighted
        return loss

    def __call__(self, policy_sum: torch.Tensor, microbatch: torch.Tensor, *,
                 context: PipelineStepContext) -> torch.Tensor:
        """``microbatch``: the schedule's target for this call, the microbatch's index (a host
        ``int64 [1]``). Runs the draft's forward and backward on the microbatch's taps (with
        the draft trained this run) and returns the policy sum for the schedule's backward."""
        m = int(microbatch)
        head_out = self._heads.pop(m)
        if self.draft is not None and context.train_draft:
            mb = context.microbatches[m]
            b, s = mb.positions.shape
            taps = self.channel.receive(m)  # in microbatch order, which the channel checks
            features = torch.cat([taps[layer] for layer in self.tap_layers], dim=-1).reshape(b * s, -1)
            embeddings = taps[EMBEDDINGS].reshape(b * s, -1)
            if self.block:
                loss = block_sums(self.draft, mb, features, embeddings, self._keeps.pop(m), context.sums,
                                  pass_decay=self.pass_decay, blocks_per_doc=self.blocks_per_doc,
                                  seed=context.anchor_seed, chunk_tokens=self.chunk_tokens)
            else:
                loss = draft_sums(self.draft, mb, features, embeddings, head_out, context.sums,
                                  ttt_steps=self.ttt_steps, pass_decay=self.pass_decay, chunk_tokens=self.chunk_tokens)
            loss.backward()
            self.channel.release(m)
        return policy_sum
