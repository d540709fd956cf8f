"""The block drafter's co-training objective: blocks at random anchors of the policy's own
sequences, each position's draft distribution against the policy's (docs/DESIGN.md, the
block drafter).

For a block at anchor ``a`` (row ``a`` of the packed batch; its document's rows are
``[s, e)``) and block position ``j = 1 .. B - 1``:

=========== =========================================================================
context     the document's rows ``s .. a - 1`` (``BlockDrafter.forward``'s ``ctx_start, ctx_end``)
target      ``x_{a+j}``
teacher     ``softmax(head(policy_hidden[a + j - 1]))`` over the full vocabulary: the policy's
            distribution for ``x_{a+j}``, recomputed per chunk from the hidden states its head
            read (no ``[T, V]`` teacher is kept)
mask        ``a + j < e`` and ``x_{a+j}`` in the loss region
weight      ``decay ** (j - 1)``
=========== =========================================================================

Anchors are drawn each step (``sample_anchors``): up to ``blocks_per_doc`` per document,
uniformly among its rows whose next token is in the loss region, without replacement. The
sums are per block position (``[B - 1]`` each) and add over microbatches and ranks; the
loss is ``sum_j w_j ce_sum_j / sum_j w_j count_j`` over the whole update, as the EAGLE-3
draft's is over its passes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from titan_cotrain.models.block_draft import BlockDrafter, head_logits

__all__ = ["BlockStats", "block_draft_sums", "block_weights", "document_bounds", "sample_anchors"]

DEFAULT_CHUNK_ROWS = 1024


@dataclass
class BlockStats:
    """Per block position ``j = 1 .. B - 1`` (``[B - 1]`` each): ``ce_sum`` (differentiable),
    ``count`` (masked positions), ``correct`` (draft top-1 == teacher argmax: greedy
    acceptance) and ``overlap`` (``sum_x min(teacher, draft)``: sampling's acceptance chance
    at temperature 1)."""

    ce_sum: torch.Tensor
    count: torch.Tensor
    correct: torch.Tensor
    overlap: torch.Tensor


def block_weights(block_size: int, decay: float, device=None) -> torch.Tensor:
    """``w_j = decay ** (j - 1)`` for ``j = 1 .. B - 1`` (fp32)."""
    return decay ** torch.arange(block_size - 1, dtype=torch.float32, device=device)


def document_bounds(cu_seqlens: torch.Tensor, device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(start, end) int64 [T]``: the bounds of each packed row's document."""
    cu = cu_seqlens.to(device=device, dtype=torch.int64)
    lengths = cu[1:] - cu[:-1]
    return cu[:-1].repeat_interleave(lengths), cu[1:].repeat_interleave(lengths)


def sample_anchors(cu_seqlens: torch.Tensor, loss_region: torch.Tensor, blocks_per_doc: int,
                   generator: torch.Generator | None = None) -> torch.Tensor:
    """``int64 [N]``, increasing: up to ``blocks_per_doc`` anchor rows per document, drawn
    uniformly without replacement among the rows ``a`` whose next row ``a + 1`` is in the
    document and in ``loss_region [T]``. Vectorised (one sort), on ``loss_region``'s device;
    ``generator`` a generator of that device."""
    t = loss_region.shape[0]
    device = loss_region.device
    start, end = document_bounds(cu_seqlens, device)
    rows = torch.arange(t, device=device)
    next_in_region = torch.cat([loss_region[1:], loss_region.new_zeros(1)])
    valid = (rows + 1 < end) & next_in_region
    # Sorted by document, then valid rows first in a random order: a document's first
    # blocks_per_doc sorted rows are its draw.
    doc = torch.searchsorted(cu_seqlens.to(device=device, dtype=torch.int64)[1:], rows, right=True)
    noise = torch.rand(t, generator=generator, device=device, dtype=torch.float64)
    order = torch.argsort(doc.double() * 4 + torch.where(valid, noise, torch.full_like(noise, 2.0)), stable=True)
    rank = rows - start[order]
    chosen = order[(rank < blocks_per_doc) & valid[order]]
    return chosen.sort().values


