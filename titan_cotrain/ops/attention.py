"""Document-causal attention over packed sequences: the one attention path of the project.

Layout: packed ``[T, H, Dh]`` tensors, where the ``T`` tokens are the concatenation of
documents whose boundaries are ``cu_seqlens: int32 [n_docs + 1]`` (``cu_seqlens[0] == 0``,
``cu_seqlens[-1] == T``), a *host* tensor: the kernels read the bounds on the host and copy
them to the device themselves, so the accelerator path never reads a device tensor. Query
``t`` of a document attends to the keys ``j <= t`` of the same document only ("the
document-mask rule"). GQA: ``Hq`` is a multiple of ``Hkv``.

Two layers live here:

* kernels: ``block_forward`` / ``block_backward`` (one block of one document, causal or
  full; the ring attention's unit of work) and ``trunk_forward`` / ``trunk_backward`` (every
  document of a packed batch). Forwards return ``(out, lse)`` with the log-sum-exp
  ``lse: [T, Hq]`` (fp32; fp64 for fp64 inputs) of every query row; backwards take an
  ``(out, lse)`` pair that may come from a *merged* attention (branch attention, ring
  attention), which is how merged attentions reuse these kernels for their backward;
* ``varlen_causal_attention``, the differentiable op, and ``VarlenAttention``, the module the
  target model calls it through: the one place context parallelism is applied from outside
  (``titan_cotrain.parallel.context_parallel.apply_context_parallel``, as torchtitan applies
  its CP to ``inner_attention``).

On the accelerator (any device but the CPU) the kernels are ATen's varlen flash kernels
(``aten::_flash_attention_forward`` / ``_backward``, private, behind ``titan_cotrain.ops.flash``;
fp16/bf16 only): one call over the whole packed batch for the trunk, one per block for the
ring. Their shapes are checked on CPU with the ops' meta kernels; their numerics have not yet
been verified on a GPU. On CPU the kernels call ATen's fused CPU flash kernel
(``aten::_scaled_dot_product_flash_attention_for_cpu``, private) one document at a time. An
exact einsum implementation (per document, O(n_doc^2) scores) is the reference the CPU tests
switch to (``_use_cpu_flash_kernel``). No path builds a ``T x T`` mask.

``merge_attention`` is the one log-sum-exp merge of two partial attentions used by
branch and ring attention.
"""

from __future__ import annotations

import torch
from torch import nn

from titan_cotrain.ops import flash

