"""The block drafter (the DFlash family): a few decoder layers that draft a block of tokens
in one forward, fed with the target's features ("KV injection").

Shapes (``H`` the hidden size, the target's; ``B`` the block size; ``n_ctx`` the target layers
that feed it):

* ``fc: [n_ctx * H] -> [H]`` and ``hidden_norm`` turn the target's hidden states after the
  layers ``target_layer_ids`` into one *context feature* ``c_p`` per position ``p``;
* a block at anchor ``a`` is the positions ``a .. a + B - 1`` with the inputs ``[e(x_a), m,
  ..., m]``: the policy's embedding of the last verified token, then the drafter's own mask
  embedding ``m`` (a parameter, so the policy's vocabulary and embedding stay as they are);
* every layer (Qwen-3 style: ``q_norm``/``k_norm`` per head, RoPE, SwiGLU) takes its
  queries from the block only, and its keys and values from ``[c_p for the document's p <
  a ; the block]``: ``k_proj``/``v_proj`` of the context features (no layer norm: ``c_p`` is
  normed once by ``hidden_norm``) at their positions, and of the block's normed hidden
  states; the block attends to itself without a causal mask (``ops.block_attention``);
* ``norm``, then the policy's ``lm_head``, read detached: the output at ``a + j`` (``j >=
  1``) drafts ``x_{a+j}``, so one forward drafts ``B - 1`` tokens.

Drafting at rollout time reads the same function through a KV pool of ``n_layers`` layers
(``new_kv_pool``): ``write_context`` stores every layer's context keys and values of the
positions the target has just run (read through the target's block tables, as the target's
own pool is), and ``draft_block`` runs a block per sequence at its anchor, its queries
seeing the cached context before the anchor (the trunk) and the block's own keys (the
branch), merged by log-sum-exp: what ``forward`` computes in training at that anchor.

The context of position ``p`` exists once the target has run ``x_p``: at drafting time,
after a verification that accepted up to ``x_{a-1}`` and sampled ``x_a``, the context is
``p < a`` and the block starts at ``a``. Training (``cotrain.block_loss``) places blocks at
random anchors of the policy's own sequences, with the same rule. Parameter names follow
the DFlash checkpoint layout (``fc``, ``hidden_norm``, ``layers.<i>.self_attn.q_proj`` ...,
``norm``) so an exporter maps them one to one; ``mask_embedding`` is this project's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from titan_cotrain.models.args import ModelArgs, RopeScaling
from titan_cotrain.models.kv_cache import KVPool, PagedKV, RowsKV
from titan_cotrain.models.transformer import (
    FeedForward,
    RMSNorm,
    apply_rope,
    init_weights_,
    rope_cos_sin,
    rope_inv_freq,
)
from titan_cotrain.models.taps import validate_tap_layers
from titan_cotrain.ops.block_attention import BlockContextRing, block_attention, merge_partials, own_block_partial

__all__ = ["BlockDraftArgs", "BlockDrafter", "block_target_layers", "head_logits"]


def block_target_layers(n_target_layers: int, n_layers: int) -> tuple[int, ...]:
    """The target layers whose outputs feed a drafter of ``n_layers`` layers, one per drafter
    layer, spread evenly from layer 1 to layer ``L - 3`` (SGLang's default when a DFlash config names none; the
    middle layer for a one-layer drafter)."""
    if n_layers == 1:
        return (n_target_layers // 2,)
    if n_target_layers < 4:
        raise ValueError(f"a {n_layers}-layer block drafter needs a target of at least 4 layers, got {n_target_layers}")
    span = n_target_layers - 4
    layers = tuple(sorted({round(1 + i * span / (n_layers - 1)) for i in range(n_layers)}))
    return validate_tap_layers(layers, n_target_layers)


@dataclass(frozen=True)
class BlockDraftArgs:
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_dim: int
    vocab_size: int
    block_size: int
    target_layer_ids: tuple[int, ...]
    norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    max_seq_len: int = 2048

    def __post_init__(self) -> None:
        if self.block_size < 2:
            raise ValueError(f"block_size must be >= 2 (the anchor and at least one drafted token), "
                             f"got {self.block_size}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({self.n_kv_heads})")
        if not self.target_layer_ids:
            raise ValueError("target_layer_ids must name at least one target layer")

    @property
    def n_ctx(self) -> int:
        return len(self.target_layer_ids)

    @property
    def target_dim(self) -> int:
        """The target's hidden size: the drafter's own (it reads the policy's embeddings and head)."""
        return self.dim

    @property
    def cache_layers(self) -> int:
        """Layers a rollout engine caches per position (``engine.kv_budget``): every layer's context."""
        return self.n_layers

    chain_cache = False  # no per-row chain: a block drafts in one forward

    @classmethod
    def from_target(cls, target: ModelArgs, n_layers: int = 1, block_size: int = 16,
                    target_layer_ids: tuple[int, ...] | None = None, ffn_dim: int = 0) -> "BlockDraftArgs":
        """A drafter for ``target``: its hidden size, heads, RoPE and vocabulary (the drafter
        reads the policy's embedding and head), ``n_layers`` layers, the target layers
        ``block_target_layers`` picks unless given."""
        layers = (block_target_layers(target.n_layers, n_layers) if target_layer_ids is None
                  else validate_tap_layers(target_layer_ids, target.n_layers))
        return cls(dim=target.dim, n_layers=n_layers, n_heads=target.n_heads, n_kv_heads=target.n_kv_heads,
                   head_dim=target.head_dim, ffn_dim=ffn_dim or target.ffn_dim, vocab_size=target.vocab_size,
                   block_size=block_size, target_layer_ids=layers, norm_eps=target.norm_eps,
                   rope_theta=target.rope_theta, rope_scaling=target.rope_scaling, max_seq_len=target.max_seq_len)

    def replace(self, **changes) -> "BlockDraftArgs":
        return dataclasses.replace(self, **changes)


class BlockAttention(nn.Module):
    def __init__(self, args: BlockDraftArgs) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = args.n_heads, args.n_kv_heads, args.head_dim
        self.q_proj = nn.Linear(args.dim, args.n_heads * args.head_dim, bias=False)
        self.k_proj = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.v_proj = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.o_proj = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=False)
        self.q_norm = RMSNorm(args.head_dim, args.norm_eps)
        self.k_norm = RMSNorm(args.head_dim, args.norm_eps)

    def kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x [..., H]`` -> rotated ``k``, ``v [..., Hkv, Dh]``."""
        k = self.k_norm(self.k_proj(x).unflatten(-1, (self.n_kv_heads, self.head_dim)))
        return apply_rope(k, cos, sin), self.v_proj(x).unflatten(-1, (self.n_kv_heads, self.head_dim))

    def query(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """``x [..., H]`` -> rotated ``q [..., Hq, Dh]``."""
        return apply_rope(self.q_norm(self.q_proj(x).unflatten(-1, (self.n_heads, self.head_dim))), cos, sin)


class BlockDraftLayer(nn.Module):
    def __init__(self, args: BlockDraftArgs) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(args.dim, args.norm_eps)
        self.self_attn = BlockAttention(args)
        self.post_attention_layernorm = RMSNorm(args.dim, args.norm_eps)
        self.mlp = FeedForward(args.dim, args.ffn_dim)

    def forward(self, x: torch.Tensor, block_rope: tuple[torch.Tensor, torch.Tensor], context: torch.Tensor,
                context_rope: tuple[torch.Tensor, torch.Tensor], ctx_start: torch.Tensor,
                ctx_end: torch.Tensor, ring: BlockContextRing | None = None) -> torch.Tensor:
        """``x [N, B, H]`` the blocks' stream; ``context [T, H]`` the context features of every
        packed position; block ``n`` reads context rows ``ctx_start[n] .. ctx_end[n] - 1``, or
        under context parallelism what ``ring`` plans (the rows then this rank's shard)."""
        attn = self.self_attn
        h = self.input_layernorm(x)
        q = attn.query(h, *block_rope)
        blk_k, blk_v = attn.kv(h, *block_rope)
        ctx_k, ctx_v = attn.kv(context, *context_rope)
        scale = attn.head_dim ** -0.5
        if ring is not None:
            out = ring.attend(q, ctx_k, ctx_v, blk_k, blk_v, scale)
        else:
            out = block_attention(q, ctx_k, ctx_v, blk_k, blk_v, ctx_start, ctx_end, scale)
        x = x + attn.o_proj(out.flatten(-2))
        return x + self.mlp(self.post_attention_layernorm(x))


class BlockDrafter(nn.Module):
    """The block drafter (module docstring). ``forward`` drafts blocks at given anchors of a
    packed batch; ``logits`` turns its output into draft distributions with the policy's head."""

    def __init__(self, args: BlockDraftArgs) -> None:
        super().__init__()
        self.args = args
        self.fc = nn.Linear(args.n_ctx * args.dim, args.dim, bias=False)
        self.hidden_norm = RMSNorm(args.dim, args.norm_eps)
        self.layers = nn.ModuleList(BlockDraftLayer(args) for _ in range(args.n_layers))
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.mask_embedding = nn.Parameter(torch.zeros(args.dim))
        self.register_buffer(
            "rope_inv_freq", rope_inv_freq(args.head_dim, args.rope_theta, args.rope_scaling), persistent=False
        )

    def init_weights(self, std: float = 0.02, generator: torch.Generator | None = None, fill=None) -> None:
        """Normal(0, std) linears and mask embedding, unit norms (``init_weights_``; ``fill``
        keeps a sharded parameter's slice of each whole draw)."""
        init_weights_(self, std, generator, *([fill] if fill is not None else []))

    def context(self, features: torch.Tensor) -> torch.Tensor:
        """``c = hidden_norm(fc(features))``: ``features [..., n_ctx * H]`` (the target layers'
        outputs, concatenated in ``target_layer_ids`` order) -> ``[..., H]``."""
        return self.hidden_norm(self.fc(features))

    def block_inputs(self, anchor_embeddings: torch.Tensor) -> torch.Tensor:
        """``[N, H]`` embeddings of the blocks' anchor tokens -> the blocks' inputs ``[N, B, H]``."""
        n, h = anchor_embeddings.shape
        masks = self.mask_embedding.to(anchor_embeddings.dtype).expand(n, self.args.block_size - 1, h)
        return torch.cat([anchor_embeddings[:, None], masks], dim=1)

    def forward(self, features: torch.Tensor, positions: torch.Tensor, anchor_embeddings: torch.Tensor,
                anchor_positions: torch.Tensor, ctx_start: torch.Tensor, ctx_end: torch.Tensor,
                score: Callable[[torch.Tensor, nn.Module], Any] | None = None, ring: BlockContextRing | None = None):
        """The blocks' final hidden states ``[N, B, H]`` (before ``norm``), or with ``score``
        what ``score(hidden, norm)`` returns: run inside this forward, where FSDP has the
        drafter's parameters gathered (the training sums, ``cotrain.block_loss``).

        ``features [T, n_ctx * H]``: the target's tapped outputs at every packed position
        (detached here: no gradient reaches the policy); ``positions [T]`` their RoPE
        positions; ``anchor_embeddings [N, H]`` the policy's embeddings of the anchors' tokens
        (detached); ``anchor_positions [N]`` the anchors' RoPE positions; block ``n`` reads the
        context rows ``ctx_start[n] <= t < ctx_end[n]`` (its document's positions before its
        anchor). Under context parallelism the rows are this rank's shard and ``ring``
        (``ops.block_attention.BlockContextRing``) replaces ``ctx_start, ctx_end``."""
        context = self.context(features.detach())
        dtype = context.dtype
        block_positions = anchor_positions[:, None] + torch.arange(self.args.block_size, device=anchor_positions.device)
        block_rope = rope_cos_sin(self.rope_inv_freq, block_positions, dtype)
        context_rope = rope_cos_sin(self.rope_inv_freq, positions, dtype)
        x = self.block_inputs(anchor_embeddings.detach().to(dtype))
        for layer in self.layers:
            x = layer(x, block_rope, context, context_rope, ctx_start, ctx_end, ring)
        return x if score is None else score(x, self.norm)

    # Drafting with a KV cache.

    def new_kv_pool(self, n_blocks: int, block_size: int, dtype: torch.dtype | None = None) -> KVPool:
        """The context keys and values of every layer, in blocks read through the target's tables."""
        a = self.args
        return KVPool(a.n_layers, n_blocks, block_size, a.n_kv_heads, a.head_dim, dtype or self.fc.weight.dtype,
                      self.fc.weight.device)

    def write_context(self, features: torch.Tensor, positions: torch.Tensor, cache: PagedKV | RowsKV) -> None:
        """Store every layer's context key and value of ``positions [Bt, s]`` (each sequence's
        positions the target has just run), from the target's ``features [Bt, s, n_ctx * H]``
        there. A slot past a sequence's committed positions may hold a rejected draft's key: no
        block reads it (``draft_block`` reads the slots before its anchor) before it is rewritten."""
        context = self.context(features)
        cos, sin = rope_cos_sin(self.rope_inv_freq, positions, context.dtype)
        for i, layer in enumerate(self.layers):
            k, v = layer.self_attn.kv(context, cos, sin)
            cache.write(i, positions, k, v)

    def draft_block(self, anchor_embeddings: torch.Tensor, anchor_positions: torch.Tensor,
                    cache: PagedKV | RowsKV) -> torch.Tensor:
        """One block per sequence: ``anchor_embeddings [Bt, H]`` (the policy's embeddings of the
        last committed tokens), ``anchor_positions [Bt]`` (theirs: the context is the cached
        positions before them). Returns the blocks' final hidden states ``[Bt, B, H]``, as
        ``forward`` computes them at the same anchors."""
        bt, b = anchor_positions.shape[0], self.args.block_size
        x = self.block_inputs(anchor_embeddings.to(self.fc.weight.dtype))
        positions = anchor_positions.view(bt, 1).to(torch.int64) + torch.arange(b, device=x.device)
        cos, sin = rope_cos_sin(self.rope_inv_freq, positions, x.dtype)
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            h = layer.input_layernorm(x)
            q = attn.query(h, cos, sin)  # [Bt, B, Hq, Dh]
            blk_k, blk_v = attn.kv(h, cos, sin)
            context = _context_attention(cache, i, q, anchor_positions)
            out = merge_partials(own_block_partial(q, blk_k, blk_v, attn.head_dim ** -0.5), [context]).to(q.dtype)
            x = x + attn.o_proj(out.flatten(-2))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return x

    def head_module_logits(self, hidden: torch.Tensor, head: nn.Module) -> torch.Tensor:
        """``[..., H] -> [..., V]``: ``head_logits`` through the policy's head *module* (an
        engine's copy, no gradient): the same function, and under tensor parallelism the module
        gathers its split logits."""
        out = head(self.norm(hidden).to(head.weight.dtype))
        return out.to(torch.promote_types(out.dtype, torch.float32))


def head_logits(norm: nn.Module, hidden: torch.Tensor, head_weight: torch.Tensor) -> torch.Tensor:
    """The drafter's logits ``[..., V]`` (fp32; fp64 for fp64 inputs): ``norm(hidden)`` through
    the policy's head weight, read detached (a plain function of the weight: no module hook,
    no gradient to the policy). ``norm`` is passed so the training sums can run it inside the
    drafter's forward, where FSDP has it gathered."""
    out = F.linear(norm(hidden), head_weight.detach().to(hidden.dtype))
    return out.to(torch.promote_types(out.dtype, torch.float32))


def _context_attention(cache: PagedKV | RowsKV, layer: int, q: torch.Tensor,
                       seqused: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``q [Bt, B, Hq, Dh]`` against the cached context slots ``< seqused [Bt]`` of ``layer``,
    every one of a block's ``B`` queries seeing all of them: the cache's one-query attention
    with the block folded into the heads (head ``(kv, r, j)`` reads KV head ``kv`` as query
    head ``(kv, r)`` does). Returns ``out [Bt, B, Hq, Dh]``, ``lse [Bt, B, Hq]``."""
    bt, b, hq, dh = q.shape
    hkv = cache.pool.k.shape[3]
    rep = hq // hkv
    folded = q.view(bt, b, hkv, rep, dh).permute(0, 2, 3, 1, 4).reshape(bt, 1, hkv * rep * b, dh)
    out, lse = cache.attend(layer, folded, seqused, return_lse=True)
    out = out.view(bt, hkv, rep, b, dh).permute(0, 3, 1, 2, 4).reshape(bt, b, hq, dh)
    lse = lse.view(bt, hkv, rep, b).permute(0, 3, 1, 2).reshape(bt, b, hq)
    return out, lse
