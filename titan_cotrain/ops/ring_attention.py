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

Pieces. A whole shard in flight would double the K/V a rank holds (in backward, K/V plus the
travelling dK/dV), so every hop is cut into ``pieces`` messages and the ring runs piece by
piece: piece ``j`` makes all ``W`` hops, each rank computing on it and passing it on, before
piece ``j + 1`` starts, and while a rank computes on piece ``j`` at step ``i`` the piece of step
``i + 1`` is on its way. In flight are then two pieces of K/V (in backward also about three of
dK/dV), not two shards. A piece holds the same offsets of the first and of the second chunk of
each document it spans; for one local document of chunk ``c = 4`` and two pieces::

    local rows   [x0 x1 x2 x3 | y0 y1 y2 y3]      piece 0: x0 x1 y0 y1    piece 1: x2 x3 y2 y3

so a step costs every rank the same on every piece of ``p`` offsets: against an earlier rank's
piece, all ``2c`` local queries meet its ``p`` first-chunk keys; against a later rank's, the
``c`` second-chunk queries meet all ``2p`` of its keys. Query rows, too, are taken a piece's
worth at a time, so no kernel call's temporaries outgrow a piece.

Backward recomputes each block's scores. Handed the *merged* ``(out, lse)``, every block's
share of dQ/dK/dV is exact (see ``trunk_backward``). dQ stays home; each piece's dK/dV
accumulate (fp32) in a buffer that travels the ring behind its K/V and, after ``W`` hops,
reaches its owner while the owner computes the next piece's first step.

The draft's branch attention (``branch_attention``) is rank-local: anchor ``t``'s branch
keys live where ``t`` lives. It is merged into the ring's ``(out, lse)`` before the first
step and differentiated against the same merged ``(out, lse)``; it never communicates, and
runs a piece's worth of query rows at a time (it is row-local).

