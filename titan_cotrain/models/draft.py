"""The EAGLE-3 draft: fusion of the target's taps, one decoder layer, a reduced-vocab head.

Shapes (``H`` the draft's hidden size, ``H_t`` the target's, ``V_d`` the draft vocab):

* ``fc: [n_taps * H_t] -> [H]`` fuses the tapped target features into ``h^0``;
* ``midlayer``: one decoder layer whose q/k/v read ``[input_layernorm(e) ; hidden_norm(h)]``
  (``2H`` wide), with the residual taken from ``h`` before its norm
  (``norm_before_residual = false``), then a SwiGLU MLP;
* ``norm`` and ``lm_head: [H] -> [V_d]``;
* buffers ``d2t: int64 [V_d]`` (target id = draft id + ``d2t[draft id]``) and
  ``t2d: bool [V]`` (which target ids the draft can emit).

The token embeddings ``e`` the draft reads are the current policy's (passed in, detached),
unless the draft's hidden size differs from the target's, in which case the draft owns an
``embed_tokens`` of its own. Parameter names are the EAGLE-3 checkpoint names, so the
exporter maps them one to one.
"""

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from titan_cotrain.data.packing import DocumentShift, take_rows
from titan_cotrain.models.args import ModelArgs, RopeScaling
from titan_cotrain.models.draft_vocab import identity_vocab_maps
from titan_cotrain.models.kv_cache import KVPool, PagedKV, RowsKV
from titan_cotrain.models.transformer import (
    FeedForward,
    RMSNorm,
    apply_rope,
    init_weights_,
    rope_cos_sin,
    rope_inv_freq,
)
from titan_cotrain.ops.attention import merge_attention, packed_cu_seqlens
from titan_cotrain.ops.branch_attention import BranchAttention, branch_forward

__all__ = ["Draft", "DraftArgs", "DraftKVCache"]


@dataclass(frozen=True)
class DraftArgs:
    dim: int
    target_dim: int
    n_taps: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_dim: int
    vocab_size: int
    draft_vocab_size: int
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    max_seq_len: int = 2048

    def __post_init__(self) -> None:
        if not 0 < self.draft_vocab_size <= self.vocab_size:
            raise ValueError(f"draft vocab ({self.draft_vocab_size}) must be in 1..target vocab ({self.vocab_size})")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"draft n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({self.n_kv_heads})")

    @classmethod
    def from_target(cls, target: ModelArgs, n_taps: int, draft_vocab_size: int = 0, dim: int = 0,
                    n_heads: int = 0, n_kv_heads: int = 0, ffn_dim: int = 0) -> "DraftArgs":
        """The draft's shape: the target's unless overridden (0 = the target's)."""
        n_heads = n_heads or target.n_heads
        dim = dim or target.dim
        return cls(
            dim=dim, target_dim=target.dim, n_taps=n_taps, n_heads=n_heads,
            n_kv_heads=n_kv_heads or target.n_kv_heads,
            head_dim=target.head_dim if dim == target.dim and n_heads == target.n_heads else dim // n_heads,
            ffn_dim=ffn_dim or target.ffn_dim, vocab_size=target.vocab_size,
            draft_vocab_size=draft_vocab_size or target.vocab_size, norm_eps=target.norm_eps,
            rope_theta=target.rope_theta, rope_scaling=target.rope_scaling, max_seq_len=target.max_seq_len,
        )

    def replace(self, **changes) -> "DraftArgs":
        return dataclasses.replace(self, **changes)

    # What a rollout engine caches per position (``engine.kv_budget``): the trunk's one layer,
    # and a chain of the passes 2..k per row.
    cache_layers = 1
    chain_cache = True


