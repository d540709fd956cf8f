"""Branch attention against a reference that builds each query's full key set the naive way."""

import math

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from titan_cotrain.ops import attention, branch_attention, branch_attention_with_lse, varlen_causal_attention

CU_SEQLENS = torch.tensor([0, 5, 6, 13, 16], dtype=torch.int32)  # uneven, one of length 1


def reference(q, k, v, branch_k, branch_v, cu_seqlens, scale):
    """float64 (out, lse): one softmax over the keys [trunk k (T) ; branch_k flattened (P*T)],
    with a dense mask [T, T + P*T]: document-causal on the trunk, t == t' on the branch."""
    t, n_rep = q.shape[0], q.shape[1] // k.shape[1]
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    doc = torch.repeat_interleave(torch.arange(lengths.numel()), lengths)
    pos = torch.arange(t)
    trunk_mask = (doc[:, None] == doc[None, :]) & (pos[None, :] <= pos[:, None])
    branch_mask = (pos[:, None] == pos[None, :]).repeat(1, branch_k.shape[0])
    mask = torch.cat([trunk_mask, branch_mask], dim=1)
    keys = torch.cat([k, branch_k.flatten(0, 1)]).double().repeat_interleave(n_rep, 1)
    values = torch.cat([v, branch_v.flatten(0, 1)]).double().repeat_interleave(n_rep, 1)
    s = torch.einsum("qhd,khd->qhk", q.double(), keys) * scale
    s = s.masked_fill(~mask[:, None, :], float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    return torch.einsum("qhk,khd->qhd", torch.exp(s - lse[..., None]), values), lse


def make_inputs(t, p, hq, hkv, d, dtype=torch.float32, seed=0):
    """q [T, Hq, D], k, v [T, Hkv, D], branch_k, branch_v [P, T, Hkv, D], all requiring grad."""
    g = torch.Generator().manual_seed(seed)
    shapes = [(t, hq, d), (t, hkv, d), (t, hkv, d), (p, t, hkv, d), (p, t, hkv, d)]
    return [torch.randn(s, generator=g, dtype=dtype, requires_grad=True) for s in shapes]


@pytest.fixture(params=["cpu_flash", "math"])
def kernel_path(request, monkeypatch):
    """Run the trunk part on ATen's CPU flash kernel and on the blockwise math fallback."""
    if request.param == "math":
        monkeypatch.setattr(attention, "_use_cpu_flash_kernel", lambda q: False)
    return request.param


def assert_matches_reference(inputs, scale, use_lse):
    """Forward (out, lse) and the five input grads of ``out·w (+ lse·u)`` vs the reference."""
    g = torch.Generator().manual_seed(1)
    w = torch.randn(inputs[0].shape, generator=g, dtype=torch.float64)
    u = torch.randn(inputs[0].shape[:2], generator=g, dtype=torch.float64) if use_lse else None

    def loss(out, lse):
        return (out.double() * w).sum() + ((lse.double() * u).sum() if use_lse else 0)

    out, lse = branch_attention_with_lse(*inputs, CU_SEQLENS, scale)
    grads = torch.autograd.grad(loss(out, lse), inputs)
    ref_inputs = [x.detach().double().requires_grad_() for x in inputs]
    ref_out, ref_lse = reference(*ref_inputs, CU_SEQLENS, scale)
    ref_grads = torch.autograd.grad(loss(ref_out, ref_lse), ref_inputs)

    torch.testing.assert_close(out.double(), ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-5, rtol=1e-5)
    for name, got, want in zip(["q", "k", "v", "branch_k", "branch_v"], grads, ref_grads):
        torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5, msg=lambda m: f"d{name}: {m}")


@pytest.mark.parametrize("p", [0, 1, 2, 6], ids=lambda p: f"D{p + 1}")  # D = P + 1 TTT passes: 1, 2, 3, 7
@pytest.mark.parametrize("hq,hkv", [(2, 2), (4, 2)])
def test_matches_reference(kernel_path, p, hq, hkv):
    assert_matches_reference(make_inputs(16, p, hq, hkv, 8), scale=0.3, use_lse=False)


