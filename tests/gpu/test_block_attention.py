"""The block drafter's attention on the GPU in bf16: the compiled block-sparse ``flex_attention``
path (``ops.block_attention.block_attention_flex``, what training calls on an accelerator)
against the fp64 exact path on the host, forward and the five input gradients, with GQA, blocks
at a document's first row (no context), and documents long enough to cross many of flex's
128-row tiles. Tolerances: ``tests/gpu/conftest.py``.

Without CUDA it is skipped: torch's CPU build runs ``flex_attention`` forward only (no
backward), and that forward's mask is checked against the exact path by
``tests/models/test_block_draft.py``; the stand-in kernels do not cover flex."""

import pytest
import torch

from tests.gpu.conftest import C_BACKWARD, C_FORWARD, DEVICE, ON_GPU, cu_seqlens, on_device, rounded_randn
from tests.gpu.conftest import assert_near
from titan_cotrain.cotrain.block_loss import document_bounds
from titan_cotrain.ops.block_attention import block_attention_exact, block_attention_flex

pytestmark = pytest.mark.skipif(not ON_GPU, reason="flex_attention's backward needs CUDA (torch's CPU build has "
                                                   "none); the CPU suite checks the flex forward's mask")

LENGTHS = [1, 700, 3, 1300, 40]
HQ, HKV, BLOCK = 4, 2, 16
NAMES = ("q", "ctx_k", "ctx_v", "blk_k", "blk_v")


@pytest.mark.parametrize("d", [64, 128])
def test_flex_block_attention_matches_the_fp64_exact_path(d):
    cu = cu_seqlens(LENGTHS)
    t = int(cu[-1])
    g = torch.Generator().manual_seed(d)
    start, _ = document_bounds(cu, "cpu", t)
    # Anchors at documents' first rows (no context), mid-document and at a long document's end.
    anchors = torch.tensor([0, 1, 2, 400, 700, 701, 704, 1500, 2003, 2004, 2040, t - 1])
    n = anchors.numel()
    host = [rounded_randn((n, BLOCK, HQ, d), g), rounded_randn((t, HKV, d), g), rounded_randn((t, HKV, d), g),
            rounded_randn((n, BLOCK, HKV, d), g), rounded_randn((n, BLOCK, HKV, d), g)]
    cotangent = rounded_randn((n, BLOCK, HQ, d), g)
    scale = d**-0.5
    ctx_start, ctx_end = start[anchors], anchors

    ref_inputs = [x.double().requires_grad_() for x in host]
    ref_out = block_attention_exact(*ref_inputs, ctx_start, ctx_end, scale)
    ref_grads = torch.autograd.grad(ref_out, ref_inputs, cotangent.double())

    inputs = on_device(*host)
    out = block_attention_flex(*inputs, ctx_start.to(DEVICE), ctx_end.to(DEVICE), scale, compiled=True)
    grads = torch.autograd.grad(out, inputs, cotangent.to(DEVICE))
    assert_near("out", out, ref_out.detach(), C_FORWARD)
    for name, grad, ref in zip(NAMES, grads, ref_grads):
        assert_near(f"d{name}", grad, ref, C_BACKWARD)
