"""One co-training step: a policy forward feeds both the policy loss and the draft's TTT.

``forward_backward`` computes ``L = L_policy + lambda * L_draft`` and runs backward once.
The draft reads only detached tensors of the policy (taps, embeddings, teacher logits),
so the policy's gradients are exactly those of ``L_policy`` alone. ``clip_and_step``
then clips the two gradient norms separately and steps two optimizers (each with its
own LR schedule). Both losses divide by *global* counts (all-reduced over the
data-parallel group), because FSDP sums gradients across ranks.
"""

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.distributed as dist

from titan_cotrain.components import titan
from titan_cotrain.cotrain.ttt import draft_loss, pass_weights, tau, ttt_unroll
from titan_cotrain.data.packing import LabelRows, layout_from_document_ids
from titan_cotrain.models.draft import Draft
from titan_cotrain.models.transformer import Transformer

__all__ = ["PackedBatch", "PolicyLoss", "PolicyLossFn", "clip_and_step", "forward_backward", "labels_of"]


@dataclass
class PackedBatch:
    """Packed training rows, all ``[B, S]`` and aligned with ``tokens``: ``document_ids``;
    ``loss_mask`` (bool), True where token ``t`` is a training target (the response region
    in RL). RL rows also carry ``advantages`` (each token its sample's advantage),
    ``old_logprobs`` (behaviour log-prob of token ``t``) and, with a KL term,
    ``ref_logprobs``."""

    tokens: torch.Tensor
    document_ids: torch.Tensor
    loss_mask: torch.Tensor
    advantages: torch.Tensor | None = None
    old_logprobs: torch.Tensor | None = None
    ref_logprobs: torch.Tensor | None = None

    def map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> "PackedBatch":
        """The same rows with ``fn`` applied to every field present (moves, slices, pads)."""
        return PackedBatch(*(None if t is None else fn(t) for t in (
            self.tokens, self.document_ids, self.loss_mask, self.advantages, self.old_logprobs, self.ref_logprobs)))

    def to(self, device) -> "PackedBatch":
        return self.map(lambda t: t.to(device))


def labels_of(batch: PackedBatch) -> LabelRows:
    """Shift every field of ``batch`` left by one token inside its document."""
    same_doc = torch.zeros_like(batch.loss_mask)
    same_doc[:, :-1] = batch.document_ids[:, 1:] == batch.document_ids[:, :-1]

    def nxt(x: torch.Tensor | None, fill=0):
        if x is None:
            return None
        out = torch.full_like(x, fill)
        out[:, :-1] = x[:, 1:]
        return torch.where(same_doc, out, torch.full_like(x, fill))

    return LabelRows(nxt(batch.tokens), nxt(batch.loss_mask, False), nxt(batch.advantages),
                     nxt(batch.old_logprobs), nxt(batch.ref_logprobs))


class PolicyLoss(NamedTuple):
    """A policy loss over the local tokens: ``loss_sum``, ``count`` (tokens it sums over)
    and ``metric_sums`` (per-token quantities summed, reported divided by the global count)."""

    loss_sum: torch.Tensor
    count: torch.Tensor
    metric_sums: dict[str, torch.Tensor] = {}


# (logits [B, S, V], label-aligned rows: LabelRows or a CP shard's CPBatch) -> PolicyLoss
PolicyLossFn = Callable[[torch.Tensor, LabelRows], PolicyLoss]


def _global_sum(x: torch.Tensor, group) -> torch.Tensor:
    x = x.detach().clone().float()
    if dist.is_initialized():
        dist.all_reduce(x, group=group)
    return x


def forward_backward(
    policy: Transformer,
    draft: Draft | None,
    batch: PackedBatch,
    policy_loss_fn: PolicyLossFn,
    *,
    ttt_steps: int,
    pass_decay: float,
    draft_loss_weight: float,
    draft_loss_on: str = "response",
    group=None,
    cp_group=None,
) -> dict[str, torch.Tensor]:
    """Forward the policy once, add the draft's TTT loss, backward once. Returns detached metrics.

    ``group`` holds every rank whose tokens share the global token mean: the data-parallel
    ranks times the context-parallel ones (None: the default group, or no communication
    when not distributed). With ``cp_group``, ``batch`` (the same on every rank of that
    group) is zigzag-sharded over it and policy and draft run context-parallel.
    """
    if cp_group is not None:
        from titan_cotrain.parallel.context_parallel import shard_batch_for_cp

        labels, shard = shard_batch_for_cp(batch, cp_group)
        tokens, positions, cu_seqlens = labels.tokens, shard.positions, shard.cu_seqlens
        region = labels.loss_mask if draft_loss_on == "response" else shard.valid
        out = policy(tokens, cp=shard, return_taps=draft is not None)
    else:
        layout = layout_from_document_ids(batch.document_ids)
        labels, shard = labels_of(batch), None
        tokens, positions, cu_seqlens = batch.tokens, layout.positions, layout.cu_seqlens
        region = batch.loss_mask if draft_loss_on == "response" else torch.ones_like(batch.loss_mask)
        out = policy(tokens, cu_seqlens=cu_seqlens, return_taps=draft is not None)
    logits = out.logits if draft is not None else out
    policy_sum, policy_count, metric_sums = policy_loss_fn(logits, labels)
    global_count = _global_sum(policy_count, group).clamp(min=1)
    policy_loss = policy_sum / global_count
    metrics = {"loss/policy": _global_sum(policy_loss, group)}
    metrics |= {name: _global_sum(value, group) / global_count for name, value in metric_sums.items()}
    loss = policy_loss
    if draft is not None:
        b, s = tokens.shape
        stats = ttt_unroll(
            draft,
            taps=torch.cat(out.taps, dim=-1).reshape(b * s, -1),
            embeddings=out.embeddings.reshape(b * s, -1),
            tokens=tokens.reshape(-1),
            positions=positions.reshape(-1),
            cu_seqlens=cu_seqlens,
            teacher_logits=logits.reshape(b * s, -1),
            loss_region=region.reshape(-1),
            ttt_steps=ttt_steps,
            cp=shard,
        )
        weights = pass_weights(ttt_steps, pass_decay, device=stats.ce_sum.device)
        counts = _global_sum(stats.count, group)
        l_draft = draft_loss(stats, weights, (weights * counts).sum())
        loss = loss + draft_loss_weight * l_draft
        ce = _global_sum(stats.ce_sum, group)
        accuracy = _global_sum(stats.correct, group) / counts.clamp(min=1)
        metrics["loss/draft"] = _global_sum(l_draft, group)
        for d in range(ttt_steps):
            metrics[f"draft/loss_pass{d + 1}"] = ce[d] / counts[d].clamp(min=1)
            metrics[f"draft/acc_pass{d + 1}"] = accuracy[d]
        metrics["draft/tau"] = tau(accuracy)
    loss.backward()
    return metrics


def clip_and_step(
    policy: Transformer,
    draft: Draft | None,
    policy_optimizers,
    draft_optimizers,
    policy_max_norm: float,
    draft_max_norm: float,
) -> dict[str, torch.Tensor]:
    """Clip policy and draft gradient norms separately, step both optimizers, zero grads."""
    metrics = {"grad_norm/policy": titan.clip_grad_norm_(policy.parameters(), policy_max_norm)}
    policy_optimizers.step()
    policy_optimizers.zero_grad()
    if draft is not None:
        metrics["grad_norm/draft"] = titan.clip_grad_norm_(draft.parameters(), draft_max_norm)
        draft_optimizers.step()
        draft_optimizers.zero_grad()
    return metrics
