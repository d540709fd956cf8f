"""Ring attention on one rank, on the GPU in bf16: the zigzag layout's blocks, the cut of the
shard into pieces, the fp32 merges and the dK/dV accumulation, all running the flash kernels,
against the fp64 trunk reference of the unsharded batch. Tolerances: ``tests/gpu/conftest.py``.

A ring of one rank needs no process group: ``RingComm(None)`` without an initialised default
group is rank 0 of 1, and its ``send_recv`` hands the tensors back. So nothing here crosses
NCCL (a ring of several ranks is ``tests/parallel/test_context_parallel.py``'s, on gloo); what
this checks is the ring's local plan on the GPU kernels, which a single rank runs whole.
"""

import pytest
import torch

from tests.gpu.conftest import (
    C_BACKWARD,
    C_FORWARD,
    DEVICE,
    LONG_DOC,
    assert_flash_kernels_ran,
    assert_near,
    packed_inputs,
    trunk_reference,
)
from titan_cotrain.ops import ring_attention as ring
from titan_cotrain.ops.ring_attention import RingComm, ring_attention
from titan_cotrain.parallel.context_parallel import shard_packed_rows

LENGTHS = [1, 7, 300, LONG_DOC]  # odd lengths: the zigzag layout pads each document to a multiple of 2
HQ, HKV, D = 4, 2, 64


@pytest.fixture(scope="module")
def problem():
    """``(shard, (q, k, v), cotangent, reference)``: the unsharded batch on the host, its fp64
    reference ``(out, lse, grads)`` and the zigzag shard of the only rank."""
    cu, q, k, v, cotangent = packed_inputs(LENGTHS, HQ, HKV, D, seed=3)
    document_ids = torch.repeat_interleave(torch.arange(len(LENGTHS)), torch.tensor(LENGTHS)).unsqueeze(0)
    shard = shard_packed_rows(document_ids)  # no process group: one rank
    assert shard.world == 1 and shard.local_len > q.shape[0]  # padding inserted
    return shard, (q, k, v), cotangent, trunk_reference(q, k, v, cotangent, cu, D**-0.5)


@pytest.mark.parametrize("pieces", [1, 3, 8])
def test_one_rank_ring_matches_the_trunk(problem, pieces, kernels):
    shard, qkv, cotangent, (ref_out, _, ref_grads) = problem

    def local(x: torch.Tensor) -> torch.Tensor:
        """``x [T, ...]`` in the shard's layout ``[T_local, ...]``, 0 on padding."""
        return shard.shard(x.unsqueeze(0))[0]

    inputs = [local(x).to(DEVICE, copy=True).requires_grad_() for x in qkv]
    valid = shard.valid[0].to(DEVICE)[:, None, None]
    out = ring_attention(*inputs, shard.cu_seqlens, RingComm(None), pieces=pieces)
    # Padding queries' outputs feed no loss, as every padded token's in training.
    grads = torch.autograd.grad(out, inputs, local(cotangent).to(DEVICE) * valid)

    assert_near("out", out * valid, local(ref_out), C_FORWARD)
    for name, grad, ref in zip(("dq", "dk", "dv"), grads, ref_grads):
        assert_near(name, grad, local(ref), C_BACKWARD)
    assert_flash_kernels_ran(kernels)


def test_the_block_segments_are_built_once_per_layout(problem, monkeypatch):
    """The kernels' ``cu_seqlens`` of every block a pass runs are made in one copy and kept for
    the batch's layout: every later forward and backward of that layout (every layer's) reuses
    them."""
    shard, qkv, cotangent, _ = problem
    built = []

    class Counted(ring.BlockSegments):
        def __init__(self, shapes, device):
            built.append(device)
            super().__init__(shapes, device)

    monkeypatch.setattr(ring, "BlockSegments", Counted)
    monkeypatch.setattr(ring, "_SEGMENTS", {})  # nothing kept from an earlier test
    inputs = [shard.shard(x.unsqueeze(0))[0].to(DEVICE, copy=True).requires_grad_() for x in qkv]
    for _ in range(2):  # two layers of one batch
        out = ring_attention(*inputs, shard.cu_seqlens, RingComm(None), pieces=3)
        torch.autograd.grad(out, inputs, torch.ones_like(out))
    assert built == [DEVICE]
