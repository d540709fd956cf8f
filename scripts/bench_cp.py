"""Context-parallel draft attention: per-rank memory, time and work balance, zigzag ring vs gathered K/V.

What runs: one TTT pass of the draft's attention, ``ring_branch_attention``: the trunk over the
pass-1 K/V of the whole row plus ``P`` branch key sets at every anchor, forward + backward, fp32,
``Hq = 2``, ``Hkv = 1``, ``Dh = 16``, on one packed row of ``S`` tokens holding uneven documents
(``DOC_FRACTIONS`` of the row). ``P = 6`` is the last, largest pass of a D = 7 unroll (the
branch K/V, rank-local in every design, then dominate memory); ``P = 0`` is pass 1, which is
also the target's attention (the K/V then dominate). The ring cuts every hop into ``--pieces``
messages (default ``DEFAULT_PIECES``). A second config, ``Hkv = Hq = 2`` (no GQA: twice the K/V
per query), is measured at fewer sizes (``--mha-seq-lens``) and reported alongside.

Implementations (branch attention rank-local in both):
* ``ring``: ``titan_cotrain.ops.ring_attention.ring_branch_attention``, K/V one hop per step;
* ``gather``: the prior-work baseline below: all-gather every rank's K/V into the global row
  (written straight into document order, no reorder copy), attend the local queries to their
  documents' prefixes, and in backward re-gather, accumulate a full-row dK/dV and
  reduce-scatter it. Nothing of the gathered row is kept between forward and backward.

Ranks are simulated one at a time in this process: W = 8 processes on a 2-core machine would
measure contention, not the design. A ``SimulatedRing`` hands rank r, at step i, the real K/V
piece of rank r - i in a freshly allocated buffer (as ``irecv`` would); the partial dK/dV that
would arrive from rank r - 1 is a fresh zero buffer (other ranks' sums change neither time nor
memory). The gather baseline's all-gather returns a fresh full-row buffer, its reduce-scatter a
fresh local one. So ``seconds`` is one rank's compute plus the local copies standing in for
messages, without network time, after one untimed warm-up run per record (the first calls at
new shapes run several times slower); it is timed in a run of its own, without the memory
tracker, whose Python hook on every op would otherwise be timed too.

Memory: ``peak_bytes_per_rank`` is the peak, over one rank's forward + backward, of the bytes of
live tensor storages that rank holds: its inputs (q, k, v, the branch K/V and grad_out shards)
and everything created during the call (saved activations, receive buffers, gathered rows,
gradients). A ``TorchDispatchMode`` sees every tensor an op creates and a weakref finaliser on
its storage sees it die: the CPU analogue of ``torch.cuda.max_memory_allocated``. Not counted:
kernel-internal scratch (the CPU flash kernel's per-thread blocks, independent of S) and
allocator slack. The single-device op is one custom op to the tracker, so its reference counts
only its inputs, saved tensors and gradients, none of its temporaries: the ideal, a lower bound
of its real peak. Zigzag ranks do the same work; their temporaries differ with the kind of step
(rank 0 only meets later ranks' K/V, rank W - 1 only earlier ones', the others both), so the
first and the last rank are simulated and the record keeps the larger numbers. For contiguous
sharding only rank W - 1, the busiest, is simulated. W = 1 is the ring of one rank; the
single-device op itself (``branch_attention``) is measured too, and is the reference of the
``single / W`` comparison.

Work balance (``work_max_over_mean``): query-key pairs per rank, from the block schedule the ring
executes (padding included), max over mean; ``zigzag_per_message`` (in ``work_balance``): the same
per message (piece j at step i) from the blocks the ring runs on it, the worst message. Also
reported: the contiguous cut of the whole row into W pieces, ignoring documents, the plain CP
sharding (analytic only).

Correctness first: on 4 real gloo ranks (CP groups of 4 and of 2), ring and gather forward and
all five input gradients must match single-device ``branch_attention`` within 1e-5 on a small
uneven packed row, and the simulated ring's forward must match the single-device op at the
smallest benchmark size on every rank; otherwise the script exits 1 before measuring anything.
It also exits 1 when the zigzag schedule's work is imbalanced beyond 1.05, per rank or per message.

    PYTHONPATH=. .venv/bin/python scripts/bench_cp.py      # ~8 min on 1-2 free cores
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
import weakref
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from titan_cotrain.ops import branch_attention
from titan_cotrain.ops.attention import lse_dtype, merge_attention
from titan_cotrain.ops.ring_attention import (
    DEFAULT_PIECES,
    RingComm,
    _LocalDocs,
    _run_rows,
    chunks_per_document,
    local_chunks,
    ring_branch_attention,
)
from titan_cotrain.parallel.context_parallel import CPShard, plan_padded_rows, shard_packed_rows

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
from benchtools import command_line, plain_ticks, pyplot, save_figure  # noqa: E402

N_HEADS, N_KV_HEADS, HEAD_DIM = 2, 1, 16  # N_KV_HEADS: the GQA config; --mha-seq-lens adds Hkv = Hq
SCALE = HEAD_DIM**-0.5
DOC_FRACTIONS = (0.37, 0.23, 0.16, 0.11, 0.07, 0.04, 0.02)  # of the row; the rest is one more document
TOL = dict(rtol=1e-5, atol=1e-5)


# ---- inputs ------------------------------------------------------------------------------------

def doc_lengths(seq_len: int) -> list[int]:
    lengths = [max(1, int(f * seq_len)) for f in DOC_FRACTIONS]
    return lengths + [seq_len - sum(lengths)]


def full_inputs(seq_len: int, branch_sets: int, seed: int = 0, kv_heads: int = N_KV_HEADS) -> list[torch.Tensor]:
    """q [S, Hq, Dh], k, v [S, Hkv, Dh], branch_k, branch_v [P, S, Hkv, Dh], grad_out [S, Hq, Dh]."""
    g = torch.Generator().manual_seed(seed)
    shapes = [(seq_len, N_HEADS, HEAD_DIM), (seq_len, kv_heads, HEAD_DIM), (seq_len, kv_heads, HEAD_DIM),
              (branch_sets, seq_len, kv_heads, HEAD_DIM), (branch_sets, seq_len, kv_heads, HEAD_DIM),
              (seq_len, N_HEADS, HEAD_DIM)]
    return [torch.randn(s, generator=g) for s in shapes]


def document_ids(seq_len: int) -> torch.Tensor:
    return torch.tensor([[i for i, n in enumerate(doc_lengths(seq_len)) for _ in range(n)]])


def cu_seqlens(seq_len: int) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(doc_lengths(seq_len)).cumsum(0).tolist()], dtype=torch.int32)


def shard_branch(shard, x: torch.Tensor) -> torch.Tensor:
    """``[P, S, ...] -> [P, local_len, ...]``."""
    return shard.shard(x.movedim(0, 1)[None])[0].movedim(1, 0)


def shard_inputs(shard, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """This rank's shards of ``full_inputs`` (grad_out zero on padding: padding feeds no loss)."""
    q, k, v, bk, bv, go = tensors
    local = [shard.shard(x[None])[0] for x in (q, k, v)]
    local += [shard_branch(shard, x) for x in (bk, bv)]
    local.append(shard.shard(go[None])[0] * shard.valid[0][:, None, None])
    return local


