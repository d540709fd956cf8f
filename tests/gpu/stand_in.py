"""Stand-in flash kernels: pure-PyTorch references with the signatures and output layouts of the
kernels ``titan_cotrain.ops.flash`` calls, so that ``tests/gpu`` runs the accelerator path with
values on a machine without CUDA. A test aid only: nothing in the project imports it.

What stands in (FA2 as torch vendors it, written from its documented behaviour):

* ``torch.nn.attention.varlen.varlen_attn`` as torch 2.11 and torch 2.13 define it, each with
  its exact signature (``StandIn.varlen_attn``): 2.11's has no ``enable_gqa``, ``seqused_k``,
  ``block_table`` or ``num_splits``; both take the causal mask as ``window_size = (-1, 0)``;
* ``aten::_flash_attention_forward`` / ``_backward`` as the installed torch's schemas define
  them (``StandIn.forward``, ``StandIn.backward``): the positional arguments ``ops/flash.py``
  passes, keyword-only ``scale`` and windows, five outputs and three. The backward takes any
  ``(out, lse)``, so it computes the gradient of the attention they are the result of, not
  that of its own forward.

Semantics. Packed ``q [T_q, Hq, D]``, ``k, v [T_k, Hkv, D]`` are cut by int32 ``cu_seq_q``,
``cu_seq_k [N + 1]``; query head ``h`` reads KV head ``h // (Hq / Hkv)``. Masks are bottom-right
aligned: query ``i`` of a segment of ``n`` queries over ``m`` keys sits at position
``m - n + i`` and, with ``window_size = (left, right)``, sees the keys ``j`` with
``pos - left <= j <= pos + right`` (``-1``: unbounded; causal is ``(-1, 0)``). The lse is fp32
``[Hq, T_q]`` (torch 2.13's docstring says ``[T_q, Hq]``; the kernel returns this). A query
that sees no key gets output 0 and lse ``+inf``. Segment ``b`` has ``seqused_k[b]`` keys where
that is given; with ``block_table [N, pages]`` (int32) ``k, v`` are pools
``[n_pages, page, Hkv, D]`` and position ``p`` of segment ``b`` is row ``p % page`` of page
``block_table[b, p // page]``.

FA2's launch quirk, mirrored: with at most one query per segment (``max_q == 1``), GQA and no
left window, it runs the ``g = Hq / Hkv`` query heads of a KV head as that head's query rows,
restores the output's layout but returns the lse as that run wrote it, ``[Hkv, N * g]`` read
as ``[Hq, N]``: scrambled (``ops/flash.py`` launches GQA calls with ``max_q >= 2``).

The kernels' limits raise here: fp16/bf16 only, one dtype; head dims up to 256 and multiples
of 8; pages of a multiple of 256 positions; ``max_q``, ``max_k`` below a segment's length (on
a GPU, rows left unwritten); dropout. Arithmetic is fp32 with one rounding of each output to
the input dtype, exact within the GPU tests' tolerances.

``MUTATIONS`` are wrong kernels the suite must catch (``tests/gpu/test_kernel_paths.py``).
"""

from __future__ import annotations

import contextlib
import inspect
from dataclasses import dataclass, field
from unittest import mock

import torch

from titan_cotrain.ops import flash, ring_attention

__all__ = ["MUTATIONS", "VERSIONS", "StandIn", "on_stand_in_accelerator"]

VERSIONS = ("2.11", "2.13")
MUTATIONS = {
    "lse-transposed": "the lse's [T_q, Hq] memory returned as [Hq, T_q]",
    "no-key-rows-zero": "lse 0 instead of +inf for a query that sees no key",
}
PAGE_MULTIPLE = 256  # FA2's paged path reads pages of a multiple of 256 positions
_HALF = (torch.float16, torch.bfloat16)


def on_stand_in_accelerator(x: torch.Tensor) -> bool:
    """``flash.takes_flash_path`` under the stand-in: the host's fp16/bf16 tensors are the
    accelerator's (the GPU tests' device inputs are bf16; their fp32/fp64 references stay on
    the CPU paths), and every device but the CPU as before."""
    return x.device.type != "cpu" or x.dtype in _HALF


