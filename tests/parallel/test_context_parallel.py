"""Context parallelism on gloo/CPU against the single-device path, at W = 2 and 4.

One spawn of 4 gloo ranks runs every distributed check, first on a CP group of all 4
ranks, then on two groups of 2 ({0, 1} and {2, 3}); each test below asserts that its
check completed on every rank (a failing check stops the run and its traceback is shown
by every test that did not get to run). References are computed here, single-device,
with the project's own single-device code (``forward_backward``, the attention ops).

The rows are packed with uneven documents, one of a single token, so chunks are as short
as one token and the TTT halo of a chunk edge spans several chunks and ranks.
"""

from __future__ import annotations

import copy
from functools import partial
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from tests.multiprocess import one_thread, run_on_ranks
from titan_cotrain.cotrain.step import forward_backward
from titan_cotrain.data.batch import PackedBatch
from titan_cotrain.cotrain.ttt import ttt_unroll
from titan_cotrain.models.args import model_args_for
from titan_cotrain.models.draft import Draft, DraftArgs
from titan_cotrain.models.draft_vocab import draft_vocab_from_counts
from titan_cotrain.models.transformer import Transformer
from titan_cotrain.rl.grpo import next_token_loss
from titan_cotrain.ops import branch_attention, varlen_causal_attention
from titan_cotrain.ops.ring_attention import RingComm, ring_attention
from titan_cotrain.parallel.context_parallel import (
    apply_context_parallel,
    check_cp_degree,
    init_cp_mesh,
    plan_padded_rows,
    prepare_cp_microbatch,
    shard_batch_for_cp,
    shard_packed_rows,
)
from titan_cotrain.parallel.cp_dispatch import cp_dispatch, cp_dispatch_is_on

DOC_LENGTHS = [[13, 1, 30, 5, 19], [40, 3, 25]]  # two rows of S = 68
SEQ_LEN = 68
TTT_STEPS, PASS_DECAY, DRAFT_WEIGHT = 3, 0.8, 0.7
TOL = dict(rtol=1e-5, atol=1e-5)  # fp32 attention ops: the bar
# Whole co-training steps run in fp64: through 8 layers fp32 rounding alone moves logits of
# magnitude ~7 by ~2e-5 (the ring sums the same terms in another order), which would hide
# a real error of that size; in fp64 any logic error stands out by orders of magnitude.
TOL_FP64 = dict(rtol=1e-9, atol=1e-9)
DRAFTS = ("reduced-vocab", "own-embedding")


def _document_ids() -> torch.Tensor:
    return torch.tensor([[i for i, n in enumerate(row) for _ in range(n)] for row in DOC_LENGTHS])


def _batch() -> PackedBatch:
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, 256, (2, SEQ_LEN), generator=g)
    loss_mask = torch.rand(2, SEQ_LEN, generator=g) < 0.7  # a ragged "response region"
    return PackedBatch(tokens, _document_ids(), loss_mask)


def _models(variant: str) -> tuple[Transformer, Draft]:
    """The target and a draft, fp64 (see ``TOL_FP64``)."""
    target = Transformer(model_args_for("llama3", "debugmodel"))
    target.init_weights(std=0.2, generator=torch.Generator().manual_seed(0))
    if variant == "reduced-vocab":
        args = DraftArgs.from_target(target.args, n_taps=3, draft_vocab_size=64)
        draft = Draft(args, *draft_vocab_from_counts(torch.arange(256).flip(0).float(), 64))
    else:  # its own embedding table: token ids ride in the halo
        draft = Draft(DraftArgs.from_target(target.args, n_taps=3, dim=32, n_heads=4, n_kv_heads=2))
    draft.init_weights(std=0.1, generator=torch.Generator().manual_seed(1))
    return target.double(), draft.double()


def _global_sum(x: torch.Tensor, group) -> torch.Tensor:
    x = x.detach().clone()
    dist.all_reduce(x, group=group)
    return x


_CP_MESHES = {}