# ---- the gather baseline -------------------------------------------------------------------------

def _bhsd(x):
    return x.transpose(0, 1).unsqueeze(0)


def _expand(x, n_rep):
    return x.repeat_interleave(n_rep, dim=1) if n_rep > 1 else x


def _reduce(g, n_rep):
    return g.unflatten(1, (-1, n_rep)).sum(2) if n_rep > 1 else g


class GatherBranchAttention(torch.autograd.Function):
    """Prior work: every rank holds the whole row's K/V. ``comm.gather(kv [2, T, Hkv, Dh])``
    returns the row's ``[2, S_row, Hkv, Dh]`` in document order, ``comm.reduce_scatter`` the
    local rows of a full-row gradient. Queries of local chunk ``j`` of a document attend to
    chunks ``0..j-1`` fully and to chunk ``j`` causally (``plan`` lists those blocks)."""

    @staticmethod
    def forward(ctx, q, k, v, branch_k, branch_v, plan, comm):
        from titan_cotrain.ops.branch_attention import branch_forward

        out, lse = branch_forward(q, branch_k, branch_v, SCALE)
        out, lse = out.to(lse_dtype(q.dtype)), lse.clone()
        kv = comm.gather(torch.stack([k, v]))
        n_rep = q.shape[1] // k.shape[1]
        for q0, q1, k0, k1, causal in plan:
            o, l = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                _bhsd(q[q0:q1]), _bhsd(_expand(kv[0, k0:k1], n_rep)), _bhsd(_expand(kv[1, k0:k1], n_rep)),
                0.0, causal, scale=SCALE)
            merged = merge_attention(out[q0:q1], lse[q0:q1], o[0].transpose(0, 1), l[0].transpose(0, 1))
            out[q0:q1], lse[q0:q1] = merged
        del kv
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, branch_k, branch_v, out, lse)
        ctx.plan, ctx.comm = plan, comm
        return out

    @staticmethod
    def backward(ctx, grad_out):
        from titan_cotrain.ops.branch_attention import branch_backward

        q, k, v, branch_k, branch_v, out, lse = ctx.saved_tensors
        dq, dbranch_k, dbranch_v = branch_backward(grad_out, q, branch_k, branch_v, out, lse, SCALE)
        dq = dq.to(lse.dtype)
        kv = ctx.comm.gather(torch.stack([k, v]))
        dkv = torch.zeros(kv.shape, dtype=lse.dtype)
        n_rep = q.shape[1] // k.shape[1]
        for q0, q1, k0, k1, causal in ctx.plan:
            gq, gk, gv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                _bhsd(grad_out[q0:q1]), _bhsd(q[q0:q1]), _bhsd(_expand(kv[0, k0:k1], n_rep)),
                _bhsd(_expand(kv[1, k0:k1], n_rep)), _bhsd(out[q0:q1]),
                lse[q0:q1].transpose(0, 1).unsqueeze(0).contiguous(), 0.0, causal, scale=SCALE)
            dq[q0:q1] += gq[0].transpose(0, 1)
            dkv[0, k0:k1] += _reduce(gk[0].transpose(0, 1), n_rep)
            dkv[1, k0:k1] += _reduce(gv[0].transpose(0, 1), n_rep)
        del kv
        dk, dv = ctx.comm.reduce_scatter(dkv)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dbranch_k, dbranch_v, None, None


