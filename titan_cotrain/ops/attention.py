"""Document-causal attention over packed sequences: the one attention path of the project.

Layout: packed ``[T, H, Dh]`` tensors, where the ``T`` tokens are the concatenation of
documents whose boundaries are ``cu_seqlens: int32 [n_docs + 1]`` (``cu_seqlens[0] == 0``,
``cu_seqlens[-1] == T``). Query ``t`` of a document attends to the keys ``j <= t`` of the
same document only ("the document-mask rule"). GQA: ``Hq`` is a multiple of ``Hkv``.

Two layers live here:

* kernels, ``trunk_forward`` / ``trunk_backward``: forward returns ``(out, lse)`` with the
  fp32 log-sum-exp ``lse: [T, Hq]`` (fp32; fp64 for fp64 inputs) of every query row, and backward takes an
  ``(out, lse)`` pair that may come from a *merged* attention (branch attention, ring
  attention), which is how merged attentions reuse the trunk kernel for their backward;
* ``varlen_causal_attention``, the differentiable op the target model calls.

On CPU the kernels call ATen's fused CPU flash-attention kernel one document at a time
(no ``T x T`` mask is ever built). Elsewhere they fall back to an exact blockwise
implementation in plain PyTorch (per document, O(n_doc^2) scores); a fused GPU kernel
can replace it behind the same two functions.

``merge_attention`` is the one log-sum-exp merge of two partial attentions used by
branch and ring attention.
"""

from __future__ import annotations

import torch

__all__ = [
    "merge_attention",
    "trunk_backward",
    "trunk_forward",
    "varlen_causal_attention",
]


def lse_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulation dtype of softmax statistics: fp32, or fp64 for fp64 inputs (reference runs)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def check_packed(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor) -> None:
    """Shape checks of a packed attention call (no data reads, so safe under tracing)."""
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError(f"packed attention expects [T, H, Dh] tensors, got q{tuple(q.shape)} k{tuple(k.shape)} v{tuple(v.shape)}")
    if k.shape != v.shape or q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2]:
        raise ValueError(f"q{tuple(q.shape)}, k{tuple(k.shape)}, v{tuple(v.shape)} do not agree on T or Dh")
    if q.shape[1] % k.shape[1] != 0:
        raise ValueError(f"GQA needs Hq ({q.shape[1]}) to be a multiple of Hkv ({k.shape[1]})")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError("cu_seqlens must be a 1-D tensor [n_docs + 1]")


def _use_cpu_flash_kernel(q: torch.Tensor) -> bool:
    return q.device.type == "cpu"


def _doc_bounds(cu_seqlens: torch.Tensor, total: int) -> list[tuple[int, int]]:
    """Non-empty ``(start, end)`` of every document; the documents must cover ``[0, total)``."""
    cu = cu_seqlens.tolist()
    if cu[0] != 0 or cu[-1] != total or any(e < s for s, e in zip(cu[:-1], cu[1:])):
        raise ValueError(f"cu_seqlens must rise from 0 to T = {total}, got {cu}")
    return [(s, e) for s, e in zip(cu[:-1], cu[1:]) if e > s]


def _expand_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """[n, Hkv, Dh] -> [n, Hkv * n_rep, Dh], query head h reading kv head h // n_rep."""
    return x if n_rep == 1 else x.repeat_interleave(n_rep, dim=1)