def _cp_mesh(group):
    """The 1-D CP mesh whose ranks are ``group``'s (``init_cp_mesh``'s blocks of ranks), made once."""
    size = dist.get_world_size(group)
    if size not in _CP_MESHES:
        _CP_MESHES[size] = init_cp_mesh(size)
    return _CP_MESHES[size]


def cp_forward_backward(policy, draft, batch, group):
    """The trainer's co-training step as ``parallelize`` sets it up under CP (the models hooked
    from outside, the microbatches zigzag-sharded), plus the unsharded logits of the policy's
    context-parallel forward."""
    mesh = _cp_mesh(group)
    apply_context_parallel(mesh, policy, draft)
    with cp_dispatch():  # as the trainer's update runs it (ParallelModels.forward_scope)
        metrics = forward_backward(policy, draft, batch, next_token_loss, ttt_steps=TTT_STEPS,
                                   pass_decay=PASS_DECAY, draft_loss_weight=DRAFT_WEIGHT, group=group,
                                   prepare=partial(prepare_cp_microbatch, group=mesh))
        with torch.no_grad():
            cp_batch, shard = shard_batch_for_cp(batch, mesh)
            logits = shard.unshard(policy(cp_batch.tokens, cu_seqlens=shard.cu_seqlens, positions=shard.positions))
    assert not cp_dispatch_is_on()  # the switch is undone after the block
    return metrics, logits


def _summed_grads(module, group) -> dict[str, torch.Tensor]:
    return {name: _global_sum(p.grad, group) for name, p in module.named_parameters()}


# ---- the checks each rank runs -------------------------------------------------------------

def _packed_qkv(seed: int, branch_sets: int = 0):
    """q [B, S, 4, 8], k, v [B, S, 2, 8] (+ branch_k, branch_v [P, B, S, 2, 8]) fp32 and a cotangent."""
    g = torch.Generator().manual_seed(seed)
    shapes = [(2, SEQ_LEN, 4, 8), (2, SEQ_LEN, 2, 8), (2, SEQ_LEN, 2, 8)]
    shapes += [(branch_sets, 2, SEQ_LEN, 2, 8)] * (2 if branch_sets else 0)
    return [torch.randn(s, generator=g) for s in shapes], torch.randn(2, SEQ_LEN, 4, 8, generator=g)


def _cu() -> torch.Tensor:
    lengths = torch.tensor([n for row in DOC_LENGTHS for n in row])
    return torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)]).to(torch.int32)


def _attention_check(group, layout: str, branch_sets: int, **ring_options) -> None:
    """Output and every input gradient of the ring (trunk, or trunk + branch) vs single device."""
    inputs, cotangent = _packed_qkv(seed=10 + branch_sets, branch_sets=branch_sets)
    full = [x.clone().requires_grad_() for x in inputs]
    flat = [x.flatten(0, 1) for x in full[:3]] + [x.flatten(1, 2) for x in full[3:]]
    if branch_sets:
        ref = branch_attention(*flat, _cu())
    else:
        ref = varlen_causal_attention(*flat, _cu())
    ref.backward(cotangent.flatten(0, 1))

    shard = shard_packed_rows(_document_ids(), group, layout=layout)
    local = [shard.shard(x).flatten(0, 1) for x in inputs[:3]]
    local += [torch.stack([shard.shard(xp) for xp in x]).flatten(1, 2) for x in inputs[3:]]
    local = [x.requires_grad_() for x in local]
    valid = shard.valid.flatten()[:, None, None]
    if branch_sets:
        from titan_cotrain.ops.ring_attention import ring_branch_attention

        out = ring_branch_attention(*local, shard.cu_seqlens, shard.group, layout=layout, **ring_options)
    else:
        out = ring_attention(*local, shard.cu_seqlens, shard.group, layout=layout, **ring_options)
    # Padding queries' outputs feed no loss, like every padded token's in training.
    out.backward(shard.shard(cotangent).flatten(0, 1) * valid)
    torch.testing.assert_close(out * valid, shard.shard(ref.detach().view(2, SEQ_LEN, 4, 8)).flatten(0, 1), **TOL)
    for name, x, x_full in zip(["dq", "dk", "dv"], local, full):
        torch.testing.assert_close(x.grad, shard.shard(x_full.grad).flatten(0, 1), **TOL, msg=name)
    for name, x, x_full in zip(["dbranch_k", "dbranch_v"], local[3:], full[3:]):
        want = torch.stack([shard.shard(g) for g in x_full.grad]).flatten(1, 2)
        torch.testing.assert_close(x.grad, want, **TOL, msg=name)


