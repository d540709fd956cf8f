"""The block drafter's attention: each block attends to its document's context before its
anchor, and to itself without a causal mask.

Layout: ``N`` blocks of ``B`` query rows, ``q [N, B, Hq, Dh]``; the context keys and values
of every position of the packed batch, ``ctx_k, ctx_v [T, Hkv, Dh]``; each block's own keys
and values, ``blk_k, blk_v [N, B, Hkv, Dh]``. Block ``n`` reads the context rows
``ctx_start[n] <= t < ctx_end[n]`` (its document's positions before its anchor: the *trunk*
part, in this project's branch-attention terms) and all ``B`` of its own rows (the *branch*).
GQA: ``Hq`` is a multiple of ``Hkv``.

Two paths compute the same function:

* ``exact``: einsum scores over one chunk of blocks at a time, against the context rows the
  chunk's blocks span, in the log-sum-exp dtype (fp32; fp64 for fp64 inputs), differentiable
  by autograd. The CPU path and the reference of the tests.
* ``flex``: one ``flex_attention`` call over ``[context ; every block's rows]`` with the mask
  above as a block-sparse mask (nothing of size ``T x T`` or ``N B x T`` is built); compiled
  on an accelerator. torch's CPU build runs it forward only (no CPU backward), which is
  how its mask is checked against ``exact`` here.
"""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import is_fake

from titan_cotrain.ops.attention import lse_dtype, merge_attention

__all__ = ["BlockContextRing", "block_attention", "block_attention_exact", "block_attention_flex",
           "block_context_partial", "chunk_plan", "context_partial_backward_exact", "context_partial_exact",
           "merge_partials", "own_block_partial"]

# The exact path's chunk: about this many score elements per head (block rows x context rows).
EXACT_CHUNK_SCORES = 1 << 22
# ... and at most twice the context rows its blocks read, plus this many rows a block.
EXACT_CHUNK_SLACK = 64


def _check(q, ctx_k, ctx_v, blk_k, blk_v, ctx_start, ctx_end) -> None:
    n, b, hq, d = q.shape
    if ctx_k.shape != ctx_v.shape or ctx_k.dim() != 3 or ctx_k.shape[-1] != d:
        raise ValueError(f"ctx_k / ctx_v must be [T, Hkv, {d}], got {tuple(ctx_k.shape)} / {tuple(ctx_v.shape)}")
    hkv = ctx_k.shape[1]
    if blk_k.shape != (n, b, hkv, d) or blk_v.shape != blk_k.shape:
        raise ValueError(f"blk_k / blk_v must be [{n}, {b}, {hkv}, {d}], got {tuple(blk_k.shape)}")
    if hq % hkv:
        raise ValueError(f"query heads ({hq}) must be a multiple of key/value heads ({hkv})")
    if ctx_start.shape != (n,) or ctx_end.shape != (n,):
        raise ValueError(f"ctx_start / ctx_end must be [{n}], got {tuple(ctx_start.shape)} / {tuple(ctx_end.shape)}")


