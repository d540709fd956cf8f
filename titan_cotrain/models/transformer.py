"""The target decoder (Llama-3 / Qwen-3 family) with taps and a KV-cache forward.

Plain PyTorch, no parallelism inside: FSDP, PP and CP wrap it from ``titan_cotrain.parallel``
(CP hooks every layer's ``self_attn.inner_attention``, a ``VarlenAttention``).
Parameter names follow the Hugging Face layout (``embed_tokens``, ``layers.N.self_attn.q_proj``,
``mlp.gate_proj``, ...) so the HF adapter only adds or strips the ``model.`` prefix, except in
the sparse layers of a mixture of experts (``models.moe``), whose ``mlp`` is torchtitan's MoE
(``mlp.router.gate``, ``mlp.experts.w1/w2/w3`` stacked over experts).

Two forwards:
* ``forward(tokens [B, S], ...)``: training over packed rows, all attention through
  ``titan_cotrain.ops.VarlenAttention`` on the flattened ``[B*S, H, Dh]`` tokens;
  returns logits ``[B, S, V]``, or a ``TargetOutput`` with the taps.
* ``forward_cached(tokens [B, s], cache, start_pos [B])``: prefill / multi-token decode
  against a paged KV cache (``models.kv_cache``) at per-sequence offsets (the rollout
  engine's path).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from titan_cotrain.data.packing import (
    PackedLayout,
    layout_from_cu_seqlens,
    layout_from_document_ids,
    layout_one_doc_per_row,
)
from titan_cotrain.models.args import ModelArgs, RopeScaling
from titan_cotrain.models.kv_cache import KVPool, PagedKV, RowsKV
from titan_cotrain.models.moe import load_balancing_loss, sparse_feed_forward
from titan_cotrain.models.taps import default_tap_layers, validate_tap_layers
from titan_cotrain.ops.attention import VarlenAttention, packed_cu_seqlens

__all__ = ["RMSNorm", "init_weights_", "TargetOutput", "TrainOutput", "Transformer", "apply_rope", "rope_inv_freq",
           "run_layers"]

# ``tap(layer index, its output [T, H])``: called after every layer ``run_layers`` runs.
TapHook = Callable[[int, torch.Tensor], None]


class TargetOutput(NamedTuple):
    """``logits [B, S, V]``; ``taps``: one detached ``[B, S, H]`` per tap layer, in layer
    order; ``embeddings``: the detached token-embedding output ``[B, S, H]``."""

    logits: torch.Tensor
    taps: tuple[torch.Tensor, ...]
    embeddings: torch.Tensor


class TrainOutput(NamedTuple):
    """``forward(..., head=fn)``: ``head`` is what ``fn`` returned (e.g. chunked loss sums);
    ``taps`` and ``embeddings`` as in ``TargetOutput``."""

    head: Any
    taps: tuple[torch.Tensor, ...]
    embeddings: torch.Tensor


class RMSNorm(nn.Module):
    """RMSNorm computed in fp32, scaled by the weight in the input dtype (HF numerics)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    """Inverse frequencies ``[head_dim // 2]`` (fp32), with Llama-3.1 scaling when given.

    Llama-3.1 scaling leaves high frequencies (wavelength below
    ``original_max / high_freq_factor``) alone, divides low frequencies (wavelength above
    ``original_max / low_freq_factor``) by ``factor``, and interpolates linearly in
    ``original_max / wavelength`` between the two.
    """
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv_freq
    wavelen = 2 * math.pi / inv_freq
    old_len = scaling.original_max_position_embeddings
    low_wavelen = old_len / scaling.low_freq_factor
    high_wavelen = old_len / scaling.high_freq_factor
    scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_len / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    interpolated = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, interpolated, scaled)


def _copy_whole(param: torch.Tensor, whole: torch.Tensor) -> None:
    param.copy_(whole)