def check_ring_attention(group, refs):
    _attention_check(group, "zigzag", branch_sets=0)


def check_ring_attention_contiguous(group, refs):
    _attention_check(group, "contiguous", branch_sets=0)


def check_ring_branch_attention(group, refs):
    _attention_check(group, "zigzag", branch_sets=3)


def check_ring_pieces(group, refs):
    """Other cuts of a ring hop into messages than the default: one message per hop (no
    pipelining), a few uneven pieces, and more pieces than chunk offsets (one offset each)."""
    for pieces in (1, 3, 1000):
        _attention_check(group, "zigzag", branch_sets=3, pieces=pieces)
    _attention_check(group, "zigzag", branch_sets=0, pieces=2)
    _attention_check(group, "contiguous", branch_sets=0, pieces=5)


def check_ring_math_fallback(group, refs):
    """The ring's plain-PyTorch block kernels (the path off CPU), causal and full blocks."""
    from titan_cotrain.ops import attention as kernels

    fused = kernels._use_cpu_flash_kernel
    kernels._use_cpu_flash_kernel = lambda q: False
    try:
        _attention_check(group, "zigzag", branch_sets=2)
    finally:
        kernels._use_cpu_flash_kernel = fused


def _cotrain_check(group, refs, variant: str) -> None:
    ref = refs[variant]
    policy, draft = _models(variant)
    policy.load_state_dict(ref["policy_state"])
    draft.load_state_dict(ref["draft_state"])
    metrics, logits = cp_forward_backward(policy, draft, _batch(), group)
    torch.testing.assert_close(logits, ref["logits"], **TOL_FP64)
    torch.testing.assert_close(metrics["loss/policy"], ref["metrics"]["loss/policy"], **TOL)  # fp32 metrics
    # The TTT masks and the teacher's argmax are identical, so the accuracies are exact.
    for d in range(TTT_STEPS):
        key = f"draft/acc_pass{d + 1}"
        assert metrics[key].item() == pytest.approx(ref["metrics"][key].item(), abs=1e-7), key
    torch.testing.assert_close(metrics["loss/draft"], ref["metrics"]["loss/draft"], **TOL)
    for kind, module in (("policy", policy), ("draft", draft)):
        for name, grad in _summed_grads(module, group).items():
            torch.testing.assert_close(grad, ref[f"{kind}_grads"][name], **TOL_FP64, msg=f"{kind} {name}")


def check_cotrain_reduced_vocab(group, refs):
    _cotrain_check(group, refs, "reduced-vocab")


def check_cotrain_own_embedding(group, refs):
    _cotrain_check(group, refs, "own-embedding")


def check_halo(group, refs):
    """exchange + shift == shift before sharding, for every d the halo serves; unshard(shard(x)) == x."""
    shard = shard_packed_rows(_document_ids(), group)
    x = torch.randn(2, SEQ_LEN, 3, generator=torch.Generator().manual_seed(5))
    ids = torch.arange(2 * SEQ_LEN).view(2, SEQ_LEN)
    halo = shard.ttt_halo(TTT_STEPS)
    x_ext, ids_ext = halo.extend(shard.shard(x).flatten(0, 1), shard.shard(ids).flatten())
    for d in range(1, TTT_STEPS + 2):
        assert torch.equal(halo.shift(x_ext, d), shard.shard_shifted(x, d).flatten(0, 1))
        assert torch.equal(halo.shift(ids_ext, d, fill=-1), shard.shard_shifted(ids, d, fill=-1).flatten())
    assert torch.equal(shard.unshard(shard.shard(x)), x)