def gather_plan(shard, rank: int) -> tuple[list[tuple[int, int, int, int, bool]], torch.Tensor]:
    """The baseline's blocks ``(q0, q1, k0, k1, causal)`` (local query rows, row key rows) and
    ``row_index``: for each row position, its (rank, local row) as ``rank * T + row``."""
    world, n_chunks = shard.world, chunks_per_document(shard.layout, shard.world)
    chunks = [local_chunks(shard.layout, r, world) for r in range(world)]
    n_slots = len(chunks[0])
    local_total = shard.local_len
    cu = shard.cu_seqlens.tolist()
    plan, row_index, row_start = [], [], 0
    for start, end in zip(cu[:-1], cu[1:]):
        c = (end - start) // n_slots
        for slot, chunk in enumerate(chunks[rank]):
            q0 = start + slot * c
            if chunk:
                plan.append((q0, q0 + c, row_start, row_start + chunk * c, False))
            plan.append((q0, q0 + c, row_start + chunk * c, row_start + (chunk + 1) * c, True))
        for chunk in range(n_chunks):
            owner = next(r for r in range(world) if chunk in chunks[r])
            slot = chunks[owner].index(chunk)
            row_index.append(torch.arange(c) + owner * local_total + start + slot * c)
        row_start += n_chunks * c
    return plan, torch.cat(row_index)


# ---- simulated communication ---------------------------------------------------------------------