__all__ = [
    "BlockSegments",
    "VarlenAttention",
    "block_backward",
    "block_forward",
    "fold_grad_lse",
    "host_cu_seqlens",
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


def packed_cu_seqlens(cu_seqlens) -> torch.Tensor:
    """A batch's document bounds (ints or a tensor) as the int32 host tensor the models
    pass to their blocks, built once per batch. Its length (documents + 1) changes from batch
    to batch, so it is marked dynamic: a compiled block (``parallel.compile``) takes every
    layout with one graph."""
    t = cu_seqlens if isinstance(cu_seqlens, torch.Tensor) else torch.tensor(cu_seqlens, dtype=torch.int32)
    torch._dynamo.maybe_mark_dynamic(t, 0)
    return t


def host_cu_seqlens(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """``cu_seqlens`` as the int32 host tensor the kernels read. The trainer passes host
    tensors; a device tensor is copied to the host here, once (on a GPU, a sync)."""
    return cu_seqlens.to("cpu", torch.int32)


def _on_accelerator(q: torch.Tensor) -> bool:
    return flash.takes_flash_path(q)


def _use_cpu_flash_kernel(q: torch.Tensor) -> bool:
    """CPU tensors take ATen's CPU flash kernel; tests patch this to False for the einsum reference."""
    return q.device.type == "cpu"


def _doc_bounds(cu_seqlens: torch.Tensor, total: int) -> list[tuple[int, int]]:
    """Non-empty ``(start, end)`` of every document; the documents must cover ``[0, total)``.
    Reads ``cu_seqlens`` on the host: free for a host tensor, a sync for a device one."""
    cu = cu_seqlens.tolist()
    if cu[0] != 0 or cu[-1] != total or any(e < s for s, e in zip(cu[:-1], cu[1:])):
        raise ValueError(f"cu_seqlens must rise from 0 to T = {total}, got {cu}")
    return [(s, e) for s, e in zip(cu[:-1], cu[1:]) if e > s]


def _device_segments(bounds: list[tuple[int, int]], device: torch.device) -> tuple[torch.Tensor, int]:
    """The flash kernel's ``cu_seqlens`` (int32, on ``device``) and longest segment for the
    documents ``bounds``, from host values: one host-to-device copy, no sync. Empty documents
    were dropped from ``bounds``, so they never reach the kernel."""
    cu = torch.tensor([0] + [e for _, e in bounds], dtype=torch.int32)
    return cu.to(device, non_blocking=True), max((e - s for s, e in bounds), default=0)


class BlockSegments:
    """The device ``cu_seqlens`` of one-segment kernel calls, ``[0, n]`` for q and ``[0, m]``
    for k, for every block shape ``(n, m)`` a caller will run: built on the host and moved in
    one copy (the ring builds one per batch layout, not one per block)."""

    def __init__(self, shapes, device: torch.device) -> None:
        shapes = sorted(set(shapes)) or [(0, 0)]
        self._index = {shape: i for i, shape in enumerate(shapes)}
        host = torch.tensor([[[0, n], [0, m]] for n, m in shapes], dtype=torch.int32)
        self._cu = host.to(device, non_blocking=True)

    def __call__(self, n: int, m: int) -> tuple[torch.Tensor, torch.Tensor]:
        cu = self._cu[self._index[(n, m)]]
        return cu[0], cu[1]


def _expand_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """[n, Hkv, Dh] -> [n, Hkv * n_rep, Dh], query head h reading kv head h // n_rep."""
    return x if n_rep == 1 else x.repeat_interleave(n_rep, dim=1)


def _reduce_kv_grad(g: torch.Tensor, n_rep: int) -> torch.Tensor:
    if n_rep == 1:
        return g
    n, h, d = g.shape
    return g.view(n, h // n_rep, n_rep, d).sum(dim=2)


def _bhsd(x: torch.Tensor) -> torch.Tensor:
    """``[n, H, Dh] -> [1, H, n, Dh]``, the layout of ATen's SDPA kernels."""
    return x.transpose(0, 1).unsqueeze(0)


def _block_scores(q: torch.Tensor, k: torch.Tensor, scale: float, causal: bool) -> torch.Tensor:
    """Exact scores ``[H, n, m]`` in the accumulation dtype, causal mask applied when asked."""
    acc = lse_dtype(q.dtype)
    s = torch.einsum("qhd,khd->hqk", q.to(acc), k.to(acc)) * scale
    if causal:
        keep = torch.ones(q.shape[0], k.shape[0], dtype=torch.bool, device=q.device).tril()
        s = s.masked_fill(~keep, float("-inf"))
    return s


def block_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool,
    segments: BlockSegments | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One block of one document: ``q [n, Hq, Dh]`` over ``k, v [m, Hkv, Dh]``, all keys
    (``causal``: ``n == m`` and key ``j <= i``). Returns ``out [n, Hq, Dh]`` (q's dtype) and
    ``lse [n, Hq]`` (fp32). The ring runs one block per document and chunk pair; on CPU the
    trunk runs one causal block per document. ``segments``: the kernel's ``cu_seqlens``
    prepared for this block's shape (else made here, one host-to-device copy)."""
    if _on_accelerator(q):
        n, m = q.shape[0], k.shape[0]
        cu_q, cu_k = (segments or BlockSegments([(n, m)], q.device))(n, m)
        return flash.varlen_forward(q, k, v, cu_q, cu_k, n, m, scale, causal)
    n_rep = q.shape[1] // k.shape[1]
    k, v = _expand_kv(k, n_rep), _expand_kv(v, n_rep)
    if _use_cpu_flash_kernel(q):
        o, l = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            _bhsd(q), _bhsd(k), _bhsd(v), 0.0, causal, scale=scale
        )
        return o[0].transpose(0, 1), l[0].transpose(0, 1)
    s = _block_scores(q, k, scale, causal)
    l = torch.logsumexp(s, dim=-1)
    out = torch.einsum("hqk,khd->qhd", torch.exp(s - l.unsqueeze(-1)), v.to(s.dtype))
    return out.to(q.dtype), l.transpose(0, 1)


def block_backward(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    scale: float,
    causal: bool,
    segments: BlockSegments | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """This block's share of ``(dq, dk, dv)`` for an attention whose final (merged) output and
    log-sum-exp are ``out``, ``lse``: ``dS = P (dO V^T - rowsum(dO * O))`` with ``P = e^(S - lse)``,
    what a flash backward computes when handed the merged pair (see ``trunk_backward``).
    Gradients are fp32 on CPU and in the inputs' dtypes from the accelerator's kernel."""
    if _on_accelerator(q):
        n, m = q.shape[0], k.shape[0]
        cu_q, cu_k = (segments or BlockSegments([(n, m)], q.device))(n, m)
        return flash.varlen_backward(grad_out, q, k, v, out, lse, cu_q, cu_k, n, m, scale, causal)
    n_rep = q.shape[1] // k.shape[1]
    acc = lse_dtype(q.dtype)
    ke, ve = _expand_kv(k, n_rep), _expand_kv(v, n_rep)
    if _use_cpu_flash_kernel(q):
        gq, gk, gv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            _bhsd(grad_out), _bhsd(q), _bhsd(ke), _bhsd(ve), _bhsd(out),
            lse.transpose(0, 1).unsqueeze(0).to(acc).contiguous(), 0.0, causal, scale=scale,
        )
        gq, gk, gv = (g[0].transpose(0, 1) for g in (gq, gk, gv))
    else:
        p = torch.exp(_block_scores(q, ke, scale, causal) - lse.to(acc).transpose(0, 1).unsqueeze(-1))
        go = grad_out.to(acc)
        delta = (go * out.to(acc)).sum(-1).transpose(0, 1)
        ds = p * (torch.einsum("qhd,khd->hqk", go, ve.to(acc)) - delta.unsqueeze(-1)) * scale
        gq = torch.einsum("hqk,khd->qhd", ds, ke.to(acc))
        gk = torch.einsum("hqk,qhd->khd", ds, q.to(acc))
        gv = torch.einsum("hqk,qhd->khd", p, go)
    return gq, _reduce_kv_grad(gk, n_rep), _reduce_kv_grad(gv, n_rep)


def trunk_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Document-causal attention. Returns ``out [T, Hq, Dh]`` (q's dtype) and ``lse [T, Hq]`` (fp32).
    On the accelerator, one flash call over every document of the batch."""
    check_packed(q, k, v, cu_seqlens)
    bounds = _doc_bounds(cu_seqlens, q.shape[0])
    if _on_accelerator(q):
        cu, max_len = _device_segments(bounds, q.device)
        return flash.varlen_forward(q, k, v, cu, cu, max_len, max_len, scale, causal=True)
    out = torch.empty_like(q)
    lse = torch.full(q.shape[:2], float("-inf"), dtype=lse_dtype(q.dtype), device=q.device)
    for s, e in bounds:
        out[s:e], lse[s:e] = block_forward(q[s:e], k[s:e], v[s:e], scale, causal=True)
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
    backward computes when handed the merged ``(out, lse)``. On the accelerator, one flash call.
    """
    bounds = _doc_bounds(cu_seqlens, q.shape[0])
    if _on_accelerator(q):
        cu, max_len = _device_segments(bounds, q.device)
        return flash.varlen_backward(grad_out, q, k, v, out, lse, cu, cu, max_len, max_len, scale, causal=True)
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for s, e in bounds:
        gq, gk, gv = block_backward(grad_out[s:e], q[s:e], k[s:e], v[s:e], out[s:e], lse[s:e], scale, causal=True)
        dq[s:e], dk[s:e], dv[s:e] = gq.to(q.dtype), gk.to(k.dtype), gv.to(v.dtype)
    return dq, dk, dv


def fold_grad_lse(
    backward,
    grad_out: torch.Tensor,
    grad_lse: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    *,
    extra_column: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` of an attention whose merged ``(out, lse)`` both receive gradients,
    from ``backward(grad_out, q, k, v, out, lse)``, a kernel that knows only ``grad_out``.

    Such a kernel sees ``delta`` only as ``rowsum(grad_out * out)``; a gradient on ``lse``
    adds ``P * grad_lse`` to ``dS`` (``d lse / dS = P``). Two exact ways in:

    * one call with one head-dim column appended (q, k: 0, so scores are unchanged; v: 1;
      out: 0; grad_out: ``grad_lse``), turning ``dO V^T - delta`` into
      ``dO V^T + grad_lse - delta``; the extra column of every gradient is dropped;
    * where that column would pass the flash kernel's head-dim limit (``Dh = 256``), a second
      call with ``V = 0``, ``dO = e_0`` and ``out = -grad_lse e_0``, whose ``dS`` is exactly
      ``P * grad_lse``: its dQ and dK are added, its dV (of the zero V) dropped.

    ``extra_column`` picks the first (default: wherever ``Dh + 1`` fits the kernel).
    """
    if extra_column is None:
        extra_column = not _on_accelerator(q) or q.shape[-1] + 1 <= flash.MAX_HEAD_DIM
    if extra_column:
        pad = torch.nn.functional.pad
        dq, dk, dv = backward(
            torch.cat([grad_out, grad_lse.unsqueeze(-1).to(grad_out.dtype)], dim=-1),
            pad(q, (0, 1)), pad(k, (0, 1)), pad(v, (0, 1), value=1.0), pad(out, (0, 1)), lse,
        )
        return dq[..., :-1], dk[..., :-1], dv[..., :-1]
    dq, dk, dv = backward(grad_out, q, k, v, out, lse)
    unit = torch.zeros_like(grad_out)
    unit[..., 0] = 1
    carrier = torch.zeros_like(out)
    carrier[..., 0] = -grad_lse.to(out.dtype)
    dq_lse, dk_lse, _ = backward(unit, q, k, torch.zeros_like(v), carrier, lse)
    return dq + dq_lse, dk + dk_lse, dv


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
# inductor backends) traces it as one opaque node: traced through, trunk_backward would
# read the document bounds from a fake cu_seqlens and fail.
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

    ``cu_seqlens`` is a host tensor (see ``host_cu_seqlens``). Returns ``out [T, Hq, Dh]``.
    Gradients flow to q, k and v (not through the lse).
    """
    if scale is None:
        scale = q.shape[-1] ** -0.5
    out, _ = _varlen_causal_attention(q, k, v, host_cu_seqlens(cu_seqlens), float(scale))
    return out


class VarlenAttention(nn.Module):
    """``varlen_causal_attention(q, k, v, cu_seqlens)`` as a module without parameters: the
    target's ``inner_attention``. Context parallelism hooks this module from outside
    (``parallel.context_parallel.apply_context_parallel``): its ``q, k, v`` then enter as
    ``Shard(0)`` DTensors of the zigzag shard and torch's CP dispatcher runs the ring."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
        return varlen_causal_attention(q, k, v, cu_seqlens)
