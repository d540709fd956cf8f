"""GPU checks: the attention kernels, the ring and the rollout engine on the accelerator path in
bf16, against fp64 CPU references and exact laws; ``scripts/gpu_check.sh`` runs them on an
H100/H200.

The device is chosen explicitly (``DEVICE``): CUDA where it exists (``titan.device_type()``,
the project's one answer), never torch's "current accelerator", which is the scale
simulator's PrivateUse1 device once ``tests/conftest.py`` has registered it, ahead of CUDA.

Without CUDA every test runs on the host under the stand-in kernels (``tests/gpu/stand_in.py``:
pure-PyTorch ``varlen_attn`` and ATen flash forward/backward with the kernels' signatures and
layouts), once per torch version a module runs under (``STAND_IN_VERSIONS``, default 2.11 and
2.13): ``ops/flash.py``, the paged path of the KV cache, the ring's segment cache and the branch
merge then run with values, bf16 host tensors taking the accelerator path. What the stand-in
cannot show is the GPU's own: Triton kernels and CUDA graphs (the compiled engine runs on
dynamo's ``eager`` backend there), NCCL, and the real kernels' numerics.

The tolerance rule of the attention tests. Inputs are N(0, 1) rounded to ``DTYPE``; the
reference is fp64 on the CPU from those same rounded values. An exact kernel that computes in
fp32 and rounds its result to the result's dtype is off by that rounding alone:
``baseline = max |dtype(fp32(ref)) - ref|`` over the tensor. A result passes when its max
error is at most ``C x baseline + floor``, ``C`` one of the constants below and ``floor`` a
small absolute term for tensors an exact kernel gets exactly (``FLOOR``, ``LSE_FLOOR``).
"""

from __future__ import annotations

import itertools
from unittest import mock

import pytest
import torch

from tests.gpu.stand_in import VERSIONS, StandIn
from titan_cotrain.components import titan
from titan_cotrain.ops import attention
from titan_cotrain.ops.attention import trunk_backward, trunk_forward

DEVICE = torch.device(titan.device_type())
ON_GPU = DEVICE.type == "cuda"
DTYPE = torch.bfloat16
# A document long enough to cross many of the GPU kernels' tiles; the stand-in does not tile,
# so there a long document only costs time.
LONG_DOC = 3000 if ON_GPU else 200

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
# 1e-4, 1/20 of bf16's half-ulp at 1.
FLOOR = {torch.bfloat16: 1e-4}
# lse is fp32 on every path (baseline: fp32 rounding, ~5e-7 at lse ~ 10), but its scores are
# fp32 sums of Dh <= 256 products and its exp / log are approximations: ATen's CPU flash kernel
# is off by 6e-5 from bf16 inputs. A swapped lse layout (FA2 with GQA and one query per
# segment), a wrong head or a wrong scale is off by 1e-2 to O(1).
LSE_FLOOR = 5e-4


def pytest_generate_tests(metafunc):
    """Without CUDA, each test once per torch version of its module's ``STAND_IN_VERSIONS``."""
    if not ON_GPU and "kernels" in metafunc.fixturenames:
        versions = getattr(metafunc.module, "STAND_IN_VERSIONS", VERSIONS)
        metafunc.parametrize("kernels", versions, indirect=True, ids=lambda v: f"torch{v}")


@pytest.fixture(autouse=True)
def kernels(request):
    """The flash kernels a test runs: torch's own on a GPU (None), else the stand-in of the
    test's torch version, patched in for the test (its ``calls`` recorded)."""
    if ON_GPU:
        yield None
        return
    with StandIn(request.param).patched() as stand_in:
        yield stand_in


@pytest.fixture(autouse=True)
def _seeded():
    torch.manual_seed(0)


def assert_flash_kernels_ran(kernels: StandIn | None) -> None:
    """Under the stand-in, that the test reached the flash kernels (forward and backward)."""
    if kernels is not None:
        called = set(kernels.kernels_called())
        assert called & {"varlen_attn", "forward"} and "backward" in called, f"flash kernels called: {called}"


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
    return [x.to(DEVICE, copy=True).requires_grad_() for x in xs]


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