def check_dtensor_dispatch(group, refs):
    """The model's own ops on DTensor Shard(seq) inputs, routed by torch's CP dispatcher."""
    from torch.distributed.tensor import DTensor, Shard

    mesh = _cp_mesh(group)
    shard = shard_packed_rows(_document_ids(), mesh)
    inputs, cotangent = _packed_qkv(seed=20, branch_sets=2)
    full = [x.clone().requires_grad_() for x in inputs]
    ref = branch_attention(*[x.flatten(0, 1) for x in full[:3]], *[x.flatten(1, 2) for x in full[3:]], _cu())
    ref.backward(cotangent.flatten(0, 1))
    local = [shard.shard(x).flatten(0, 1).requires_grad_() for x in inputs[:3]]
    local += [torch.stack([shard.shard(xp) for xp in x]).flatten(1, 2).requires_grad_() for x in inputs[3:]]
    dtensors = [DTensor.from_local(x, mesh, [Shard(0 if i < 3 else 1)], run_check=False) for i, x in enumerate(local)]
    valid = shard.valid.flatten()[:, None, None]
    with cp_dispatch():
        out = branch_attention(*dtensors, shard.cu_seqlens)
        assert isinstance(out, DTensor) and out.placements == (Shard(0),)
        out.to_local().backward(shard.shard(cotangent).flatten(0, 1) * valid)
        trunk = varlen_causal_attention(*dtensors[:3], shard.cu_seqlens)
    assert not cp_dispatch_is_on()
    want = shard.shard(ref.detach().view(2, SEQ_LEN, 4, 8)).flatten(0, 1)
    torch.testing.assert_close(out.to_local() * valid, want, **TOL)
    for x, x_full in zip(local[:3], full[:3]):
        torch.testing.assert_close(x.grad, shard.shard(x_full.grad).flatten(0, 1), **TOL)
    for x, x_full in zip(local[3:], full[3:]):
        torch.testing.assert_close(x.grad, torch.stack([shard.shard(g) for g in x_full.grad]).flatten(1, 2), **TOL)
    ref_trunk = varlen_causal_attention(*[x.detach().flatten(0, 1) for x in inputs[:3]], _cu())
    want = shard.shard(ref_trunk.view(2, SEQ_LEN, 4, 8)).flatten(0, 1)
    torch.testing.assert_close(trunk.to_local() * valid, want, **TOL)


def check_torch_context_parallel_sdpa(group, refs):
    """Stock ``torch...context_parallel`` + ``F.scaled_dot_product_attention`` on CPU, forward
    and backward, once our CPU SDPA handlers are registered."""
    from torch.distributed.tensor.experimental import context_parallel
    from torch.distributed.tensor.experimental._attention import context_parallel_unshard

    from titan_cotrain.parallel.cp_dispatch import register_cp_handlers

    register_cp_handlers()
    mesh = _cp_mesh(group)
    g = torch.Generator().manual_seed(7)
    q, k, v, cotangent = (torch.randn(2, 4, 32, 8, generator=g) for _ in range(4))
    full = [x.clone().requires_grad_() for x in (q, k, v)]
    F.scaled_dot_product_attention(*full, is_causal=True).backward(cotangent)
    buffers = [q.clone(), k.clone(), v.clone(), cotangent.clone()]
    with context_parallel(mesh, buffers=buffers, buffer_seq_dims=[2, 2, 2, 2]):
        local = [b.clone().requires_grad_() for b in buffers[:3]]
        out = F.scaled_dot_product_attention(*local, is_causal=True)
        out.backward(buffers[3])
        gathered = context_parallel_unshard(mesh, [out.detach(), *(x.grad for x in local)], [2, 2, 2, 2])
    want = [F.scaled_dot_product_attention(q, k, v, is_causal=True), *(x.grad for x in full)]
    for got, ref in zip(gathered, want):
        torch.testing.assert_close(got, ref, **TOL)


CHECKS = {
    "ring_attention": check_ring_attention,
    "ring_attention_contiguous": check_ring_attention_contiguous,
    "ring_branch_attention": check_ring_branch_attention,
    "ring_pieces": check_ring_pieces,
    "ring_math_fallback": check_ring_math_fallback,
    "halo": check_halo,
    "cotrain_reduced_vocab": check_cotrain_reduced_vocab,
    "cotrain_own_embedding": check_cotrain_own_embedding,
    "dtensor_dispatch": check_dtensor_dispatch,
    "torch_context_parallel_sdpa": check_torch_context_parallel_sdpa,
}


