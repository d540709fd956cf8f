"""Ring attention: document-causal attention over packed tokens sharded across a CP group.

The zigzag layout (``titan_cotrain.parallel.context_parallel`` builds it). Every document
of a packed row is padded at its end to a multiple of ``2W`` tokens (``W`` = CP size) and
cut into ``2W`` equal chunks; CP rank ``r`` holds chunks ``r`` and ``2W-1-r`` of *every*
document, in document order. For ``W = 2``, a document A of 8 tokens and B of 4::

                      chunk 0   chunk 1   chunk 2   chunk 3
    global       A:   a0 a1  |  a2 a3  |  a4 a5  |  a6 a7        B:  b0 | b1 | b2 | b3
    rank 0 holds      a0 a1                         a6 a7  ,          b0             b3
    rank 1 holds                a2 a3     a4 a5            ,               b1   b2

    local tokens  rank 0: [a0 a1 a6 a7 | b0 b3]   rank 1: [a2 a3 a4 a5 | b1 b2]
    local cu_seqlens (both ranks): [0, 4, 6]

A rank's local document is its two chunks side by side, so every rank has the same local
``cu_seqlens``, and a K/V shard arriving from another rank is laid out like the local one.

The ring. K/V travel one hop per step (rank ``r`` sends to ``r+1`` and receives from
``r-1``), the next hop posted before the current step's compute so the two overlap. At
step ``i`` rank ``r`` holds the K/V of rank ``s = r - i``; query chunk ``a`` meets key
chunk ``b`` of the same document as::

    b == a   causal   (step 0 only: causal attention over the local [chunk r | chunk 2W-1-r]
                       is exactly right, since chunk r < chunk 2W-1-r)
    b <  a   full
    b >  a   skip

    s < r:   all local queries  x  the first chunk of s's K/V        (2c x c per document)
    s > r:   the local 2nd chunk  x  all of s's K/V                  (c x 2c per document)

so after step 0 every rank does ``2 c^2`` query-key pairs per document of chunk ``c`` at
every step: the load balance. Partial attentions merge in fp32 with ``merge_attention``.

Backward recomputes each block's scores. Handed the *merged* ``(out, lse)``, every block's
share of dQ/dK/dV is exact (see ``trunk_backward``). dQ stays home; dK/dV accumulate (fp32)
in a buffer that travels the ring behind the K/V and, after ``W`` hops, reaches its owner.

The draft's branch attention (``branch_attention``) is rank-local: anchor ``t``'s branch
keys live where ``t`` lives. It is merged into the ring's ``(out, lse)`` before the first
step and differentiated against the same merged ``(out, lse)``; it never communicates.

The ``contiguous`` layout (rank ``r`` holds chunk ``r`` of ``W``) uses the same rule; it
is unbalanced (rank ``W-1`` does ``W`` times the work of rank 0) and exists for torch's CP
with load balancing turned off and as the benchmark's baseline.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
import torch.distributed as dist

from titan_cotrain.ops.attention import (
    _expand_kv,
    _reduce_kv_grad,
    _use_cpu_flash_kernel,
    check_packed,
    lse_dtype,
    merge_attention,
    trunk_backward,
    trunk_forward,
)
from titan_cotrain.ops.branch_attention import branch_backward, branch_forward

__all__ = [
    "LAYOUTS",
    "RingComm",
    "chunks_per_document",
    "local_chunks",
    "ring_attention",
    "ring_backward",
    "ring_branch_attention",
    "ring_forward",
]

LAYOUTS = ("zigzag", "contiguous")

_KV_TAG, _DKV_TAG = 0, 1


def chunks_per_document(layout: str, world: int) -> int:
    """How many chunks every document is cut into: ``2W`` (zigzag) or ``W`` (contiguous)."""
    if layout not in LAYOUTS:
        raise ValueError(f"unknown CP layout {layout!r}; expected one of {LAYOUTS}")
    return 2 * world if layout == "zigzag" else world


def local_chunks(layout: str, rank: int, world: int) -> tuple[int, ...]:
    """The chunk ids of every document that ``rank`` holds, in local (ascending) order."""
    chunks_per_document(layout, world)
    return (rank, 2 * world - 1 - rank) if layout == "zigzag" else (rank,)


class _InFlight:
    """A posted send/receive pair; ``wait()`` returns the received tensor."""

    def __init__(self, works: list, sent: torch.Tensor, received: torch.Tensor) -> None:
        self._works, self._sent, self.received = works, sent, received

    def wait(self) -> torch.Tensor:
        for work in self._works:
            work.wait()
        self._sent = None  # the send buffer may be freed only once the send completed
        return self.received


class RingComm:
    """Neighbour exchange on a process group: send to ``rank + 1``, receive from ``rank - 1``.

    ``group`` is the CP process group (None: the default group; a single rank needs no
    initialised process group). ``send_recv`` is asynchronous; with one rank it returns
    the tensor itself.
    """

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        self.group = group
        single = group is None and not dist.is_initialized()
        self.rank = 0 if single else dist.get_rank(group)
        self.world = 1 if single else dist.get_world_size(group)

    def send_recv(self, tensor: torch.Tensor, tag: int) -> _InFlight:
        tensor = tensor.contiguous()
        if self.world == 1:
            return _InFlight([], tensor, tensor)
        received = torch.empty_like(tensor)
        ops = [
            dist.P2POp(dist.isend, tensor, group=self.group, group_peer=(self.rank + 1) % self.world, tag=tag),
            dist.P2POp(dist.irecv, received, group=self.group, group_peer=(self.rank - 1) % self.world, tag=tag),
        ]
        return _InFlight(dist.batch_isend_irecv(ops), tensor, received)


@dataclass(frozen=True)
class _Block:
    """One attention call of a ring step: local query rows x the held K/V rows (None: all
    rows), each with the ``cu_seqlens`` of its rows, causal or full within a document."""

    q_rows: torch.Tensor | None
    cu_q: torch.Tensor
    kv_rows: torch.Tensor | None
    cu_kv: torch.Tensor
    causal: bool


class _LocalDocs:
    """The local documents, each ``n_slots`` equal chunks side by side (``c`` tokens each)."""

    def __init__(self, cu_seqlens: torch.Tensor, n_slots: int) -> None:
        cu = cu_seqlens.tolist()
        lengths = [e - s for s, e in zip(cu[:-1], cu[1:])]
        if cu[0] != 0 or any(n < 0 or n % n_slots for n in lengths):
            raise ValueError(
                f"local cu_seqlens {cu} must rise from 0 in documents whose lengths are multiples of "
                f"{n_slots} (each local document is this rank's {n_slots} chunk(s) of one document)"
            )
        self.cu = cu_seqlens.to(torch.int32)
        self.starts, self.chunk = cu[:-1], [n // n_slots for n in lengths]
        self._rows: dict[tuple[int, int], tuple[torch.Tensor | None, torch.Tensor]] = {}

    def rows(self, lo: int, hi: int, n_slots: int) -> tuple[torch.Tensor | None, torch.Tensor]:
        """Rows of slots ``lo..hi-1`` of every document (None when that is all rows) and their cu_seqlens."""
        if (lo, hi) not in self._rows:
            if lo == 0 and hi == n_slots:
                self._rows[lo, hi] = (None, self.cu)
            else:
                index = [torch.arange(s + lo * c, s + hi * c) for s, c in zip(self.starts, self.chunk)]
                lengths = torch.tensor([(hi - lo) * c for c in self.chunk], dtype=torch.int32)
                cu = torch.cat([torch.zeros(1, dtype=torch.int32), lengths.cumsum(0, dtype=torch.int32)])
                device = self.cu.device
                self._rows[lo, hi] = (torch.cat(index).to(device), cu.to(device))
        return self._rows[lo, hi]

    def blocks(self, layout: str, world: int, rank: int, source: int, causal: bool) -> list[_Block]:
        """The attention calls of rank ``rank`` against the K/V of rank ``source``."""
        if source == rank or not causal:
            return [_Block(None, self.cu, None, self.cu, causal and source == rank)]
        q_chunks, kv_chunks = local_chunks(layout, rank, world), local_chunks(layout, source, world)
        n_slots = len(q_chunks)
        # Query slot a sees the key slots with a smaller chunk id: a prefix of the key
        # slots, non-decreasing in a, so equal prefixes group into one call.
        visible = [sum(b < a for b in kv_chunks) for a in q_chunks]
        blocks = []
        for n_visible, slots in itertools.groupby(range(n_slots), key=visible.__getitem__):
            slots = list(slots)
            if n_visible:
                q_rows, cu_q = self.rows(slots[0], slots[-1] + 1, n_slots)
                kv_rows, cu_kv = self.rows(0, n_visible, n_slots)
                blocks.append(_Block(q_rows, cu_q, kv_rows, cu_kv, causal=False))
        return blocks


def _rows(x: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
    return x if rows is None else x.index_select(0, rows)


def _doc_pairs(cu_q: torch.Tensor, cu_kv: torch.Tensor):
    """``(q_start, q_end, kv_start, kv_end)`` of every document with queries and keys."""
    cq, ck = cu_q.tolist(), cu_kv.tolist()
    for qs, qe, ks, ke in zip(cq[:-1], cq[1:], ck[:-1], ck[1:]):
        if qe > qs and ke > ks:
            yield qs, qe, ks, ke


def _bhsd(x: torch.Tensor) -> torch.Tensor:
    return x.transpose(0, 1).unsqueeze(0)


def _full_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, cu_kv: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every query of document ``i`` (rows ``cu_q[i]:cu_q[i+1]``) attends to *all* keys of
    document ``i`` (rows ``cu_kv[i]:cu_kv[i+1]``). Returns ``out`` (q's dtype) and fp32 ``lse``."""
    n_rep = q.shape[1] // k.shape[1]
    acc = lse_dtype(q.dtype)
    out = torch.zeros_like(q)
    lse = torch.full(q.shape[:2], float("-inf"), dtype=acc, device=q.device)
    for qs, qe, ks, ke in _doc_pairs(cu_q, cu_kv):
        qd, kd, vd = q[qs:qe], _expand_kv(k[ks:ke], n_rep), _expand_kv(v[ks:ke], n_rep)
        if _use_cpu_flash_kernel(q):
            o, l = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                _bhsd(qd), _bhsd(kd), _bhsd(vd), 0.0, False, scale=scale
            )
            out[qs:qe], lse[qs:qe] = o[0].transpose(0, 1), l[0].transpose(0, 1)
        else:
            s = torch.einsum("qhd,khd->hqk", qd.to(acc), kd.to(acc)) * scale
            l = torch.logsumexp(s, dim=-1)
            out[qs:qe] = torch.einsum("hqk,khd->qhd", torch.exp(s - l.unsqueeze(-1)), vd.to(acc)).to(q.dtype)
            lse[qs:qe] = l.transpose(0, 1)
    return out, lse


