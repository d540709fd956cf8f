"""The accelerator path of the attention ops, run on the simulated accelerator (fake tensors):
it reaches ATen's varlen flash ops with what they take, and never reads a device tensor on
the host (the simulator raises on such a read). Numerics are the CPU tests' business."""

import pytest
import torch
from torch._subclasses.fake_tensor import DataDependentOutputException

from titan_cotrain.ops import branch_attention, branch_attention_with_lse, flash, varlen_causal_attention
from titan_cotrain.ops.attention import trunk_forward
from titan_cotrain.ops.flash import check_flash_schema
from titan_cotrain.ops.ring_attention import RingComm, ring_branch_attention
from titan_cotrain.simulate.device import SimulatedDevice, register_simulated_device, sim_device

# The autograd engine sizes its per-device queues at the process's first backward: the
# simulated device must exist by then (collection runs before any test).
register_simulated_device()

CU_SEQLENS = torch.tensor([0, 6, 6, 16], dtype=torch.int32)  # host; an empty document; even lengths for the ring
T, HQ, HKV, D, P = 16, 4, 2, 16, 3


class OpsRunTheirImplementation(SimulatedDevice):
    """The simulator, except that the project's custom ops run their implementations on the
    fake tensors instead of their ``register_fake`` shapes: the accelerator path itself runs."""


def _run_implementation(mode, func, types, args, kwargs):
    # A custom_op's implementation is registered for every backend; CPU's is the same function.
    kernel = torch.library.get_kernel(func, "CPU")
    with mode:
        return kernel.call_boxed(torch._C.DispatchKeySet(torch.DispatchKey.CPU), *args, **kwargs)


for _op in ("varlen_causal_attention", "branch_attention"):
    for _name in (_op, f"{_op}_backward"):
        torch.library.register_torch_dispatch(f"titan_cotrain::{_name}", OpsRunTheirImplementation, _run_implementation)


@pytest.fixture
def kernel_calls(monkeypatch):
    """``(direction, args)`` of every call that reaches a flash kernel: torch's public
    ``varlen_attn`` forward, or ATen's private backward."""
    calls = []
    forward, (_, backward) = flash.varlen_attn, flash._flash_ops()

    def recorded(direction, op):
        def call(*args, **kwargs):
            calls.append((direction, args))
            return op(*args, **kwargs)

        return call

    monkeypatch.setattr(flash, "varlen_attn", recorded("forward", forward))
    monkeypatch.setattr(flash, "_flash_ops", lambda: (None, recorded("backward", backward)))
    return calls


def sim_inputs(*shapes, dtype=torch.bfloat16):
    return [torch.randn(s, dtype=dtype, device=sim_device(), requires_grad=True) for s in shapes]


def assert_like(tensors, like):
    for t, x in zip(tensors, like, strict=True):
        assert (t.shape, t.dtype, t.device) == (x.shape, x.dtype, x.device)


def test_varlen_causal_attention_is_one_flash_call_each_way(kernel_calls):
    with OpsRunTheirImplementation():
        inputs = sim_inputs((T, HQ, D), (T, HKV, D), (T, HKV, D))
        out = varlen_causal_attention(*inputs, CU_SEQLENS)
        grads = torch.autograd.grad(out.float().square().sum(), inputs)
    assert_like([out], inputs[:1])
    assert_like(grads, inputs)
    assert [direction for direction, _ in kernel_calls] == ["forward", "backward"]
    (_, fwd), (_, bwd) = kernel_calls
    cu_q, max_q = fwd[3], fwd[5]
    assert (cu_q.device, cu_q.dtype, cu_q.shape) == (sim_device(), torch.int32, (3,))  # the empty document dropped
    assert max_q == 10
    assert fwd[1].shape == (T, HKV, D)  # GQA without repeated K/V
    assert bwd[5].shape == (HQ, T) and bwd[5].dtype == torch.float32  # the op's varlen lse layout


