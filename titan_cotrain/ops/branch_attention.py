"""Branch attention: the attention of the EAGLE-3 draft's training-time-test (TTT) passes.

Pass ``d`` at anchor ``t`` attends to two disjoint key sets (docs/DESIGN.md section 3):

* the **trunk**: the pass-1 keys ``k[j]``, ``j <= t`` in ``t``'s document, the
  document-causal attention of ``titan_cotrain.ops.attention``;
* the **branch**: ``branch_k[p, t]`` for every ``p``, the keys the later passes produced
  *at the same anchor* (``P = d - 1`` of them).

For one document of 4 tokens and ``P = 2``, query ``t`` sees (``x`` = attends)::

              trunk keys j       branch keys (p, t)
               0  1  2  3        p=0   p=1
      t = 0    x  .  .  .         x     x        <- branch_k[0, 0], branch_k[1, 0]
      t = 1    x  x  .  .         x     x        <- branch_k[0, 1], branch_k[1, 1]
      t = 2    x  x  x  .         x     x
      t = 3    x  x  x  x         x     x

The branch is "diagonal": query ``t`` only ever meets the branch keys stored at row
``t``, so its scores are ``[T, H, P]`` and never a ``T x (P*T)`` matrix. The two parts
are computed separately and merged exactly by ``merge_attention``; the backward hands
the *merged* ``(out, lse)`` to both ``trunk_backward`` and ``branch_backward``, each of
which then produces its share of the exact gradient.

``branch_forward`` / ``branch_backward`` are the branch kernels, shaped like the trunk
kernels so that ring attention can merge the branch into its own result.
``branch_attention`` is the differentiable op; ``BranchAttention`` the module the draft calls
it through, where context parallelism is applied from outside (as for ``VarlenAttention``).
"""

from __future__ import annotations

import torch
from torch import nn

from titan_cotrain.ops.attention import (
    check_packed,
    fold_grad_lse,
    host_cu_seqlens,
    lse_dtype,
    merge_attention,
    trunk_backward,
    trunk_forward,
)

__all__ = [
    "BranchAttention",
    "branch_attention",
    "branch_attention_with_lse",
    "branch_backward",
    "branch_forward",
    "check_branch",
]


def check_branch(k: torch.Tensor, branch_k: torch.Tensor, branch_v: torch.Tensor) -> None:
    """``branch_k, branch_v`` are ``[P, T, Hkv, Dh]`` over the trunk keys ``k [T, Hkv, Dh]``."""
    if branch_k.dim() != 4 or branch_k.shape != branch_v.shape or branch_k.shape[1:] != k.shape:
        raise ValueError(
            f"branch_k{tuple(branch_k.shape)} and branch_v{tuple(branch_v.shape)} must both be "
            f"[P, T, Hkv, Dh] with [T, Hkv, Dh] = k's shape {tuple(k.shape)}"
        )


def _grouped(x: torch.Tensor, n_kv_heads: int, dtype: torch.dtype) -> torch.Tensor:
    """``[T, Hq, ...] -> [T, Hkv, Hq // Hkv, ...]`` in ``dtype``: query head ``h`` reads kv head ``h // (Hq // Hkv)``."""
    return x.unflatten(1, (n_kv_heads, -1)).to(dtype)


def _branch_scores(q: torch.Tensor, branch_k: torch.Tensor, scale: float) -> torch.Tensor:
    """``q [T, Hq, Dh]``, ``branch_k [P, T, Hkv, Dh]`` -> scores ``[T, Hkv, Hq // Hkv, P]`` (fp32)."""
    acc = lse_dtype(q.dtype)
    return torch.einsum("tgrd,ptgd->tgrp", _grouped(q, branch_k.shape[2], acc), branch_k.to(acc)) * scale