def _reduce_kv_grad(g: torch.Tensor, n_rep: int) -> torch.Tensor:
    if n_rep == 1:
        return g
    n, h, d = g.shape
    return g.view(n, h // n_rep, n_rep, d).sum(dim=2)


def _causal_scores(q: torch.Tensor, k: torch.Tensor, scale: float) -> torch.Tensor:
    """[n, H, Dh] x [n, H, Dh] -> fp32 scores [H, n, n] with the causal mask applied."""
    acc = lse_dtype(q.dtype)
    s = torch.einsum("qhd,khd->hqk", q.to(acc), k.to(acc)) * scale
    n = q.shape[0]
    causal = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
    return s.masked_fill(~causal, float("-inf"))


def trunk_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Document-causal attention. Returns ``out [T, Hq, Dh]`` (q's dtype) and ``lse [T, Hq]`` (fp32)."""
    check_packed(q, k, v, cu_seqlens)
    n_rep = q.shape[1] // k.shape[1]
    out = torch.empty_like(q)
    lse = torch.full(q.shape[:2], float("-inf"), dtype=lse_dtype(q.dtype), device=q.device)
    for s, e in _doc_bounds(cu_seqlens, q.shape[0]):
        qd, kd, vd = q[s:e], _expand_kv(k[s:e], n_rep), _expand_kv(v[s:e], n_rep)
        if _use_cpu_flash_kernel(q):
            o, l = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                qd.transpose(0, 1).unsqueeze(0),
                kd.transpose(0, 1).unsqueeze(0),
                vd.transpose(0, 1).unsqueeze(0),
                0.0,
                True,
                scale=scale,
            )
            out[s:e] = o[0].transpose(0, 1)
            lse[s:e] = l[0].transpose(0, 1)
        else:
            scores = _causal_scores(qd, kd, scale)
            l = torch.logsumexp(scores, dim=-1)
            p = torch.exp(scores - l.unsqueeze(-1))
            out[s:e] = torch.einsum("hqk,khd->qhd", p, vd.to(p.dtype)).to(q.dtype)
            lse[s:e] = l.transpose(0, 1)
    return out, lse


def trunk_backward(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    cu_seqlens: torch.Tensor,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of the trunk part of an attention whose softmax normaliser is ``lse``.

    ``out`` and ``lse`` are the *final* output and log-sum-exp of the attention the trunk
    belongs to (the trunk alone, or the trunk merged with other key sets). With
    ``P = exp(S - lse)`` and ``delta = rowsum(grad_out * out)``, the trunk's share of the
    gradient is ``dS = P * (grad_out @ V^T - delta)``, which is exactly what a flash
    backward computes when handed the merged ``(out, lse)``.
    """
    n_rep = q.shape[1] // k.shape[1]
    dq = torch.zeros_like(q)
    dk = torch.zeros_like(k)
    dv = torch.zeros_like(v)
    for s, e in _doc_bounds(cu_seqlens, q.shape[0]):
        qd, kd, vd = q[s:e], _expand_kv(k[s:e], n_rep), _expand_kv(v[s:e], n_rep)
        if _use_cpu_flash_kernel(q):
            bhsd = lambda x: x.transpose(0, 1).unsqueeze(0)  # noqa: E731
            gq, gk, gv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                bhsd(grad_out[s:e]),
                bhsd(qd),
                bhsd(kd),
                bhsd(vd),
                bhsd(out[s:e]),
                lse[s:e].transpose(0, 1).unsqueeze(0).to(lse_dtype(q.dtype)).contiguous(),
                0.0,
                True,
                scale=scale,
            )
            gq, gk, gv = (g[0].transpose(0, 1) for g in (gq, gk, gv))
        else:
            scores = _causal_scores(qd, kd, scale)
            p = torch.exp(scores - lse[s:e].transpose(0, 1).unsqueeze(-1))
            acc = p.dtype
            go = grad_out[s:e].to(acc)
            delta = (go * out[s:e].to(acc)).sum(-1).transpose(0, 1)  # [H, n]
            dp = torch.einsum("qhd,khd->hqk", go, vd.to(acc))
            ds = p * (dp - delta.unsqueeze(-1)) * scale
            gq = torch.einsum("hqk,khd->qhd", ds, kd.to(acc))
            gk = torch.einsum("hqk,qhd->khd", ds, qd.to(acc))
            gv = torch.einsum("hqk,qhd->khd", p, go)
        dq[s:e] = gq.to(q.dtype)
        dk[s:e] = _reduce_kv_grad(gk, n_rep).to(k.dtype)
        dv[s:e] = _reduce_kv_grad(gv, n_rep).to(v.dtype)
    return dq, dk, dv


def merge_attention(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact merge of two attentions of the same queries over disjoint key sets.

    ``out_*: [..., H, Dh]``, ``lse_*: [..., H]`` (fp32, fp64 for fp64 inputs). ``lse = logaddexp(lse_a, lse_b)``,
    ``out = e^(lse_a - lse) out_a + e^(lse_b - lse) out_b``, computed in fp32. A side with
    ``lse = -inf`` (no keys) contributes nothing; both sides empty gives ``out = 0``.
    """
    lse = torch.logaddexp(lse_a, lse_b)
    safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    w_a = torch.exp(lse_a - safe).unsqueeze(-1)
    w_b = torch.exp(lse_b - safe).unsqueeze(-1)
    acc = lse.dtype
    out = w_a * out_a.to(acc) + w_b * out_b.to(acc)
    return out.to(out_a.dtype), lse


@torch.library.custom_op("titan_cotrain::varlen_causal_attention", mutates_args=())
def _varlen_causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    out, lse = trunk_forward(q, k, v, cu_seqlens, scale)
    return out, lse


@_varlen_causal_attention.register_fake
def _(q, k, v, cu_seqlens, scale):
    return torch.empty_like(q), q.new_empty(q.shape[:2], dtype=lse_dtype(q.dtype))


def _setup_context(ctx, inputs, output):
    q, k, v, cu_seqlens, scale = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, cu_seqlens, out, lse)
    ctx.scale = scale


# The backward is an op of its own so that AOTAutograd (torch.compile's aot_eager and
# inductor backends) traces it as one opaque node: traced through, trunk_backward's
# per-document loop would read cu_seqlens on fake tensors and fail.
@torch.library.custom_op("titan_cotrain::varlen_causal_attention_backward", mutates_args=())
def _varlen_causal_attention_backward(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    cu_seqlens: torch.Tensor,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return trunk_backward(grad_out, q, k, v, out, lse, cu_seqlens, scale)


@_varlen_causal_attention_backward.register_fake
def _(grad_out, q, k, v, out, lse, cu_seqlens, scale):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _backward(ctx, grad_out, grad_lse):
    q, k, v, cu_seqlens, out, lse = ctx.saved_tensors
    dq, dk, dv = _varlen_causal_attention_backward(grad_out.contiguous(), q, k, v, out, lse, cu_seqlens, ctx.scale)
    return dq, dk, dv, None, None


_varlen_causal_attention.register_autograd(_backward, setup_context=_setup_context)


def varlen_causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, scale: float | None = None
) -> torch.Tensor:
    """Differentiable document-causal attention over packed ``[T, H, Dh]`` tensors.

    Returns ``out [T, Hq, Dh]``. Gradients flow to q, k and v (not through the lse).
    """
    if scale is None:
        scale = q.shape[-1] ** -0.5
    out, _ = _varlen_causal_attention(q, k, v, cu_seqlens.to(torch.int32), float(scale))
    return out