@pytest.mark.parametrize("use_lse", [False, True])
def test_branch_attention_runs_the_trunk_on_flash(kernel_calls, use_lse):
    """With a gradient on the merged lse, the trunk's head dim grows by one column (the
    grad_lse fold), which the flash wrapper pads to a multiple of 8."""
    with OpsRunTheirImplementation():
        inputs = sim_inputs((T, HQ, D), (T, HKV, D), (T, HKV, D), (P, T, HKV, D), (P, T, HKV, D))
        if use_lse:
            out, lse = branch_attention_with_lse(*inputs, CU_SEQLENS)
            loss = out.float().sum() + lse.sum()
        else:
            out = branch_attention(*inputs, CU_SEQLENS)
            loss = out.float().sum()
        grads = torch.autograd.grad(loss, inputs)
    assert_like([out], inputs[:1])
    assert_like(grads, inputs)
    assert [direction for direction, _ in kernel_calls] == ["forward", "backward"]
    assert kernel_calls[1][1][1].shape[-1] == (24 if use_lse else D)


def test_ring_blocks_run_on_flash(kernel_calls):
    with SimulatedDevice():
        inputs = sim_inputs((T, HQ, D), (T, HKV, D), (T, HKV, D), (P, T, HKV, D), (P, T, HKV, D))
        out = ring_branch_attention(*inputs, CU_SEQLENS, RingComm(), pieces=2)
        grads = torch.autograd.grad(out.float().sum(), inputs)
    assert_like([out], inputs[:1])
    assert_like(grads, inputs)
    directions = [direction for direction, _ in kernel_calls]
    assert directions.count("forward") == directions.count("backward") > 0


def test_fp32_on_the_accelerator_asks_for_bf16():
    with OpsRunTheirImplementation():
        inputs = sim_inputs((T, HQ, D), (T, HKV, D), (T, HKV, D), dtype=torch.float32)
        with pytest.raises(TypeError, match='mixed_precision_param = "bfloat16"'):
            varlen_causal_attention(*inputs, CU_SEQLENS)


def test_a_device_cu_seqlens_would_be_caught():
    """The simulator raises on a host read of a device tensor, so the tests above would see one."""
    with SimulatedDevice():
        q, k, v = sim_inputs((T, HQ, D), (T, HKV, D), (T, HKV, D))
        with pytest.raises(DataDependentOutputException):
            trunk_forward(q, k, v, CU_SEQLENS.to(sim_device()), 0.25)


def test_schema_check_accepts_this_torch():
    for op in (torch.ops.aten._flash_attention_forward, torch.ops.aten._flash_attention_backward):
        check_flash_schema(op.default._schema)


@pytest.mark.parametrize(
    "old,new,problem",
    [
        ("float? scale=None", "float? softmax_scale=None", "no keyword argument scale"),
        ("SymInt max_q", "Tensor max_q", "argument 5 (max_q) is Tensor, we pass int"),
        ("bool return_debug_mask,", "bool return_debug_mask, int num_splits,", "num_splits is required"),
    ],
)
def test_schema_check_rejects_a_changed_schema(old, new, problem):
    text = str(torch.ops.aten._flash_attention_forward.default._schema)
    assert old in text
    with pytest.raises(RuntimeError) as raised:
        check_flash_schema(torch._C.parse_schema(text.replace(old, new)))
    assert problem in str(raised.value) and f"torch {torch.__version__}" in str(raised.value)


def test_head_dim_256_with_a_gradient_on_the_lse_stays_within_the_kernel(kernel_calls):
    """At Dh = 256 the grad_lse column would make 257 (over FA2's limit): the fold takes a
    second backward call instead, and no call passes the limit."""
    with OpsRunTheirImplementation():
        inputs = sim_inputs((T, HQ, 256), (T, HKV, 256), (T, HKV, 256), (P, T, HKV, 256), (P, T, HKV, 256))
        out, lse = branch_attention_with_lse(*inputs, CU_SEQLENS)
        torch.autograd.grad(out.float().sum() + lse.sum(), inputs)
    assert [direction for direction, _ in kernel_calls] == ["forward", "backward", "backward"]
    assert all(args[1].shape[-1] <= flash.MAX_HEAD_DIM for _, args in kernel_calls)


