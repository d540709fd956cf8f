"""The trunk (document-causal varlen attention) on the GPU's flash kernels in bf16 against the
fp64 einsum reference: out, lse and dq, dk, dv over document mixes with empty, one-token and
long (``LONG_DOC``) documents, GQA (one-token documents only included: FA2 swaps query heads
into the sequence dimension when ``max_seqlen_q == 1`` with GQA, and its lse layout with them),
head dims 64 to 256 and one the kernel needs padded, a backward handed a merged ``(out, lse)``,
and queries that see no key merged with another key set. Tolerances: ``tests/gpu/conftest.py``."""

import itertools

import pytest
import torch

from tests.gpu.conftest import (
    C_BACKWARD,
    C_FORWARD,
    DEVICE,
    DTYPE,
    LONG_DOC,
    LSE_FLOOR,
    assert_flash_kernels_ran,
    assert_near,
    exact_einsum_path,
    on_device,
    packed_inputs,
    rounded_randn,
    trunk_reference,
)
from titan_cotrain.ops import flash, varlen_causal_attention
from titan_cotrain.ops.attention import merge_attention, trunk_backward, trunk_forward

DOC_MIX = [0, 1, 7, 300, 0, LONG_DOC, 1, 0]  # empty documents first, inside and last
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
def test_trunk_matches_the_fp64_reference(case, kernels):
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
    assert_flash_kernels_ran(kernels)


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



def test_queries_without_keys_merge_to_nothing():
    """Segments with fewer keys than queries (bottom-right causal: the first queries see no
    key) and one without keys, merged with a one-key set per query as branch attention merges:
    a query without trunk keys must contribute nothing (lse -inf, where FA2 writes +inf)."""
    hq, hkv, d = 4, 2, 64
    q_lens, k_lens = [5, 3, 4], [2, 0, 4]
    g = torch.Generator().manual_seed(11)
    q = rounded_randn((sum(q_lens), hq, d), g)
    k, v = (rounded_randn((sum(k_lens), hkv, d), g) for _ in range(2))
    other_out = rounded_randn((sum(q_lens), hq, d), g)  # a second key set's partial result
    other_lse = torch.randn(sum(q_lens), hq, generator=g)
    scale = d**-0.5

    ref_out, ref_lse = [], []
    for b, (n, m) in enumerate(zip(q_lens, k_lens)):
        q0, k0 = sum(q_lens[:b]), sum(k_lens[:b])
        keys, values = (x[k0:k0 + m].double().repeat_interleave(hq // hkv, 1) for x in (k, v))
        scores = torch.einsum("qhd,khd->qhk", q[q0:q0 + n].double(), keys) * scale
        hidden = torch.arange(m)[None, :] > torch.arange(n)[:, None] + (m - n)
        scores = scores.masked_fill(hidden[:, None, :], float("-inf"))
        lse = torch.logsumexp(scores, -1)
        weights = torch.exp(scores - lse.nan_to_num(neginf=0.0)[..., None])
        ref_out.append(torch.einsum("qhk,khd->qhd", weights, values))
        ref_lse.append(lse)
    ref = merge_attention(torch.cat(ref_out), torch.cat(ref_lse), other_out.double(), other_lse.double())

    cu_q, cu_k = (torch.tensor([0, *itertools.accumulate(x)], dtype=torch.int32, device=DEVICE)
                  for x in (q_lens, k_lens))
    out, lse = flash.varlen_forward(*(x.to(DEVICE) for x in (q, k, v)), cu_q, cu_k, max(q_lens), max(k_lens), scale,
                                    causal=True)
    without_keys = [0, 1, 2, 5, 6, 7]  # 3 of 5 queries over 2 keys, and all 3 over none
    assert bool((lse[without_keys] == float("-inf")).all()), f"lse of queries without keys: {lse[without_keys]}"
    merged_out, merged_lse = merge_attention(out, lse, other_out.to(DEVICE), other_lse.to(DEVICE))
    assert_near("merged out", merged_out, ref[0], C_FORWARD)
    assert_near("merged lse", merged_lse, ref[1], C_FORWARD, floor=LSE_FLOOR)