class DraftAttention(nn.Module):
    def __init__(self, args: DraftArgs) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = args.n_heads, args.n_kv_heads, args.head_dim
        self.q_proj = nn.Linear(2 * args.dim, args.n_heads * args.head_dim, bias=False)
        self.k_proj = nn.Linear(2 * args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.v_proj = nn.Linear(2 * args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.o_proj = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=False)
        self.inner_attention = BranchAttention()

    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """``x [T, 2H]`` -> rotated ``q [T, Hq, Dh]``, ``k, v [T, Hkv, Dh]``."""
        t = x.shape[0]
        q = self.q_proj(x).view(t, self.n_heads, self.head_dim)
        k = self.k_proj(x).view(t, self.n_kv_heads, self.head_dim)
        v = self.v_proj(x).view(t, self.n_kv_heads, self.head_dim)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v


class DraftLayer(nn.Module):
    """EAGLE-3's single decoder layer (``midlayer``)."""

    def __init__(self, args: DraftArgs) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(args.dim, args.norm_eps)
        self.hidden_norm = RMSNorm(args.dim, args.norm_eps)
        self.self_attn = DraftAttention(args)
        self.post_attention_layernorm = RMSNorm(args.dim, args.norm_eps)
        self.mlp = FeedForward(args.dim, args.ffn_dim)

    def attention_input(self, embeds: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """``[input_layernorm(e) ; hidden_norm(h)]``, ``[T, 2H]``."""
        return torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)

    def finish(self, hidden: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        """Residual from the un-normed ``hidden``, then the MLP block: ``[T, H]``."""
        x = hidden + self.self_attn.o_proj(attn_out.flatten(-2))
        return x + self.mlp(self.post_attention_layernorm(x))


@dataclass
class DraftKVCache:
    """The draft's drafting cache for a batch of ``B`` sequences.

    The *trunk* is paged like the target's cache (a one-layer ``KVPool`` with the target's
    block tables, ``trunk``): position ``j`` holds the pass-1 key/value of anchor ``j``
    (RoPE position ``j``). The *chain*, ``chain_k, chain_v [B, chain_len, Hkv, Dh]``, holds
    the keys/values of passes ``2 .. chain_len + 1`` at the current drafting anchor,
    overwritten every drafting round. A chain step attends to both, as branch attention
    does in training: the trunk through the cache (the paged kernel on an accelerator) and the
    chain's few keys directly, merged by log-sum-exp.
    """

    trunk: PagedKV | RowsKV
    chain_k: torch.Tensor
    chain_v: torch.Tensor

    def attend_trunk(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Store ``k, v [B, s, Hkv, Dh]`` at trunk ``positions [B, s]`` (consecutive per row);
        ``q [B, s, Hq, Dh]`` attends to the trunk slots at or before its own position."""
        self.trunk.write(0, positions, k, v)
        return self.trunk.attend(0, q, positions[:, -1] + 1)

    def attend_chain(self, index: int, anchor: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                     v: torch.Tensor) -> torch.Tensor:
        """Store ``k, v [B, 1, Hkv, Dh]`` in chain slot ``index``; ``q [B, 1, Hq, Dh]`` attends
        to the trunk slots ``<= anchor [B]`` and the chain slots ``0..index``."""
        self.chain_k[:, index] = k[:, 0].to(self.chain_k.dtype)
        self.chain_v[:, index] = v[:, 0].to(self.chain_v.dtype)
        out_t, lse_t = self.trunk.attend(0, q, anchor + 1, return_lse=True)
        chain_k = self.chain_k[:, : index + 1].transpose(0, 1).to(q.dtype)  # [P, B, Hkv, Dh]
        chain_v = self.chain_v[:, : index + 1].transpose(0, 1).to(q.dtype)
        out_c, lse_c = branch_forward(q[:, 0], chain_k, chain_v, q.shape[-1] ** -0.5)
        out, _ = merge_attention(out_t[:, 0], lse_t[:, 0], out_c, lse_c)
        return out.unsqueeze(1)


class Draft(nn.Module):
    """The EAGLE-3 draft model.

    ``forward`` runs the whole TTT unroll over packed tokens (training); ``forward_pass``
    is one pass of it. Drafting at rollout time runs the same passes against a
    ``DraftKVCache``: ``extend`` (pass 1 over newly committed positions) and ``chain_step``
    (pass ``d >= 2`` at the last one), batched over sequences at their own offsets.
    """

    def __init__(self, args: DraftArgs, d2t: torch.Tensor | None = None, t2d: torch.Tensor | None = None) -> None:
        super().__init__()
        self.args = args
        if (d2t is None) != (t2d is None):
            raise ValueError("give both d2t and t2d, or neither (identity vocabulary)")
        if d2t is None:
            if args.draft_vocab_size != args.vocab_size:
                raise ValueError("a reduced draft vocabulary needs its d2t / t2d maps")
            d2t, t2d = identity_vocab_maps(args.vocab_size)
        if d2t.shape != (args.draft_vocab_size,) or t2d.shape != (args.vocab_size,):
            raise ValueError(f"d2t must be [{args.draft_vocab_size}] and t2d [{args.vocab_size}]")
        self.embed_tokens = nn.Embedding(args.vocab_size, args.dim) if args.dim != args.target_dim else None
        self.fc = nn.Linear(args.n_taps * args.target_dim, args.dim, bias=False)
        self.midlayer = DraftLayer(args)
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.lm_head = nn.Linear(args.dim, args.draft_vocab_size, bias=False)
        self.register_buffer("d2t", d2t.to(torch.int64))
        self.register_buffer("t2d", t2d.to(torch.bool))
        self.register_buffer(
            "rope_inv_freq", rope_inv_freq(args.head_dim, args.rope_theta, args.rope_scaling), persistent=False
        )

    def init_weights(self, std: float = 0.02, generator: torch.Generator | None = None, fill=None) -> None:
        init_weights_(self, std, generator, *([fill] if fill is not None else []))

    def embed(self, tokens: torch.Tensor, target_embeddings: torch.Tensor) -> torch.Tensor:
        """The draft's input embeddings: the policy's (given) or its own table."""
        return target_embeddings if self.embed_tokens is None else self.embed_tokens(tokens)

    def fuse(self, taps: torch.Tensor) -> torch.Tensor:
        """``h^0 = fc(taps)``; ``taps [T, n_taps * H_t]`` (the tap layers concatenated)."""
        return self.fc(taps)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[T, H] -> [T, V_d]`` (fp32)."""
        return self.lm_head(self.norm(hidden)).float()

    def rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return rope_cos_sin(self.rope_inv_freq, positions, dtype)

    def forward_pass(
        self,
        embeds: torch.Tensor,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        cu_seqlens: torch.Tensor,
        trunk_kv: tuple[torch.Tensor, torch.Tensor] | None,
        branch_kv: Sequence[tuple[torch.Tensor, torch.Tensor]],
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """One TTT pass over packed tokens.

        ``embeds, hidden: [T, H]`` (``e(x_{i+d})`` and ``h^{d-1}_i``), ``positions: [T]`` the
        RoPE positions of this pass. ``trunk_kv`` is pass 1's ``(k, v)`` (None on pass 1,
        which then provides it); ``branch_kv`` the ``(k, v)`` of passes ``2..d-1``. Returns
        the pass output ``h^d [T, H]`` and this pass's own ``(k, v) [T, Hkv, Dh]``. Under CP
        (applied from outside to ``self_attn.inner_attention``) the trunk runs over the ring.
        """
        layer = self.midlayer
        cos, sin = self.rope(positions, hidden.dtype)
        q, k, v = layer.self_attn.qkv(layer.attention_input(embeds, hidden), cos, sin)
        if trunk_kv is None:
            trunk_kv, branch = (k, v), []
        else:
            branch = [*branch_kv, (k, v)]
        if branch:
            branch_k = torch.stack([bk for bk, _ in branch])
            branch_v = torch.stack([bv for _, bv in branch])
        else:
            branch_k = branch_v = k.new_zeros((0, *k.shape))
        out = layer.self_attn.inner_attention(q, *trunk_kv, branch_k, branch_v, cu_seqlens)
        return layer.finish(hidden, out), (k, v)

    def forward(
        self,
        taps: torch.Tensor,
        target_embeddings: torch.Tensor,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        cu_seqlens: torch.Tensor,
        select: torch.Tensor,
        score: Callable[[int, torch.Tensor, Callable[[torch.Tensor], torch.Tensor]], Any] | None = None,
        shift_rows: torch.Tensor | None = None,
    ) -> list:
        """The TTT unroll: ``D = select.shape[0]`` passes with teacher forcing.

        ``taps [T, n_taps * H_t]``, ``target_embeddings [T, H_t]`` (the policy's, detached),
        ``tokens, positions [T]``, ``select: bool [D, T]`` (anchors scored at each pass),
        ``cu_seqlens``: a host tensor or a sequence of ints (what FSDP's root-input moving
        leaves on the host).
        Pass ``d`` reads ``e(x_{i+d})`` and ``h^{d-1}_i`` at RoPE position ``i + d - 1`` and
        attends to pass 1's keys at ``j <= i`` plus passes ``2..d``'s keys at ``i``.
        Returns, per pass, the draft logits ``[n_d, V_d]`` (fp32) of the selected anchors, or
        with ``score``, what ``score(d, h^d [T, H], head)`` returns for pass ``d``: it runs
        here, inside the draft's forward, where FSDP has the head (``head``: ``[c, H] ->
        [c, V_d]`` fp32 logits) gathered (the chunked soft CE of ``ttt_unroll``).

        ``shift_rows: int64 [>= D, T']`` (a ``DocumentShift``'s or a ``TTTHalo``'s ``rows``, on
        the device): pass ``d`` reads its input embedding at row ``shift_rows[d - 1, i]`` of
        ``tokens`` / ``target_embeddings`` (``[T', ...]``, ``T' >= T``), zeros where it is -1.
        Default: the rows of ``t + d`` inside each document (``T' = T``). Under context
        parallelism the tensors are this rank's shard, ``tokens`` and ``target_embeddings``
        carry the TTT halo's rows after the local ones and ``shift_rows`` reaches into them
        (``ttt_unroll`` passes a ``TTTHalo``'s); the model itself is the same.
        """
        cu_seqlens = packed_cu_seqlens(cu_seqlens)  # host metadata, maybe passed as ints
        embeds = self.embed(tokens, target_embeddings)
        hidden = self.fuse(taps)
        if shift_rows is None:
            shift_rows = DocumentShift(cu_seqlens, select.shape[0], hidden.device).rows
        # A new tuple per pass, never a list appended to: an activation-checkpointed pass
        # recomputes from the very inputs it was given.
        trunk_kv, branch_kv, logits = None, (), []
        for d in range(1, select.shape[0] + 1):
            embeds_d = take_rows(embeds, shift_rows[d - 1])
            hidden, kv = self.forward_pass(embeds_d, hidden, positions + (d - 1), cu_seqlens, trunk_kv, branch_kv)
            if trunk_kv is None:
                trunk_kv = kv
            else:
                branch_kv = (*branch_kv, kv)
            logits.append(score(d, hidden, self.logits) if score is not None else self.logits(hidden[select[d - 1]]))
        return logits

    def new_kv_pool(self, n_blocks: int, block_size: int, dtype: torch.dtype | None = None) -> KVPool:
        """The trunk's block pool (one layer), to be read through the target's block tables."""
        a = self.args
        return KVPool(1, n_blocks, block_size, a.n_kv_heads, a.head_dim, dtype or self.fc.weight.dtype,
                      self.fc.weight.device)

    def extend(self, taps: torch.Tensor, embeds: torch.Tensor, start_pos: torch.Tensor,
               cache: DraftKVCache) -> torch.Tensor:
        """TTT pass 1 over ``s`` new anchors ``j = start_pos[b] + 0..s-1`` of every sequence.

        ``taps [B, s, n_taps * H_t]``: the target's taps at positions ``j``; ``embeds [B, s, H]``:
        the draft's embeddings (``embed``) of the tokens at ``j + 1``. Writes the pass-1
        key/value of anchor ``j`` to trunk slot ``j`` and returns ``h^1_j [B, s, H]``.

        Invariant (drafting reads what training wrote): trunk slot ``j`` holds exactly the key
        TTT pass 1 computes at anchor ``j`` -- input ``[e(x_{j+1}) ; fc(taps_j)]`` at RoPE
        position ``j`` -- and anchor ``j`` attends to trunk slots ``<= j``, the trunk of branch
        attention. Slots past a sequence's last committed anchor may hold stale keys (of
        rejected drafts, or of prompt padding); no query sees them (``<= j``) before they are
        rewritten.
        """
        b, s, _ = embeds.shape
        positions = start_pos.view(b, 1).to(torch.int64) + torch.arange(s, device=embeds.device)
        return self._cached_pass(embeds, self.fuse(taps), positions,
                                 lambda q, k, v: cache.attend_trunk(positions, q, k, v))

    def chain_step(self, embeds: torch.Tensor, hidden: torch.Tensor, anchor: torch.Tensor, depth: int,
                   cache: DraftKVCache) -> torch.Tensor:
        """TTT pass ``depth >= 2`` at each sequence's drafting ``anchor [B]``.

        ``embeds [B, H]``: the draft's embedding of the token pass ``depth - 1`` drafted;
        ``hidden [B, H]``: that pass's output ``h^{depth-1}``. RoPE position
        ``anchor + depth - 1``; the key goes to chain slot ``depth - 2``. The query sees the
        trunk slots ``<= anchor`` (pass-1 keys, see ``extend``) and the chain slots of passes
        ``2..depth`` -- the branch of branch attention -- so a chain step computes what TTT
        pass ``depth`` computes at ``anchor`` given the drafted tokens. Returns ``h^depth [B, H]``.
        """
        b = hidden.shape[0]
        positions = (anchor.to(torch.int64) + depth - 1).view(b, 1)
        out = self._cached_pass(embeds.unsqueeze(1), hidden.unsqueeze(1), positions,
                                lambda q, k, v: cache.attend_chain(depth - 2, anchor, q, k, v))
        return out.squeeze(1)

    def _cached_pass(self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                     attend: Callable) -> torch.Tensor:
        """One pass over ``[B, s]`` queries (``embeds, hidden [B, s, H]``, RoPE ``positions [B, s]``):
        ``attend(q [B, s, Hq, Dh], k, v [B, s, Hkv, Dh])`` stores the keys/values and returns
        the queries' attention output ``[B, s, Hq, Dh]``. Returns ``[B, s, H]``."""
        layer, attn = self.midlayer, self.midlayer.self_attn
        b, s, _ = hidden.shape
        cos, sin = self.rope(positions.reshape(-1), hidden.dtype)
        q, k, v = attn.qkv(layer.attention_input(embeds, hidden).reshape(b * s, -1), cos, sin)
        out = attend(*(x.view(b, s, *x.shape[1:]) for x in (q, k, v)))
        return layer.finish(hidden, out)
