"""Context parallelism (CP) over packed rows: applied to the models from outside, the zigzag
shard of a batch, its inverse, and the TTT halo.

Applying it (``apply_context_parallel``, called by ``parallel.parallelize``): every attention
module of the policy and the draft (``ops.VarlenAttention``, ``ops.BranchAttention``) is
hooked with the ``RingAttention`` parallel style, torch's ``parallelize_module`` way, and
our ring handlers join torch's CP dispatcher, which the update turns on around its
forward-backward (``parallel.cp_dispatch.cp_dispatch``): the hooked modules' inputs become
DTensors sharded on the token dimension, the dispatcher routes their attention op to the
ring, and the outputs come back as local tensors. The model code
never asks whether it runs sharded. ``prepare_cp_microbatch`` is the matching data side:
host rows in, this rank's shard of a ``Microbatch`` out, with the TTT halo as its shift.

Sharding (the picture is at the top of ``titan_cotrain.ops.ring_attention``). A CP group of
``W`` ranks splits every packed row ``[S]`` of a batch:

1. each document (true length ``n``) is padded *at its end* to ``m``, the next multiple
   of ``2W``, and the row is closed by a filler document up to ``row_len`` tokens (a
   multiple of ``2W``, at least the padded documents' total);
2. every document is cut in ``2W`` chunks of ``c = m / 2W`` tokens, and rank ``r`` keeps
   chunks ``r`` and ``2W-1-r`` of each, in document order: ``row_len / W`` local tokens.

Positions stay the global in-document ones (RoPE sees the unsharded sequence). Padding
sits after a document's real tokens, so under the causal mask no real query ever sees it,
and every loss mask is False on it: the real tokens' results are those of the unsharded
row. ``CPShard`` is one rank's share: ``cu_seqlens`` and ``positions`` for the model, and
``shard`` / ``shard_shifted`` / ``unshard`` for any per-token tensor (taps, labels, loss
masks, advantages, logits).

The TTT halo. Pass ``d`` of the draft reads ``e(x_{i+d})`` and scores against the teacher
at ``i + d`` (its mask against the loss region at ``i + d + 1``; docs/DESIGN.md section 3); for
the last tokens of a chunk those live in the next chunk of the document, on another rank
(or on this one: chunk ``W-1``'s successor is chunk ``W``; with chunks shorter than ``D``,
on several). For every local chunk, ``TTTHalo.extend`` fetches the ``D + 1`` positions
that follow it from wherever they live, for any number of per-token tensors at once (the
TTT unroll sends token ids, the policy's embeddings, the draft-vocabulary teacher, its
in-vocabulary flag and the loss region) as raw bytes in one ``all_to_all`` per step;
``TTTHalo.shift`` then reads ``x_{i+d}`` from the local rows or the halo, with the
single-device semantics of ``shift_in_document`` (``fill`` past a document's true end).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import ParallelStyle, parallelize_module

from titan_cotrain.cotrain.step import check_draft_loss_on
from titan_cotrain.data.batch import LabelRows, Microbatch, PackedBatch
from titan_cotrain.data.packing import layout_from_document_ids, take_rows
from titan_cotrain.ops import BranchAttention, VarlenAttention
from titan_cotrain.ops.ring_attention import chunks_per_document, local_chunks

__all__ = [
    "CPBatch",
    "CPShard",
    "RingAttention",
    "TTTHalo",
    "apply_context_parallel",
    "check_cp_degree",
    "init_cp_mesh",
    "plan_padded_rows",
    "prepare_cp_microbatch",
    "shard_batch_for_cp",
    "shard_packed_rows",
]


class RingAttention(ParallelStyle):
    """The parallel style of an attention module under CP (torch's ``_ContextParallel`` for
    our packed ops): a forward pre-hook makes ``q, k, v`` (the first three positional inputs,
    ``[T, H, Dh]``) DTensors ``Shard(0)`` and, for a ``BranchAttention``, ``branch_k, branch_v``
    (``[P, T, Hkv, Dh]``) ``Shard(1)`` on the 1-D CP mesh; ``cu_seqlens`` stays a plain host
    tensor. A forward hook hands the output back as the local tensor. In between, torch's CP
    dispatcher runs our handlers (``parallel.cp_dispatch``).

    torch's own ``_ContextParallel`` style wraps *every* tensor input as ``Shard(seq_dim)``:
    it would move the host ``cu_seqlens`` onto the mesh's device (a copy per layer, and a
    device-to-host read in the ring to plan its blocks) and label the branch's token
    dimension wrongly; this style is the same hooks with the placements our ops take.
    """

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        if device_mesh.ndim != 1:
            raise ValueError(f"the CP mesh must be 1-D, got a {device_mesh.ndim}-D mesh")
        placements = [Shard(0)] * 3 + ([Shard(1)] * 2 if isinstance(module, BranchAttention) else [])

        def shard_inputs(_module, args):
            sharded = [DTensor.from_local(x, device_mesh, [p], run_check=False) for x, p in zip(args, placements)]
            return (*sharded, *args[len(placements):])

        def local_output(_module, _args, out):
            return out.to_local()

        module.register_forward_pre_hook(shard_inputs)
        module.register_forward_hook(local_output)
        return module


def apply_context_parallel(cp_mesh, *models: nn.Module | None) -> None:
    """Context parallelism over the 1-D ``cp_mesh`` for ``models`` (the policy, the draft; None
    skipped): every ``VarlenAttention`` / ``BranchAttention`` inside gets the ``RingAttention``
    style and our ring handlers join torch's CP handler table. From then on these models take
    this rank's zigzag shard (``prepare_cp_microbatch``) in every packed forward, run inside
    ``parallel.cp_dispatch.cp_dispatch()`` (the update's forward-backward: torch's CP
    dispatcher is on for that block only); models left out (the KL reference, the rollout
    engine's copies) attend locally."""
    from titan_cotrain.parallel.cp_dispatch import register_cp_handlers

    register_cp_handlers()
    for model in models:
        if model is None:
            continue
        for module in model.modules():
            if isinstance(module, (VarlenAttention, BranchAttention)):
                parallelize_module(module, cp_mesh, RingAttention())


def cp_forward_scope():
    """The block a context-parallel model's forward-backward runs in (torch's CP dispatcher
    on, ``parallel.cp_dispatch.cp_dispatch``): ``ParallelModels.forward_scope`` and the
    pipeline's under CP."""
    from titan_cotrain.parallel.cp_dispatch import cp_dispatch

    return cp_dispatch()


def check_cp_degree(cp_degree: int, world_size: int) -> None:
    """A CP group of ``cp_degree`` ranks must tile the ``world_size`` ranks exactly."""
    if cp_degree < 1 or world_size % cp_degree:
        raise ValueError(
            f"context_parallel_degree = {cp_degree} does not divide the mesh of {world_size} ranks; "
            f"use a divisor of {world_size}"
        )


def init_cp_mesh(cp_degree: int, device_type: str | None = None):
    """The 1-D CP mesh of this rank: ranks ``[k W, (k+1) W)`` form a group (``("dp", "cp")`` mesh).

    For runs whose world mesh comes from torchtitan's ``ParallelDims``, use its ``"cp"``
    dimension instead.
    """
    from torch.distributed.device_mesh import init_device_mesh

    from titan_cotrain.components.titan import device_type as resolve_device_type

    world = dist.get_world_size()
    check_cp_degree(cp_degree, world)
    mesh = init_device_mesh(
        device_type or resolve_device_type(), (world // cp_degree, cp_degree), mesh_dim_names=("dp", "cp")
    )
    return mesh["cp"]


def plan_padded_rows(
    doc_lengths: Sequence[Sequence[int]], world: int, row_len: int | None = None, layout: str = "zigzag"
) -> tuple[list[list[int]], int]:
    """Padded document lengths per row and the CP row length.

    ``doc_lengths[b]``: the true lengths of row ``b``'s documents. Each is rounded up to a
    multiple of the chunk count (``2W`` zigzag, ``W`` contiguous). ``row_len`` (default: the
    longest padded row) must hold every row's padded documents; fixing it keeps shapes
    static from step to step.
    """
    n_chunks = chunks_per_document(layout, world)
    padded = [[math.ceil(n / n_chunks) * n_chunks for n in row] for row in doc_lengths]
    need = max((sum(row) for row in padded), default=0)
    if row_len is None:
        return padded, max(need, n_chunks)
    if row_len < 1 or row_len % n_chunks:
        raise ValueError(f"CP row_len = {row_len} must be a positive multiple of {n_chunks} ({layout}, W = {world})")
    for b, (row, prow) in enumerate(zip(doc_lengths, padded)):
        for n, m in zip(row, prow):
            if m > row_len:
                raise ValueError(
                    f"row {b}: a document of {n} tokens ({m} once padded to a multiple of {n_chunks}) is longer "
                    f"than the CP row of {row_len} tokens"
                )
        if sum(prow) > row_len:
            raise ValueError(
                f"row {b}: its documents {list(row)} need {sum(prow)} tokens once each is padded to a multiple of "
                f"{n_chunks}, more than the CP row of {row_len} tokens; pass a larger row_len or pack fewer documents"
            )
    return padded, row_len


def _group_of(group_or_mesh):
    """A ProcessGroup (or None) from a process group or a 1-D DeviceMesh."""
    if hasattr(group_or_mesh, "get_group"):
        if group_or_mesh.ndim != 1:
            raise ValueError(f"the CP mesh must be 1-D, got a {group_or_mesh.ndim}-D mesh")
        return group_or_mesh.get_group()
    return group_or_mesh


class CPShard:
    """One CP rank's share of a batch of packed rows (see the module docstring).

    For the model: ``cu_seqlens`` (int32, the local documents over the flattened
    ``B * local_len`` tokens; identical on every rank), ``positions`` (int64 ``[B,
    local_len]``, global in-document), ``valid`` (bool ``[B, local_len]``, False on
    padding), ``group`` and ``layout`` (for the ring). Build it with ``shard_packed_rows``;
    the constructor takes the plan (``plan_padded_rows``) and rank ``rank`` of ``world``.
    """

    def __init__(self, doc_lengths: list[list[int]], padded: list[list[int]], seq_len: int, row_len: int, *,
                 group, rank: int, world: int, layout: str = "zigzag", device: torch.device | str = "cpu") -> None:
        self.group, self.rank, self.world = group, rank, world
        self.layout, self.seq_len, self.row_len = layout, seq_len, row_len
        self.batch = len(doc_lengths)
        self.local_len = row_len // self.world
        self.device = device
        self._n_chunks = chunks_per_document(layout, self.world)
        self._chunks = [local_chunks(layout, r, self.world) for r in range(self.world)]
        self._n_slots = len(self._chunks[0])
        # Every local document (real ones, then one filler per row when there is room):
        # chunk length, true length, flat index of its first token in the unsharded batch.
        chunk, true_len, base = [], [], []
        for b, (row, prow) in enumerate(zip(doc_lengths, padded)):
            start = 0
            for n, m in zip(row, prow):
                chunk.append(m // self._n_chunks)
                true_len.append(n)
                base.append(b * seq_len + start)
                start += n
            if row_len > sum(prow):
                chunk.append((row_len - sum(prow)) // self._n_chunks)
                true_len.append(0)
                base.append(-1)
        self._chunk = torch.tensor(chunk, dtype=torch.int64)
        self._true_len = torch.tensor(true_len, dtype=torch.int64)
        self._base = torch.tensor(base, dtype=torch.int64)
        local_lengths = self._chunk * self._n_slots
        self._local_start = torch.cumsum(local_lengths, 0) - local_lengths
        cu = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(local_lengths, 0)])
        self.cu_seqlens = cu.to(torch.int32).to(device)
        self._halos: dict[tuple[int, torch.device], TTTHalo] = {}

        doc, slot, offset, pos = self._tokens(self.rank)
        self._doc, self._slot, self._offset, self._pos = doc, slot, offset, pos
        self.positions = pos.view(self.batch, self.local_len).to(device)
        self.valid = (pos < self._true_len[doc]).view(self.batch, self.local_len).to(device)

    # -- where every token lives -----------------------------------------------------------
    def _tokens(self, rank: int):
        """For rank ``rank``'s local tokens: document, slot, offset in the chunk, global position."""
        local_lengths = self._chunk * self._n_slots
        total = int(local_lengths.sum())
        doc = torch.repeat_interleave(torch.arange(len(self._chunk)), local_lengths, output_size=total)
        within = torch.arange(total) - self._local_start[doc]
        c = self._chunk[doc]
        slot, offset = within // c, within % c
        chunk_id = torch.tensor(self._chunks[rank], dtype=torch.int64)[slot]
        return doc, slot, offset, chunk_id * c + offset

    def _source(self, rank: int) -> torch.Tensor:
        """int64 ``[B * local_len]``: each of ``rank``'s local tokens as a flat index of the
        unsharded batch, -1 for padding."""
        doc, _, _, pos = self._tokens(rank) if rank != self.rank else (self._doc, None, None, self._pos)
        return torch.where(pos < self._true_len[doc], self._base[doc] + pos, -1)

    def _gather(self, x: torch.Tensor, source: torch.Tensor, fill) -> torch.Tensor:
        """``x [B, S, ...]`` read at ``source`` (flat, -1 = ``fill``) -> ``[B, local_len, ...]``."""
        if x.shape[:2] != (self.batch, self.seq_len):
            raise ValueError(f"expected [B, S, ...] = [{self.batch}, {self.seq_len}, ...], got {tuple(x.shape)}")
        source = source.to(x.device)
        flat = x.reshape(self.batch * self.seq_len, *x.shape[2:])
        picked = flat[source.clamp(min=0)]
        keep = (source >= 0).view(-1, *([1] * (x.dim() - 2)))
        out = torch.where(keep, picked, torch.full((), fill, dtype=x.dtype, device=x.device))
        return out.view(self.batch, self.local_len, *x.shape[2:])

    # -- per-token tensors -----------------------------------------------------------------
    def shard(self, x: torch.Tensor, fill=0) -> torch.Tensor:
        """This rank's tokens of ``x [B, S, ...]``: ``[B, local_len, ...]``, ``fill`` on padding.
        Differentiable (an index)."""
        return self._gather(x, self._source(self.rank), fill)

    def shard_shifted(self, x: torch.Tensor, d: int, fill=0) -> torch.Tensor:
        """``shard`` of ``x`` shifted by ``d`` inside documents: local token at position ``i``
        gets ``x`` at ``i + d`` of its document, ``fill`` past the document's (true) end. The
        shift happens before sharding, so it needs no communication (labels, loss masks)."""
        inside = self._pos + d < self._true_len[self._doc]
        return self._gather(x, torch.where(inside, self._base[self._doc] + self._pos + d, -1), fill)

    @torch.no_grad()
    def unshard(self, x: torch.Tensor) -> torch.Tensor:
        """Inverse of ``shard``: ``[B, local_len, ...]`` on every rank -> ``[B, S, ...]`` on
        every rank (one all_gather; padding dropped; not differentiable)."""
        if x.shape[:2] != (self.batch, self.local_len):
            raise ValueError(
                f"expected [B, local_len, ...] = [{self.batch}, {self.local_len}, ...], got {tuple(x.shape)}"
            )
        x = x.contiguous()
        parts = [x] if self.world == 1 else [torch.empty_like(x) for _ in range(self.world)]
        if self.world > 1:
            dist.all_gather(parts, x, group=self.group)
        out = x.new_zeros(self.batch * self.seq_len, *x.shape[2:])
        for rank, part in enumerate(parts):
            source = self._source(rank).to(x.device)
            keep = source >= 0
            out[source[keep]] = part.reshape(-1, *x.shape[2:])[keep]
        return out.view(self.batch, self.seq_len, *x.shape[2:])

    def ttt_halo(self, ttt_steps: int, device: torch.device | str | None = None) -> TTTHalo:
        """The halo of a ``ttt_steps``-pass TTT unroll (``D + 1`` positions per chunk edge:
        pass ``d`` reads inputs at ``i + d`` and loss masks at ``i + d + 1``), its rows on
        ``device`` (default: the shard's). Cached."""
        device = torch.device(device if device is not None else self.device)
        if (ttt_steps, device) not in self._halos:
            self._halos[ttt_steps, device] = TTTHalo(self, ttt_steps + 1, device)
        return self._halos[ttt_steps, device]


class TTTHalo:
    """The ``width`` positions after the end of every local chunk, from wherever they live.

    An *extended* tensor is a local ``[T, ...]`` tensor (``T = B * local_len``) followed
    by its halo rows, ``[T + n_halo, ...]``: ``extend`` builds them, ``shift`` reads them,
    through ``rows: int64 [width, T]`` (on ``device``; ``rows[d - 1, t]`` the extended row of
    ``x_{t+d}``, -1 past ``t``'s document). The interface of the single-device
    ``titan_cotrain.data.packing.DocumentShift``, which the TTT unroll takes either of.
    """

    def __init__(self, shard: CPShard, width: int, device: torch.device | str | None = None) -> None:
        self.shard, self.width = shard, width
        s = shard
        n_local = s.batch * s.local_len
        owner, owner_row, wanted = zip(*(self._requests(rank) for rank in range(s.world)))
        me = s.rank
        # What this rank sends to rank o: its own rows that o's halo wants, in o's halo order.
        self._send = [owner_row[o][wanted[o] & (owner[o] == me)] for o in range(s.world)]
        # Where the rows received from rank o go in this rank's halo.
        halo_rows = torch.arange(owner[me].numel())
        self._recv = [halo_rows[wanted[me] & (owner[me] == o)] for o in range(s.world)]
        self.n_halo = owner[me].numel()
        # rows[d - 1, t]: the extended row holding x_{t+d}: in t's chunk, or in the halo that
        # follows it (its first row: n_local + (doc * n_slots + slot) * width); -1 past the
        # document's true end.
        chunk_len, offset = s._chunk[s._doc], s._offset
        halo_base = n_local + (s._doc * s._n_slots + s._slot) * width
        room = s._true_len[s._doc] - s._pos
        rows = []
        for d in range(1, width + 1):
            index = torch.where(offset + d < chunk_len, torch.arange(n_local) + d, halo_base + offset + d - chunk_len)
            rows.append(torch.where(d < room, index, -1))
        self.rows = torch.stack(rows).to(device)
        # Each local row's index in the unsharded batch (-1 on padding), and the group the
        # block drafter's anchors and context are exchanged over (None at W = 1).
        self.global_rows = s._source(s.rank).to(device)
        self.group = s.group if s.world > 1 else None

    def _requests(self, rank: int):
        """``rank``'s halo rows (document, slot, 0..width-1): owner rank, row on the owner,
        and whether the position is a real token (inside the document's true length)."""
        s = self.shard
        n_docs = len(s._chunk)
        doc = torch.arange(n_docs).repeat_interleave(s._n_slots * self.width)
        slot = torch.arange(s._n_slots).repeat_interleave(self.width).repeat(n_docs)
        j = torch.arange(self.width).repeat(n_docs * s._n_slots)
        c = s._chunk[doc]
        chunk_id = torch.tensor(s._chunks[rank], dtype=torch.int64)[slot]
        pos = (chunk_id + 1) * c + j
        wanted = pos < s._true_len[doc]
        owner_chunk = torch.where(wanted, pos // c.clamp(min=1), 0)
        owner_of = torch.empty(s._n_chunks, dtype=torch.int64)
        slot_of = torch.empty(s._n_chunks, dtype=torch.int64)
        for r, chunks in enumerate(s._chunks):
            for k, chunk in enumerate(chunks):
                owner_of[chunk], slot_of[chunk] = r, k
        owner_row = s._local_start[doc] + slot_of[owner_chunk] * c + pos % c.clamp(min=1)
        return owner_of[owner_chunk], owner_row, wanted

    @torch.no_grad()
    def extend(self, *xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Extend local tensors ``[T, ...]`` (any dtypes) with their halo rows, all in one
        ``all_to_all`` of raw bytes. Positions past a document's end arrive as zeros. The
        halo carries data, not gradients: the inputs are detached."""
        n_local = self.shard.batch * self.shard.local_len
        for x in xs:
            if x.shape[0] != n_local:
                raise ValueError(f"halo exchange expects local [T = {n_local}, ...] tensors, got {tuple(x.shape)}")
        as_bytes = [x.detach().reshape(n_local, -1).contiguous().view(torch.uint8) for x in xs]
        packed = torch.cat(as_bytes, dim=1)
        device = packed.device
        send = packed[torch.cat(self._send).to(device)]
        received = torch.empty(sum(r.numel() for r in self._recv), packed.shape[1], dtype=torch.uint8, device=device)
        if self.shard.world > 1:
            dist.all_to_all_single(
                received, send, [r.numel() for r in self._recv], [s.numel() for s in self._send],
                group=self.shard.group,
            )
        else:
            received = send
        halo = packed.new_zeros(self.n_halo, packed.shape[1])
        halo[torch.cat(self._recv).to(device)] = received
        out, col = [], 0
        for x, b in zip(xs, as_bytes):
            halo_x = halo[:, col : col + b.shape[1]].contiguous().view(x.dtype).view(self.n_halo, *x.shape[1:])
            out.append(torch.cat([x.detach(), halo_x]))
            col += b.shape[1]
        return tuple(out)

    def shift(self, x: torch.Tensor, d: int, fill=0) -> torch.Tensor:
        """``out[t] = x[t + d]`` in ``t``'s document, else ``fill``: ``shift_in_document`` for
        an extended ``x [T + n_halo, ...]``; returns ``[T, ...]``. ``1 <= d <= width``."""
        if not 1 <= d <= self.width:
            raise ValueError(f"the halo holds {self.width} positions per chunk edge; cannot shift by {d}")
        return take_rows(x, self.rows[d - 1].to(x.device), fill)


def shard_packed_rows(
    document_ids: torch.Tensor, group=None, *, row_len: int | None = None, layout: str = "zigzag"
) -> CPShard:
    """This rank's ``CPShard`` of packed rows ``document_ids [B, S]`` (documents are maximal
    runs of equal ids) over the CP ``group`` (a ProcessGroup or a 1-D DeviceMesh; None: the
    default group, or no CP without an initialised process group). See ``plan_padded_rows``
    for ``row_len``. Every rank of the group must hold the same batch."""
    group = _group_of(group)
    single = group is None and not dist.is_initialized()
    rank, world = (0, 1) if single else (dist.get_rank(group), dist.get_world_size(group))
    b, s = document_ids.shape
    cu = layout_from_document_ids(document_ids).cu_seqlens.to(torch.int64).cpu()
    ends = [[int(e) - row * s for e in cu[1:] if row * s < int(e) <= (row + 1) * s] for row in range(b)]
    doc_lengths = [[e - p for p, e in zip([0, *row_ends[:-1]], row_ends)] for row_ends in ends]
    padded, row_len = plan_padded_rows(doc_lengths, world, row_len, layout)
    return CPShard(doc_lengths, padded, s, row_len, group=group, rank=rank, world=world, layout=layout,
                   device=document_ids.device)


@dataclass(kw_only=True)
class CPBatch(LabelRows):
    """One CP rank's share of a ``PackedBatch``, every field ``[B, local_len]``.

    ``tokens`` (the model input) and ``loss_mask`` (False on padding) are token-aligned.
    The ``next_*`` fields (``LabelRows``') are label-aligned, shifted by one inside each document *before*
    sharding, so a next-token loss at local token ``i`` needs no communication:
    ``next_tokens`` (token ``i + 1``, 0 past the document's end), ``next_token_mask``
    (token ``i + 1`` exists and is in the loss mask), and the batch's ``advantages``,
    ``old_logprobs``, ``ref_logprobs``, ``inv_lens``, ``seq_logratios`` at ``i + 1`` (None
    when the batch has none). These
    replace the ``[:, 1:]`` / ``[:, :-1]`` slicing of the unsharded losses.
    """

    tokens: torch.Tensor
    loss_mask: torch.Tensor


def shard_batch_for_cp(batch, group=None, *, row_len: int | None = None) -> tuple[CPBatch, CPShard]:
    """Zigzag-shard a ``PackedBatch`` (``[B, S]`` fields, the same on every rank of the CP
    ``group``) for this rank. With CP applied to the models (``apply_context_parallel``), run
    the policy as ``policy(cp_batch.tokens, cu_seqlens=shard.cu_seqlens,
    positions=shard.positions, return_taps=True)`` and the draft as ``ttt_unroll(...,
    shift=shard.ttt_halo(D))`` with ``positions=shard.positions``, ``cu_seqlens=shard.cu_seqlens``
    and the local outputs; normalise losses by counts summed over the CP (x data-parallel)
    group. ``prepare_cp_microbatch`` does all of this for the co-training step."""
    shard = shard_packed_rows(batch.document_ids, group, row_len=row_len)

    def next_of(x):
        return None if x is None else shard.shard_shifted(x, 1)

    cp_batch = CPBatch(
        tokens=shard.shard(batch.tokens),
        loss_mask=shard.shard(batch.loss_mask, fill=False),
        next_tokens=shard.shard_shifted(batch.tokens, 1),
        next_token_mask=shard.shard_shifted(batch.loss_mask, 1, fill=False),
        next_advantages=next_of(getattr(batch, "advantages", None)),
        next_old_logprobs=next_of(getattr(batch, "old_logprobs", None)),
        next_ref_logprobs=next_of(getattr(batch, "ref_logprobs", None)),
        next_inv_lens=next_of(getattr(batch, "inv_lens", None)),
        next_seq_logratios=next_of(getattr(batch, "seq_logratios", None)),
    )
    return cp_batch, shard


def prepare_cp_microbatch(batch: PackedBatch, device, *, ttt_steps: int, draft_loss_on: str = "response",
                          group=None, row_len: int | None = None) -> Microbatch:
    """``cotrain.step.prepare_microbatch`` for a model under CP: host rows ``batch`` (the
    same on every rank of the CP ``group``, a ProcessGroup or 1-D mesh) zigzag-sharded for
    this rank (padded to ``row_len``, see ``plan_padded_rows``), the model inputs moved to
    ``device``, and the shard's ``TTTHalo`` as the microbatch's ``shift``. ``parallelize``
    hands the trainer this function with ``group`` and ``row_len`` bound."""
    check_draft_loss_on(draft_loss_on)
    labels, shard = shard_batch_for_cp(batch, group, row_len=row_len)
    region = labels.loss_mask if draft_loss_on == "response" else shard.valid
    labels = dataclasses.replace(labels, **{f.name: getattr(labels, f.name).to(device)
                                            for f in dataclasses.fields(labels) if getattr(labels, f.name) is not None})
    return Microbatch(labels, labels.tokens, shard.positions.to(device), region.to(device), shard.cu_seqlens,
                      shard.ttt_halo(ttt_steps, device))