def _scores_lse(s: torch.Tensor, keep: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(p, lse)`` of scores ``s [c, H, B, L]`` over their last dimension, ``keep [c, L]`` the
    visible keys (None: all). A block with no visible key gets ``p = 0`` and ``lse = -inf``,
    with finite gradients (its scores are replaced before the softmax, not after)."""
    if keep is None:
        lse = torch.logsumexp(s, -1)
        return (s - lse[..., None]).exp(), lse
    empty = ~keep.any(-1)  # [c]
    s = s.masked_fill(~keep[:, None, None, :], float("-inf")).masked_fill(empty[:, None, None, None], 0.0)
    lse = torch.logsumexp(s, -1)
    p = (s - lse[..., None]).exp().masked_fill(empty[:, None, None, None], 0.0)
    return p, lse.masked_fill(empty[:, None, None], float("-inf"))


def chunk_plan(starts: list[int], ends: list[int], b: int, chunk_scores: int = EXACT_CHUNK_SCORES) -> list[int]:
    """The exact path's chunks of blocks (host ints): consecutive blocks whose context span
    keeps the scores near ``chunk_scores`` elements per head (``b`` query rows a block) and is
    at most twice the rows they read (plus ``EXACT_CHUNK_SLACK`` a block: a span over several
    documents is mostly masked, each block reading its own document's prefix). Flat
    ``[first, last, lo, hi, ...]``: blocks ``[first, last)`` and the context rows ``[lo, hi)``
    they span."""
    plan, n, first = [], len(starts), 0
    while first < n:
        last, lo, hi = first + 1, starts[first], ends[first]
        read = hi - lo
        while last < n:
            new_lo, new_hi = min(lo, starts[last]), max(hi, ends[last])
            blocks, new_read = last + 1 - first, read + ends[last] - starts[last]
            if (blocks * b * (new_hi - new_lo + b) > chunk_scores
                    or blocks * (new_hi - new_lo) > 2 * new_read + blocks * EXACT_CHUNK_SLACK):
                break
            lo, hi, read = new_lo, new_hi, new_read
            last += 1
        plan += [first, last, lo, max(hi, lo)]
        first = last
    return plan


def _chunks(q, ctx_k, ctx_v, ctx_start, ctx_end, chunk_scores: int, plan: list[int]):
    """``chunk_plan``'s chunks (``plan``; empty: planned here from the spans, one read of them
    from the device): per chunk ``(first, last, lo, hi, qc, kc, vc, keep)``, its queries and
    context rows' keys and values in the log-sum-exp dtype (key heads repeated for GQA:
    ``[L, Hq, Dh]``), and ``keep [c, L]`` the rows each block reads."""
    if not plan and q.shape[0]:
        plan = chunk_plan(ctx_start.tolist(), ctx_end.tolist(), q.shape[1], chunk_scores)
    rep = q.shape[2] // ctx_k.shape[1]
    acc = lse_dtype(q.dtype)
    for i in range(0, len(plan), 4):
        first, last, lo, hi = plan[i:i + 4]
        rows = torch.arange(lo, hi, device=q.device)
        keep = (rows >= ctx_start[first:last, None]) & (rows < ctx_end[first:last, None])
        yield (first, last, lo, hi, q[first:last].to(acc), ctx_k[lo:hi].to(acc).repeat_interleave(rep, dim=1),
               ctx_v[lo:hi].to(acc).repeat_interleave(rep, dim=1), keep)


def context_partial_exact(
    q: torch.Tensor, ctx_k: torch.Tensor, ctx_v: torch.Tensor, ctx_start: torch.Tensor, ctx_end: torch.Tensor,
    scale: float, chunk_scores: int = EXACT_CHUNK_SCORES, plan: list[int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The blocks' attention over their context rows alone: ``(out [N, B, Hq, Dh], lse [N, B,
    Hq])`` in the log-sum-exp dtype (fp32, fp64 for fp64 inputs); a block with no context row
    gets ``out = 0``, ``lse = -inf``. Differentiable by autograd. ``plan``: ``chunk_plan``'s,
    made once by a caller that calls this for every layer; without it the chunks' spans are
    read here (one sync per call)."""
    acc = lse_dtype(q.dtype)
    outs, lses = [], []
    for _, _, _, _, qc, kc, vc, keep in _chunks(q, ctx_k, ctx_v, ctx_start, ctx_end, chunk_scores, plan or []):
        p, lse = _scores_lse(torch.einsum("cqhd,lhd->chql", qc, kc) * scale, keep)
        outs.append(torch.einsum("chql,lhd->cqhd", p, vc))
        lses.append(lse.transpose(1, 2))  # [c, B, Hq]
    if not outs:  # no block: zeros, still on the graph of the context (its parameters get zero gradients)
        touch = (ctx_k.sum() + ctx_v.sum()).to(acc) * 0.0
        return q.new_zeros(q.shape, dtype=acc) + touch, q.new_full(q.shape[:3], float("-inf"), dtype=acc)
    return torch.cat(outs), torch.cat(lses)


