"""Paged KV cache for the target's inference forward (and the draft's trunk), and the
attention of new queries against a cache (the target's and the draft's decode path).

A ``KVPool`` is one tensor of fixed-size *blocks* per keys and values, token-major inside a
block, ``[n_layers, n_blocks, block_size, Hkv, Dh]`` (the layout paged decode kernels read).
A sequence owns a list of blocks, its *block table*: position ``p`` lives in block
``table[p // block_size]`` at offset ``p % block_size``. Blocks are handed out and taken
back by the engine's scheduler (``titan_cotrain.engine.kv_blocks``), so a sequence holds
memory for the positions it has reached, and sequences of a GRPO group can point at the
same prompt blocks. Block 0 is the *scratch* block: table entries past what a sequence
owns point there, so the writes of padding and of finished rows land where nobody reads.

``KVPool.view`` gives the batch-shaped ``PagedKV`` a forward writes and attends through:
``write`` stores new keys, ``attend`` runs the new queries against every key a row has.

How ``attend`` runs. On an accelerator whose torch has the paged flash kernel
(``torch.nn.attention.varlen.varlen_attn`` with ``block_table``, torch 2.13), the kernel reads
the pool through the block table: no gather, no score tensor, one call per layer for the
whole batch (``titan_cotrain.ops.flash.paged_forward``; blocks of a multiple of 256
positions). Elsewhere, and as the tests' reference, the rows' blocks are gathered into one
``[B, Hkv, width, Dh]`` view and attended with a mask by position (``cached_attention``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from titan_cotrain.ops import flash
from titan_cotrain.ops.attention import lse_dtype

__all__ = ["SCRATCH_BLOCK", "KVPool", "PagedKV", "RowsKV", "cached_attention", "paged_attention"]

SCRATCH_BLOCK = 0


class KVPool:
    """Keys and values ``[n_layers, n_blocks, block_size, Hkv, Dh]``, allocated once (zeros:
    padding reads finite values)."""

    def __init__(self, n_layers: int, n_blocks: int, block_size: int, n_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str) -> None:
        if n_blocks < 2 or block_size < 1:
            raise ValueError(f"a pool needs the scratch block and one more ({n_blocks} blocks) of >= 1 "
                             f"positions ({block_size})")
        shape = (n_layers, n_blocks, block_size, n_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)

    @property
    def n_blocks(self) -> int:
        return self.k.shape[1]

    @property
    def block_size(self) -> int:
        return self.k.shape[2]

    def view(self, table: torch.Tensor) -> PagedKV:
        """The sequences of ``table: int64 [B, nb]`` (block ids, row ``b`` = sequence ``b``)."""
        return PagedKV(self, table)

    def rows(self, first: int, batch: int, width: int | None = None) -> RowsKV:
        """Blocks ``first .. first + batch - 1`` as sequences ``0 .. batch - 1``, one block
        each: the static layout, read without a gather (see ``RowsKV``)."""
        return RowsKV(self, first, batch, width or self.block_size)

    @torch.no_grad()
    def copy_blocks(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Block ``dst[i]`` <- block ``src[i]`` in every layer (copy-on-write)."""
        for t in (self.k, self.v):
            t[:, dst] = t[:, src]


