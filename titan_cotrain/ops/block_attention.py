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

__all__ = ["block_attention", "block_attention_exact", "block_attention_flex"]

# The exact path's chunk: about this many score elements per head (block rows x context rows).
EXACT_CHUNK_SCORES = 1 << 22


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


def block_attention_exact(
    q: torch.Tensor, ctx_k: torch.Tensor, ctx_v: torch.Tensor, blk_k: torch.Tensor, blk_v: torch.Tensor,
    ctx_start: torch.Tensor, ctx_end: torch.Tensor, scale: float, chunk_scores: int = EXACT_CHUNK_SCORES,
) -> torch.Tensor:
    """``out [N, B, Hq, Dh]`` (q's dtype), the blocks taken in chunks whose scores stay near
    ``chunk_scores`` elements per head. Reads the chunks' context spans on the host (one
    sync per chunk): the CPU and test path."""
    _check(q, ctx_k, ctx_v, blk_k, blk_v, ctx_start, ctx_end)
    n, b, hq, d = q.shape
    rep = hq // ctx_k.shape[1]
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    starts, ends = ctx_start.tolist(), ctx_end.tolist()
    outs, first = [], 0
    while first < n:
        # Grow the chunk while its blocks' context span keeps the scores within budget.
        last, lo, hi = first + 1, starts[first], ends[first]
        while last < n and (last + 1 - first) * b * (max(hi, ends[last]) - min(lo, starts[last]) + b) <= chunk_scores:
            lo, hi = min(lo, starts[last]), max(hi, ends[last])
            last += 1
        hi = max(hi, lo)
        qc = q[first:last].to(acc)
        kc = ctx_k[lo:hi].to(acc).repeat_interleave(rep, dim=1)  # [L, Hq, Dh]
        vc = ctx_v[lo:hi].to(acc).repeat_interleave(rep, dim=1)
        kb = blk_k[first:last].to(acc).repeat_interleave(rep, dim=2)  # [c, B, Hq, Dh]
        vb = blk_v[first:last].to(acc).repeat_interleave(rep, dim=2)
        rows = torch.arange(lo, hi, device=q.device)
        keep = (rows >= ctx_start[first:last, None]) & (rows < ctx_end[first:last, None])  # [c, L]
        s_ctx = torch.einsum("cqhd,lhd->chql", qc, kc) * scale
        s_ctx = s_ctx.masked_fill(~keep[:, None, None, :], float("-inf"))
        s_blk = torch.einsum("cqhd,ckhd->chqk", qc, kb) * scale
        p = torch.cat([s_ctx, s_blk], dim=-1).softmax(-1)  # the block's own keys: never an empty row
        out = (torch.einsum("chql,lhd->cqhd", p[..., : hi - lo], vc)
               + torch.einsum("chqk,ckhd->cqhd", p[..., hi - lo:], vb))
        outs.append(out.to(q.dtype))
        first = last
    return torch.cat(outs)


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
    """The block drafter's attention (module docstring): ``flex`` on an accelerator, ``exact`` on CPU."""
    if q.device.type == "cpu":
        return block_attention_exact(q, ctx_k, ctx_v, blk_k, blk_v, ctx_start, ctx_end, scale)
    return block_attention_flex(q, ctx_k, ctx_v, blk_k, blk_v, ctx_start, ctx_end, scale)
