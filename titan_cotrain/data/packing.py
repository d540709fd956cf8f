"""Packed rows: several documents laid end to end in one row of a ``[B, S]`` batch.

The model flattens a batch to ``T = B * S`` tokens and describes document boundaries
with ``cu_seqlens: int32 [n_docs + 1]`` over the flattened tokens (a row boundary is
always a document boundary). Positions restart at 0 at every document start; attention
never crosses a boundary (the rule itself lives in ``titan_cotrain.ops.attention``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = [
    "DocumentShift",
    "PackedLayout",
    "layout_from_cu_seqlens",
    "layout_from_document_ids",
    "layout_one_doc_per_row",
    "shift_in_document",
    "successor_rows",
    "take_rows",
]


@dataclass(frozen=True)
class PackedLayout:
    """``cu_seqlens: int32 [n_docs + 1]`` over the flattened ``B * S`` tokens and
    ``positions: int64 [B, S]``, each token's position inside its document."""

    cu_seqlens: torch.Tensor
    positions: torch.Tensor


def _positions_from_starts(starts: torch.Tensor) -> torch.Tensor:
    """``starts: bool [B, S]`` (True where a document begins) -> in-document positions."""
    b, s = starts.shape
    idx = torch.arange(s, device=starts.device).expand(b, s)
    last_start = torch.where(starts, idx, torch.zeros_like(idx)).cummax(dim=1).values
    return idx - last_start


def _layout_from_starts(starts: torch.Tensor) -> PackedLayout:
    starts = starts.clone()
    starts[:, 0] = True
    b, s = starts.shape
    flat_starts = starts.reshape(-1).nonzero().flatten()
    end = torch.tensor([b * s], device=starts.device)
    cu = torch.cat([flat_starts, end]).to(torch.int32)
    return PackedLayout(cu_seqlens=cu, positions=_positions_from_starts(starts))


def layout_one_doc_per_row(batch: int, seq_len: int, device: torch.device | str = "cpu") -> PackedLayout:
    starts = torch.zeros(batch, seq_len, dtype=torch.bool, device=device)
    return _layout_from_starts(starts)


def layout_from_document_ids(document_ids: torch.Tensor) -> PackedLayout:
    """``document_ids: int [B, S]``; a document is a maximal run of equal ids within a row.

    Ids need not be globally unique, but a document must be contiguous: the same id
    appearing in two separate runs of one row is rejected (it would silently split).
    """
    if document_ids.dim() != 2:
        raise ValueError(f"document_ids must be [B, S], got shape {tuple(document_ids.shape)}")
    starts = torch.ones_like(document_ids, dtype=torch.bool)
    starts[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
    n_runs = starts.sum(dim=1)
    n_ids = torch.tensor([row.unique().numel() for row in document_ids], device=document_ids.device)
    if bool((n_runs != n_ids).any()):
        raise ValueError("document_ids: a document id appears in two separate runs of a row; documents must be contiguous")
    return _layout_from_starts(starts)


def layout_from_cu_seqlens(cu_seqlens: torch.Tensor, batch: int, seq_len: int) -> PackedLayout:
    """``cu_seqlens`` over the flattened ``batch * seq_len`` tokens; every row start must be a boundary."""
    cu = cu_seqlens.to(torch.int64)
    total = batch * seq_len
    if cu.dim() != 1 or cu.numel() < 2 or int(cu[0]) != 0 or int(cu[-1]) != total:
        raise ValueError(f"cu_seqlens must be 1-D, start at 0 and end at B*S = {total}")
    if bool((cu[1:] < cu[:-1]).any()):
        raise ValueError("cu_seqlens must be non-decreasing")
    row_starts = torch.arange(0, total, seq_len, device=cu.device)
    if not bool(torch.isin(row_starts, cu).all()):
        raise ValueError("cu_seqlens: a document crosses a row boundary")
    starts = torch.zeros(total, dtype=torch.bool, device=cu.device)
    starts[cu[:-1][cu[:-1] < total]] = True
    return _layout_from_starts(starts.view(batch, seq_len))


def _doc_end(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """``[T]``: the flat index one past the end of each token's document."""
    cu = cu_seqlens.to(torch.int64)
    return torch.repeat_interleave(cu[1:], cu[1:] - cu[:-1], output_size=total)


def take_rows(x: torch.Tensor, rows: torch.Tensor, fill=0) -> torch.Tensor:
    """``out[t] = x[rows[t]]``, ``fill`` where ``rows[t] == -1``; ``x [N, ...]``, ``rows: int64 [T]``
    on ``x``'s device. Differentiable in ``x``."""
    picked = x[rows.clamp(min=0)]
    keep = (rows >= 0).view(-1, *([1] * (x.dim() - 1)))
    return torch.where(keep, picked, torch.full((), fill, dtype=x.dtype, device=x.device))


def successor_rows(cu_seqlens: torch.Tensor, d: int, total: int) -> torch.Tensor:
    """int64 ``[T]``: ``t + d`` while that is in ``t``'s document, else -1 (host)."""
    idx = torch.arange(total) + d
    return torch.where(idx < _doc_end(cu_seqlens.cpu(), total), idx, -1)


def shift_in_document(x: torch.Tensor, d: int, cu_seqlens: torch.Tensor, fill=0) -> torch.Tensor:
    """``out[t] = x[t + d]`` when ``t + d`` is in ``t``'s document, else ``fill``; ``x [T, ...]``.

    The draft's TTT shifts (inputs ``e(x_{i+d})``, teacher at ``i + d``) all follow this
    rule (``DocumentShift``); under context parallelism the tokens past a chunk edge come
    from a halo (``titan_cotrain.parallel.context_parallel.TTTHalo``).
    """
    return take_rows(x, successor_rows(cu_seqlens, d, x.shape[0]).to(x.device), fill)


class DocumentShift:
    """Where each token's ``width`` successors live, for the draft's TTT shifts over a packed
    batch that holds whole documents: ``rows: int64 [width, T]`` on ``device``,
    ``rows[d - 1, t]`` the row of ``x_{t+d}`` (``shift_in_document``'s), -1 past ``t``'s
    document.

    The TTT unroll reads ``x_{t+d}`` of several per-token tensors through this interface:
    ``extend(*xs)`` returns the tensors the rows index (here the tensors themselves) and
    ``shift(x, d)`` reads them. A context-parallel shard's ``TTTHalo``
    (``titan_cotrain.parallel.context_parallel``) has the same interface, its rows reaching
    into halo rows that ``extend`` fetches from the other ranks.
    """

    def __init__(self, cu_seqlens: torch.Tensor, width: int, device: torch.device | str | None = None) -> None:
        cu = torch.as_tensor(cu_seqlens)
        total = int(cu[-1])
        self.width = width
        self.rows = torch.stack([successor_rows(cu, d, total) for d in range(1, width + 1)]).to(device)
        # Each row's index in the whole batch (here: itself), and no group to exchange with:
        # a CP shard's TTTHalo has both.
        self.global_rows = torch.arange(total, device=device)
        self.group = None

    def extend(self, *xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The tensors ``rows`` index: the local ones, detached (the shifted inputs carry no gradient back)."""
        return tuple(x.detach() for x in xs)

    def shift(self, x: torch.Tensor, d: int, fill=0) -> torch.Tensor:
        """``x [T, ...]`` read at ``t + d`` inside ``t``'s document, ``fill`` elsewhere; ``1 <= d <= width``."""
        if not 1 <= d <= self.width:
            raise ValueError(f"the shift holds {self.width} successors per token; cannot shift by {d}")
        return take_rows(x, self.rows[d - 1].to(x.device), fill)
