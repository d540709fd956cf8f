"""Branch attention on the GPU in bf16 (the trunk on the flash kernels, the branch in fp32
einsums, merged by log-sum-exp) against the fp64 dense reference of ``tests/ops``: out, lse and
the five input gradients, at P = 0, 1 and 6 branch key sets, with and without a gradient
reaching the merged lse (folded into the trunk's backward as an extra head-dim column, or by a
second backward call at Dh = 256, where that column would pass the kernel's limit).
Tolerances: ``tests/gpu/conftest.py``."""

import pytest
import torch

from tests.gpu.conftest import (
    C_BACKWARD,
    C_FORWARD,
    DEVICE,
    LSE_FLOOR,
    assert_flash_kernels_ran,
    assert_near,
    on_device,
    packed_inputs,
    rounded_randn,
)
from tests.ops.test_branch_attention import reference
from titan_cotrain.ops import branch_attention_with_lse

LENGTHS = [0, 1, 7, 300, 0, 45]
HQ, HKV = 4, 2
NAMES = ("q", "k", "v", "branch_k", "branch_v")


@pytest.mark.parametrize("d", [128, 256])
@pytest.mark.parametrize("grad_lse", [False, True], ids=["out-only", "grad-lse"])
@pytest.mark.parametrize("p", [0, 1, 6], ids=lambda p: f"P{p}")
def test_branch_attention_matches_the_fp64_reference(p, grad_lse, d, kernels):
    cu, q, k, v, cotangent = packed_inputs(LENGTHS, HQ, HKV, d, seed=p + d)
    g = torch.Generator().manual_seed(100 + p)
    t = q.shape[0]
    branch_k, branch_v = (rounded_randn((p, t, HKV, d), g) for _ in range(2))
    lse_cotangent = torch.randn(t, HQ, generator=g)  # fp32, as the lse is
    scale = d**-0.5
    host = (q, k, v, branch_k, branch_v)

    ref_inputs = [x.double().requires_grad_() for x in host]
    ref_out, ref_lse = reference(*ref_inputs, cu, scale)
    loss = (ref_out * cotangent.double()).sum() + ((ref_lse * lse_cotangent.double()).sum() if grad_lse else 0)
    ref_grads = torch.autograd.grad(loss, ref_inputs)

    inputs = on_device(*host)
    out, lse = branch_attention_with_lse(*inputs, cu, scale)
    if grad_lse:
        grads = torch.autograd.grad((out, lse), inputs, (cotangent.to(DEVICE), lse_cotangent.to(DEVICE)))
    else:  # the lse's gradient arrives as None: the plain trunk backward
        grads = torch.autograd.grad(out, inputs, cotangent.to(DEVICE))

    assert_near("out", out, ref_out.detach(), C_FORWARD)
    assert_near("lse", lse, ref_lse.detach(), C_FORWARD, floor=LSE_FLOOR)
    for name, grad, ref in zip(NAMES, grads, ref_grads):
        assert_near(f"d{name}", grad, ref, C_BACKWARD)
    assert_flash_kernels_ran(kernels)