The ``contiguous`` layout (rank ``r`` holds chunk ``r`` of ``W``) follows the same rule; it
is unbalanced (rank ``W-1`` does ``2W-1`` times the work of rank 0) and exists for torch's
CP with load balancing turned off and as the benchmark's baseline.
"""

from __future__ import annotations

import itertools

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import is_fake

from titan_cotrain.ops import flash
from titan_cotrain.ops.attention import (
    BlockSegments,
    block_backward,
    block_forward,
    check_packed,
    fold_grad_lse,
    host_cu_seqlens,
    lse_dtype,
    merge_attention,
)
from titan_cotrain.ops.branch_attention import branch_backward, branch_forward, check_branch

__all__ = [
    "DEFAULT_PIECES",
    "LAYOUTS",
    "RingComm",
    "chunks_per_document",
    "local_chunks",
    "ring_attention",
    "ring_backward",
    "ring_branch_attention",
    "ring_forward",
    "ring_name",
    "RING_OP_IMPLEMENTATIONS",
]

LAYOUTS = ("zigzag", "contiguous")

# Message tags: K and V travel as tags 0 and 1, their gradients as 2 and 3.
_KV_TAG, _DKV_TAG = 0, 2

# Messages per ring hop: the K/V (and dK/dV) in flight are about 2 / DEFAULT_PIECES of a shard.
DEFAULT_PIECES = 8


def chunks_per_document(layout: str, world: int) -> int:
    """How many chunks every document is cut into: ``2W`` (zigzag) or ``W`` (contiguous)."""
    if layout not in LAYOUTS:
        raise ValueError(f"unknown CP layout {layout!r}; expected one of {LAYOUTS}")
    if world < 1:
        raise ValueError(f"a CP group has at least one rank, got {world}")
    return 2 * world if layout == "zigzag" else world


def local_chunks(layout: str, rank: int, world: int) -> tuple[int, ...]:
    """The chunk ids of every document that ``rank`` holds, in local (ascending) order."""
    chunks_per_document(layout, world)
    return (rank, 2 * world - 1 - rank) if layout == "zigzag" else (rank,)


class _InFlight:
    """Posted sends and receives; ``wait()`` returns the received tensors."""

    def __init__(self, works: list, sent: tuple[torch.Tensor, ...], received: tuple[torch.Tensor, ...]) -> None:
        self._works, self._sent, self.received = works, sent, received

    def wait(self) -> tuple[torch.Tensor, ...]:
        for work in self._works:
            work.wait()
        self._sent = None  # a send buffer may be freed only once its send completed
        return self.received


class RingComm:
    """Neighbour exchange on a process group: send to ``rank + 1``, receive from ``rank - 1``.

    ``group`` is the CP process group (None: the default group; a single rank needs no
    initialised process group). ``send_recv`` is asynchronous; with one rank it hands the
    tensors back.
    """

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        self.group = group
        single = group is None and not dist.is_initialized()
        self.rank = 0 if single else dist.get_rank(group)
        self.world = 1 if single else dist.get_world_size(group)

    def send_recv(self, tensors: tuple[torch.Tensor, ...], tag: int) -> _InFlight:
        """Send ``tensors`` to the next rank and receive as many, alike, from the previous one
        (message ``i`` under tag ``tag + i``), in one batch."""
        tensors = tuple(t.contiguous() for t in tensors)
        if self.world == 1:
            return _InFlight([], tensors, tensors)
        received = tuple(torch.empty_like(t) for t in tensors)
        nxt, prev = (self.rank + 1) % self.world, (self.rank - 1) % self.world
        ops = [dist.P2POp(dist.isend, t, group=self.group, group_peer=nxt, tag=tag + i) for i, t in enumerate(tensors)]
        ops += [
            dist.P2POp(dist.irecv, r, group=self.group, group_peer=prev, tag=tag + i) for i, r in enumerate(received)
        ]
        return _InFlight(dist.batch_isend_irecv(ops), tensors, received)


class _Piece:
    """One ring message: the rows ``segments = [(row_start, row_end), ...]`` of a local shard
    (ascending), sent as one buffer that holds them back to back."""

    def __init__(self, segments: list[tuple[int, int]]) -> None:
        self.segments = segments
        self.offsets = list(itertools.accumulate((e - s for s, e in segments), initial=0))
        self.rows = self.offsets[-1]

    def take(self, x: torch.Tensor) -> torch.Tensor:
        """The piece's rows of ``x [T, ...]``, as one ``[rows, ...]`` buffer."""
        return torch.cat([x[s:e] for s, e in self.segments])

    def put(self, x: torch.Tensor, buffer: torch.Tensor) -> None:
        """Write a ``[rows, ...]`` buffer back to the piece's rows of ``x``."""
        for (s, e), o in zip(self.segments, self.offsets):
            x[s:e] = buffer[o:o + e - s]

    def blocks(self, blocks, q_rows: int):
        """``(q_start, q_end, buf_start, buf_end, causal)``: ``blocks`` (row ranges, as
        ``_LocalDocs.blocks`` gives them) cut down to the keys in this piece, keys as buffer
        rows. Query ranges are cut into runs of at most ``q_rows`` so that no temporary
        exceeds a piece. A causal block (query rows = key rows) meets a key segment
        ``[x0, x1)`` as one causal square plus the full block of the queries below it."""
        for qs, qe, ks, ke, causal in blocks:
            for (s, e), o in zip(self.segments, self.offsets):
                x0, x1 = max(ks, s), min(ke, e)
                if x0 >= x1:
                    continue
                b0, b1 = o + x0 - s, o + x1 - s
                if causal:
                    yield x0, x1, b0, b1, True
                    yield from _runs(x1, qe, q_rows, b0, b1)
                else:
                    yield from _runs(qs, qe, q_rows, b0, b1)


def _runs(q_start: int, q_end: int, q_rows: int, b0: int, b1: int):
    for q0 in range(q_start, q_end, q_rows):
        yield q0, min(q0 + q_rows, q_end), b0, b1, False


