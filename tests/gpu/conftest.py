"""GPU checks: the attention kernels, the ring and the rollout engine on a CUDA device in bf16,
against fp64 CPU references and exact laws. Without a CUDA device every test is skipped with
its reason (``needs_gpu``); ``scripts/gpu_check.sh`` runs them on an H100/H200.

Developer switch: ``TITAN_GPU_TESTS_ON_CPU=1`` runs the same tests on device ``"cpu"`` in
float32 instead of ``"cuda"`` in bfloat16. The library then takes its CPU paths (ATen's CPU
flash kernel for the trunk, the gather path for the engine's decode, dynamo's ``eager``
backend for the compiled engine), so a mistake in a test's own logic shows on a machine
without a GPU; it proves nothing about the GPU::

    TITAN_GPU_TESTS_ON_CPU=1 .venv/bin/python -m pytest tests/gpu

The tolerance rule of the attention tests. Inputs are N(0, 1) rounded to ``DTYPE``; the
reference is fp64 on the CPU from those same rounded values. An exact kernel that computes in
fp32 and rounds its result to the result's dtype is off by that rounding alone:
``baseline = max |dtype(fp32(ref)) - ref|`` over the tensor. A result passes when its max
error is at most ``C x baseline + floor``, ``C`` one of the constants below and ``floor`` a
small absolute term for tensors an exact kernel gets exactly (``FLOOR``, ``LSE_FLOOR``).
"""

from __future__ import annotations

import itertools
import os
from unittest import mock

import pytest
import torch

from titan_cotrain.ops import attention
from titan_cotrain.ops.attention import trunk_backward, trunk_forward

ON_CPU = os.environ.get("TITAN_GPU_TESTS_ON_CPU") == "1"
DEVICE = torch.device("cpu" if ON_CPU else "cuda")
DTYPE = torch.float32 if ON_CPU else torch.bfloat16

# Flash attention's forward rounds the probabilities P to the input dtype before P @ V: each
# term of an output carries one more rounding than an exact kernel's, at most about the
# output's own; 4 leaves room for that and for the merges of branch and ring attention
# (partial outputs rounded before an fp32 merge). A wrong mask, scale or lse layout is off
# by O(1), hundreds of baselines.
C_FORWARD = 4
# The backward rounds P and dS = P (dP - delta) to the input dtype before its matmuls and
# forms delta = rowsum(dO * O) from the rounded output; with GQA, dK and dV are sums of
# Hq / Hkv per-query-head gradients each already rounded (FA2 reduces its expanded dK/dV in
# the input dtype), and branch and ring attention add bf16 partial gradients in fp32. ATen's
# CPU flash kernel, which rounds alike, reaches 5 baselines in bf16 at Hq / Hkv = 4: 8.
C_BACKWARD = 8
# Absolute floor of a result in DTYPE. Where an exact kernel makes no rounding error (a
# one-token document's output is its value row, its dq and dk are 0) the baseline is 0 and
# only a kernel's fp32 accumulation noise remains, 1e-6 to 1e-5 on these O(1) values. bf16:
# 1e-4, 1/20 of bf16's half-ulp at 1. fp32 (the CPU switch): ATen's CPU flash kernel and the
# einsum reference differ by summation order, up to 3.4e-6 here: 1e-5.
FLOOR = {torch.bfloat16: 1e-4, torch.float32: 1e-5}
# lse is fp32 on every path (baseline: fp32 rounding, ~5e-7 at lse ~ 10), but its scores are
# fp32 sums of Dh <= 256 products and its exp / log are approximations: ATen's CPU flash kernel
# is off by 6e-5 from bf16 inputs. A swapped lse layout (FA2 with GQA and one query per
# segment), a wrong head or a wrong scale is off by 1e-2 to O(1).
LSE_FLOOR = 5e-4


def needs_gpu(checks: str) -> pytest.MarkDecorator:
    """A test module's skip marker, ``pytestmark = needs_gpu("what the module checks")``:
    skipped without a CUDA device, unless the CPU switch is on."""
    return pytest.mark.skipif(not ON_CPU and not torch.cuda.is_available(), reason=f"needs a CUDA GPU: {checks}")


@pytest.fixture(autouse=True)
def _seeded():
    torch.manual_seed(0)


def cu_seqlens(lengths: list[int]) -> torch.Tensor:
    """Host int32 ``[n_docs + 1]`` bounds of documents of ``lengths`` (zeros allowed)."""
    return torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)


def rounded_randn(shape: tuple[int, ...], generator: torch.Generator, dtype: torch.dtype = DTYPE) -> torch.Tensor:
    """N(0, 1) values rounded to ``dtype``, on the host: the references read them in fp64."""
    return torch.randn(shape, generator=generator).to(dtype)


def packed_inputs(lengths: list[int], hq: int, hkv: int, d: int, seed: int):
    """``(cu_seqlens, q [T, Hq, D], k, v [T, Hkv, D], cotangent [T, Hq, D])`` on the host, in ``DTYPE``."""
    cu = cu_seqlens(lengths)
    t = int(cu[-1])
    g = torch.Generator().manual_seed(seed)
    q, k, v, cotangent = (rounded_randn((t, h, d), g) for h in (hq, hkv, hkv, hq))
    return cu, q, k, v, cotangent


def on_device(*xs: torch.Tensor) -> list[torch.Tensor]:
    """Copies of host tensors on ``DEVICE`` that require grad (leaves of the device graph)."""
    return [x.to(DEVICE).requires_grad_() for x in xs]


def exact_einsum_path():
    """Within it, CPU attention takes the library's exact einsum path (the reference), not
    ATen's CPU flash kernel."""
    return mock.patch.object(attention, "_use_cpu_flash_kernel", lambda q: False)


def trunk_reference(q, k, v, cotangent, cu: torch.Tensor, scale: float):
    """fp64 host ``(out, lse, (dq, dk, dv))`` of document-causal attention over packed
    ``q [T, Hq, D]``, ``k, v [T, Hkv, D]`` with output cotangent ``cotangent [T, Hq, D]``."""
    x = [t.detach().cpu().double() for t in (q, k, v)]
    with exact_einsum_path():
        out, lse = trunk_forward(*x, cu, scale)
        grads = trunk_backward(cotangent.detach().cpu().double(), *x, out, lse, cu, scale)
    return out, lse, grads


def assert_near(name: str, got: torch.Tensor, ref: torch.Tensor, c: float, floor: float | None = None) -> None:
    """``got`` (any device, in the dtype its kernel returns) against the fp64 ``ref`` by the
    rule of this module's docstring; ``floor`` defaults to ``FLOOR`` of ``got``'s dtype."""
    assert got.shape == ref.shape, f"{name}: shape {tuple(got.shape)}, reference {tuple(ref.shape)}"
    if ref.numel() == 0:
        return
    dtype = got.dtype
    floor = FLOOR[dtype] if floor is None else floor
    got = got.detach().cpu().double()
    assert torch.isfinite(got).all(), f"{name}: {int((~torch.isfinite(got)).sum())} non-finite values"
    baseline = float((ref.float().to(dtype).double() - ref).abs().max())
    error = (got - ref).abs()
    worst = int(error.argmax())
    bound = c * baseline + floor
    assert float(error.max()) <= bound, (
        f"{name}: max error {float(error.max()):.3g} (flat index {worst}: got {got.flatten()[worst]:.6g}, "
        f"reference {ref.flatten()[worst]:.6g}) > {c} x baseline {baseline:.3g} + floor {floor:.3g}"
    )
