"""Static, preallocated KV cache for the target's inference forward, and the attention of
new queries against a cache (the target's and the draft's decode path).

Caches are head-major, ``[..., B, Hkv, L, Dh]``: one sequence's keys of one KV head are
contiguous, so the grouped attention below batches over ``B * Hkv`` without copying the
cache, and the layout is the one SDPA and decode kernels read.
"""

from __future__ import annotations

import copy
import math

import torch
import torch.nn.functional as F

from titan_cotrain.ops.attention import lse_dtype

__all__ = ["KVCache", "cached_attention"]


class KVCache:
    """Keys and values ``[n_layers, B, Hkv, max_len, Dh]``, allocated once.

    Slot ``[layer, b, :, p]`` holds the keys of sequence ``b`` at position ``p``. Writes go
    to explicit per-sequence positions, so sequences advance independently.
    """

    def __init__(
        self, n_layers: int, batch: int, max_len: int, n_kv_heads: int, head_dim: int,
        dtype: torch.dtype, device: torch.device | str,
    ) -> None:
        shape = (n_layers, batch, n_kv_heads, max_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)

    @property
    def max_len(self) -> int:
        return self.k.shape[3]

    @property
    def batch(self) -> int:
        return self.k.shape[1]

    def rows(self, batch: int, length: int | None = None) -> KVCache:
        """A view of the first ``batch`` sequences and (optionally) their first ``length``
        positions: same storage, nothing allocated. A prefill over ``length`` positions
        attends to that many keys instead of the whole cache."""
        view = copy.copy(self)
        view.k, view.v = self.k[:, :batch, :, :length], self.v[:, :batch, :, :length]
        return view

    def write(
        self, layer: int, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store ``k, v [B, s, Hkv, Dh]`` at ``positions [B, s]``; return the layer's full
        ``keys, values [B, Hkv, max_len, Dh]``."""
        if positions.shape[0] != self.batch:
            raise ValueError(f"cache holds {self.batch} sequences, got a batch of {positions.shape[0]}")
        rows = torch.arange(positions.shape[0], device=positions.device).unsqueeze(1)
        # The two index tensors sandwich the head slice, so the indexed shape is [B, s, Hkv, Dh].
        self.k[layer][rows, :, positions] = k.to(self.k.dtype)
        self.v[layer][rows, :, positions] = v.to(self.v.dtype)
        return self.k[layer], self.v[layer]


def _use_sdpa(q: torch.Tensor) -> bool:
    return q.device.type == "cpu"


def cached_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """``q [B, s, Hq, Dh]`` over a cache's ``keys, values [B, Hkv, L, Dh]``, query ``i`` of
    sequence ``b`` seeing the slots where ``visible: bool [B, s, L]``; returns ``[B, s, Hq, Dh]``
    in q's dtype. Query head ``h`` reads KV head ``h // (Hq / Hkv)`` (SDPA's ``enable_gqa``).

    On CPU this is SDPA (the exact reference the tests compare against). Elsewhere SDPA with
    a boolean mask and GQA falls to its math kernel, which repeats K/V to all ``Hq`` heads
    over the whole cache; instead the ``g = Hq / Hkv`` query heads of a KV head become
    ``g * s`` rows against that head's keys, so the only temporaries are the fp32 scores
    ``[B, Hkv, g * s, L]`` (no K/V copy: the cache's ``B, Hkv`` dims fold into one batch dim).
    """
    b, s, hq, dh = q.shape
    hkv, length = keys.shape[1], keys.shape[2]
    if _use_sdpa(q):
        out = F.scaled_dot_product_attention(q.transpose(1, 2), keys, values, attn_mask=visible.unsqueeze(1),
                                             enable_gqa=hq != hkv)
        return out.transpose(1, 2)
    g, acc = hq // hkv, lse_dtype(q.dtype)
    rows = q.view(b, s, hkv, g, dh).permute(0, 2, 3, 1, 4).reshape(b * hkv, g * s, dh)
    keys_t = keys.flatten(0, 1).transpose(1, 2)  # [B * Hkv, Dh, L], a view
    # Half-precision scores come out of the GEMM in fp32 rather than upcasting the cache.
    scores = torch.bmm(rows, keys_t) if q.dtype == acc else torch.bmm(rows, keys_t, out_dtype=acc)
    scores = scores.mul_(1 / math.sqrt(dh)).view(b, hkv, g, s, length)
    scores.masked_fill_(~visible.view(b, 1, 1, s, length), float("-inf"))
    probs = scores.softmax(-1).to(values.dtype).view(b * hkv, g * s, length)
    out = torch.bmm(probs, values.flatten(0, 1))  # [B * Hkv, g * s, Dh]
    return out.view(b, hkv, g, s, dh).permute(0, 3, 1, 2, 4).reshape(b, s, hq, dh)