def test_single_query_segments_with_gqa_launch_max_q_2(kernel_calls):
    """FA2 swaps query heads into the sequence dimension (and its lse layout) for GQA at
    max_seqlen_q == 1; the bound is only a launch size, so 2 keeps the usual layout."""
    cu = torch.arange(0, T + 1, dtype=torch.int32)  # every document of length 1
    with OpsRunTheirImplementation():
        inputs = sim_inputs((T, HQ, D), (T, HKV, D), (T, HKV, D))
        torch.autograd.grad(varlen_causal_attention(*inputs, cu).float().sum(), inputs)
    (_, fwd), (_, bwd) = kernel_calls
    assert fwd[5] == 2 and bwd[8] == 2


def test_head_dims_over_256_are_refused():
    with OpsRunTheirImplementation():
        inputs = sim_inputs((T, HQ, 264), (T, HKV, 264), (T, HKV, 264))
        with pytest.raises(ValueError, match="head dims up to 256"):
            varlen_causal_attention(*inputs, CU_SEQLENS)


@pytest.mark.parametrize("block_size,paged_kernel", [(256, True), (16, False)])
def test_engine_decode_reads_the_pool_through_the_block_table(kernel_calls, block_size, paged_kernel):
    """On an accelerator the engine's cached attention is one ``varlen_attn`` call with the
    pool, the block table and the rows' lengths (no gather, no score tensor); blocks the paged
    kernel cannot read (not a multiple of 256 positions) take the gathered path instead."""
    from titan_cotrain.models.kv_cache import KVPool

    b, s, nb = 3, 2, 2
    with SimulatedDevice():
        pool = KVPool(1, 8, block_size, HKV, D, torch.bfloat16, sim_device())
        table = torch.tensor([[1, 2], [3, 0], [4, 5]], device=sim_device())
        q = torch.randn(b, s, HQ, D, dtype=torch.bfloat16, device=sim_device())
        seqused = torch.tensor([5, 3, 9], device=sim_device())
        out, lse = pool.view(table).attend(0, q, seqused, return_lse=True)
    assert (out.shape, lse.shape, lse.dtype) == ((b, s, HQ, D), (b, s, HQ), torch.float32)
    if not paged_kernel:
        assert kernel_calls == []
        return
    ((direction, args),) = kernel_calls
    assert direction == "forward"
    assert args[0].shape == (b * s, HQ, D) and args[1].shape == (8, block_size, HKV, D)  # the pool itself
    assert args[5] == s and args[6] == nb * block_size  # max_q, max_k


def test_ring_moves_its_block_segments_once_per_pass(kernel_calls, monkeypatch):
    """The ring's kernel calls read ``cu_seqlens`` prepared for every block shape of the pass
    in one host-to-device copy, not one copy per block."""
    from titan_cotrain.ops import attention

    made = []
    init = attention.BlockSegments.__init__
    monkeypatch.setattr(attention.BlockSegments, "__init__", lambda self, *a: made.append(1) or init(self, *a))
    with SimulatedDevice():
        inputs = sim_inputs((T, HQ, D), (T, HKV, D), (T, HKV, D), (P, T, HKV, D), (P, T, HKV, D))
        out = ring_branch_attention(*inputs, CU_SEQLENS, RingComm(), pieces=2)
        torch.autograd.grad(out.float().sum(), inputs)
    assert len(kernel_calls) > 2 and len(made) == 2  # forward and backward, one copy each


@pytest.mark.parametrize("params,causal,gqa,want", [
    ({"return_aux", "window_size", "enable_gqa"}, True, True, {"enable_gqa": True, "window_size": (-1, 0)}),
    ({"return_aux", "window_size"}, False, False, {"window_size": (-1, -1)}),
    ({"return_aux", "is_causal"}, True, False, {"is_causal": True}),  # torch before window_size
    ({"return_aux", "is_causal"}, True, True, None),  # no public GQA: the private forward
    ({"is_causal"}, True, False, None),  # no lse output
])
def test_public_varlen_options_follow_this_torchs_signature(monkeypatch, params, causal, gqa, want):
    monkeypatch.setattr(flash, "_VARLEN_PARAMS", frozenset(params))
    assert flash._public_options(causal, gqa) == want
