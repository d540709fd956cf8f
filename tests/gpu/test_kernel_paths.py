"""Which kernel each torch version's path reaches (docs/DESIGN.md section 11), the kernel hazards
``ops/flash.py`` closes, and the stand-in kernels themselves: their signatures are torch's,
their launch quirk is FA2's, and a wrong stand-in fails the GPU checks.

These run on the host under explicitly chosen stand-ins, on any machine; only the mutant checks,
which rerun other GPU checks on ``DEVICE``, need the stand-in to be the kernels there."""

import inspect

import pytest
import torch
from torch.nn.attention.varlen import AuxRequest

from tests.gpu import test_attention
from tests.gpu.conftest import ON_GPU
from tests.gpu.stand_in import MUTATIONS, VERSIONS, StandIn
from titan_cotrain.models.kv_cache import KVPool
from titan_cotrain.ops import flash, varlen_causal_attention

# The autouse stand-in (conftest) once; the tests choose their own versions.
STAND_IN_VERSIONS = ("2.13",)
# torch 2.11's varlen_attn, as its documentation gives it.
VARLEN_ATTN_2_11 = ("(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None, "
                    "window_size=(-1, -1))")


def _parameters(fn) -> list[tuple]:
    return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]


def _randn(*shape, seed=0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.bfloat16)


def test_the_stand_in_has_torchs_signatures():
    """2.11's varlen_attn as documented, 2.13's as the pinned torch (2.13) defines it, and the
    private ops' arguments and outputs as this torch's schemas give them."""
    assert str(inspect.signature(StandIn("2.11").varlen_attn)) == VARLEN_ATTN_2_11
    assert _parameters(StandIn("2.13").varlen_attn) == _parameters(torch.nn.attention.varlen.varlen_attn)
    stand_in = StandIn("2.13")
    q, k, v = _randn(3, 2, 16, seed=1), _randn(3, 2, 16, seed=2), _randn(3, 2, 16, seed=3)
    cu = torch.tensor([0, 3], dtype=torch.int32)
    outputs = {"forward": stand_in.forward(q, k, v, cu, cu, 3, 3, 0.0, True, False)}
    outputs["backward"] = stand_in.backward(q, q, k, v, *outputs["forward"][:2], cu, cu, 3, 3, 0.0, True,
                                            *outputs["forward"][2:4])
    for name, kernel in (("forward", stand_in.forward), ("backward", stand_in.backward)):
        schema = getattr(torch.ops.aten, f"_flash_attention_{name}").default._schema
        flash.check_flash_schema(schema)
        assert [(a.name, a.kwarg_only) for a in schema.arguments] == [
            (p.name, p.kind is inspect.Parameter.KEYWORD_ONLY) for p in inspect.signature(kernel).parameters.values()]
        assert len(outputs[name]) == len(schema.returns)


@pytest.mark.parametrize("version", VERSIONS)
def test_each_torch_version_takes_its_documented_path(version):
    """torch 2.13: every forward through ``varlen_attn`` (GQA by ``enable_gqa``), the engine on
    the paged pool with one split. torch 2.11: MHA through ``varlen_attn``, GQA through the
    private forward, the engine on its gather path. The backward is the private op on both."""
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    with StandIn(version).patched() as kernels:
        for hkv in (4, 2):  # MHA, then GQA
            inputs = [_randn(8, 4, 16, seed=1).requires_grad_(), *(_randn(8, hkv, 16, seed=s).requires_grad_()
                                                                   for s in (2, 3))]
            torch.autograd.grad(varlen_causal_attention(*inputs, cu).float().sum(), inputs)
        pool = KVPool(1, 3, flash.PAGE_MULTIPLE, 2, 16, torch.bfloat16, "cpu")
        pool.view(torch.tensor([[1], [2]])).attend(0, _randn(2, 1, 4, 16), torch.tensor([5, 9]))  # GQA decode
        assert flash.has_paged_kernel() == (version == "2.13")
        paths = flash.kernel_paths()  # what the GPU report states for this torch
    if version == "2.13":
        assert (paths["trunk"], paths["trunk_gqa"]) == ("varlen_attn", "varlen_attn(enable_gqa)")
        assert paths["decode"].startswith("varlen_attn(block_table")
    else:
        assert (paths["trunk"], paths["trunk_gqa"]) == ("varlen_attn", "aten._flash_attention_forward")
        assert paths["decode"].startswith("gathered blocks")
    calls = kernels.calls
    mha, gqa = calls[0].arguments, calls[2].arguments
    assert mha["window_size"] == (-1, 0)  # causal, spelt as both versions spell it
    if version == "2.13":
        assert kernels.kernels_called() == ["varlen_attn", "backward", "varlen_attn", "backward", "varlen_attn"]
        assert gqa["enable_gqa"]
        paged = calls[4].arguments
        assert paged["block_table"].tolist() == [[1], [2]] and paged["seqused_k"].tolist() == [5, 9]
        assert paged["num_splits"] == 1  # no split-KV on the paged path (torchtitan #3235)
        assert paged["max_q"] == 2  # one query per row with GQA: launched as 2 (FA2's lse layout swap)
    else:
        assert kernels.kernels_called() == ["varlen_attn", "backward", "forward", "backward"]
        assert gqa["is_causal"] and gqa["key"].shape[1] == 2  # GQA native, K/V not repeated


