"""Document-causal packed attention and the LSE merge against a dense float64 reference."""

import pytest
import torch

from titan_cotrain.ops import attention, merge_attention, varlen_causal_attention
from titan_cotrain.ops.attention import trunk_backward, trunk_forward

# Uneven documents, one of length 1.
CU_SEQLENS = torch.tensor([0, 5, 6, 13, 16], dtype=torch.int32)


def doc_causal_mask(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """bool [T, T]: query i may read key j iff same document and j <= i."""
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    doc = torch.repeat_interleave(torch.arange(lengths.numel()), lengths)
    pos = torch.arange(doc.numel())
    return (doc[:, None] == doc[None, :]) & (pos[None, :] <= pos[:, None])


def dense_attention(q, k, v, mask, scale):
    """float64 softmax attention of q [T, Hq, D] over keys [K, Hkv, D] where mask [T, K] allows."""
    n_rep = q.shape[1] // k.shape[1]
    q, k, v = q.double(), k.double().repeat_interleave(n_rep, 1), v.double().repeat_interleave(n_rep, 1)
    s = torch.einsum("qhd,khd->qhk", q, k) * scale
    s = s.masked_fill(~mask[:, None, :], float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    return torch.einsum("qhk,khd->qhd", torch.exp(s - lse[..., None]), v), lse


def make_qkv(t, hq, hkv, d, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(t, h, d, generator=g, dtype=dtype, requires_grad=True) for h in (hq, hkv, hkv)]


@pytest.fixture(params=["cpu_flash", "math"])
def kernel_path(request, monkeypatch):
    """Run the test on ATen's CPU flash kernel and on the blockwise math fallback."""
    if request.param == "math":
        monkeypatch.setattr(attention, "_use_cpu_flash_kernel", lambda q: False)
    return request.param


@pytest.mark.parametrize("hq,hkv", [(2, 2), (4, 2)])
def test_matches_dense_reference(kernel_path, hq, hkv):
    q, k, v = make_qkv(16, hq, hkv, 8)
    scale = 0.3
    grad = torch.randn(16, hq, 8)
    out = varlen_causal_attention(q, k, v, CU_SEQLENS, scale)
    grads = torch.autograd.grad((out * grad).sum(), (q, k, v))

    ref_in = [x.detach().double().requires_grad_() for x in (q, k, v)]
    ref_out, ref_lse = dense_attention(*ref_in, doc_causal_mask(CU_SEQLENS), scale)
    ref_grads = torch.autograd.grad((ref_out * grad.double()).sum(), ref_in)

    torch.testing.assert_close(out.double(), ref_out, atol=1e-5, rtol=1e-5)
    _, lse = trunk_forward(q.detach(), k.detach(), v.detach(), CU_SEQLENS, scale)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-5, rtol=1e-5)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g.double(), r, atol=1e-5, rtol=1e-5)


def test_default_scale_is_inverse_sqrt_head_dim():
    q, k, v = make_qkv(16, 2, 1, 8)
    torch.testing.assert_close(
        varlen_causal_attention(q, k, v, CU_SEQLENS), varlen_causal_attention(q, k, v, CU_SEQLENS, 8**-0.5)
    )


def test_gradcheck_float64(kernel_path):
    q, k, v = make_qkv(6, 2, 1, 3, dtype=torch.float64)
    cu = torch.tensor([0, 1, 4, 6], dtype=torch.int32)
    assert torch.autograd.gradcheck(lambda q, k, v: varlen_causal_attention(q, k, v, cu), (q, k, v))


