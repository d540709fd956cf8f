"""The trunk (document-causal varlen attention) on the GPU's flash kernels in bf16 against the
fp64 einsum reference: out, lse and dq, dk, dv over document mixes with empty, one-token and
3000-token documents, GQA (one-token documents only included: FA2 swaps query heads into the
sequence dimension when ``max_seqlen_q == 1`` with GQA, and its lse layout with them), head
dims 64 to 256 and one the kernel needs padded, and a backward handed a merged ``(out, lse)``.
Tolerances: ``tests/gpu/conftest.py``."""

import pytest
import torch

from tests.gpu.conftest import (
    C_BACKWARD,
    C_FORWARD,
    DEVICE,
    DTYPE,
    LSE_FLOOR,
    assert_near,
    exact_einsum_path,
    needs_gpu,
    on_device,
    packed_inputs,
    trunk_reference,
)
from titan_cotrain.ops import varlen_causal_attention
from titan_cotrain.ops.attention import trunk_backward, trunk_forward

pytestmark = needs_gpu("varlen flash attention (trunk out, lse, dq/dk/dv) against the fp64 reference")

DOC_MIX = [0, 1, 7, 300, 0, 3000, 1, 0]  # empty documents first, inside and last
SHORT_MIX = [0, 1, 7, 300, 0, 45]

CASES = {
    # name: (document lengths, Hq, Hkv, Dh)
    "mix-MHA-D64": (DOC_MIX, 4, 4, 64),
    "mix-GQA4-D64": (DOC_MIX, 4, 1, 64),
    "one-token-docs-GQA4-D128": ([1] * 64, 8, 2, 128),
    "short-mix-GQA2-D64": (SHORT_MIX, 4, 2, 64),
    "short-mix-GQA2-D128": (SHORT_MIX, 4, 2, 128),
    "short-mix-GQA2-D256": (SHORT_MIX, 4, 2, 256),  # the kernel's largest head dim
    "short-mix-GQA2-D100": (SHORT_MIX, 4, 2, 100),  # padded to 104 for the kernel
}


@pytest.mark.parametrize("case", list(CASES))
def test_trunk_matches_the_fp64_reference(case):
    lengths, hq, hkv, d = CASES[case]
    cu, q, k, v, cotangent = packed_inputs(lengths, hq, hkv, d, seed=len(case))
    scale = d**-0.5
    ref_out, ref_lse, ref_grads = trunk_reference(q, k, v, cotangent, cu, scale)

    inputs = on_device(q, k, v)
    # The op reads host bounds; a device cu_seqlens is accepted and copied to the host once.
    cu_arg = cu.to(DEVICE) if max(lengths) == 1 else cu
    out = varlen_causal_attention(*inputs, cu_arg)  # default scale: Dh ** -0.5
    grads = torch.autograd.grad(out, inputs, cotangent.to(DEVICE))
    _, lse = trunk_forward(*(x.detach() for x in inputs), cu, scale)

    assert out.dtype == DTYPE and lse.shape == ref_lse.shape
    assert_near("out", out, ref_out, C_FORWARD)
    assert_near("lse", lse, ref_lse, C_FORWARD, floor=LSE_FLOOR)
    for name, grad, ref in zip(("dq", "dk", "dv"), grads, ref_grads):
        assert_near(name, grad, ref, C_BACKWARD)


def test_trunk_backward_takes_a_merged_out_and_lse():
    """Branch and ring attention hand the trunk's backward the ``(out, lse)`` of the whole
    merged attention; the kernel must differentiate against those, not its own."""
    cu, q, k, v, cotangent = packed_inputs(SHORT_MIX, 4, 2, 128, seed=7)
    scale = 128**-0.5
    ref_out, ref_lse, _ = trunk_reference(q, k, v, cotangent, cu, scale)
    # Stand-in for a merge with another key set: a larger normaliser and another output.
    out, lse = (0.7 * ref_out).to(DTYPE), (ref_lse + 0.5).float()
    with exact_einsum_path():
        ref_grads = trunk_backward(*(x.double() for x in (cotangent, q, k, v, out, lse)), cu, scale)
    grads = trunk_backward(*(x.to(DEVICE) for x in (cotangent, q, k, v, out, lse)), cu, scale)
    for name, grad, ref in zip(("dq", "dk", "dv"), grads, ref_grads):
        assert_near(name, grad, ref, C_BACKWARD)