def _full_backward(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    cu_q: torch.Tensor,
    cu_kv: torch.Tensor,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The share of ``_full_forward``'s keys in the gradient of an attention whose final
    (merged) output and log-sum-exp are ``out``, ``lse``; like ``trunk_backward``."""
    n_rep = q.shape[1] // k.shape[1]
    acc = lse_dtype(q.dtype)
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for qs, qe, ks, ke in _doc_pairs(cu_q, cu_kv):
        qd, kd, vd = q[qs:qe], _expand_kv(k[ks:ke], n_rep), _expand_kv(v[ks:ke], n_rep)
        if _use_cpu_flash_kernel(q):
            gq, gk, gv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                _bhsd(grad_out[qs:qe]),
                _bhsd(qd),
                _bhsd(kd),
                _bhsd(vd),
                _bhsd(out[qs:qe]),
                lse[qs:qe].transpose(0, 1).unsqueeze(0).to(acc).contiguous(),
                0.0,
                False,
                scale=scale,
            )
            gq, gk, gv = (g[0].transpose(0, 1) for g in (gq, gk, gv))
        else:
            s = torch.einsum("qhd,khd->hqk", qd.to(acc), kd.to(acc)) * scale
            p = torch.exp(s - lse[qs:qe].to(acc).transpose(0, 1).unsqueeze(-1))
            go = grad_out[qs:qe].to(acc)
            delta = (go * out[qs:qe].to(acc)).sum(-1).transpose(0, 1)
            ds = p * (torch.einsum("qhd,khd->hqk", go, vd.to(acc)) - delta.unsqueeze(-1)) * scale
            gq = torch.einsum("hqk,khd->qhd", ds, kd.to(acc))
            gk = torch.einsum("hqk,qhd->khd", ds, qd.to(acc))
            gv = torch.einsum("hqk,qhd->khd", p, go)
        dq[qs:qe] = gq.to(q.dtype)
        dk[ks:ke] = _reduce_kv_grad(gk, n_rep).to(k.dtype)
        dv[ks:ke] = _reduce_kv_grad(gv, n_rep).to(v.dtype)
    return dq, dk, dv


def _merge_rows(out, lse, rows, block_out, block_lse):
    """Merge a block's partial attention into the running fp32 ``(out, lse)`` at ``rows``."""
    if rows is None:
        return merge_attention(out, lse, block_out, block_lse)
    merged_out, merged_lse = merge_attention(out[rows], lse[rows], block_out, block_lse)
    return out.index_copy(0, rows, merged_out), lse.index_copy(0, rows, merged_lse)


def ring_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    scale: float,
    comm: RingComm,
    *,
    layout: str = "zigzag",
    causal: bool = True,
    initial: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward kernel. ``q [T, Hq, Dh]``, ``k, v [T, Hkv, Dh]``: this rank's shard in
    ``layout``; ``cu_seqlens: int32`` the local documents (the same on every rank).

    Returns ``out [T, Hq, Dh]`` (q's dtype) and ``lse [T, Hq]`` (fp32; fp64 for fp64) of
    every local query over all keys of its document on all ranks (``causal=False``: the
    whole document, not only the keys before the query). ``initial``, a partial
    ``(out, lse)`` over other keys of the same queries (the branch), is merged in.
    """
    check_packed(q, k, v, cu_seqlens)
    world, rank = comm.world, comm.rank
    docs = _LocalDocs(cu_seqlens, len(local_chunks(layout, rank, world)))
    acc = lse_dtype(q.dtype)
    if initial is None:
        out = torch.zeros(q.shape, dtype=acc, device=q.device)
        lse = torch.full(q.shape[:2], float("-inf"), dtype=acc, device=q.device)
    else:
        out, lse = initial[0].to(acc), initial[1].to(acc)
    kv = torch.stack([k, v])
    for step in range(world):
        incoming = comm.send_recv(kv, _KV_TAG) if step + 1 < world else None
        for block in docs.blocks(layout, world, rank, (rank - step) % world, causal):
            qb, kb, vb = _rows(q, block.q_rows), _rows(kv[0], block.kv_rows), _rows(kv[1], block.kv_rows)
            if block.causal:
                block_out, block_lse = trunk_forward(qb, kb, vb, block.cu_q, scale)
            else:
                block_out, block_lse = _full_forward(qb, kb, vb, block.cu_q, block.cu_kv, scale)
            out, lse = _merge_rows(out, lse, block.q_rows, block_out, block_lse)
        if incoming is not None:
            kv = incoming.wait()
    return out.to(q.dtype), lse


def ring_backward(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    cu_seqlens: torch.Tensor,
    scale: float,
    comm: RingComm,
    *,
    layout: str = "zigzag",
    causal: bool = True,
    grad_lse: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Backward kernel: ``(dq, dk, dv)`` of this rank's shard, shaped like ``q, k, v``.

    ``out``, ``lse`` are the final (merged) forward results of the local queries, so the
    gradient is that of the whole attention they belong to (ring, plus a branch if any).
    dK/dV of every rank's keys collect contributions from all ranks on their way around
    the ring and come home after ``W`` hops. ``grad_lse [T, Hq]``, a gradient reaching the
    merged ``lse``, is folded in with one extra head-dim column (q, k: 0; v: 1; out: 0;
    grad_out: grad_lse), which turns every block's ``dS / P = dO V^T - delta`` into
    ``dO V^T + grad_lse - delta``, as in ``branch_attention``.
    """
    if grad_lse is not None:
        pad = torch.nn.functional.pad
        dq, dk, dv = ring_backward(
            torch.cat([grad_out, grad_lse.unsqueeze(-1).to(grad_out.dtype)], dim=-1),
            pad(q, (0, 1)), pad(k, (0, 1)), pad(v, (0, 1), value=1.0), pad(out, (0, 1)),
            lse, cu_seqlens, scale, comm, layout=layout, causal=causal,
        )
        return dq[..., :-1], dk[..., :-1], dv[..., :-1]
    world, rank = comm.world, comm.rank
    docs = _LocalDocs(cu_seqlens, len(local_chunks(layout, rank, world)))
    acc = lse_dtype(q.dtype)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    kv = torch.stack([k, v])
    dkv_in_flight = None
    for step in range(world):
        incoming = comm.send_recv(kv, _KV_TAG) if step + 1 < world else None
        dkv = torch.zeros(kv.shape, dtype=acc, device=kv.device)
        for block in docs.blocks(layout, world, rank, (rank - step) % world, causal):
            args = [_rows(x, block.q_rows) for x in (grad_out, q)]
            args += [_rows(kv[0], block.kv_rows), _rows(kv[1], block.kv_rows)]
            args += [_rows(x, block.q_rows) for x in (out, lse)]
            if block.causal:
                gq, gk, gv = trunk_backward(*args, block.cu_q, scale)
            else:
                gq, gk, gv = _full_backward(*args, block.cu_q, block.cu_kv, scale)
            dq = dq + gq if block.q_rows is None else dq.index_add(0, block.q_rows, gq.to(acc))
            gkv = torch.stack([gk, gv]).to(acc)
            dkv = dkv + gkv if block.kv_rows is None else dkv.index_add(1, block.kv_rows, gkv)
        if dkv_in_flight is not None:
            dkv = dkv + dkv_in_flight.wait()
        dkv_in_flight = comm.send_recv(dkv, _DKV_TAG)
        if incoming is not None:
            kv = incoming.wait()
    dkv = dkv_in_flight.wait()
    return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, branch_k, branch_v, cu_seqlens, scale, comm, layout):
        initial = None if branch_k is None else branch_forward(q, branch_k, branch_v, scale)
        out, lse = ring_forward(q, k, v, cu_seqlens, scale, comm, layout=layout, initial=initial)
        ctx.save_for_backward(q, k, v, branch_k, branch_v, cu_seqlens, out, lse)
        ctx.scale, ctx.comm, ctx.layout = scale, comm, layout
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, branch_k, branch_v, cu_seqlens, out, lse = ctx.saved_tensors
        grad_out = grad_out.contiguous()
        dq, dk, dv = ring_backward(grad_out, q, k, v, out, lse, cu_seqlens, ctx.scale, ctx.comm, layout=ctx.layout)
        dbranch_k = dbranch_v = None
        if branch_k is not None:
            dq_branch, dbranch_k, dbranch_v = branch_backward(grad_out, q, branch_k, branch_v, out, lse, ctx.scale)
            dq = dq + dq_branch
        return dq, dk, dv, dbranch_k, dbranch_v, None, None, None, None


def _comm(group) -> RingComm:
    return group if isinstance(group, RingComm) else RingComm(group)


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    group: dist.ProcessGroup | RingComm | None = None,
    scale: float | None = None,
    *,
    layout: str = "zigzag",
) -> torch.Tensor:
    """Differentiable document-causal attention of a CP shard: ``varlen_causal_attention``
    for tokens spread over the ranks of ``group`` in ``layout``.

    ``q [T, Hq, Dh]``, ``k, v [T, Hkv, Dh]`` and ``cu_seqlens`` (the local documents) are
    this rank's local tensors; returns this rank's ``out [T, Hq, Dh]``. Every rank of the
    group must call it (forward and backward are collective).
    """
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    return _RingAttention.apply(q, k, v, None, None, cu_seqlens.to(torch.int32), scale, _comm(group), layout)


def ring_branch_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    branch_k: torch.Tensor,
    branch_v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    group: dist.ProcessGroup | RingComm | None = None,
    scale: float | None = None,
    *,
    layout: str = "zigzag",
) -> torch.Tensor:
    """``branch_attention`` of a CP shard: the trunk over the ring, the branch
    ``branch_k, branch_v [P, T, Hkv, Dh]`` (the local anchors' own keys) rank-local,
    merged by log-sum-exp. Local tensors in, this rank's ``out [T, Hq, Dh]`` out."""
    if branch_k.dim() != 4 or branch_k.shape != branch_v.shape or branch_k.shape[1:] != k.shape:
        raise ValueError(
            f"branch_k{tuple(branch_k.shape)} and branch_v{tuple(branch_v.shape)} must both be "
            f"[P, T, Hkv, Dh] with [T, Hkv, Dh] = k's shape {tuple(k.shape)}"
        )
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    return _RingAttention.apply(
        q, k, v, branch_k, branch_v, cu_seqlens.to(torch.int32), scale, _comm(group), layout
    )