def _run_rows(n_rows: int, pieces: int) -> int:
    """Query rows per kernel call: about a piece, so that per-call temporaries stay a piece's size."""
    return max(1, -(-n_rows // pieces))


class _LocalDocs:
    """The local documents, each ``n_slots`` equal chunks side by side, the per-document
    attention blocks of every ring step, and the cut of the shard into ring messages."""

    def __init__(self, cu_seqlens: torch.Tensor, n_slots: int) -> None:
        cu = cu_seqlens.tolist()
        lengths = [e - s for s, e in zip(cu[:-1], cu[1:])]
        if cu[0] != 0 or any(n < 0 or n % n_slots for n in lengths):
            raise ValueError(
                f"local cu_seqlens {cu} must rise from 0 in documents whose lengths are multiples of "
                f"{n_slots} (each local document is this rank's {n_slots} chunk(s) of one document)"
            )
        self.docs = [(s, n // n_slots) for s, n in zip(cu[:-1], lengths) if n]  # (start, chunk length)
        self.n_slots = n_slots

    def blocks(self, layout: str, world: int, rank: int, source: int, causal: bool):
        """``(q_start, q_end, kv_start, kv_end, causal)`` row ranges: the attention calls of rank
        ``rank``'s queries against the K/V of rank ``source`` (both in the local layout)."""
        whole = self.n_slots
        if source == rank or not causal:
            return [(s, s + whole * c, s, s + whole * c, causal) for s, c in self.docs]
        q_chunks, kv_chunks = local_chunks(layout, rank, world), local_chunks(layout, source, world)
        # Query slot a sees the key slots with a smaller chunk id: a prefix of the key
        # slots, non-decreasing in a, so slots with equal prefixes share one call.
        visible = [sum(b < a for b in kv_chunks) for a in q_chunks]
        blocks = []
        for n_visible, slots in itertools.groupby(range(whole), key=visible.__getitem__):
            slots = list(slots)
            if n_visible:
                lo, hi = slots[0], slots[-1] + 1
                blocks += [(s + lo * c, s + hi * c, s, s + n_visible * c, False) for s, c in self.docs]
        return blocks

    def pieces(self, n_pieces: int) -> list[_Piece]:
        """The shard cut into at most ``n_pieces`` messages of near-equal size. Piece ``j`` holds
        offsets ``[u0, u1)`` of the chunks of the documents it spans, *in every slot*, so each
        message carries as many keys of a first chunk as of a second one (see the module doc)."""
        if n_pieces < 1:
            raise ValueError(f"a ring hop is cut into at least one piece, got {n_pieces}")
        total = sum(c for _, c in self.docs)
        cuts = sorted({j * total // n_pieces for j in range(n_pieces + 1)})
        pieces = []
        for u0, u1 in zip(cuts[:-1], cuts[1:]):
            segments, doc_offset = [], 0
            for start, c in self.docs:
                lo, hi = max(u0 - doc_offset, 0), min(u1 - doc_offset, c)
                if lo < hi:
                    segments += [(start + slot * c + lo, start + slot * c + hi) for slot in range(self.n_slots)]
                doc_offset += c
            pieces.append(_Piece(segments))
        return pieces


def _segments(cu_seqlens, docs: _LocalDocs, plan: list[_Piece], q_rows: int, layout: str, world: int, rank: int,
              causal: bool, q: torch.Tensor) -> BlockSegments | None:
    """The kernel ``cu_seqlens`` of every block a ring pass runs, in one host-to-device copy;
    kept for the batch's layout, so every layer's forward and backward reuse them. None off
    the flash path (the CPU's kernels take no ``cu_seqlens``)."""
    if not flash.takes_flash_path(q):
        return None
    device = q.device
    key = (tuple(cu_seqlens.tolist()), len(plan), q_rows, layout, world, rank, causal)
    if _SEGMENTS.get(key, (None, None))[0] == device:
        return _SEGMENTS[key][1]
    shapes = {(q1 - q0, b1 - b0)
              for piece in plan for step in range(world)
              for q0, q1, b0, b1, _ in piece.blocks(docs.blocks(layout, world, rank, (rank - step) % world, causal),
                                                    q_rows)}
    segments = BlockSegments(shapes, device)
    if not is_fake(q):  # fake tensors (the simulator's) are not kept across calls
        _SEGMENTS.clear()  # one batch layout at a time
        _SEGMENTS[key] = (device, segments)
    return segments


_SEGMENTS: dict[tuple, tuple[torch.device, BlockSegments]] = {}


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
    pieces: int = DEFAULT_PIECES,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward kernel. ``q [T, Hq, Dh]``, ``k, v [T, Hkv, Dh]``: this rank's shard in
    ``layout``; ``cu_seqlens: int32`` the local documents (the same on every rank), read on
    the host (see ``host_cu_seqlens``).

    Returns ``out [T, Hq, Dh]`` (q's dtype) and ``lse [T, Hq]`` (fp32; fp64 for fp64) of
    every local query over all keys of its document on all ranks (``causal=False``: the
    whole document, not only the keys before the query). ``initial``, a partial
    ``(out, lse)`` over other keys of the same queries (the branch), is merged in.
    The K/V travel in ``pieces`` messages per hop (see the module doc). Partial results
    merge into fp32 accumulators, one block of at most a piece's rows at a time.
    """
    check_packed(q, k, v, cu_seqlens)
    world, rank = comm.world, comm.rank
    docs = _LocalDocs(cu_seqlens, len(local_chunks(layout, rank, world)))
    acc = lse_dtype(q.dtype)
    if initial is None:
        out = torch.zeros(q.shape, dtype=acc, device=q.device)
        lse = torch.full(q.shape[:2], float("-inf"), dtype=acc, device=q.device)
    else:
        out, lse = initial[0].to(acc, copy=True), initial[1].to(acc, copy=True)
    plan, q_rows = docs.pieces(pieces), _run_rows(q.shape[0], pieces)
    segments = _segments(cu_seqlens, docs, plan, q_rows, layout, world, rank, causal, q)
    for piece in plan:
        held = (piece.take(k), piece.take(v))
        for step in range(world):
            incoming = comm.send_recv(held, _KV_TAG) if step + 1 < world else None
            step_blocks = docs.blocks(layout, world, rank, (rank - step) % world, causal)
            for q0, q1, b0, b1, block_causal in piece.blocks(step_blocks, q_rows):
                # One statement, so that no block's temporaries outlive it.
                out[q0:q1], lse[q0:q1] = merge_attention(
                    out[q0:q1], lse[q0:q1],
                    *block_forward(q[q0:q1], held[0][b0:b1], held[1][b0:b1], scale, block_causal, segments),
                )
            if incoming is not None:
                held = incoming.wait()
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
    pieces: int = DEFAULT_PIECES,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Backward kernel: ``(dq, dk, dv)`` of this rank's shard, shaped like ``q, k, v``.

    ``out``, ``lse`` are the final (merged) forward results of the local queries, so the
    gradient is that of the whole attention they belong to (ring, plus a branch if any).
    Every piece's dK/dV collect contributions from all ranks on their way around the ring
    and come home after ``W`` hops. ``grad_lse [T, Hq]``, a gradient reaching the
    merged ``lse``, is folded in by ``fold_grad_lse`` (the ring runs with one more head-dim
    column, or twice where that column would pass the kernel's head-dim limit).
    """
    if grad_lse is not None:
        def ring(*args):
            return ring_backward(*args, cu_seqlens, scale, comm, layout=layout, causal=causal, pieces=pieces)

        return fold_grad_lse(ring, grad_out, grad_lse, q, k, v, out, lse)
    world, rank = comm.world, comm.rank
    docs = _LocalDocs(cu_seqlens, len(local_chunks(layout, rank, world)))
    acc = lse_dtype(q.dtype)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    dk = torch.zeros(k.shape, dtype=acc, device=k.device)
    dv = torch.zeros(v.shape, dtype=acc, device=v.device)
    plan, q_rows = docs.pieces(pieces), _run_rows(q.shape[0], pieces)
    segments = _segments(cu_seqlens, docs, plan, q_rows, layout, world, rank, causal, q)
    homecoming = None  # (the previous piece's dK/dV on their last hop home, that piece)
    for piece in plan:
        held, grads_in_flight = (piece.take(k), piece.take(v)), None
        for step in range(world):
            incoming = comm.send_recv(held, _KV_TAG) if step + 1 < world else None
            piece_grads = tuple(torch.zeros((piece.rows, *x.shape[1:]), dtype=acc, device=x.device) for x in (k, v))
            step_blocks = docs.blocks(layout, world, rank, (rank - step) % world, causal)
            for q0, q1, b0, b1, block_causal in piece.blocks(step_blocks, q_rows):
                _accumulate(
                    (dq[q0:q1], piece_grads[0][b0:b1], piece_grads[1][b0:b1]),
                    block_backward(
                        grad_out[q0:q1], q[q0:q1], held[0][b0:b1], held[1][b0:b1], out[q0:q1], lse[q0:q1], scale,
                        block_causal, segments,
                    ),
                )
            if homecoming is not None:  # waited for only now: its last hop overlapped this step
                _land(*homecoming, (dk, dv))
                homecoming = None
            if grads_in_flight is not None:
                _accumulate(piece_grads, grads_in_flight.wait())
            grads_in_flight = comm.send_recv(piece_grads, _DKV_TAG)
            if incoming is not None:
                held = incoming.wait()
        homecoming = grads_in_flight, piece
    if homecoming is not None:
        _land(*homecoming, (dk, dv))
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _accumulate(into: tuple[torch.Tensor, ...], arrived: tuple[torch.Tensor, ...]) -> None:
    """``into[i] += arrived[i]``; ``arrived`` dies with the call (no loop variable keeps it)."""
    for total, part in zip(into, arrived):
        total += part


def _land(grads: _InFlight, piece: _Piece, into: tuple[torch.Tensor, ...]) -> None:
    """Write a piece's finished dK/dV, arriving home, into the shard's gradients."""
    for total, arrived in zip(into, grads.wait()):
        piece.put(total, arrived)


def _branch_forward(q, branch_k, branch_v, scale: float, run_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``branch_forward`` (fp32 results), ``run_rows`` query rows at a time: the branch is
    row-local, so its temporaries need never be a whole shard's."""
    acc = lse_dtype(q.dtype)
    out = torch.empty(q.shape, dtype=acc, device=q.device)
    lse = torch.empty(q.shape[:2], dtype=acc, device=q.device)
    for a in range(0, q.shape[0], run_rows):
        b = a + run_rows
        out[a:b], lse[a:b] = branch_forward(q[a:b], branch_k[:, a:b], branch_v[:, a:b], scale)
    return out, lse


def _branch_backward(grad_out, q, branch_k, branch_v, out, lse, scale: float, run_rows: int, dq: torch.Tensor):
    """``branch_backward``, ``run_rows`` query rows at a time, its dq added into ``dq``;
    returns ``(dbranch_k, dbranch_v)``."""
    dbranch_k, dbranch_v = torch.empty_like(branch_k), torch.empty_like(branch_v)
    for a in range(0, q.shape[0], run_rows):
        b = a + run_rows
        dq_run, dbranch_k[:, a:b], dbranch_v[:, a:b] = branch_backward(
            grad_out[a:b], q[a:b], branch_k[:, a:b], branch_v[:, a:b], out[a:b], lse[a:b], scale
        )
        dq[a:b] += dq_run
    return dbranch_k, dbranch_v


_COMMS: dict[str, RingComm] = {}


def ring_name(group: str | dist.ProcessGroup | RingComm | None) -> str:
    """A name for ``group``'s ring (a process group, a ``RingComm``, None for the default
    group, or a name given before), under which the ring ops below find its ``RingComm``.
    Ops take names, not groups, so that ``torch.compile`` traces them as opaque nodes with
    constant arguments; a process group keeps one name (and one ``RingComm``) for good."""
    if isinstance(group, str):
        if group not in _COMMS:
            raise KeyError(f"no ring is registered as {group!r}")
        return group
    if isinstance(group, RingComm):
        name = f"comm:{id(group)}"
        _COMMS.setdefault(name, group)  # held, so the id is never reused
        return name
    # The default group's ring depends on whether a process group exists yet.
    name = ("default" if dist.is_initialized() else "single") if group is None else f"group:{group.group_name}"
    if name not in _COMMS:
        _COMMS[name] = RingComm(group)
    return name


# Forward and backward are custom ops of their own, so that torch.compile (dynamo and
# AOTAutograd) sees each as one opaque node with a fake implementation: the ring's
# point-to-point messages and its host-side document plan never enter a graph.
def _ring_attention_impl(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, branch_k: torch.Tensor | None, branch_v: torch.Tensor | None,
    cu_seqlens: torch.Tensor, scale: float, ring: str, layout: str, pieces: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    initial = None
    if branch_k is not None:
        initial = _branch_forward(q, branch_k, branch_v, scale, _run_rows(q.shape[0], pieces))
    return ring_forward(q, k, v, cu_seqlens, scale, _COMMS[ring], layout=layout, initial=initial, pieces=pieces)


def _ring_attention_backward_impl(
    grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, branch_k: torch.Tensor | None,
    branch_v: torch.Tensor | None, out: torch.Tensor, lse: torch.Tensor, cu_seqlens: torch.Tensor, scale: float,
    ring: str, layout: str, pieces: int,
) -> list[torch.Tensor]:
    """``[dq, dk, dv]``, then ``dbranch_k, dbranch_v`` when there is a branch."""
    dq, dk, dv = ring_backward(grad_out, q, k, v, out, lse, cu_seqlens, scale, _COMMS[ring], layout=layout,
                               pieces=pieces)
    if branch_k is None:
        return [dq, dk, dv]
    return [dq, dk, dv, *_branch_backward(grad_out, q, branch_k, branch_v, out, lse, scale,
                                          _run_rows(q.shape[0], pieces), dq)]


_ring_attention_op = torch.library.custom_op("titan_cotrain::ring_attention", _ring_attention_impl, mutates_args=())
_ring_attention_backward_op = torch.library.custom_op("titan_cotrain::ring_attention_backward",
                                                      _ring_attention_backward_impl, mutates_args=())
# What the ops run, by op name: the scale simulator runs these on its fake tensors rather than
# the shapes below, so that the ring's own buffers and messages are simulated too.
RING_OP_IMPLEMENTATIONS = {"ring_attention": _ring_attention_impl,
                           "ring_attention_backward": _ring_attention_backward_impl}


@_ring_attention_op.register_fake
def _(q, k, v, branch_k, branch_v, cu_seqlens, scale, ring, layout, pieces):
    return torch.empty_like(q), q.new_empty(q.shape[:2], dtype=lse_dtype(q.dtype))


@_ring_attention_backward_op.register_fake
def _(grad_out, q, k, v, branch_k, branch_v, out, lse, cu_seqlens, scale, ring, layout, pieces):
    grads = [torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)]
    return grads if branch_k is None else [*grads, torch.empty_like(branch_k), torch.empty_like(branch_v)]


def _setup_ring_context(ctx, inputs, output):
    q, k, v, branch_k, branch_v, cu_seqlens, scale, ring, layout, pieces = inputs
    ctx.save_for_backward(q, k, v, branch_k, branch_v, cu_seqlens, *output)
    ctx.options = (scale, ring, layout, pieces)


def _ring_attention_backward(ctx, grad_out, grad_lse):
    q, k, v, branch_k, branch_v, cu_seqlens, out, lse = ctx.saved_tensors
    grads = _ring_attention_backward_op(grad_out.contiguous(), q, k, v, branch_k, branch_v, out, lse, cu_seqlens,
                                        *ctx.options)
    dbranch = grads[3:] if branch_k is not None else [None, None]
    return (*grads[:3], *dbranch, None, None, None, None, None)


_ring_attention_op.register_autograd(_ring_attention_backward, setup_context=_setup_ring_context)


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    group: str | dist.ProcessGroup | RingComm | None = None,
    scale: float | None = None,
    *,
    layout: str = "zigzag",
    pieces: int = DEFAULT_PIECES,
) -> torch.Tensor:
    """Differentiable document-causal attention of a CP shard: ``varlen_causal_attention``
    for tokens spread over the ranks of ``group`` in ``layout``.

    ``q [T, Hq, Dh]``, ``k, v [T, Hkv, Dh]`` and ``cu_seqlens`` (the local documents) are
    this rank's local tensors; returns this rank's ``out [T, Hq, Dh]``. Every rank of the
    group must call it (forward and backward are collective) with the same ``pieces``,
    the number of messages each ring hop is cut into.
    """
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    out, _ = _ring_attention_op(q, k, v, None, None, host_cu_seqlens(cu_seqlens), scale, ring_name(group), layout,
                                pieces)
    return out


def ring_branch_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    branch_k: torch.Tensor,
    branch_v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    group: str | dist.ProcessGroup | RingComm | None = None,
    scale: float | None = None,
    *,
    layout: str = "zigzag",
    pieces: int = DEFAULT_PIECES,
) -> torch.Tensor:
    """``branch_attention`` of a CP shard: the trunk over the ring, the branch
    ``branch_k, branch_v [P, T, Hkv, Dh]`` (the local anchors' own keys) rank-local,
    merged by log-sum-exp. Local tensors in, this rank's ``out [T, Hq, Dh]`` out."""
    check_branch(k, branch_k, branch_v)
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    out, _ = _ring_attention_op(q, k, v, branch_k, branch_v, host_cu_seqlens(cu_seqlens), scale, ring_name(group),
                                layout, pieces)
    return out