def test_the_forwards_paired_with_the_flash_backward_run_on_flash(monkeypatch):
    """Where ``varlen_attn`` may choose cuDNN (torch after 2.13), the trunk's forward runs with
    only the flash backend enabled: its (out, lse) meet ATen's flash backward. The paged
    forward (inference, no backward) leaves the choice to torch. On torch 2.13, which always
    runs flash, nothing is changed."""
    assert flash._VARLEN_MAY_CHOOSE_CUDNN is (tuple(map(int, torch.__version__.split(".")[:2])) > (2, 13))
    monkeypatch.setattr(flash, "_VARLEN_MAY_CHOOSE_CUDNN", True)
    with StandIn("2.13").patched() as kernels:
        inputs = [_randn(8, 4, 16, seed=s) for s in (1, 2, 3)]
        varlen_causal_attention(*inputs, torch.tensor([0, 8], dtype=torch.int32))
        pool = KVPool(1, 2, flash.PAGE_MULTIPLE, 4, 16, torch.bfloat16, "cpu")
        pool.view(torch.tensor([[1]])).attend(0, _randn(1, 2, 4, 16), torch.tensor([7]))
    assert [(call.kernel, call.cudnn_enabled) for call in kernels.calls] == [("varlen_attn", False),
                                                                              ("varlen_attn", True)]
    assert torch.backends.cuda.cudnn_sdp_enabled()  # restored


def test_one_query_segments_with_gqa_get_fa2s_other_lse_layout():
    """The stand-in mirrors FA2's launch quirk: at ``max_q == 1`` with GQA the lse comes back
    scrambled; at ``max_q == 2`` (what ``ops/flash.py`` launches) in the kernel's ``[Hq, T]``."""
    q, k, v = _randn(3, 4, 16, seed=1), _randn(6, 2, 16, seed=2), _randn(6, 2, 16, seed=3)
    cu_q, cu_k = torch.tensor([0, 1, 2, 3], dtype=torch.int32), torch.tensor([0, 1, 3, 6], dtype=torch.int32)
    stand_in = StandIn("2.13")

    def lse(max_q):
        return stand_in.varlen_attn(q, k, v, cu_q, cu_k, max_q, 3, return_aux=AuxRequest(lse=True),
                                    window_size=(-1, 0), enable_gqa=True)[1]

    swapped, kernel = lse(1), lse(2)
    assert swapped.shape == kernel.shape == (4, 3)
    assert torch.equal(swapped, kernel.view(2, 2, 3).transpose(1, 2).reshape(4, 3))
    assert not torch.equal(swapped, kernel)
    with stand_in.patched():
        _, ours = flash.varlen_forward(q, k, v, cu_q, cu_k, 1, 3, 16**-0.5, causal=True)
    assert torch.equal(ours, kernel.t())


@pytest.mark.skipif(ON_GPU, reason="the mutants replace the kernels only where the stand-in runs (no CUDA)")
@pytest.mark.parametrize("mutation, check, failure", [
    ("lse-transposed", lambda: test_attention.test_trunk_matches_the_fp64_reference("short-mix-GQA2-D64", None),
     "^lse: "),
    ("no-key-rows-zero", test_attention.test_queries_without_keys_merge_to_nothing, "lse of queries without keys"),
])
def test_a_mutant_stand_in_fails_the_checks(mutation, check, failure):
    assert mutation in MUTATIONS
    check()  # passes under the true stand-in
    with StandIn("2.13", mutation).patched(), pytest.raises(AssertionError, match=failure):
        check()


@pytest.mark.skipif(ON_GPU, reason="shows the stand-in's launch quirk, which replaces FA2's only where no CUDA exists")
def test_without_the_max_q_bound_the_one_token_gqa_documents_fail(monkeypatch):
    """``ops/flash.py`` launches single-query GQA segments with ``max_q = 2``; without that the
    trunk's lse comes back in FA2's other layout and the GPU check of it fails."""
    monkeypatch.setattr(flash, "_launch_max_q", lambda max_q, q, k_heads: max_q)
    with pytest.raises(AssertionError, match="lse"):
        test_attention.test_trunk_matches_the_fp64_reference("one-token-docs-GQA4-D128", None)
