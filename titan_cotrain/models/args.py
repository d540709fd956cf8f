"""Shapes of the target model family (Llama-3 / Qwen-3 decoders) and their named sizes."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

__all__ = ["ARCHITECTURES", "ModelArgs", "RopeScaling", "model_args_for"]

ARCHITECTURES = ("llama3", "qwen3")


@dataclass(frozen=True)
class RopeScaling:
    """Llama-3.1 frequency-dependent RoPE scaling (HF ``rope_type = "llama3"``)."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelArgs:
    """Everything that fixes the shape and numerics of a target decoder.

    ``architecture`` is ``"llama3"`` or ``"qwen3"``; Qwen-3 differs by the per-head RMSNorm
    on q and k (``qk_norm``) and an explicit ``head_dim``.
    """

    architecture: str = "llama3"
    dim: int = 64
    n_layers: int = 8
    n_heads: int = 4
    n_kv_heads: int = 2
    head_dim: int = 16
    ffn_dim: int = 128
    vocab_size: int = 256
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    qk_norm: bool = False
    tie_embeddings: bool = False
    max_seq_len: int = 2048

    def __post_init__(self) -> None:
        if self.architecture not in ARCHITECTURES:
            raise ValueError(f"unknown architecture {self.architecture!r}; known: {', '.join(ARCHITECTURES)}")
        if self.n_heads % self.n_kv_heads != 0:
            raise ValueError(f"n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({self.n_kv_heads})")
        if self.head_dim % 2 != 0:
            raise ValueError(f"head_dim ({self.head_dim}) must be even for RoPE")

    def replace(self, **changes) -> "ModelArgs":
        return dataclasses.replace(self, **changes)


_LLAMA31_SCALING = RopeScaling(8.0, 1.0, 4.0, 8192)

_FLAVORS: dict[str, dict[str, ModelArgs]] = {
    "llama3": {
        "debugmodel": ModelArgs(architecture="llama3"),
        # The debug model twice as deep: on CPU a forward's cost is mostly per layer, so the
        # one-layer draft costs about 1/8 of a target forward here (1/4 with debugmodel, about
        # 1/30 at 8B): the long-tailed job's speculation costs nearer what it does at scale.
        "debugdeep": ModelArgs(architecture="llama3", n_layers=16),
        "8B": ModelArgs(
            architecture="llama3", dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, head_dim=128,
            ffn_dim=14336, vocab_size=128256, norm_eps=1e-5, rope_theta=500000.0,
            rope_scaling=_LLAMA31_SCALING, max_seq_len=131072,
        ),
        "70B": ModelArgs(
            architecture="llama3", dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, head_dim=128,
            ffn_dim=28672, vocab_size=128256, norm_eps=1e-5, rope_theta=500000.0,
            rope_scaling=_LLAMA31_SCALING, max_seq_len=131072,
        ),
    },
    "qwen3": {
        "debugmodel": ModelArgs(architecture="qwen3", qk_norm=True, norm_eps=1e-6, rope_theta=1e6, tie_embeddings=True),
        "0.6B": ModelArgs(
            architecture="qwen3", dim=1024, n_layers=28, n_heads=16, n_kv_heads=8, head_dim=128,
            ffn_dim=3072, vocab_size=151936, norm_eps=1e-6, rope_theta=1e6, qk_norm=True,
            tie_embeddings=True, max_seq_len=40960,
        ),
        "1.7B": ModelArgs(
            architecture="qwen3", dim=2048, n_layers=28, n_heads=16, n_kv_heads=8, head_dim=128,
            ffn_dim=6144, vocab_size=151936, norm_eps=1e-6, rope_theta=1e6, qk_norm=True,
            tie_embeddings=True, max_seq_len=40960,
        ),
        "8B": ModelArgs(
            architecture="qwen3", dim=4096, n_layers=36, n_heads=32, n_kv_heads=8, head_dim=128,
            ffn_dim=12288, vocab_size=151936, norm_eps=1e-6, rope_theta=1e6, qk_norm=True,
            tie_embeddings=False, max_seq_len=40960,
        ),
        "32B": ModelArgs(
            architecture="qwen3", dim=5120, n_layers=64, n_heads=64, n_kv_heads=8, head_dim=128,
            ffn_dim=25600, vocab_size=151936, norm_eps=1e-6, rope_theta=1e6, qk_norm=True,
            tie_embeddings=False, max_seq_len=40960,
        ),
    },
}


def flavors(architecture: str) -> tuple[str, ...]:
    return tuple(_FLAVORS.get(architecture, {}))


def model_args_for(architecture: str, flavor: str) -> ModelArgs:
    """The named size ``flavor`` of ``architecture`` (e.g. ``("qwen3", "0.6B")``)."""
    if architecture not in _FLAVORS:
        raise ValueError(f"unknown architecture {architecture!r}; known: {', '.join(ARCHITECTURES)}")
    if flavor not in _FLAVORS[architecture]:
        raise ValueError(
            f"unknown flavor {flavor!r} for {architecture}; known: {', '.join(_FLAVORS[architecture])}"
        )
    return _FLAVORS[architecture][flavor]
