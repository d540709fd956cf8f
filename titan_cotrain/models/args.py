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

    Mixture of experts (Qwen3-MoE, ``n_experts > 0``): the feed-forward of every sparse layer
    (``is_sparse_layer``) is ``n_experts`` SwiGLU experts of width ``moe_inter_dim``, of which
    a softmax router picks ``top_k`` per token, their weights renormalised to sum to 1 when
    ``norm_topk_prob``; the other layers keep the dense ``ffn_dim`` SwiGLU. With the default
    ``n_experts = 0`` every layer is dense and the other MoE fields are unused.
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
    n_experts: int = 0
    top_k: int = 0
    moe_inter_dim: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.architecture not in ARCHITECTURES:
            raise ValueError(f"unknown architecture {self.architecture!r}; known: {', '.join(ARCHITECTURES)}")
        if self.n_heads % self.n_kv_heads != 0:
            raise ValueError(f"n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({self.n_kv_heads})")
        if self.head_dim % 2 != 0:
            raise ValueError(f"head_dim ({self.head_dim}) must be even for RoPE")
        if self.n_experts:
            self._check_moe()

    def _check_moe(self) -> None:
        if self.architecture != "qwen3":
            raise ValueError(f"mixture of experts (n_experts = {self.n_experts}) is a qwen3 feature, "
                             f"not {self.architecture}'s")
        if not 1 <= self.top_k <= self.n_experts:
            raise ValueError(f"top_k ({self.top_k}) must be between 1 and n_experts ({self.n_experts})")
        if self.moe_inter_dim < 1 or self.decoder_sparse_step < 1:
            raise ValueError(f"moe_inter_dim ({self.moe_inter_dim}) and decoder_sparse_step "
                             f"({self.decoder_sparse_step}) must be positive")
        if any(i < 0 for i in self.mlp_only_layers):
            raise ValueError(f"mlp_only_layers {list(self.mlp_only_layers)} must be 0-based layer indices")

    def is_sparse_layer(self, layer: int) -> bool:
        """Whether decoder layer ``layer`` (0-based) has the MoE feed-forward: Hugging Face's
        rule, every ``decoder_sparse_step``-th layer (1-based) not in ``mlp_only_layers``."""
        return (self.n_experts > 0 and layer not in self.mlp_only_layers
                and (layer + 1) % self.decoder_sparse_step == 0)

    @property
    def n_sparse_layers(self) -> int:
        """How many decoder layers have the MoE feed-forward (0 for a dense model)."""
        return sum(map(self.is_sparse_layer, range(self.n_layers)))

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
        # A tiny MoE for tests: every other layer sparse (decoder_sparse_step 2), layer 5
        # dense by mlp_only_layers, so both of Hugging Face's rules are in play.
        "debugmoe": ModelArgs(
            architecture="qwen3", qk_norm=True, norm_eps=1e-6, rope_theta=1e6, tie_embeddings=True, n_experts=8,
            top_k=2, moe_inter_dim=32, norm_topk_prob=True, decoder_sparse_step=2, mlp_only_layers=(5,),
        ),
        # The MoE sizes are torchtitan 0.2.2's (``torchtitan.models.qwen3``); RoPE base and
        # context are the published base checkpoints' config.json, as for the dense flavors
        # (torchtitan has rope_theta 5e6 for 235B-A22B, contexts of 262144 and 4096). Every
        # layer is sparse; ffn_dim is the hub configs' intermediate_size, which no layer uses.
        "30B-A3B": ModelArgs(
            architecture="qwen3", dim=2048, n_layers=48, n_heads=32, n_kv_heads=4, head_dim=128,
            ffn_dim=6144, vocab_size=151936, norm_eps=1e-6, rope_theta=1e6, qk_norm=True,
            tie_embeddings=False, max_seq_len=40960, n_experts=128, top_k=8, moe_inter_dim=768, norm_topk_prob=True,
        ),
        "235B-A22B": ModelArgs(
            architecture="qwen3", dim=4096, n_layers=94, n_heads=64, n_kv_heads=4, head_dim=128,
            ffn_dim=12288, vocab_size=151936, norm_eps=1e-6, rope_theta=1e6, qk_norm=True,
            tie_embeddings=False, max_seq_len=40960, n_experts=128, top_k=8, moe_inter_dim=1536, norm_topk_prob=True,
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