@torch.no_grad()
def init_weights_(model: nn.Module, std: float, generator: torch.Generator | None,
                  fill: Callable[[torch.Tensor, torch.Tensor], None] = _copy_whole) -> None:
    """Normal(0, std) linears, embeddings and MoE experts, unit norms, fresh RoPE frequencies;
    deterministic under ``generator`` (a CPU generator). Shared by the target and the draft.

    Every weight is drawn whole on the host, one at a time, and handed to ``fill(param,
    whole)``: a plain copy here; for sharded parameters the caller passes a fill that keeps
    only this rank's slice, so a rank never holds more than one whole tensor and every
    sharding gives the same values."""
    # A head tied to the embedding: both get the head's draw (drawn last, it is what one
    # shared tensor ends up holding), filled into each by name, since under PP the first
    # and the last stage hold the two apart.
    tied = getattr(getattr(model, "args", None), "tie_embeddings", False)
    for module in model.modules():
        if isinstance(module, (nn.Linear, nn.Embedding)):
            whole = torch.empty(module.weight.shape, dtype=module.weight.dtype).normal_(0.0, std, generator=generator)
            if tied and module is model.embed_tokens:
                continue
            fill(module.weight, whole)
            if tied and module is model.lm_head:
                fill(model.embed_tokens.weight, whole)
        elif isinstance(module, RMSNorm):
            module.weight.fill_(1.0)
        else:  # weights a module holds itself: the MoE experts' [E, ...] stacks
            for weight in module.parameters(recurse=False):
                fill(weight, torch.empty(weight.shape, dtype=weight.dtype).normal_(0.0, std, generator=generator))
    args = model.args
    model.rope_inv_freq.copy_(rope_inv_freq(args.head_dim, args.rope_theta, args.rope_scaling))