def _rank_main(rank: int, world_size: int, out_dir: str, refs) -> None:
    torch.set_num_threads(1)
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank creates both
    for cp_size, group in ((4, dist.group.WORLD), (2, pairs[rank // 2])):
        for name, check in CHECKS.items():
            check(group, refs)
            with open(Path(out_dir) / f"rank{rank}.txt", "a") as f:
                f.write(f"{name} {cp_size}\n")




@one_thread()
def _references() -> dict:
    refs = {}
    for variant in DRAFTS:
        policy, draft = _models(variant)
        state = (copy.deepcopy(policy.state_dict()), copy.deepcopy(draft.state_dict()))
        batch = _batch()
        metrics = forward_backward(policy, draft, batch, next_token_loss, ttt_steps=TTT_STEPS, pass_decay=PASS_DECAY,
                                   draft_loss_weight=DRAFT_WEIGHT)
        stats = ttt_unroll(draft, **_draft_inputs(policy, batch), ttt_steps=TTT_STEPS)
        with torch.no_grad():
            logits = policy(batch.tokens, document_ids=batch.document_ids)
        refs[variant] = {
            "policy_state": state[0], "draft_state": state[1], "metrics": metrics, "logits": logits,
            "count": stats.count.float().tolist(),
            "policy_grads": {n: p.grad.clone() for n, p in policy.named_parameters()},
            "draft_grads": {n: p.grad.clone() for n, p in draft.named_parameters()},
        }
    return refs


def _draft_inputs(policy, batch) -> dict:
    from titan_cotrain.data.packing import layout_from_document_ids

    layout = layout_from_document_ids(batch.document_ids)
    with torch.no_grad():
        out = policy(batch.tokens, cu_seqlens=layout.cu_seqlens, return_taps=True)
    t = batch.tokens.numel()
    return dict(
        taps=torch.cat(out.taps, -1).reshape(t, -1), embeddings=out.embeddings.reshape(t, -1),
        tokens=batch.tokens.reshape(-1), positions=layout.positions.reshape(-1), cu_seqlens=layout.cu_seqlens,
        teacher_logits=out.logits.reshape(t, -1), loss_region=batch.loss_mask.reshape(-1),
    )


@pytest.fixture(scope="module")
def cp_run(tmp_path_factory):
    """Run every check on 4 gloo ranks once; returns ({(check, W) done on all ranks}, failure)."""
    out_dir = tmp_path_factory.mktemp("cp")
    failure = None
    try:
        run_on_ranks(_rank_main, 4, str(out_dir), _references())
    except AssertionError as e:
        failure = str(e)
    lines = [set((out_dir / f"rank{r}.txt").read_text().split("\n")) if (out_dir / f"rank{r}.txt").exists() else set()
             for r in range(4)]
    done = set.intersection(*lines)
    return {tuple((name, int(w))) for name, w in (line.split() for line in done if line)}, failure


@pytest.mark.slow
@pytest.mark.parametrize("cp_size", [2, 4])
@pytest.mark.parametrize("check", list(CHECKS))
def test_matches_single_device(cp_run, check, cp_size):
    done, failure = cp_run
    assert (check, cp_size) in done, f"{check} at W = {cp_size} did not pass:\n{failure}"


# ---- in-process: W = 1 and bad input ----------------------------------------------------------

def _w1_check(rank: int, world_size: int, refs) -> None:
    policy, draft = _models("reduced-vocab")
    policy.load_state_dict(refs["policy_state"])
    draft.load_state_dict(refs["draft_state"])
    mesh = init_cp_mesh(1)
    apply_context_parallel(mesh, policy, draft)  # a ring of one rank
    cp_batch, shard = shard_batch_for_cp(_batch(), mesh)
    assert shard.world == 1 and shard.row_len > SEQ_LEN  # documents padded to even lengths
    b, n = cp_batch.tokens.shape
    with cp_dispatch():
        out = policy(cp_batch.tokens, cu_seqlens=shard.cu_seqlens, positions=shard.positions, return_taps=True)
        stats = ttt_unroll(
            draft, taps=torch.cat(out.taps, -1).reshape(b * n, -1), embeddings=out.embeddings.reshape(b * n, -1),
            tokens=cp_batch.tokens.reshape(-1), positions=shard.positions.reshape(-1), cu_seqlens=shard.cu_seqlens,
            teacher_logits=out.logits.reshape(b * n, -1), loss_region=cp_batch.loss_mask.reshape(-1),
            ttt_steps=TTT_STEPS, shift=shard.ttt_halo(TTT_STEPS),
        )
    torch.testing.assert_close(shard.unshard(out.logits.detach()), refs["logits"], **TOL_FP64)
    assert stats.count.float().tolist() == refs["count"]


def test_cp_machinery_at_w1_is_the_single_device_step():
    """On one rank the CP path (padding to 2-token chunks, halo, the models hooked from
    outside, a ring of one) reproduces ``forward_backward``: the same code, run as a ring of one."""
    run_on_ranks(_w1_check, 1, _references()["reduced-vocab"])


def test_a_document_longer_than_the_row_is_rejected():
    with pytest.raises(ValueError, match="longer than the CP row of 16 tokens"):
        plan_padded_rows([[30]], world=2, row_len=16)


def test_a_row_whose_padded_documents_overflow_is_rejected():
    # 5 + 11 = 16 tokens fit unpadded, but 8 + 12 = 20 once each is padded to 2W = 4.
    with pytest.raises(ValueError, match="need 20 tokens"):
        plan_padded_rows([[5, 11]], world=2, row_len=16)
    with pytest.raises(ValueError, match="multiple of 4"):
        plan_padded_rows([[4]], world=2, row_len=18)
    padded, row_len = plan_padded_rows([[5, 11], [16]], world=2)
    assert padded == [[8, 12], [16]] and row_len == 20


def test_a_cp_degree_that_does_not_divide_the_mesh_is_rejected():
    with pytest.raises(ValueError, match="does not divide the mesh of 4 ranks"):
        check_cp_degree(3, 4)
    check_cp_degree(2, 4)


def test_bad_local_layouts_and_shifts_are_rejected():
    q = torch.randn(3, 2, 4)
    with pytest.raises(ValueError, match="multiples of 2"):  # a zigzag local document is 2 chunks
        ring_attention(q, q, q, torch.tensor([0, 3], dtype=torch.int32), RingComm(None))
    with pytest.raises(ValueError, match="at least one piece"):
        ring_attention(q[:2], q[:2], q[:2], torch.tensor([0, 2], dtype=torch.int32), RingComm(None), pieces=0)
    shard = shard_packed_rows(_document_ids(), None)
    with pytest.raises(ValueError, match="cannot shift by 5"):
        shard.ttt_halo(TTT_STEPS).shift(torch.zeros(10_000), 5)


def test_cp_dispatch_refuses_unsupported_torch():
    from titan_cotrain.parallel.cp_dispatch import check_torch_version

    for supported in ("2.11.0+cu130", "2.12.1", "2.13.0+cpu"):
        check_torch_version(supported)
    with pytest.raises(RuntimeError, match="found torch 2.10.1"):
        check_torch_version("2.10.1")


def test_the_cp_dispatcher_is_on_only_inside_its_block():
    """``cp_dispatch()`` turns torch's process-wide CP dispatcher on for its block, nests, and
    leaves it as it found it (off), also when the block raises."""
    assert not cp_dispatch_is_on()
    with cp_dispatch():
        assert cp_dispatch_is_on()
        with cp_dispatch():
            assert cp_dispatch_is_on()
        assert cp_dispatch_is_on()  # the inner block does not switch the outer one off
    assert not cp_dispatch_is_on()
    with pytest.raises(RuntimeError, match="inside"):
        with cp_dispatch():
            raise RuntimeError("inside")
    assert not cp_dispatch_is_on()