@pytest.mark.parametrize("p", [0, 2])
def test_gradient_through_lse_matches_reference(kernel_path, p):
    """A caller that merges the lse again backpropagates through it."""
    assert_matches_reference(make_inputs(16, p, 4, 2, 8), scale=0.3, use_lse=True)


def test_gradcheck_float64():
    """Both outputs: the Jacobian of out (lse unused) and of lse (out unused) row by row."""
    inputs = make_inputs(5, 2, 2, 1, 2, dtype=torch.float64)
    cu = torch.tensor([0, 1, 3, 5], dtype=torch.int32)
    assert torch.autograd.gradcheck(lambda *x: branch_attention_with_lse(*x, cu), inputs)


def test_no_branch_keys_is_plain_causal_attention():
    q, k, v, bk, bv = make_inputs(16, 0, 4, 2, 8)
    out = branch_attention(q, k, v, bk, bv, CU_SEQLENS)
    grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    trunk_out = varlen_causal_attention(q, k, v, CU_SEQLENS)
    trunk_grads = torch.autograd.grad(trunk_out.square().sum(), (q, k, v))
    torch.testing.assert_close(out, trunk_out)
    for a, b in zip(grads, trunk_grads):
        torch.testing.assert_close(a, b)


def test_bfloat16_keeps_lse_in_float32():
    inputs = make_inputs(16, 2, 4, 2, 8)
    out, lse = branch_attention_with_lse(*[x.detach().bfloat16() for x in inputs], CU_SEQLENS)
    ref_out, ref_lse = branch_attention_with_lse(*inputs, CU_SEQLENS)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    torch.testing.assert_close(out.float(), ref_out, atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(lse, ref_lse, atol=3e-2, rtol=3e-2)


def test_compiled_fullgraph_matches_eager():
    inputs = make_inputs(16, 3, 4, 2, 8)

    def loss(q, k, v, bk, bv, cu):
        return branch_attention(q, k, v, bk, bv, cu).square().sum()

    compiled = torch.autograd.grad(torch.compile(loss, fullgraph=True, backend="aot_eager")(*inputs, CU_SEQLENS), inputs)
    eager = torch.autograd.grad(loss(*inputs, CU_SEQLENS), inputs)
    for c, e in zip(compiled, eager):
        torch.testing.assert_close(c, e)


def largest_tensor_seen(fn) -> int:
    """Largest numel among the tensor inputs of every op dispatched (forward and backward)."""
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        fn()
    return max(
        math.prod(shape)
        for event in prof.events()
        for shape in event.input_shapes
        if shape and all(isinstance(n, int) for n in shape)
    )


def test_never_builds_a_dense_score_or_mask_matrix():
    """With many 8-token documents, an O(T * P) implementation stays far below T * T, while a
    dense one (the reference, used here as the check's control) does not."""
    t, p = 512, 3
    inputs = make_inputs(t, p, 2, 1, 4)
    cu = torch.arange(0, t + 1, 8, dtype=torch.int32)
    budget = t * t // 8  # the largest legitimate tensor is branch_k: P * T * Hkv * Dh = 6144

    assert largest_tensor_seen(lambda: branch_attention(*inputs, cu).sum().backward()) < budget
    assert largest_tensor_seen(lambda: reference(*inputs, cu, 0.5)[0].sum().backward()) >= budget


@pytest.mark.parametrize(
    "branch_shape,branch_v_shape",
    [
        ((16, 2, 8), (16, 2, 8)),  # not [P, T, Hkv, Dh]
        ((2, 16, 2, 8), (3, 16, 2, 8)),  # branch_k and branch_v disagree
        ((2, 15, 2, 8), (2, 15, 2, 8)),  # T differs from the trunk's
        ((2, 16, 1, 8), (2, 16, 1, 8)),  # Hkv differs from the trunk's
    ],
)
def test_bad_branch_shapes_raise(branch_shape, branch_v_shape):
    q, k, v = torch.randn(16, 4, 8), torch.randn(16, 2, 8), torch.randn(16, 2, 8)
    with pytest.raises(ValueError):
        branch_attention(q, k, v, torch.randn(branch_shape), torch.randn(branch_v_shape), CU_SEQLENS)