def _block_chunk(hidden: torch.Tensor, teacher_rows: torch.Tensor, mask: torch.Tensor, slot: torch.Tensor,
                 norm: torch.nn.Module, policy_hidden: torch.Tensor, head_weight: torch.Tensor, slots: int):
    """One chunk's per-slot ``(ce_sum, correct, overlap)`` (``[slots]`` each); ``hidden [c, H]``
    the drafter's outputs before its ``norm``, ``teacher_rows, mask, slot [c]``."""
    weight = head_weight.detach()
    logits = head_logits(norm, hidden, weight)  # [c, V]
    with torch.no_grad():
        teacher = F.linear(policy_hidden[teacher_rows].detach().to(weight.dtype), weight)
        teacher = teacher.to(logits.dtype).log_softmax(-1)
    teacher_probs, draft_logprobs = teacher.exp(), logits.log_softmax(-1)
    ce = torch.where(mask, -(teacher_probs * draft_logprobs).sum(-1), 0.0)
    ce_sum = torch.zeros(slots, dtype=ce.dtype, device=ce.device).index_add(0, slot, ce)
    with torch.no_grad():
        finite = logits.amax(-1).isfinite() & teacher.amax(-1).isfinite() & mask
        hit = ((logits.argmax(-1) == teacher.argmax(-1)) & finite).float()
        chance = torch.where(finite, torch.minimum(teacher_probs, draft_logprobs.exp()).sum(-1), 0.0)
        correct = torch.zeros(slots, device=ce.device).index_add(0, slot, hit)
        overlap = torch.zeros(slots, device=ce.device).index_add(0, slot, chance.float())
    return ce_sum, correct, overlap


def block_draft_sums(
    drafter: BlockDrafter,
    features: torch.Tensor,
    embeddings: torch.Tensor,
    positions: torch.Tensor,
    cu_seqlens: torch.Tensor,
    loss_region: torch.Tensor,
    policy_hidden: torch.Tensor,
    head_weight: torch.Tensor,
    anchors: torch.Tensor,
    *,
    chunk_rows: int = DEFAULT_CHUNK_ROWS,
) -> BlockStats:
    """The drafter's sums over one packed microbatch (module docstring).

    ``features [T, n_ctx * H]``: the policy's outputs of ``target_layer_ids``, concatenated;
    ``embeddings [T, H]``: its token embeddings; ``positions [T]`` (in-document RoPE
    positions); ``cu_seqlens``; ``loss_region [T]`` bool; ``policy_hidden [T, H]``: what the
    policy's head read (its final norm's output); ``head_weight [V, H]``; ``anchors [N]``
    (``sample_anchors``). Every policy tensor is read detached. The draft logits of
    ``chunk_rows`` block rows at a time, each chunk checkpointed: no ``[N B, V]`` tensor is
    kept from forward to backward."""
    b = drafter.args.block_size
    if anchors.numel() == 0:  # nothing to train on: zero sums, still reaching every parameter
        zero = sum(p.sum() for p in drafter.parameters()) * 0.0
        return BlockStats(zero.expand(b - 1), *(torch.zeros(b - 1, device=features.device) for _ in range(3)))
    start, end = document_bounds(cu_seqlens, features.device)
    targets = anchors[:, None] + torch.arange(1, b, device=anchors.device)  # [N, B - 1]
    inside = targets < end[anchors][:, None]
    targets = torch.where(inside, targets, anchors[:, None])  # any row in range where masked
    mask = (inside & loss_region[targets]).reshape(-1)
    teacher_rows = (targets - 1).reshape(-1)
    slot = torch.arange(b - 1, device=anchors.device).repeat(anchors.shape[0])

    def score(hidden: torch.Tensor, norm: torch.nn.Module):
        rows = hidden[:, 1:].reshape(-1, hidden.shape[-1])
        return [checkpoint(_block_chunk, *chunk, norm, policy_hidden, head_weight, b - 1,
                           use_reentrant=False, preserve_rng_state=False)
                for chunk in zip(rows.split(chunk_rows), teacher_rows.split(chunk_rows), mask.split(chunk_rows),
                                 slot.split(chunk_rows))]

    sums = drafter(features, positions, embeddings[anchors], positions[anchors], start[anchors], anchors, score=score)
    ce_sum, correct, overlap = (torch.stack(parts).sum(0) for parts in zip(*sums))
    count = torch.zeros(b - 1, dtype=torch.int64, device=mask.device).index_add(0, slot, mask.long())
    return BlockStats(ce_sum, count, correct, overlap)