class SimulatedRing(RingComm):
    """Rank ``rank`` of a ring whose other ranks' ``(k, v)`` shards are given (see the module docstring).

    ``plan`` is the ring's cut of a shard into messages (``_LocalDocs.pieces``): the ring sends
    piece after piece, each W - 1 hops around, so the ``n``-th K/V message received, in forward
    as in backward, is piece ``n // (W - 1)`` of rank ``rank - 1 - n % (W - 1)``."""

    def __init__(self, rank: int, world: int, kv_shards: list[tuple[torch.Tensor, torch.Tensor]], plan) -> None:
        self.group, self.rank, self.world = None, rank, world
        # Every rank's messages, cut before tracking starts: the other ranks' memory.
        self._messages = [[(piece.take(k), piece.take(v)) for piece in plan] for k, v in kv_shards]
        self._kv_hops = 0

    def send_recv(self, tensors, tag):
        from titan_cotrain.ops.ring_attention import _KV_TAG, _InFlight

        received = tuple(torch.empty_like(t) for t in tensors)  # what irecv would allocate
        if tag == _KV_TAG:
            hops = self.world - 1
            source = (self.rank - 1 - self._kv_hops % hops) % self.world
            messages = self._messages[source]
            for buffer, message in zip(received, messages[self._kv_hops // hops % len(messages)]):
                buffer.copy_(message)
            self._kv_hops += 1
        else:
            for buffer in received:
                buffer.zero_()
        return _InFlight([], tuple(tensors), received)


class SimulatedGather:
    """Rank ``rank``'s all-gather and reduce-scatter, the other ranks' shards given."""

    def __init__(self, rank: int, kv_shards: list[torch.Tensor], row_index: torch.Tensor) -> None:
        self.rank, self._row_index = rank, row_index
        self._local = kv_shards[rank][0].shape[0]
        # The other ranks' memory, made before tracking starts.
        self._everyone = torch.cat([torch.stack(kv) for kv in kv_shards], dim=1)

    def gather(self, kv_local):
        return self._everyone[:, self._row_index]  # one fresh full-row buffer, as all-gather fills

    def reduce_scatter(self, dkv_row):
        local = self._local
        mine = (self._row_index >= self.rank * local) & (self._row_index < (self.rank + 1) * local)
        out = torch.empty(2, local, *dkv_row.shape[2:], dtype=dkv_row.dtype)
        out[:, self._row_index[mine] - self.rank * local] = dkv_row[:, mine]
        return out[0], out[1]


class DistributedGather:
    """The baseline's collectives on a real process group (correctness only)."""

    def __init__(self, group, row_index: torch.Tensor) -> None:
        self.group, self._row_index = group, row_index
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)

    def gather(self, kv_local):
        parts = [torch.empty_like(kv_local) for _ in range(self.world)]
        dist.all_gather(parts, kv_local.contiguous(), group=self.group)
        return torch.cat(parts, dim=1)[:, self._row_index]

    def reduce_scatter(self, dkv_row):
        local = dkv_row.shape[1] // self.world
        flat = dkv_row.new_zeros(2, self.world * local, *dkv_row.shape[2:])
        flat[:, self._row_index] = dkv_row
        dist.all_reduce(flat, group=self.group)
        mine = flat[:, self.rank * local:(self.rank + 1) * local]
        return mine[0], mine[1]


# ---- memory ----------------------------------------------------------------------------------------

class PeakLiveBytes(TorchDispatchMode):
    """Peak bytes of live tensor storages: adopted inputs plus every storage an op creates."""

    def __init__(self) -> None:
        super().__init__()
        self.live = self.peak = 0
        self._alive: dict[int, int] = {}

    def adopt(self, tensors) -> None:
        for t in tensors:
            self._track(t)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._track(t)
        return out

    def _track(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        key, size = storage.data_ptr(), storage.nbytes()
        if size == 0 or key in self._alive:
            return
        self._alive[key] = size
        self.live += size
        self.peak = max(self.peak, self.live)
        weakref.finalize(storage, self._free, key)

    def _free(self, key: int) -> None:
        self.live -= self._alive.pop(key, 0)


# ---- one simulated rank ------------------------------------------------------------------------------

def _peak(run, held: list[torch.Tensor]) -> tuple[int, torch.Tensor]:
    """Peak live bytes (``held`` counted from the start) of ``run()``'s forward + backward, and its output."""
    *inputs, grad_out = held
    tracker = PeakLiveBytes()
    tracker.adopt(held)
    with tracker:
        out = run(inputs)
        out.backward(grad_out)
    return tracker.peak, out.detach()


def _seconds(run, held: list[torch.Tensor]) -> float:
    """Seconds of ``run()``'s forward + backward, untracked (the tracker's per-op Python hook is slow)."""
    *inputs, grad_out = held
    start = time.perf_counter()
    run(inputs).backward(grad_out)
    return time.perf_counter() - start


def _fresh(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    return [x.clone().requires_grad_() for x in tensors[:5]] + [tensors[5].clone()]


def run_single_device(seq_len: int, tensors) -> dict:
    """The single-device op, ``branch_attention``, on the whole row (after a warm-up run)."""
    cu = cu_seqlens(seq_len)
    run = lambda inputs: branch_attention(*inputs, cu, SCALE)  # noqa: E731
    _seconds(run, _fresh(tensors))
    seconds = _seconds(run, _fresh(tensors))
    peak, _ = _peak(run, _fresh(tensors))
    return {"seq_len": seq_len, "branch_sets": tensors[3].shape[0], "n_kv_heads": tensors[1].shape[1],
            "peak_bytes": peak, "seconds": round(seconds, 3)}


def run_rank(impl: str, layout: str, world: int, seq_len: int, rank: int, tensors,
             pieces: int = DEFAULT_PIECES, timed: bool = True) -> dict:
    """One rank's forward + backward on the real shards: a timed run (``timed``) and a tracked one;
    returns its peak bytes, seconds and output."""
    lengths = [doc_lengths(seq_len)]
    padded, row_len = plan_padded_rows(lengths, world, layout=layout)
    shards = [CPShard(lengths, padded, seq_len, row_len, group=None, rank=r, world=world, layout=layout)
              for r in range(world)]
    shard = shards[rank]
    local_inputs = [shard_inputs(s, tensors) for s in shards]
    kv_shards = [(x[1], x[2]) for x in local_inputs]
    mine = local_inputs[rank]
    del local_inputs
    if impl == "ring":
        if world > 1:
            plan = _LocalDocs(shard.cu_seqlens, len(local_chunks(layout, rank, world))).pieces(pieces)
            comm = SimulatedRing(rank, world, kv_shards, plan)
        else:
            comm = RingComm(None)
        run = lambda inputs: ring_branch_attention(  # noqa: E731
            *inputs, shard.cu_seqlens, comm, SCALE, layout=layout, pieces=pieces)
    else:
        plan, row_index = gather_plan(shard, rank)
        comm = SimulatedGather(rank, kv_shards, row_index)
        run = lambda inputs: GatherBranchAttention.apply(*inputs, plan, comm)  # noqa: E731
    seconds = _seconds(run, _fresh(mine)) if timed else None
    peak, out = _peak(run, _fresh(mine))
    return {"peak_bytes": peak, "seconds": seconds, "out": out, "shard": shard}


# ---- work balance ------------------------------------------------------------------------------------

def schedule_work(layout: str, world: int, seq_len: int) -> list[int]:
    """Query-key pairs each rank computes under the ring's block schedule (padding included)."""
    n_chunks = chunks_per_document(layout, world)
    work = [0] * world
    for n in doc_lengths(seq_len):
        c = math.ceil(n / n_chunks)
        for rank in range(world):
            mine = local_chunks(layout, rank, world)
            local = len(mine) * c
            work[rank] += local * (local + 1) // 2  # step 0: causal over the local document
            for source in range(world):
                if source != rank:
                    theirs = local_chunks(layout, source, world)
                    work[rank] += sum(c * c for a in mine for b in theirs if b < a)
    return work


def message_work_max_over_mean(world: int, seq_len: int, pieces: int) -> float:
    """The zigzag ring's balance per message: query-key pairs each rank computes on piece ``j``
    at step ``i``, from the blocks the ring executes, max over ranks / mean, worst ``(j, i)``.
    Ranks move in near lock-step (each waits for its neighbour's piece), so an imbalance of
    single messages would cost time even where the per-rank totals are equal."""
    lengths = [doc_lengths(seq_len)]
    padded, row_len = plan_padded_rows(lengths, world, layout="zigzag")
    work = {}
    for rank in range(world):
        shard = CPShard(lengths, padded, seq_len, row_len, group=None, rank=rank, world=world, layout="zigzag")
        docs = _LocalDocs(shard.cu_seqlens, 2)
        q_rows = _run_rows(shard.local_len, pieces)
        for j, piece in enumerate(docs.pieces(pieces)):
            for step in range(world):
                blocks = piece.blocks(docs.blocks("zigzag", world, rank, (rank - step) % world, True), q_rows)
                work.setdefault((j, step), []).append(
                    sum((q1 - q0) * (q1 - q0 + 1) // 2 if causal else (q1 - q0) * (b1 - b0)
                        for q0, q1, b0, b1, causal in blocks))
    return max(max_over_mean(w) if sum(w) else 1.0 for w in work.values())


def row_contiguous_work(world: int, seq_len: int) -> list[int]:
    """Query-key pairs per rank when the row is cut in W contiguous pieces (documents ignored)."""
    work, start = [0] * world, 0
    piece = seq_len // world
    for n in doc_lengths(seq_len):
        for i in range(n):
            work[min((start + i) // piece, world - 1)] += i + 1
        start += n
    return work


def max_over_mean(work: list[int]) -> float:
    return max(work) / (sum(work) / len(work))


# ---- correctness ---------------------------------------------------------------------------------------

def ring_errors(pieces: int, impls=("ring", "gather"), device: torch.device | str = "cpu",
                dtype: torch.dtype = torch.float32, seq_len: int = 90) -> dict[str, dict[str, float]]:
    """On every rank of the default group (W ranks): ``impls`` over CP groups of all W ranks
    and of each half (W >= 4), against ``branch_attention`` on this rank's ``device`` alone,
    on one uneven packed row; forward and all five input gradients, in ``dtype``.

    Both are measured against the fp64 result on the host: per ``"<impl> W=<w> <tensor>"``,
    ``{"error": max |impl - exact|, "single_error": max |single device - exact|}``. Raises
    ``AssertionError`` where an error exceeds ``(w + 1) x single_error + 1e-5``: the ring
    merges up to ``w`` partial results in ``dtype`` where the single device rounds once (in
    fp32 this is the 1e-5 bar alone). ``gather`` is the CPU baseline (CPU flash kernels)."""
    world = dist.get_world_size()
    groups = [dist.group.WORLD]
    if world >= 4:  # every rank creates every group, in the same order
        halves = [dist.new_group(list(range(0, world // 2))), dist.new_group(list(range(world // 2, world)))]
        groups.append(halves[dist.get_rank() * 2 // world])
    tensors = full_inputs(seq_len, branch_sets=3, seed=1)

    def single_device(tensors, device, dtype):
        full = [x.to(device, dtype, copy=True).requires_grad_() for x in tensors[:5]]
        out = branch_attention(*full, cu_seqlens(seq_len), SCALE)
        out.backward(tensors[5].to(device, dtype))
        return [out.detach()] + [x.grad for x in full]

    exact = single_device(tensors, "cpu", torch.float64)
    single = single_device(tensors, device, dtype)
    names = ["out", "dq", "dk", "dv", "dbranch_k", "dbranch_v"]
    errors, failures = {}, []
    for group in groups:
        w = dist.get_world_size(group)
        shard = shard_packed_rows(document_ids(seq_len), group)
        valid = shard.valid[0][:, None, None]

        def local(full):  # this rank's shard of a whole-row output or gradient, on the host
            full = [x.to("cpu", torch.float64) for x in full]
            return [shard.shard(x[None])[0] for x in full[:4]] + [shard_branch(shard, x) for x in full[4:]]

        want, theirs = local(exact), local(single)
        *local_inputs, grad_out = (x.to(device, dtype) for x in shard_inputs(shard, tensors))
        for impl in impls:
            inputs = [x.clone().requires_grad_() for x in local_inputs]
            if impl == "ring":
                out = ring_branch_attention(*inputs, shard.cu_seqlens, group, SCALE, pieces=pieces)
            else:
                plan, row_index = gather_plan(shard, dist.get_rank(group))
                out = GatherBranchAttention.apply(*inputs, plan, DistributedGather(group, row_index))
            out.backward(grad_out)
            got = [out.detach() * valid.to(out.device)] + [x.grad for x in inputs]
            for name, a, b, s in zip(names, got, want, theirs):
                error = float((a.to("cpu", torch.float64) - b).abs().max())
                single_error = float((s - b).abs().max())
                errors[f"{impl} W={w} {name}"] = {"error": error, "single_error": single_error}
                if error > (w + 1) * single_error + 1e-5:
                    failures.append(f"{impl}, W = {w}: {name} is {error:.3g} from the exact result, the single "
                                    f"device {single_error:.3g}")
    assert not failures, "; ".join(failures)
    return errors


def _check_rank(rank: int, world_size: int, pieces: int) -> None:
    torch.set_num_threads(1)
    ring_errors(pieces)


def check_correctness(seq_len: int, pieces: int) -> list[str]:
    sys.path.insert(0, str(ROOT))
    from tests.multiprocess import run_on_ranks

    failures = []
    try:
        run_on_ranks(_check_rank, 4, pieces)
    except AssertionError as e:
        failures.append(f"ring/gather vs single-device branch_attention on gloo: {e}")
    tensors = full_inputs(seq_len, branch_sets=6)
    with torch.no_grad():
        ref = branch_attention(*tensors[:5], cu_seqlens(seq_len), SCALE)
    for world in (2, 8):
        for rank in range(world):
            r = run_rank("ring", "zigzag", world, seq_len, rank, tensors, pieces, timed=False)
            want = r["shard"].shard(ref[None])[0]
            if not torch.allclose(r["out"] * r["shard"].valid[0][:, None, None], want, **TOL):
                failures.append(f"simulated ring, W = {world}, rank {rank}: forward differs from single device")
    return failures


# ---- main ---------------------------------------------------------------------------------------------

def measure(impl: str, layout: str, world: int, seq_len: int, tensors, pieces: int) -> dict:
    """One record: the simulated ranks' larger peak and time, and the schedule's balance."""
    if world == 1:
        ranks = [0]
    elif layout == "contiguous":
        ranks = [world - 1]
    else:
        ranks = [0, world - 1]
    # Warm-up: the first calls at new shapes are several times slower.
    run_rank(impl, layout, world, seq_len, ranks[0], tensors, pieces, timed=False)
    runs = [run_rank(impl, layout, world, seq_len, rank, tensors, pieces) for rank in ranks]
    work = schedule_work(layout, world, seq_len)
    return {
        "impl": impl, "sharding": layout, "world": world, "seq_len": seq_len, "branch_sets": tensors[3].shape[0],
        "n_kv_heads": tensors[1].shape[1], "pieces": pieces if impl == "ring" else None,
        "peak_bytes_per_rank": max(r["peak_bytes"] for r in runs),
        "seconds": round(max(r["seconds"] for r in runs), 3),
        "work_max_over_mean": round(max_over_mean(work), 4),
        "simulated_ranks": ranks,
        "peak_bytes_by_rank": [r["peak_bytes"] for r in runs],
        "seconds_by_rank": [round(r["seconds"], 3) for r in runs],
        "row_len": runs[0]["shard"].row_len,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[4096, 8192, 16384, 32768, 65536])
    parser.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--branch-sets", type=int, nargs="+", default=[6, 0],
                        help="P per measured call: 6 = the last pass of a D = 7 unroll, 0 = pass 1 / the target")
    parser.add_argument("--mha-seq-lens", type=int, nargs="*", default=[16384, 65536],
                        help=f"also measure Hkv = Hq = {N_HEADS} (no GQA) at these S (none: skip)")
    parser.add_argument("--pieces", type=int, default=DEFAULT_PIECES, help="messages per ring hop")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", type=Path, default=ROOT / "assets" / "bench_cp.json")
    parser.add_argument("--png", type=Path, default=ROOT / "assets" / "bench_cp.png",
                        help="P = first --branch-sets; the other P values get NAME_p<P>.png")
    parser.add_argument("--replot", action="store_true", help="only redraw the PNGs from an existing --json")
    args = parser.parse_args()
    if args.replot:
        result = json.loads(args.json.read_text())
        for p, png in png_paths(args.png, result["config"]["branch_sets"]):
            plot(result["records"], p, png)
        return 0
    torch.set_num_threads(args.threads)
    start = time.perf_counter()

    failures = check_correctness(min(args.seq_lens), args.pieces)
    if failures:
        for failure in failures:
            print(f"FAIL: {failure}", file=sys.stderr)
        return 1
    print(f"correctness checks passed ({time.perf_counter() - start:.0f} s)")

    records, singles, balance = [], [], []
    configs = [(N_KV_HEADS, args.seq_lens)] + ([(N_HEADS, args.mha_seq_lens)] if args.mha_seq_lens else [])
    for kv_heads, seq_lens in configs:
        for seq_len in seq_lens:
            for branch_sets in args.branch_sets:
                tensors = full_inputs(seq_len, branch_sets, kv_heads=kv_heads)
                singles.append(run_single_device(seq_len, tensors))
                for world in args.worlds:
                    impls = [("ring", "zigzag")] + ([("gather", "zigzag")] if world > 1 else [])
                    if world > 1 and branch_sets == args.branch_sets[0] and kv_heads == N_KV_HEADS:
                        impls.append(("ring", "contiguous"))
                    for impl, layout in impls:
                        records.append(measure(impl, layout, world, seq_len, tensors, args.pieces))
                        r = records[-1]
                        print(f"Hkv={kv_heads} P={branch_sets} {impl:>6} {layout:>10}  W={world}  S={seq_len:>6}  "
                              f"peak/rank {r['peak_bytes_per_rank'] / 2**20:8.1f} MiB  {r['seconds']:7.2f} s  "
                              f"work max/mean {r['work_max_over_mean']:.3f}", flush=True)
    for seq_len in args.seq_lens:
        for world in args.worlds[1:]:
            balance.append({
                "world": world, "seq_len": seq_len,
                "zigzag": round(max_over_mean(schedule_work("zigzag", world, seq_len)), 4),
                "zigzag_per_message": round(message_work_max_over_mean(world, seq_len, args.pieces), 4),
                "contiguous_per_document": round(max_over_mean(schedule_work("contiguous", world, seq_len)), 4),
                "contiguous_row": round(max_over_mean(row_contiguous_work(world, seq_len)), 4),
            })

    summary, failures = summarize(records, singles)
    failures += [f"zigzag work per message max/mean {b['zigzag_per_message']} > {GOAL_WORK_MAX_OVER_MEAN} "
                 f"at W = {b['world']}, S = {b['seq_len']}"
                 for b in balance if b["zigzag_per_message"] > GOAL_WORK_MAX_OVER_MEAN]
    result = {
        "description": __doc__.split("\n\n")[1].replace("\n", " "),
        "config": {"n_heads": N_HEADS, "n_kv_heads": [kv for kv, _ in configs], "head_dim": HEAD_DIM,
                   "branch_sets": args.branch_sets, "pieces": args.pieces, "dtype": "float32",
                   "doc_fractions": list(DOC_FRACTIONS), "threads": args.threads, "torch": torch.__version__},
        "method": " ".join(__doc__.split("\n\n")[3:6]).replace("\n", " "),
        "goals": summary["goals"],
        "records": records,
        "single_device": singles,
        "work_balance": balance,
        "summary": summary,
        "checks": {"passed": not failures, "failures": failures},
        "command": command_line(),
        "runtime_seconds": round(time.perf_counter() - start, 1),
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2) + "\n")
    for p, png in png_paths(args.png, args.branch_sets):
        plot(records, p, png)
    for g in summary["goals"]:
        ratios = "  ".join(f"W={w}: {r:.3f}" for w, r in g["ring_over_single_div_w"].items())
        met = ", ".join(f"{name} {'MET' if ok else 'NOT met'}" for name, ok in g["met"].items())
        print(f"Hkv={g['n_kv_heads']} P={g['branch_sets']} S={g['seq_len']}: ring / (single / W) {ratios}; "
              f"gather / ring at W={g['gather_over_ring_at_max_w']['world']}: "
              f"{g['gather_over_ring_at_max_w']['ratio']:.2f}; work max/mean {g['work_max_over_mean']:.3f}; {met}")
    for failure in failures:
        print(f"FAIL: {failure}", file=sys.stderr)
    return 1 if failures else 0


GOAL_RING_OVER_SINGLE_DIV_W = 1.2   # (1) per-rank memory within 1.2x single-device / W
GOAL_WORK_MAX_OVER_MEAN = 1.05      # (3) zigzag work balance


def summarize(records: list[dict], singles: list[dict]) -> tuple[dict, list[str]]:
    """The issue's goals: per (Hkv, S, P, W) the ratios, and per (Hkv, P) at the largest S
    whether each goal is met (``goals``)."""
    failures, rows = [], []
    by_key = {(r["impl"], r["sharding"], r["world"], r["seq_len"], r["branch_sets"], r["n_kv_heads"]): r
              for r in records}
    single = {(s["seq_len"], s["branch_sets"], s["n_kv_heads"]): s for s in singles}
    for (impl, layout, world, seq_len, p, kv), ring in sorted(by_key.items()):
        if impl != "ring" or layout != "zigzag" or world == 1:
            continue
        gather = by_key[("gather", "zigzag", world, seq_len, p, kv)]
        ref = single[(seq_len, p, kv)]
        per_rank_share = ref["peak_bytes"] / world
        row = {"n_kv_heads": kv, "seq_len": seq_len, "branch_sets": p, "world": world,
               "ring_over_single_div_w": round(ring["peak_bytes_per_rank"] / per_rank_share, 3),
               "ring_minus_1_2x_single_div_w_bytes": round(ring["peak_bytes_per_rank"] - 1.2 * per_rank_share),
               "gather_over_ring": round(gather["peak_bytes_per_rank"] / ring["peak_bytes_per_rank"], 3),
               # Gathering the whole sequence (the draft run unsharded on every rank) needs at
               # least the single-device op's memory on every rank.
               "single_over_ring": round(ref["peak_bytes"] / ring["peak_bytes_per_rank"], 3),
               "ring_speedup_over_single": round(ref["seconds"] / ring["seconds"], 2),
               "zigzag_work_max_over_mean": ring["work_max_over_mean"]}
        contiguous = by_key.get(("ring", "contiguous", world, seq_len, p, kv))
        if contiguous:
            row["contiguous_work_max_over_mean"] = contiguous["work_max_over_mean"]
            row["contiguous_over_zigzag_seconds"] = round(contiguous["seconds"] / ring["seconds"], 3)
        rows.append(row)
        if ring["work_max_over_mean"] > GOAL_WORK_MAX_OVER_MEAN:
            failures.append(f"zigzag work max/mean {ring['work_max_over_mean']} > {GOAL_WORK_MAX_OVER_MEAN} "
                            f"at W = {world}, S = {seq_len}")
    goals = []
    for kv, p in sorted({(r["n_kv_heads"], r["branch_sets"]) for r in rows}):
        mine = [r for r in rows if (r["n_kv_heads"], r["branch_sets"]) == (kv, p)]
        largest = max(r["seq_len"] for r in mine)
        at = {r["world"]: r for r in mine if r["seq_len"] == largest}
        w_max = max(at)
        ring_ratio = {w: r["ring_over_single_div_w"] for w, r in sorted(at.items())}
        work = max(r["zigzag_work_max_over_mean"] for r in mine)
        goals.append({
            "n_kv_heads": kv, "branch_sets": p, "seq_len": largest,
            "ring_over_single_div_w": ring_ratio,
            "gather_over_ring_at_max_w": {"world": w_max, "ratio": at[w_max]["gather_over_ring"]},
            "work_max_over_mean": work,
            "met": {"ring_within_1.2x_single_div_w": max(ring_ratio.values()) <= GOAL_RING_OVER_SINGLE_DIV_W,
                    "gather_over_ring_at_least_w_div_2": at[w_max]["gather_over_ring"] >= w_max / 2,
                    "work_max_over_mean_at_most_1.05": work <= GOAL_WORK_MAX_OVER_MEAN},
        })
    return {"goals": goals, "per_size": rows}, failures


# ---- plot ---------------------------------------------------------------------------------------------

def plot(records: list[dict], p: int, path: Path) -> None:
    """Peak bytes per rank against S (log-log), GQA config, ``P = p``: ring at every W, gather at every W > 1."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(9, 6))
    colors = {1: "black", 2: "tab:green", 4: "tab:blue", 8: "tab:red"}
    series = {}
    for r in records:
        if r["sharding"] == "zigzag" and r["branch_sets"] == p and r["n_kv_heads"] == N_KV_HEADS:
            series.setdefault((r["impl"], r["world"]), []).append((r["seq_len"], r["peak_bytes_per_rank"]))
    for (impl, world), pts in sorted(series.items()):
        sizes, peaks = zip(*sorted(pts))
        ax.plot(sizes, [b / 2**20 for b in peaks], marker="o", color=colors.get(world, "grey"),
                ls="-" if impl == "ring" else "--", label=f"{'ring' if impl == 'ring' else 'gather K/V'}, W = {world}")
    sizes = sorted({s for pts in series.values() for s, _ in pts})
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    ax.set_xticks(sizes, [f"{s // 1024}K" for s in sizes])
    plain_ticks(ax.yaxis)
    ax.set_xlabel("tokens per row, S")
    ax.set_ylabel("peak MiB per rank (live tensor storages)")
    pieces = next(r["pieces"] for r in records if r["impl"] == "ring")
    ax.set_title(f"draft attention fwd+bwd per rank, P = {p}, Hkv = {N_KV_HEADS}, {pieces} pieces per hop (CPU, fp32)")
    ax.grid(alpha=0.3, which="both")
    ax.legend(ncol=2)
    save_figure(fig, path)


def png_paths(png: Path, branch_sets: list[int]) -> list[tuple[int, Path]]:
    """The first P gets ``png``, the others ``<stem>_p<P>.png``."""
    return [(p, png if i == 0 else png.with_name(f"{png.stem}_p{p}{png.suffix}")) for i, p in enumerate(branch_sets)]


if __name__ == "__main__":
    sys.exit(main())
