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
from torch._subclasses.fake_tensor import is_fake
from torch.utils.checkpoint import checkpoint

from titan_cotrain.models.block_draft import BlockDrafter, head_logits

__all__ = ["BlockStats", "anchor_keys", "block_draft_sums", "block_weights", "document_bounds", "document_index",
           "sample_anchors"]

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


def document_bounds(cu_seqlens: torch.Tensor, device, total: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(start, end) int64 [T]``: the bounds of each packed row's document. ``total``: ``T``
    when the caller knows it (the expansion then needs no read of its size from the device:
    no sync on an accelerator, and the scale simulator's fake tensors can run it)."""
    cu = cu_seqlens.to(device=device, dtype=torch.int64)
    lengths = cu[1:] - cu[:-1]
    return (cu[:-1].repeat_interleave(lengths, output_size=total),
            cu[1:].repeat_interleave(lengths, output_size=total))


def document_index(cu_seqlens: torch.Tensor, device, total: int | None = None) -> torch.Tensor:
    """``int64 [T]``: each packed row's document, ``0 .. len(cu_seqlens) - 2`` (``total`` as
    ``document_bounds``')."""
    cu = cu_seqlens.to(device=device, dtype=torch.int64)
    return torch.arange(cu.numel() - 1, device=device).repeat_interleave(cu[1:] - cu[:-1], output_size=total)


_MIX = (0x5851F42D4C957F2D, 0x14057B7EF767814F)  # odd 63-bit multipliers
_KEY_BITS = (1 << 62) - 1
_NO_KEY = torch.iinfo(torch.int64).max


def _logical_shift(x: torch.Tensor, bits: int) -> torch.Tensor:
    """``x >> bits`` of the 64-bit pattern (torch's ``>>`` keeps the sign of an int64)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def _mix(x: torch.Tensor) -> torch.Tensor:
    for multiplier, bits in ((_MIX[0], 29), (_MIX[1], 32), (_MIX[0], 29)):
        x = x * multiplier
        x = x ^ _logical_shift(x, bits)
    return x


def anchor_keys(positions: torch.Tensor, tokens: torch.Tensor, next_tokens: torch.Tensor, seed: int) -> torch.Tensor:
    """int64 ``[T]`` in ``[0, 2^62)``: a hash of ``(seed, position in the document, token,
    next token)`` per row (multiply-xorshift rounds, wrapping int64 arithmetic). What a row
    holds, not where a batch put it: the same key on one device and under any context-parallel
    degree (whose packing pads documents and moves them between rows). Within a document the
    positions differ, so the keys are independent draws; documents that are identical get the
    same anchors."""
    x = _mix(positions.to(torch.int64) + (seed * _MIX[1]) % (1 << 63))
    x = _mix(x + tokens.to(torch.int64))
    return _mix(x + next_tokens.to(torch.int64)) & _KEY_BITS


def sample_anchors(cu_seqlens: torch.Tensor, loss_region: torch.Tensor, blocks_per_doc: int, seed: int = 0,
                   *, positions: torch.Tensor, tokens: torch.Tensor, shift=None) -> torch.Tensor:
    """``int64 [N]``, increasing: up to ``blocks_per_doc`` anchor rows per document, drawn
    uniformly without replacement among the rows ``a`` whose next row ``a + 1`` is in the
    document and in ``loss_region [T]``: per document, the valid rows with the smallest
    ``anchor_keys`` of ``seed`` (from ``positions``, the in-document positions, and
    ``tokens``). Vectorised (one sort, no loop over documents), on ``loss_region``'s device.

    ``shift`` (the microbatch's ``DocumentShift`` or, under context parallelism, its
    ``TTTHalo``; default: this batch's own) says where each row's successor is; under CP the
    ranks of the group exchange their documents' smallest keys (one ``all_gather`` of
    ``[documents, blocks_per_doc]``), so together they draw the anchors one device draws from
    the same documents, each rank keeping its own rows."""
    import torch.distributed as dist

    from titan_cotrain.data.packing import DocumentShift

    device = loss_region.device
    t = loss_region.shape[0]
    if is_fake(loss_region):
        # The scale simulator's fake tensors have no values to draw from: the most blocks a
        # step can train, every document's on this rank (a memory bound).
        return torch.arange(min(t, (cu_seqlens.numel() - 1) * blocks_per_doc), device=device)
    shift = shift if shift is not None else DocumentShift(cu_seqlens, 1, device)
    region, ext_tokens = shift.extend(loss_region, tokens.to(device))
    successor = shift.rows[0].to(device)
    next_row = successor.clamp(min=0)
    valid = (successor >= 0) & region[next_row]
    cu = cu_seqlens.to(device=device, dtype=torch.int64)
    n_docs = cu.numel() - 1
    rows = torch.arange(t, device=device)
    doc = document_index(cu, device, t)
    key = torch.where(valid, anchor_keys(positions.to(device), tokens.to(device), ext_tokens[next_row], seed), _NO_KEY)
    # Per document its blocks_per_doc smallest keys here ([documents, blocks_per_doc], _NO_KEY
    # where it has fewer valid rows), then over the CP group.
    order = torch.argsort(key, stable=True)
    order = order[torch.argsort(doc[order], stable=True)]
    rank = rows - cu[:-1][doc[order]]
    take = rank < blocks_per_doc
    smallest = torch.full((n_docs, blocks_per_doc), _NO_KEY, dtype=torch.int64, device=device)
    smallest[doc[order][take], rank[take]] = key[order][take]
    if shift.group is not None:
        every = [torch.empty_like(smallest) for _ in range(dist.get_world_size(shift.group))]
        dist.all_gather(every, smallest, group=shift.group)
        smallest = torch.cat(every, dim=1).sort(dim=1).values[:, :blocks_per_doc]
    chosen = valid & (key <= smallest[:, -1][doc])
    return chosen.nonzero().squeeze(1)


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
    shift=None,
) -> BlockStats:
    """The drafter's sums over one packed microbatch (module docstring).

    ``features [T, n_ctx * H]``: the policy's outputs of ``target_layer_ids``, concatenated;
    ``embeddings [T, H]``: its token embeddings; ``positions [T]`` (in-document RoPE
    positions); ``cu_seqlens``; ``loss_region [T]`` bool; ``policy_hidden [T, H]``: what the
    policy's head read (its final norm's output); ``head_weight [V, H]``; ``anchors [N]``
    (``sample_anchors``). Every policy tensor is read detached. The draft logits of
    ``chunk_rows`` block rows at a time, each chunk checkpointed: no ``[N B, V]`` tensor is
    kept from forward to backward.

    ``shift``: where each row's successors live (the microbatch's ``DocumentShift``, default
    this batch's own, or under context parallelism its ``TTTHalo``, at least ``B - 1`` wide):
    a block's teacher rows and targets past the end of this rank's chunk come from its halo,
    and its context from every rank of the group (``ops.block_attention.BlockContextRing``)."""
    from titan_cotrain.data.packing import DocumentShift
    from titan_cotrain.ops.block_attention import BlockContextRing

    b = drafter.args.block_size
    device = features.device
    shift = shift if shift is not None else DocumentShift(cu_seqlens, b - 1, device)
    if shift.width < b - 1:
        raise ValueError(f"a block of {b} reads {b - 1} successors of its anchor; the shift holds {shift.width}")
    # Row of x_{a+j} (j = 1 .. B - 1) in the extended tensors, -1 past the document's end.
    targets = shift.rows[: b - 1, anchors].to(device).T  # [N, B - 1]
    inside = targets >= 0
    teacher_hidden, region = shift.extend(policy_hidden, loss_region)
    mask = (inside & region[targets.clamp(min=0)]).reshape(-1)
    # The teacher of x_{a+j} reads row a + j - 1: the anchor, then the targets before j.
    teacher_rows = torch.cat([anchors[:, None], targets[:, :-1]], dim=1)
    teacher_rows = torch.where(teacher_rows >= 0, teacher_rows, anchors[:, None]).reshape(-1)  # masked there
    slot = torch.arange(b - 1, device=anchors.device).repeat(anchors.shape[0])
    if shift.group is not None:
        ring = BlockContextRing(shift.group, document_index(cu_seqlens, device, features.shape[0]),
                                positions.to(device), anchors)
        start = None
    else:
        ring, (start, _) = None, document_bounds(cu_seqlens, device, features.shape[0])

    def score(hidden: torch.Tensor, norm: torch.nn.Module):
        if anchors.numel() == 0:
            # No block here (under CP its context may still serve the group's blocks): zero
            # sums on the graph of every parameter (the empty blocks' forward and the context's
            # attention reach them), so every rank's gradients have the same parameters.
            zero = norm(hidden).sum() * 0.0
            return [(zero.expand(b - 1), torch.zeros(b - 1, device=device), torch.zeros(b - 1, device=device))]
        rows = hidden[:, 1:].reshape(-1, hidden.shape[-1])
        return [checkpoint(_block_chunk, *chunk, norm, teacher_hidden, head_weight, b - 1,
                           use_reentrant=False, preserve_rng_state=False)
                for chunk in zip(rows.split(chunk_rows), teacher_rows.split(chunk_rows), mask.split(chunk_rows),
                                 slot.split(chunk_rows))]

    ctx = (anchors, anchors) if ring is not None else (start[anchors], anchors)  # the ring plans them under CP
    sums = drafter(features, positions, embeddings[anchors], positions[anchors], *ctx, score=score, ring=ring)
    ce_sum, correct, overlap = (torch.stack(parts).sum(0) for parts in zip(*sums))
    count = torch.zeros(b - 1, dtype=torch.int64, device=mask.device).index_add(0, slot, mask.long())
    return BlockStats(ce_sum, count, correct, overlap)