@dataclass
class PagedKV:
    """A batch's view of a ``KVPool``: ``table [B, nb]`` maps each sequence's logical blocks
    to the pool's. What a forward sees is the first ``width = nb * block_size`` positions of
    every sequence; it must write only below that."""

    pool: KVPool
    table: torch.Tensor

    @property
    def width(self) -> int:
        return self.table.shape[1] * self.pool.block_size

    def _where(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        bs = self.pool.block_size
        return self.table.gather(1, positions // bs), positions % bs

    def write(self, layer: int, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store ``k, v [B, s, Hkv, Dh]`` at ``positions [B, s]`` (each ``< width``)."""
        if positions.shape[0] != self.table.shape[0]:
            raise ValueError(f"cache view holds {self.table.shape[0]} sequences, got a batch of {positions.shape[0]}")
        block, offset = self._where(positions)
        self.pool.k[layer][block, offset] = k.to(self.pool.k.dtype)
        self.pool.v[layer][block, offset] = v.to(self.pool.v.dtype)

    def attend(self, layer: int, q: torch.Tensor, seqused: torch.Tensor, return_lse: bool = False):
        """``q [B, s, Hq, Dh]`` against the layer's keys, row ``b`` having ``seqused[b]`` of
        them (``[B]``, on the device) and its query ``i`` at position ``seqused[b] - s + i``,
        seeing the keys at or before it. Returns ``out [B, s, Hq, Dh]`` (and with
        ``return_lse`` its ``lse [B, s, Hq]``, fp32). The paged kernel where it runs, else the
        gathered reference (module docstring)."""
        if _paged_kernel_runs(q, self.pool):
            return paged_attention(q, self.pool.k[layer], self.pool.v[layer], self.table, seqused, return_lse)
        keys, values = self.read(layer)
        return cached_attention(q, keys, values, seqused, return_lse)

    def read(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        b = self.table.shape[0]
        keys = self.pool.k[layer][self.table].view(b, self.width, *self.pool.k.shape[3:])
        values = self.pool.v[layer][self.table].view(b, self.width, *self.pool.v.shape[3:])
        return keys.transpose(1, 2), values.transpose(1, 2)


@dataclass
class RowsKV:
    """The static layout: sequence ``b`` is the whole block ``first + b`` (a pool whose block
    holds a sequence's every position), and a forward sees its first ``width`` positions as
    views of the pool, nothing copied. ``write``, ``attend`` and ``read`` as ``PagedKV``'s."""

    pool: KVPool
    first: int
    batch: int
    width: int

    def write(self, layer: int, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        if positions.shape[0] != self.batch:
            raise ValueError(f"cache view holds {self.batch} sequences, got a batch of {positions.shape[0]}")
        rows = self.first + torch.arange(self.batch, device=positions.device).unsqueeze(1)
        self.pool.k[layer][rows, positions] = k.to(self.pool.k.dtype)
        self.pool.v[layer][rows, positions] = v.to(self.pool.v.dtype)

    def attend(self, layer: int, q: torch.Tensor, seqused: torch.Tensor, return_lse: bool = False):
        """As ``PagedKV.attend``; a row is one block, so the kernel's table is ``[[first + b]]``."""
        if _paged_kernel_runs(q, self.pool):
            table = self.first + torch.arange(self.batch, device=q.device).unsqueeze(1)
            return paged_attention(q, self.pool.k[layer], self.pool.v[layer], table, seqused, return_lse)
        keys, values = self.read(layer)
        return cached_attention(q, keys, values, seqused, return_lse)

    def read(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        span = slice(self.first, self.first + self.batch)
        return (self.pool.k[layer][span, : self.width].transpose(1, 2),
                self.pool.v[layer][span, : self.width].transpose(1, 2))


def _paged_kernel_runs(q: torch.Tensor, pool: KVPool) -> bool:
    """Whether ``attend`` takes the paged flash kernel: an accelerator, a torch that has it,
    and a pool it reads (bf16/fp16, blocks of a multiple of ``flash.PAGE_MULTIPLE``)."""
    return (flash.takes_flash_path(q) and flash.has_paged_kernel() and pool.block_size % flash.PAGE_MULTIPLE == 0
            and pool.k.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] % 8 == 0)


def paged_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, table: torch.Tensor,
                    seqused: torch.Tensor, return_lse: bool = False):
    """``q [B, s, Hq, Dh]`` over one layer's pool ``[n_blocks, block_size, Hkv, Dh]`` through
    ``table [B, nb]``, as ``PagedKV.attend`` describes, by the paged flash kernel."""
    b, s, hq, dh = q.shape
    width = table.shape[1] * k_pool.shape[1]
    out, lse = flash.paged_forward(q.reshape(b * s, hq, dh).to(k_pool.dtype), k_pool, v_pool, table,
                                   seqused.to(torch.int32), s, width, dh ** -0.5)
    out = out.view(b, s, hq, dh).to(q.dtype)
    return (out, lse.view(b, s, hq)) if return_lse else out


def _use_sdpa(q: torch.Tensor) -> bool:
    return not flash.takes_flash_path(q)


def cached_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, seqused: torch.Tensor,
                     return_lse: bool = False):
    """The reference: ``q [B, s, Hq, Dh]`` over a cache's gathered ``keys, values
    [B, Hkv, L, Dh]``, query ``i`` of row ``b`` seeing the slots ``< seqused[b] - s + i + 1``;
    returns ``[B, s, Hq, Dh]`` in q's dtype (and with ``return_lse`` the ``lse [B, s, Hq]``,
    fp32). Query head ``h`` reads KV head ``h // (Hq / Hkv)``.

    On CPU without the lse this is SDPA with a mask. Otherwise (and off CPU, where SDPA with a
    boolean mask and GQA falls to its math kernel, which repeats K/V to all ``Hq`` heads) the
    ``g = Hq / Hkv`` query heads of a KV head become ``g * s`` rows against that head's keys,
    so the temporaries are the fp32 scores ``[B, Hkv, g * s, L]``.
    """
    b, s, hq, dh = q.shape
    hkv, length = keys.shape[1], keys.shape[2]
    visible = torch.arange(length, device=q.device) < (seqused.view(b, 1, 1) - s + 1
                                                       + torch.arange(s, device=q.device).view(1, s, 1))  # [B, s, L]
    if _use_sdpa(q) and not return_lse:
        out = F.scaled_dot_product_attention(q.transpose(1, 2), keys, values, attn_mask=visible.unsqueeze(1),
                                             enable_gqa=hq != hkv)
        return out.transpose(1, 2)
    g, acc = hq // hkv, lse_dtype(q.dtype)
    rows = q.view(b, s, hkv, g, dh).permute(0, 2, 3, 1, 4).reshape(b * hkv, g * s, dh)
    keys_t = keys.reshape(b * hkv, length, dh).transpose(1, 2)  # [B * Hkv, Dh, L]
    scores = torch.bmm(rows.to(acc), keys_t.to(acc))
    scores = scores.mul_(1 / math.sqrt(dh)).view(b, hkv, g, s, length)
    scores.masked_fill_(~visible.view(b, 1, 1, s, length), float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [B, Hkv, g, s]
    probs = torch.exp(scores - lse.unsqueeze(-1)).nan_to_num_(0.0).to(values.dtype).view(b * hkv, g * s, length)
    out = torch.bmm(probs, values.reshape(b * hkv, length, dh))  # [B * Hkv, g * s, Dh]
    out = out.view(b, hkv, g, s, dh).permute(0, 3, 1, 2, 4).reshape(b, s, hq, dh).to(q.dtype)
    if not return_lse:
        return out
    return out, lse.permute(0, 3, 1, 2).reshape(b, s, hq)