def test_math_path_agrees_with_cpu_kernel_given_a_merged_lse(monkeypatch):
    """Both paths of trunk_backward must honour an (out, lse) they did not produce themselves."""
    q, k, v = (x.detach() for x in make_qkv(16, 4, 2, 8))
    out, lse = trunk_forward(q, k, v, CU_SEQLENS, 0.3)
    # Stand-in for a merge with an extra key set: a larger normaliser and another output.
    lse = lse + 0.5
    out = out * 0.7
    grad = torch.randn_like(out)
    cpu = trunk_backward(grad, q, k, v, out, lse, CU_SEQLENS, 0.3)
    monkeypatch.setattr(attention, "_use_cpu_flash_kernel", lambda q: False)
    math_out, math_lse = trunk_forward(q, k, v, CU_SEQLENS, 0.3)
    math = trunk_backward(grad, q, k, v, out, lse, CU_SEQLENS, 0.3)
    monkeypatch.undo()
    cpu_out, cpu_lse = trunk_forward(q, k, v, CU_SEQLENS, 0.3)
    torch.testing.assert_close(math_out, cpu_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(math_lse, cpu_lse, atol=1e-5, rtol=1e-5)
    for a, b in zip(math, cpu):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_merge_equals_attention_over_union_of_key_sets():
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(5, 3, 4, generator=g, dtype=torch.float64) for _ in range(3))
    in_a = torch.rand(5, 5, generator=g) < 0.5
    in_a[:, 0] = True  # both sides non-empty for every query
    in_a[:, 1] = False
    out_a, lse_a = dense_attention(q, k, v, in_a, 0.5)
    out_b, lse_b = dense_attention(q, k, v, ~in_a, 0.5)
    out, lse = merge_attention(out_a, lse_a, out_b, lse_b)
    ref_out, ref_lse = dense_attention(q, k, v, torch.ones(5, 5, dtype=torch.bool), 0.5)
    torch.testing.assert_close(out, ref_out)
    torch.testing.assert_close(lse, ref_lse)


def test_merge_with_an_empty_side():
    out_a, lse_a = torch.randn(4, 2, 3), torch.randn(4, 2)
    empty_out, empty_lse = torch.zeros(4, 2, 3), torch.full((4, 2), float("-inf"))
    out, lse = merge_attention(out_a, lse_a, empty_out, empty_lse)
    torch.testing.assert_close(out, out_a)
    torch.testing.assert_close(lse, lse_a)
    out, lse = merge_attention(empty_out, empty_lse, empty_out, empty_lse)
    assert torch.equal(out, empty_out) and torch.equal(lse, empty_lse)


@pytest.mark.parametrize(
    "q_shape,kv_shape,cu",
    [
        ((16, 2, 8), (16, 8), CU_SEQLENS),  # k not [T, H, Dh]
        ((16, 2, 8), (15, 1, 8), CU_SEQLENS),  # T differs
        ((16, 2, 8), (16, 1, 4), CU_SEQLENS),  # Dh differs
        ((16, 3, 8), (16, 2, 8), CU_SEQLENS),  # Hq not a multiple of Hkv
        ((16, 2, 8), (16, 1, 8), CU_SEQLENS.view(1, -1)),  # cu_seqlens not 1-D
    ],
)
def test_bad_shapes_raise(q_shape, kv_shape, cu):
    with pytest.raises(ValueError):
        varlen_causal_attention(torch.randn(q_shape), torch.randn(kv_shape), torch.randn(kv_shape), cu)


def test_compiled_backward_matches_eager():
    """AOTAutograd traces the backward too; it must see the backward as one opaque op."""
    q, k, v = make_qkv(16, 4, 2, 8)
    fn = torch.compile(varlen_causal_attention, fullgraph=True, backend="aot_eager")
    compiled = torch.autograd.grad(fn(q, k, v, CU_SEQLENS).square().sum(), (q, k, v))
    eager = torch.autograd.grad(varlen_causal_attention(q, k, v, CU_SEQLENS).square().sum(), (q, k, v))
    for c, e in zip(compiled, eager):
        torch.testing.assert_close(c, e)


@pytest.mark.parametrize("extra_column", [True, False])
def test_fold_grad_lse_equals_autograd_through_the_lse(extra_column):
    """Both ways of folding a gradient on the lse into a kernel that only knows grad_out
    (one extra head-dim column; or, where that column would pass the flash kernel's head-dim
    limit, a second call with V = 0) give the gradient autograd takes through ``(out, lse)``."""
    q, k, v = make_qkv(16, 4, 2, 8, dtype=torch.float64, seed=3)
    scale = 8 ** -0.5
    out, lse = dense_attention(q, k, v, doc_causal_mask(CU_SEQLENS), scale)
    g = torch.Generator().manual_seed(4)
    grad_out, grad_lse = torch.randn(out.shape, generator=g, dtype=torch.float64), torch.randn(lse.shape, generator=g, dtype=torch.float64)
    want = torch.autograd.grad((out * grad_out).sum() + (lse * grad_lse).sum(), (q, k, v))

    def trunk(*args):
        return trunk_backward(*args, CU_SEQLENS, scale)

    got = attention.fold_grad_lse(trunk, grad_out, grad_lse, q.detach(), k.detach(), v.detach(), out.detach(),
                                  lse.detach(), extra_column=extra_column)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a.double(), b, rtol=1e-9, atol=1e-9)