def branch_forward(
    q: torch.Tensor, branch_k: torch.Tensor, branch_v: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of every query ``t`` over its own ``P`` branch keys ``branch_k[:, t]``.

    ``q [T, Hq, Dh]``, ``branch_k, branch_v [P, T, Hkv, Dh]``. Returns ``out [T, Hq, Dh]``
    (q's dtype) and ``lse [T, Hq]`` (fp32; fp64 for fp64 inputs). ``P = 0`` gives
    ``out = 0`` and ``lse = -inf``, which ``merge_attention`` treats as "no keys".
    """
    acc = lse_dtype(q.dtype)
    scores = _branch_scores(q, branch_k, scale)
    lse = torch.logsumexp(scores, dim=-1)
    p = torch.exp(scores - lse.unsqueeze(-1))
    out = torch.einsum("tgrp,ptgd->tgrd", p, branch_v.to(acc))
    return out.flatten(1, 2).to(q.dtype), lse.flatten(1)


def branch_backward(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    branch_k: torch.Tensor,
    branch_v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    scale: float,
    grad_lse: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients ``(dq [T, Hq, Dh], dbranch_k, dbranch_v [P, T, Hkv, Dh])`` of the branch part.

    Like ``trunk_backward``, ``out [T, Hq, Dh]`` and ``lse [T, Hq]`` are those of the whole
    (merged) attention: with ``P_b = exp(S_b - lse)`` and ``delta = rowsum(grad_out * out)``,
    the branch's share is ``dS_b = P_b * (grad_out @ V_b^T - delta)``. ``grad_lse [T, Hq]``,
    the gradient reaching the merged ``lse`` if it was used downstream, adds
    ``P_b * grad_lse`` (``d lse / dS = P``), i.e. it is subtracted from ``delta``.
    """
    acc = lse_dtype(q.dtype)
    hkv = branch_k.shape[2]
    go = _grouped(grad_out, hkv, acc)
    p = torch.exp(_branch_scores(q, branch_k, scale) - _grouped(lse, hkv, acc).unsqueeze(-1))
    delta = (go * _grouped(out, hkv, acc)).sum(-1)
    if grad_lse is not None:
        delta = delta - _grouped(grad_lse, hkv, acc)
    dp = torch.einsum("tgrd,ptgd->tgrp", go, branch_v.to(acc))
    ds = p * (dp - delta.unsqueeze(-1)) * scale
    dq = torch.einsum("tgrp,ptgd->tgrd", ds, branch_k.to(acc)).flatten(1, 2)
    dk = torch.einsum("tgrp,tgrd->ptgd", ds, _grouped(q, hkv, acc))
    dv = torch.einsum("tgrp,tgrd->ptgd", p, go)
    return dq.to(q.dtype), dk.to(branch_k.dtype), dv.to(branch_v.dtype)


@torch.library.custom_op("titan_cotrain::branch_attention", mutates_args=())
def _branch_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    branch_k: torch.Tensor,
    branch_v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    out_trunk, lse_trunk = trunk_forward(q, k, v, cu_seqlens, scale)
    out_branch, lse_branch = branch_forward(q, branch_k, branch_v, scale)
    out, lse = merge_attention(out_trunk, lse_trunk, out_branch, lse_branch)
    return out.contiguous(), lse.contiguous()


# Outputs are contiguous whatever the inputs' strides, so fake and real layouts agree.
@_branch_attention.register_fake
def _(q, k, v, branch_k, branch_v, cu_seqlens, scale):
    return q.new_empty(q.shape), q.new_empty(q.shape[:2], dtype=lse_dtype(q.dtype))


# An op of its own so that AOTAutograd traces the backward as one opaque node (the trunk
# kernel reads the document bounds from cu_seqlens, which a fake tensor does not hold).
@torch.library.custom_op("titan_cotrain::branch_attention_backward", mutates_args=())
def _branch_attention_backward(
    grad_out: torch.Tensor,
    grad_lse: torch.Tensor | None,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    branch_k: torch.Tensor,
    branch_v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    cu_seqlens: torch.Tensor,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    if grad_lse is None:
        dq, dk, dv = trunk_backward(grad_out, q, k, v, out, lse, cu_seqlens, scale)
    else:
        def trunk(*args):
            return trunk_backward(*args, cu_seqlens, scale)

        dq, dk, dv = fold_grad_lse(trunk, grad_out, grad_lse, q, k, v, out, lse)
    dq_branch, dbranch_k, dbranch_v = branch_backward(grad_out, q, branch_k, branch_v, out, lse, scale, grad_lse)
    return tuple(g.contiguous() for g in (dq + dq_branch, dk, dv, dbranch_k, dbranch_v))


@_branch_attention_backward.register_fake
def _(grad_out, grad_lse, q, k, v, branch_k, branch_v, out, lse, cu_seqlens, scale):
    return tuple(x.new_empty(x.shape) for x in (q, k, v, branch_k, branch_v))


def _setup_context(ctx, inputs, output):
    q, k, v, branch_k, branch_v, cu_seqlens, scale = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, branch_k, branch_v, cu_seqlens, out, lse)
    ctx.scale = scale
    # An lse nobody used arrives as None instead of zeros, which keeps the common
    # (out-only) backward on the plain trunk kernel.
    ctx.set_materialize_grads(False)


def _backward(ctx, grad_out, grad_lse):
    q, k, v, branch_k, branch_v, cu_seqlens, out, lse = ctx.saved_tensors
    if grad_out is None:
        grad_out = torch.zeros_like(out)
    grads = _branch_attention_backward(
        grad_out.contiguous(), grad_lse, q, k, v, branch_k, branch_v, out, lse, cu_seqlens, ctx.scale
    )
    return (*grads, None, None)


_branch_attention.register_autograd(_backward, setup_context=_setup_context)


def branch_attention_with_lse(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    branch_k: torch.Tensor,
    branch_v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``branch_attention`` that also returns the merged ``lse [T, Hq]`` (fp32; fp64 for fp64
    inputs), for callers that merge it with further key sets. Both outputs are differentiable."""
    check_packed(q, k, v, cu_seqlens)
    check_branch(k, branch_k, branch_v)
    if scale is None:
        scale = q.shape[-1] ** -0.5
    return _branch_attention(q, k, v, branch_k, branch_v, host_cu_seqlens(cu_seqlens), float(scale))


def branch_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    branch_k: torch.Tensor,
    branch_v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    scale: float | None = None,
) -> torch.Tensor:
    """Differentiable trunk + branch attention over packed tokens.

    ``q [T, Hq, Dh]``; trunk ``k, v [T, Hkv, Dh]`` (the pass-1 keys/values); branch
    ``branch_k, branch_v [P, T, Hkv, Dh]``, ``P >= 0`` (the keys/values of TTT passes
    ``2..d`` at each anchor); ``cu_seqlens: int32 [n_docs + 1]``, a host tensor (see
    ``host_cu_seqlens``). Query ``t`` attends to the keys ``j <= t`` of its document and to
    ``branch_k[p, t]`` for every ``p``, under one softmax. GQA when ``Hq`` is a multiple of
    ``Hkv``; default ``scale = Dh ** -0.5``. Returns ``out [T, Hq, Dh]``; gradients flow to q,
    k, v, branch_k and branch_v. Memory beyond the trunk attention is ``O(T * P)``. ``P = 0``
    is plain document-causal attention.
    """
    out, _ = branch_attention_with_lse(q, k, v, branch_k, branch_v, cu_seqlens, scale)
    return out


class BranchAttention(nn.Module):
    """``branch_attention(q, k, v, branch_k, branch_v, cu_seqlens)`` as a module without
    parameters: the draft's ``inner_attention``. Under context parallelism
    (``parallel.context_parallel.apply_context_parallel``) ``q, k, v`` enter as ``Shard(0)``
    and ``branch_k, branch_v`` as ``Shard(1)`` DTensors, and torch's CP dispatcher runs the
    trunk over the ring with the branch merged in rank-locally."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, branch_k: torch.Tensor,
                branch_v: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
        return branch_attention(q, k, v, branch_k, branch_v, cu_seqlens)