@torch.library.custom_op("titan_cotrain::block_context_partial", mutates_args=())
def _block_context_partial(q: torch.Tensor, ctx_k: torch.Tensor, ctx_v: torch.Tensor, ctx_start: torch.Tensor,
                           ctx_end: torch.Tensor, scale: float, chunk_scores: int, plan: list[int]
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.no_grad():
        out, lse = context_partial_exact(q, ctx_k, ctx_v, ctx_start, ctx_end, scale, chunk_scores, plan)
    return out.contiguous(), lse.contiguous()


@_block_context_partial.register_fake
def _(q, ctx_k, ctx_v, ctx_start, ctx_end, scale, chunk_scores, plan):
    return q.new_empty(q.shape, dtype=lse_dtype(q.dtype)), q.new_empty(q.shape[:3], dtype=lse_dtype(q.dtype))


def context_partial_backward_exact(
    grad_out: torch.Tensor, grad_lse: torch.Tensor, q: torch.Tensor, ctx_k: torch.Tensor, ctx_v: torch.Tensor,
    ctx_start: torch.Tensor, ctx_end: torch.Tensor, scale: float, chunk_scores: int = EXACT_CHUNK_SCORES,
    plan: list[int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradients of ``context_partial_exact``'s ``(out, lse)`` for ``q, ctx_k, ctx_v``,
    chunk by chunk with the probabilities recomputed: ``dv = p^T do``, ``ds = p (do v^T - D +
    dlse)`` with ``D = sum(do * out)`` per query row, ``dq = ds k scale``, ``dk = ds^T q
    scale`` (GQA: summed over each key head's query heads)."""
    hkv = ctx_k.shape[1]
    rep = q.shape[2] // hkv
    acc = lse_dtype(q.dtype)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    dk = torch.zeros(ctx_k.shape, dtype=acc, device=q.device)
    dv = torch.zeros(ctx_v.shape, dtype=acc, device=q.device)
    for first, last, lo, hi, qc, kc, vc, keep in _chunks(q, ctx_k, ctx_v, ctx_start, ctx_end, chunk_scores,
                                                         plan or []):
        p, _ = _scores_lse(torch.einsum("cqhd,lhd->chql", qc, kc) * scale, keep)  # [c, Hq, B, L]
        go = grad_out[first:last].to(acc)  # [c, B, Hq, Dh]
        out = torch.einsum("chql,lhd->cqhd", p, vc)
        row_term = (go * out).sum(-1) - grad_lse[first:last].to(acc)  # [c, B, Hq]
        ds = p * (torch.einsum("cqhd,lhd->chql", go, vc) - row_term.transpose(1, 2)[..., None])
        dq[first:last] += torch.einsum("chql,lhd->cqhd", ds, kc) * scale
        dk[lo:hi] += (torch.einsum("chql,cqhd->lhd", ds, qc) * scale).unflatten(1, (hkv, rep)).sum(2)
        dv[lo:hi] += torch.einsum("chql,cqhd->lhd", p, go).unflatten(1, (hkv, rep)).sum(2)
    return dq.to(q.dtype), dk.to(ctx_k.dtype), dv.to(ctx_v.dtype)


# Its own op, so a traced or simulated backward is one opaque node (the chunks are planned from
# the blocks' context spans, which fake tensors do not hold).
@torch.library.custom_op("titan_cotrain::block_context_partial_backward", mutates_args=())
def _block_context_partial_backward(grad_out: torch.Tensor, grad_lse: torch.Tensor, q: torch.Tensor,
                                    ctx_k: torch.Tensor, ctx_v: torch.Tensor, ctx_start: torch.Tensor,
                                    ctx_end: torch.Tensor, scale: float, chunk_scores: int, plan: list[int]
                                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    grads = context_partial_backward_exact(grad_out, grad_lse, q, ctx_k, ctx_v, ctx_start, ctx_end, scale,
                                           chunk_scores, plan)
    return tuple(g.contiguous() for g in grads)


@_block_context_partial_backward.register_fake
def _(grad_out, grad_lse, q, ctx_k, ctx_v, ctx_start, ctx_end, scale, chunk_scores, plan):
    return tuple(x.new_empty(x.shape) for x in (q, ctx_k, ctx_v))


def _partial_setup(ctx, inputs, output):
    q, ctx_k, ctx_v, ctx_start, ctx_end, scale, chunk_scores, plan = inputs
    ctx.save_for_backward(q, ctx_k, ctx_v, ctx_start, ctx_end)
    ctx.scale, ctx.chunk_scores, ctx.plan = scale, chunk_scores, plan
    ctx.set_materialize_grads(False)


def _partial_backward(ctx, grad_out, grad_lse):
    q, ctx_k, ctx_v, ctx_start, ctx_end = ctx.saved_tensors
    acc = lse_dtype(q.dtype)
    grad_out = torch.zeros(q.shape, dtype=acc, device=q.device) if grad_out is None else grad_out
    grad_lse = torch.zeros(q.shape[:3], dtype=acc, device=q.device) if grad_lse is None else grad_lse
    grads = _block_context_partial_backward(grad_out.contiguous(), grad_lse.contiguous(), q, ctx_k, ctx_v,
                                            ctx_start, ctx_end, ctx.scale, ctx.chunk_scores, ctx.plan)
    return (*grads, None, None, None, None, None)


_block_context_partial.register_autograd(_partial_backward, setup_context=_partial_setup)


def block_context_partial(q: torch.Tensor, ctx_k: torch.Tensor, ctx_v: torch.Tensor, ctx_start: torch.Tensor,
                          ctx_end: torch.Tensor, scale: float, chunk_scores: int = EXACT_CHUNK_SCORES,
                          plan: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``context_partial_exact`` as one op (``titan_cotrain::block_context_partial``) with a
    fake kernel and its own backward op (``context_partial_backward_exact``): what the block
    attention calls, so the scale simulator's fake tensors (which hold no spans to plan
    chunks from) and tracing see one node with the output's shapes. ``plan``: as
    ``context_partial_exact``'s (the forward and the backward use it)."""
    return _block_context_partial(q, ctx_k, ctx_v, ctx_start, ctx_end, scale, chunk_scores, plan or [])


def own_block_partial(q: torch.Tensor, blk_k: torch.Tensor, blk_v: torch.Tensor,
                      scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Each block's attention over its own ``B`` rows (no mask): ``(out, lse)`` as
    ``context_partial_exact``'s."""
    rep = q.shape[2] // blk_k.shape[2]
    acc = lse_dtype(q.dtype)
    kb = blk_k.to(acc).repeat_interleave(rep, dim=2)  # [N, B, Hq, Dh]
    vb = blk_v.to(acc).repeat_interleave(rep, dim=2)
    p, lse = _scores_lse(torch.einsum("nqhd,nkhd->nhqk", q.to(acc), kb) * scale, None)
    return torch.einsum("nhqk,nkhd->nqhd", p, vb), lse.transpose(1, 2)


def merge_partials(own: tuple[torch.Tensor, torch.Tensor], parts: list[tuple[torch.Tensor, torch.Tensor]]
                   ) -> torch.Tensor:
    """The attention over the union of the keys from each part's ``(out, lse)``, folded into the
    block's own part (``ops.attention.merge_attention``): its ``lse`` is finite, so a part
    with ``lse = -inf`` (no key) weighs 0 with a zero gradient."""
    out, lse = own
    for part in parts:
        out, lse = merge_attention(out, lse, *part)
    return out


def block_attention_exact(
    q: torch.Tensor, ctx_k: torch.Tensor, ctx_v: torch.Tensor, blk_k: torch.Tensor, blk_v: torch.Tensor,
    ctx_start: torch.Tensor, ctx_end: torch.Tensor, scale: float, chunk_scores: int = EXACT_CHUNK_SCORES,
) -> torch.Tensor:
    """``out [N, B, Hq, Dh]`` (q's dtype): the context part (``block_context_partial``, blocks
    in chunks whose scores stay near ``chunk_scores`` elements per head) merged with the
    block's own part by log-sum-exp. The CPU and test path."""
    _check(q, ctx_k, ctx_v, blk_k, blk_v, ctx_start, ctx_end)
    context = block_context_partial(q, ctx_k, ctx_v, ctx_start, ctx_end, scale, chunk_scores)
    return merge_partials(own_block_partial(q, blk_k, blk_v, scale), [context]).to(q.dtype)


_compiled_flex = None


def block_attention_flex(
    q: torch.Tensor, ctx_k: torch.Tensor, ctx_v: torch.Tensor, blk_k: torch.Tensor, blk_v: torch.Tensor,
    ctx_start: torch.Tensor, ctx_end: torch.Tensor, scale: float, compiled: bool | None = None,
) -> torch.Tensor:
    """``out [N, B, Hq, Dh]``: one ``flex_attention`` over the keys ``[context (T rows) ;
    blocks (N B rows)]`` with the block mask, built from ``ctx_start``, ``ctx_end`` and the
    block index of every row (device tensors, no host sync). ``compiled``: through
    ``torch.compile`` (default: on an accelerator)."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    global _compiled_flex
    _check(q, ctx_k, ctx_v, blk_k, blk_v, ctx_start, ctx_end)
    n, b, hq, d = q.shape
    t = ctx_k.shape[0]
    block_of = torch.arange(n * b, device=q.device) // b

    def mask(batch, head, q_index, kv_index):
        block = block_of[q_index]
        own = (kv_index - t) // b == block
        context = (kv_index >= ctx_start[block]) & (kv_index < ctx_end[block])
        return torch.where(kv_index < t, context, own)

    block_mask = create_block_mask(mask, None, None, n * b, t + n * b, device=q.device)
    keys = torch.cat([ctx_k, blk_k.flatten(0, 1)])[None].transpose(1, 2)  # [1, Hkv, T + N B, Dh]
    values = torch.cat([ctx_v, blk_v.flatten(0, 1)])[None].transpose(1, 2)
    query = q.flatten(0, 1)[None].transpose(1, 2)  # [1, Hq, N B, Dh]
    if compiled is None:
        compiled = q.device.type != "cpu"
    if compiled and _compiled_flex is None:
        _compiled_flex = torch.compile(flex_attention)
    attend = _compiled_flex if compiled else flex_attention
    out = attend(query, keys, values, block_mask=block_mask, scale=scale, enable_gqa=hq != ctx_k.shape[1])
    return out[0].transpose(0, 1).reshape(n, b, hq, d)


def block_attention(
    q: torch.Tensor, ctx_k: torch.Tensor, ctx_v: torch.Tensor, blk_k: torch.Tensor, blk_v: torch.Tensor,
    ctx_start: torch.Tensor, ctx_end: torch.Tensor, scale: float,
) -> torch.Tensor:
    """The block drafter's attention (module docstring): ``flex`` on an accelerator, ``exact`` on
    CPU and on the scale simulator's fake tensors (its op has a fake kernel)."""
    if q.device.type == "cpu" or is_fake(q):
        return block_attention_exact(q, ctx_k, ctx_v, blk_k, blk_v, ctx_start, ctx_end, scale)
    return block_attention_flex(q, ctx_k, ctx_v, blk_k, blk_v, ctx_start, ctx_end, scale)


class _ExchangeRows(torch.autograd.Function):
    """``all_to_all`` of equal row chunks over ``group``: chunk ``o`` of the input goes to rank
    ``o``, chunk ``o`` of the output came from rank ``o``. Its own adjoint, so the backward is
    the same exchange of the gradients. Blocking collectives: the result is ready when it is
    returned (no asynchronous tensor for the autograd engine to read early)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        import torch.distributed as dist

        ctx.group = group
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _ExchangeRows.apply(grad.contiguous(), ctx.group), None


class _GatherRows(torch.autograd.Function):
    """``all_gather`` of equal ``[n, ...]`` tensors over ``group`` into ``[W n, ...]`` (rank order);
    the backward sends each rank its rows' gradients and sums what arrives (a reduce-scatter
    built from ``all_to_all``, which gloo has)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        import torch.distributed as dist

        ctx.group, ctx.world = group, dist.get_world_size(group)
        parts = [torch.empty_like(x) for _ in range(ctx.world)]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        import torch.distributed as dist

        arrived = torch.empty_like(grad)
        dist.all_to_all_single(arrived, grad.contiguous(), group=ctx.group)
        return arrived.view(ctx.world, -1, *grad.shape[1:]).sum(0), None


class BlockContextRing:
    """The block attention of one microbatch under context parallelism: a block's context (its
    document's positions before its anchor) is spread over the CP ranks' zigzag shards, while
    the block itself (its queries, keys and values) lives on the rank that holds its anchor.

    The queries travel instead of the context: every rank's blocks' queries are gathered (``N
    B`` rows, few next to the ``T`` context rows), each rank attends all of them to its own
    context rows (``context_partial_exact``: the part of each block's softmax over this rank's
    keys, with its log-sum-exp), the parts go back to the blocks' ranks in one
    ``all_to_all``, and there they merge by log-sum-exp with the block's own part
    (``merge_partials``), as a ring merges its steps. Both exchanges are differentiable
    (``_GatherRows``, ``_ExchangeRows``), so the gradients of the queries and of every rank's context
    keys and values are those of the one-device attention. The plan (which context rows of
    this rank each gathered block reads) is built once per microbatch.

    ``row_doc [T]``, ``row_pos [T]``: each local row's document (the same index on every rank)
    and global in-document position, rows of a document in increasing position (the zigzag
    shard's order); ``anchors [N]``: this rank's blocks' local anchor rows.
    """

    def __init__(self, group, row_doc: torch.Tensor, row_pos: torch.Tensor, anchors: torch.Tensor) -> None:
        import torch.distributed as dist

        self.group = group
        self.world = dist.get_world_size(group)
        device = row_doc.device
        self.n = anchors.numel()
        if is_fake(row_doc):  # the scale simulator: every rank holds as many blocks (no values to read)
            self.n_max = self.n
        else:
            counts = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(self.world)]
            dist.all_gather(counts, torch.tensor([self.n], dtype=torch.int64, device=device), group=group)
            self.n_max = max(int(c) for c in counts)
        # (document, anchor position) of every rank's blocks, padded with document -1.
        mine = torch.full((self.n_max, 2), -1, dtype=torch.int64, device=device)
        mine[: self.n, 0], mine[: self.n, 1] = row_doc[anchors], row_pos[anchors]
        every = [torch.empty_like(mine) for _ in range(self.world)]
        dist.all_gather(every, mine, group=group)
        doc, pos = torch.cat(every).unbind(1)
        # The context rows of block (doc, pos) here: this rank's rows of doc before pos, a
        # run of local rows (a document's rows are consecutive, in increasing position).
        key = row_doc * (1 << 32) + row_pos
        start = torch.searchsorted(key, doc * (1 << 32))
        end = torch.searchsorted(key, doc * (1 << 32) + pos)
        real = doc >= 0
        self.ctx_start, self.ctx_end = torch.where(real, start, 0), torch.where(real, end, 0)
        self.plan: list[int] | None = None  # chunk_plan's, made at the first layer's attend

    def attend(self, q: torch.Tensor, ctx_k: torch.Tensor, ctx_v: torch.Tensor, blk_k: torch.Tensor,
               blk_v: torch.Tensor, scale: float) -> torch.Tensor:
        """``out [N, B, Hq, Dh]`` for this rank's blocks (``block_attention``'s function over
        the whole, unsharded batch); ``ctx_k, ctx_v`` this rank's context rows."""
        if q.shape[0] != self.n:
            raise ValueError(f"the plan holds {self.n} blocks on this rank, got queries of {q.shape[0]}")
        n, b, hq, d = q.shape
        own = own_block_partial(q, blk_k, blk_v, scale)
        if self.n_max == 0:  # no rank has a block (every rank knows): nothing to exchange
            touch = (ctx_k.sum() + ctx_v.sum()) * 0.0  # zero gradients for the context's parameters
            return merge_partials(own, []).to(q.dtype) + touch
        padded = torch.cat([q, q.new_zeros(self.n_max - n, b, hq, d)]) if self.n_max > n else q
        every = _GatherRows.apply(padded, self.group)  # [W n_max, B, Hq, Dh]
        if self.plan is None and not is_fake(self.ctx_start):
            # One read of the spans for the microbatch: every layer, forward and backward, reuses it.
            self.plan = chunk_plan(self.ctx_start.tolist(), self.ctx_end.tolist(), b)
        out, lse = block_context_partial(every, ctx_k, ctx_v, self.ctx_start, self.ctx_end, scale, plan=self.plan)
        parts = torch.cat([out.flatten(2), lse], dim=-1).contiguous()  # [W n_max, B, Hq Dh + Hq]
        back = _ExchangeRows.apply(parts, self.group)
        back = back.view(self.world, self.n_max, b, -1)[:, :n]
        merged = [(part[..., : hq * d].unflatten(-1, (hq, d)), part[..., hq * d:]) for part in back.unbind(0)]
        return merge_partials(own, merged).to(q.dtype)
