"""Static, preallocated KV cache for the target's inference forward."""

from __future__ import annotations

import torch

__all__ = ["KVCache"]


class KVCache:
    """Keys and values ``[n_layers, B, max_len, Hkv, Dh]``, allocated once.

    Slot ``[layer, b, p]`` holds the key of sequence ``b`` at position ``p``. Writes go to
    explicit per-sequence positions, so sequences advance independently.
    """

    def __init__(
        self, n_layers: int, batch: int, max_len: int, n_kv_heads: int, head_dim: int,
        dtype: torch.dtype, device: torch.device | str,
    ) -> None:
        shape = (n_layers, batch, max_len, n_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)

    @property
    def max_len(self) -> int:
        return self.k.shape[2]

    @property
    def batch(self) -> int:
        return self.k.shape[1]

    def write(
        self, layer: int, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store ``k, v [B, s, Hkv, Dh]`` at ``positions [B, s]``; return the layer's full
        ``keys, values [B, max_len, Hkv, Dh]``."""
        if positions.shape[0] != self.batch:
            raise ValueError(f"cache holds {self.batch} sequences, got a batch of {positions.shape[0]}")
        rows = torch.arange(positions.shape[0], device=positions.device).unsqueeze(1)
        self.k[layer][rows, positions] = k.to(self.k.dtype)
        self.v[layer][rows, positions] = v.to(self.v.dtype)
        return self.k[layer], self.v[layer]