@dataclass
class Call:
    """One kernel call: ``kernel`` (``"varlen_attn"``, ``"forward"``, ``"backward"``), its
    arguments by name, and whether cuDNN's SDPA backend was enabled while it ran."""

    kernel: str
    arguments: dict
    cudnn_enabled: bool = field(default_factory=torch.backends.cuda.cudnn_sdp_enabled)


class StandIn:
    """The kernels of torch ``version`` (one of ``VERSIONS``), wrong as ``mutation`` says (one
    of ``MUTATIONS``, or None). ``calls`` records every call; ``patched()`` puts them where
    ``ops/flash.py`` resolves its kernels and makes its half-precision host tensors take the
    accelerator path."""

    def __init__(self, version: str, mutation: str | None = None) -> None:
        if version not in VERSIONS or (mutation is not None and mutation not in MUTATIONS):
            raise ValueError(f"no stand-in for torch {version} with mutation {mutation}")
        self.version, self.mutation = version, mutation
        self.varlen_attn = self._varlen_attn_2_11 if version == "2.11" else self._varlen_attn_2_13
        self.calls: list[Call] = []

    @contextlib.contextmanager
    def patched(self):
        params = frozenset(inspect.signature(self.varlen_attn).parameters)
        with mock.patch.multiple(flash, varlen_attn=self.varlen_attn, _VARLEN_PARAMS=params,
                                 _flash_ops=lambda: (self.forward, self.backward),
                                 takes_flash_path=on_stand_in_accelerator):
            ring_attention._SEGMENTS.clear()  # the ring keeps segments on the flash path's device
            try:
                yield self
            finally:
                ring_attention._SEGMENTS.clear()

    def kernels_called(self) -> list[str]:
        return [call.kernel for call in self.calls]

    # torch.nn.attention.varlen.varlen_attn, torch 2.11
    def _varlen_attn_2_11(self, query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                          window_size=(-1, -1)):
        self.calls.append(Call("varlen_attn", _arguments(locals())))
        if query.shape[1] != key.shape[1]:
            raise ValueError(f"torch 2.11's varlen_attn takes no GQA: Hq = {query.shape[1]}, Hkv = {key.shape[1]}")
        out, lse = self._forward(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale, window_size)
        return (out, lse) if return_aux is not None and return_aux.lse else out

    # torch.nn.attention.varlen.varlen_attn, torch 2.13
    def _varlen_attn_2_13(self, query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                          window_size=(-1, -1), enable_gqa=False, seqused_k=None, block_table=None, num_splits=None):
        self.calls.append(Call("varlen_attn", _arguments(locals())))
        hq, hkv = query.shape[1], key.shape[-2] if block_table is not None else key.shape[1]
        if (hq != hkv and not enable_gqa) or hq % hkv:
            raise ValueError(f"Hq = {hq} over Hkv = {hkv} with enable_gqa = {enable_gqa}")
        if block_table is not None and seqused_k is None:
            raise ValueError("block_table requires seqused_k")
        out, lse = self._forward(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale, window_size, seqused_k,
                                 block_table)
        return (out, lse) if return_aux is not None and return_aux.lse else out

    # aten::_flash_attention_forward
    def forward(self, query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal, return_debug_mask,
                *, scale=None, window_size_left=None, window_size_right=None, seqused_k=None, alibi_slopes=None,
                block_table=None, num_splits=None):
        self.calls.append(Call("forward", _arguments(locals())))
        if dropout_p or return_debug_mask or alibi_slopes is not None:
            raise NotImplementedError("the stand-in runs no dropout, debug mask or ALiBi")
        window = (_unbounded(window_size_left), 0 if is_causal else _unbounded(window_size_right))
        out, lse = self._forward(query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, scale, window, seqused_k,
                                 block_table)
        empty = torch.empty(0, dtype=torch.uint64, device=query.device)
        return out, lse, torch.zeros(2, dtype=torch.uint64, device=query.device), empty, query.new_empty(0)

    # aten::_flash_attention_backward
    @torch.no_grad()
    def backward(self, grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p,
                 is_causal, rng_state, unused, *, scale=None, window_size_left=None, window_size_right=None):
        self.calls.append(Call("backward", _arguments(locals())))
        _check_kernel_inputs(grad_out, query, key, value, out)
        hq, hkv, t_q = query.shape[1], key.shape[1], query.shape[0]
        if logsumexp.shape != (hq, t_q) or logsumexp.dtype != torch.float32:
            raise RuntimeError(f"logsumexp must be fp32 [Hq, T_q] = [{hq}, {t_q}], got "
                               f"{logsumexp.dtype} {list(logsumexp.shape)}")
        if dropout_p:
            raise NotImplementedError("the stand-in runs no dropout")
        scale = query.shape[-1] ** -0.5 if scale is None else scale
        window = (_unbounded(window_size_left), 0 if is_causal else _unbounded(window_size_right))
        g = hq // hkv
        dq = torch.zeros(query.shape, dtype=torch.float32, device=query.device)
        dk = torch.zeros(key.shape, dtype=torch.float32, device=key.device)
        dv = torch.zeros(value.shape, dtype=torch.float32, device=value.device)
        for (q0, q1), (k0, k1) in _segments(cum_seq_q, cum_seq_k, max_q, max_k):
            keys, values = key[k0:k1].float().repeat_interleave(g, 1), value[k0:k1].float().repeat_interleave(g, 1)
            q, do = query[q0:q1].float(), grad_out[q0:q1].float()
            # P = exp(S - lse): 0 where masked, and for lse = +inf (no keys); a -inf lse gives NaN, as on the GPU.
            p = torch.exp(_scores(q, keys, scale, window) - logsumexp[:, q0:q1, None])  # [Hq, n, m]
            delta = (do * out[q0:q1].float()).sum(-1).t()  # [Hq, n]
            ds = p * (torch.einsum("qhd,khd->hqk", do, values) - delta[..., None])
            dq[q0:q1] = torch.einsum("hqk,khd->qhd", ds, keys) * scale
            dk[k0:k1] = _per_kv_head(torch.einsum("hqk,qhd->khd", ds, q) * scale, g)
            dv[k0:k1] = _per_kv_head(torch.einsum("hqk,qhd->khd", p, do), g)
        return dq.to(query.dtype), dk.to(key.dtype), dv.to(value.dtype)

    @torch.no_grad()
    def _forward(self, query, key, value, cu_q, cu_k, max_q, max_k, scale, window, seqused_k=None, block_table=None):
        """``(out [T_q, Hq, D], lse)`` with the lse as the kernel returns it (module docstring)."""
        _check_kernel_inputs(query, key, value)
        paged = block_table is not None
        if paged and (key.shape[1] % PAGE_MULTIPLE or block_table.dtype != torch.int32):
            raise RuntimeError(f"paged KV needs int32 block tables and pages of a multiple of {PAGE_MULTIPLE} "
                               f"positions, got {block_table.dtype} and {key.shape[1]}")
        hq, hkv = query.shape[1], key.shape[-2]
        g, left = hq // hkv, window[0]
        scale = query.shape[-1] ** -0.5 if scale is None else scale
        used = seqused_k.tolist() if seqused_k is not None else None
        out = torch.zeros(query.shape, dtype=torch.float32, device=query.device)
        lse = torch.full((hq, query.shape[0]), float("inf"), device=query.device)
        for b, ((q0, q1), (k0, k1)) in enumerate(_segments(cu_q, cu_k, max_q, max_k, used)):
            if paged:
                page = key.shape[1]
                position = torch.arange(k1 - k0, device=key.device)
                rows = block_table[b, position // page].long() * page + position % page
                keys, values = key.flatten(0, 1)[rows], value.flatten(0, 1)[rows]
            else:
                keys, values = key[k0:k1], value[k0:k1]
            keys, values = keys.float().repeat_interleave(g, -2), values.float().repeat_interleave(g, -2)
            scores = _scores(query[q0:q1].float(), keys, scale, window)  # [Hq, n, m]
            seg_lse = torch.logsumexp(scores, dim=-1)  # -inf where a query sees no key
            seen = torch.isfinite(seg_lse)
            p = torch.exp(scores - torch.where(seen, seg_lse, 0.0)[..., None])
            out[q0:q1] = torch.einsum("hqk,khd->qhd", p, values)
            lse[:, q0:q1] = torch.where(seen, seg_lse, float("inf") if self.mutation != "no-key-rows-zero" else 0.0)
        if self.mutation == "lse-transposed":
            lse = lse.t().contiguous().view(lse.shape)
        if max_q == 1 and g > 1 and left < 0:  # the launch quirk (module docstring)
            n = cu_q.numel() - 1
            if query.shape[0] != n:
                raise RuntimeError(f"max_q = 1 with GQA needs one query per segment: {query.shape[0]} over {n}")
            lse = lse.view(hkv, g, n).transpose(1, 2).reshape(hq, n)
        return out.to(query.dtype), lse


def _arguments(local_vars: dict) -> dict:
    return {name: value for name, value in local_vars.items() if name != "self"}


def _unbounded(window: int | None) -> int:
    return -1 if window is None else window


def _check_kernel_inputs(*xs: torch.Tensor) -> None:
    dtypes = {x.dtype for x in xs}
    if len(dtypes) != 1 or not dtypes <= set(_HALF):
        raise RuntimeError(f"FlashAttention takes fp16 or bf16 tensors of one dtype, got {sorted(map(str, dtypes))}")
    d = xs[0].shape[-1]
    if d > 256 or d % 8 or any(x.shape[-1] != d for x in xs):
        raise RuntimeError(f"FlashAttention takes head dims up to 256, multiples of 8, alike: "
                           f"{[x.shape[-1] for x in xs]}")


def _segments(cu_q: torch.Tensor, cu_k: torch.Tensor, max_q: int, max_k: int, used: list[int] | None = None):
    """``((q0, q1), (k0, k1))`` of every segment, its keys the rows ``k0:k1`` of the packed
    keys (``used[b]`` of them where given: ``seqused_k``); raises where ``max_q`` or ``max_k``
    is below a segment's length."""
    if cu_q.dtype != torch.int32 or cu_k.dtype != torch.int32:
        raise RuntimeError(f"cu_seqlens must be int32, got {cu_q.dtype} and {cu_k.dtype}")
    q_bounds, k_bounds = cu_q.tolist(), cu_k.tolist()
    segments = []
    for b in range(len(q_bounds) - 1):
        q0, q1 = q_bounds[b], q_bounds[b + 1]
        k0 = k_bounds[b]
        k1 = k_bounds[b + 1] if used is None else k0 + used[b]
        if q1 - q0 > max_q or k1 - k0 > max_k:
            raise RuntimeError(f"segment {b} has {q1 - q0} queries over {k1 - k0} keys, above max_q = {max_q}, "
                               f"max_k = {max_k}: the kernel would leave rows unwritten")
        segments.append(((q0, q1), (k0, k1)))
    return segments


def _scores(q: torch.Tensor, keys: torch.Tensor, scale: float, window: tuple[int, int]) -> torch.Tensor:
    """Scaled scores ``[Hq, n, m]`` of ``q [n, Hq, D]`` over ``keys [m, Hq, D]``, ``-inf``
    outside the bottom-right aligned window."""
    n, m = q.shape[0], keys.shape[0]
    scores = torch.einsum("qhd,khd->hqk", q, keys) * scale
    position = torch.arange(n, device=q.device)[:, None] + (m - n)
    key = torch.arange(m, device=q.device)[None, :]
    left, right = window
    visible = torch.ones(n, m, dtype=torch.bool, device=q.device)
    if left >= 0:
        visible &= key >= position - left
    if right >= 0:
        visible &= key <= position + right
    return scores.masked_fill(~visible, float("-inf"))


def _per_kv_head(grad: torch.Tensor, g: int) -> torch.Tensor:
    """``[m, Hq, D]`` per query head -> ``[m, Hkv, D]``, the sum over each KV head's query heads."""
    m, hq, d = grad.shape
    return grad.view(m, hq // g, g, d).sum(2)