def rope_cos_sin(inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``positions: int [...]`` -> ``cos, sin: [..., head_dim]`` (half-split layout)."""
    freqs = positions.to(torch.float32).unsqueeze(-1) * inv_freq.to(positions.device)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def run_layers(layers: Iterable[tuple[int, nn.Module]], rope_inv_freq: torch.Tensor, x: torch.Tensor,
               positions: torch.Tensor, cu_seqlens: torch.Tensor, tap: TapHook | None = None) -> torch.Tensor:
    """The training forward's layer loop, shared by ``Transformer.forward`` and a pipeline
    stage's (so their hidden states and taps are bitwise the same): the packed stream ``x [T,
    H]`` at in-document ``positions`` (``T`` of them, any shape) through ``layers``, ``(whole-model
    index, DecoderLayer)`` pairs in order, with ``tap(index, output)`` after each."""
    cos, sin = rope_cos_sin(rope_inv_freq, positions.to(x.device).reshape(-1), x.dtype)
    for i, layer in layers:
        x = layer(x, cos, sin, cu_seqlens)
        if tap is not None:
            tap(i, x)
    return x


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [..., H, Dh]`` by ``cos/sin [..., Dh]`` (broadcast over heads), half-split pairs."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos.unsqueeze(-2) + rotated * sin.unsqueeze(-2)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.head_dim = args.head_dim
        self.q_proj = nn.Linear(args.dim, args.n_heads * args.head_dim, bias=False)
        self.k_proj = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.v_proj = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.o_proj = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=False)
        if args.qk_norm:
            self.q_norm = RMSNorm(args.head_dim, args.norm_eps)
            self.k_norm = RMSNorm(args.head_dim, args.norm_eps)
        else:
            self.q_norm = self.k_norm = None
        self.inner_attention = VarlenAttention()

    def _qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """``x [..., dim]`` -> rotated ``q [..., Hq, Dh]``, ``k, v [..., Hkv, Dh]``: the heads
        the projections give, ``1 / t`` of them on a rank of a tensor-parallel engine."""
        lead = x.shape[:-1]
        q = self.q_proj(x).view(*lead, -1, self.head_dim)
        k = self.k_proj(x).view(*lead, -1, self.head_dim)
        v = self.v_proj(x).view(*lead, -1, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
        """Packed ``x [T, dim]``, ``cos/sin [T, Dh]`` (under CP: this rank's zigzag shard)."""
        q, k, v = self._qkv(x, cos, sin)
        return self.o_proj(self.inner_attention(q, k, v, cu_seqlens).flatten(-2))

    def forward_cached(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: PagedKV | RowsKV, layer: int, positions: torch.Tensor
    ) -> torch.Tensor:
        """``x [B, s, dim]`` at ``positions [B, s]``; writes k/v into ``cache`` then attends
        to every cached key at a position ``<=`` the query's own."""
        q, k, v = self._qkv(x, cos, sin)
        cache.write(layer, positions, k, v)
        return self.o_proj(cache.attend(layer, q, positions[:, -1] + 1).flatten(-2))


class FeedForward(nn.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """Attention then a feed-forward, each pre-normed and residual. ``sparse``: the feed-forward
    is the mixture of experts (``models.moe.sparse_feed_forward``), else the dense SwiGLU."""

    def __init__(self, args: ModelArgs, sparse: bool = False) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(args.dim, args.norm_eps)
        self.self_attn = Attention(args)
        self.post_attention_layernorm = RMSNorm(args.dim, args.norm_eps)
        self.sparse = sparse
        self.mlp = sparse_feed_forward(args) if sparse else FeedForward(args.dim, args.ffn_dim)

    def forward(self, x, cos, sin, cu_seqlens):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, cu_seqlens)
        return x + self._feed_forward(x)

    def forward_cached(self, x, cos, sin, cache, layer, positions):
        x = x + self.self_attn.forward_cached(self.input_layernorm(x), cos, sin, cache, layer, positions)
        return x + self._feed_forward(x)

    def _feed_forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.post_attention_layernorm(x)
        if self.sparse:  # torchtitan's MoE takes [B, S, dim]; the training stream is [T, dim]
            return self.mlp(h.view(1, -1, h.shape[-1])).view_as(h)
        return self.mlp(h)


class Transformer(nn.Module):
    """A Llama-3 / Qwen-3 decoder whose forward also returns the draft's taps.

    ``tap_layers`` (default: EAGLE-3's ``(1, L//2 - 1, L - 4)``) are decoder-layer indices
    whose outputs are returned, detached, when ``return_taps=True``. A mixture of experts
    (``args.n_experts > 0``) also leaves its routers' load-balancing loss of each forward run
    with gradients, read by ``moe_aux_loss()``; the forward's outputs are the same either way.
    """

    def __init__(self, args: ModelArgs, tap_layers: Sequence[int] | None = None) -> None:
        super().__init__()
        self.args = args
        self.tap_layers = (
            default_tap_layers(args.n_layers) if tap_layers is None else validate_tap_layers(tap_layers, args.n_layers)
        )
        self.embed_tokens = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(DecoderLayer(args, args.is_sparse_layer(i)) for i in range(args.n_layers))
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.lm_head = nn.Linear(args.dim, args.vocab_size, bias=False)
        if args.tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.register_buffer(
            "rope_inv_freq", rope_inv_freq(args.head_dim, args.rope_theta, args.rope_scaling), persistent=False
        )

    def init_weights(self, std: float = 0.02, generator: torch.Generator | None = None, fill=_copy_whole) -> None:
        init_weights_(self, std, generator, fill)

    def _layout(self, tokens, document_ids, cu_seqlens) -> PackedLayout:
        b, s = tokens.shape
        if document_ids is not None and cu_seqlens is not None:
            raise ValueError("give document_ids or cu_seqlens, not both")
        if document_ids is not None:
            if document_ids.shape != tokens.shape:
                raise ValueError(f"document_ids {tuple(document_ids.shape)} must match tokens {tuple(tokens.shape)}")
            return layout_from_document_ids(document_ids)
        if cu_seqlens is not None:
            return layout_from_cu_seqlens(cu_seqlens, b, s)
        return layout_one_doc_per_row(b, s, tokens.device)

    def forward(
        self,
        tokens: torch.Tensor,
        *,
        document_ids: torch.Tensor | None = None,
        cu_seqlens: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
        return_taps: bool = False,
        head: Callable[[torch.Tensor, torch.Tensor], Any] | None = None,
    ) -> torch.Tensor | TargetOutput | TrainOutput:
        """Training forward over packed rows.

        ``tokens: int64 [B, S]``; packing given as ``document_ids [B, S]`` or ``cu_seqlens``
        over the flattened ``B * S`` tokens (neither: one document per row). ``cu_seqlens``
        is read on the host: pass a sequence of ints (FSDP moves a root module's tensor
        inputs to the device, which would cost a sync per layer), and with it the
        in-document ``positions [B, S]`` already on the device if you have them. Positions
        restart at each document start. Returns ``logits [B, S, V]`` (fp32), or
        ``TargetOutput`` when ``return_taps``.

        ``head(hidden [B*S, H], lm_head weight [V, H])`` replaces the head: it gets the
        final-normed hidden states *inside* this forward (where FSDP has the head's weight
        gathered) and its result comes back as ``TrainOutput.head``; no ``[B, S, V]``
        logits are made (the chunked losses of ``titan_cotrain.cotrain.vocab``).

        Context parallel (applied by ``parallel.context_parallel.apply_context_parallel``):
        ``tokens`` are this rank's ``[B, local_len]`` zigzag shard, given with the shard's
        local ``cu_seqlens`` and global ``positions`` (a ``CPShard``'s); the model does not
        know, its attention modules are hooked from outside.
        """
        if tokens.dim() != 2:
            raise ValueError(f"tokens must be [B, S], got shape {tuple(tokens.shape)}")
        b, s = tokens.shape
        if cu_seqlens is not None:
            cu_seqlens = packed_cu_seqlens(cu_seqlens)  # host metadata, maybe passed as ints
        if positions is None:
            layout = self._layout(tokens, document_ids, cu_seqlens)
            cu_seqlens, positions = packed_cu_seqlens(layout.cu_seqlens), layout.positions
        h = self.embed_tokens(tokens)
        taps = []

        def tap(layer: int, out: torch.Tensor) -> None:
            if layer in self.tap_layers:
                taps.append(out.detach().view(b, s, -1))

        x = run_layers(enumerate(self.layers), self.rope_inv_freq, h.reshape(b * s, -1), positions, cu_seqlens,
                       tap if return_taps else None)
        if head is not None:
            return TrainOutput(head=head(self.norm(x), self.lm_head.weight), taps=tuple(taps), embeddings=h.detach())
        # Reshape before the head so the logits are a fresh tensor, not a view (FSDP's
        # pre-backward hook on a view is lost by in-place use downstream).
        logits = self.lm_head(self.norm(x.view(b, s, -1))).float()
        if not return_taps:
            return logits
        return TargetOutput(logits=logits, taps=tuple(taps), embeddings=h.detach())

    def moe_aux_loss(self) -> torch.Tensor | None:
        """Hugging Face's Qwen3-MoE load-balancing loss over the last forward run with
        gradients, pooled over the sparse layers (``models.moe.load_balancing_loss``): a 0-dim
        fp32 tensor whose gradient reaches only the routers' weights; None for a dense model
        or after a forward under ``no_grad``. The trainer adds ``[model] moe_aux_loss_weight``
        times it to the policy loss of that forward."""
        return load_balancing_loss(self)

    def new_kv_pool(self, n_blocks: int, block_size: int, dtype: torch.dtype | None = None,
                    n_kv_heads: int | None = None) -> KVPool:
        """A pool of ``n_blocks`` KV blocks of ``block_size`` positions for every layer, of all
        KV heads or (a tensor-parallel rank's) ``n_kv_heads`` of them."""
        a = self.args
        dtype = dtype or self.embed_tokens.weight.dtype
        return KVPool(a.n_layers, n_blocks, block_size, n_kv_heads or a.n_kv_heads, a.head_dim, dtype,
                      self.embed_tokens.weight.device)

    def forward_cached(
        self, tokens: torch.Tensor, cache: PagedKV | RowsKV, start_pos: torch.Tensor, *, return_taps: bool = False,
        logits_at: torch.Tensor | None = None,
    ) -> torch.Tensor | TargetOutput:
        """Prefill or decode ``tokens [B, s]`` at positions ``start_pos[b] + (0..s-1)``.

        Each sequence has its own offset (ragged prompts, ragged acceptance). Cache slots
        past a sequence's current position may hold stale entries; they are never
        attended (keys are masked by position) and are overwritten as the sequence grows.
        Logits are fp32 ``[B, s, V]``, or ``[B, 1, V]`` at the offsets ``logits_at [B]`` only
        (a prefill needs one position per prompt: no ``[B, P, V]`` fp32 tensor).
        """
        b, s = tokens.shape
        positions = start_pos.view(b, 1).to(torch.int64) + torch.arange(s, device=tokens.device)
        h = self.embed_tokens(tokens)
        cos, sin = rope_cos_sin(self.rope_inv_freq, positions, h.dtype)
        x, taps = h, []
        for i, layer in enumerate(self.layers):
            x = layer.forward_cached(x, cos, sin, cache, i, positions)
            if return_taps and i in self.tap_layers:
                taps.append(x.detach())
        if logits_at is not None:
            x = x[torch.arange(b, device=x.device), logits_at].unsqueeze(1)
        logits = self.lm_head(self.norm(x)).float()
        if not return_taps:
            return logits
        return TargetOutput(logits=logits, taps=tuple(taps), embeddings=h.detach())
