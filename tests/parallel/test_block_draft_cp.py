"""The block drafter's training objective under context parallelism equals one device's.

One spawn of 8 gloo ranks checks CP groups of 2, 4 and 8 ranks (zigzag shards; at W = 8 a
document's chunks are 1-4 tokens, so a block's targets and teacher rows cross several chunk
edges and its context spans every rank). In float64, on every rank of a group:

* the anchors the group draws together (``sample_anchors`` with the shard's halo) are, as
  rows of the unsharded batch, exactly those one device draws from the whole batch;
* the sums (loss, count, top-1 agreement, acceptance chance per block position) added over
  the group, and every drafter gradient added over the group, equal the one-device
  ``block_draft_sums``' (itself checked against a direct block-by-block computation in
  ``tests/models/test_block_draft.py``), to 1e-10 (the acceptance chance, summed in fp32,
  to 1e-6).
"""

import torch
import torch.distributed as dist

from tests.multiprocess import run_on_ranks
from tests.models.test_block_draft import _drafter
from titan_cotrain.cotrain.block_loss import block_draft_sums, block_weights, document_bounds, sample_anchors
from titan_cotrain.data.packing import layout_from_document_ids
from titan_cotrain.parallel.context_parallel import shard_packed_rows

ROWS, SEQ = 2, 64
DOCS = [[37, 20, 7], [50, 14]]  # tokens per document, per packed row
BLOCK, PER_DOC, SEED, DECAY = 4, 3, 11, 0.7


def _document_ids() -> torch.Tensor:
    ids, next_id = [], 0
    for row in DOCS:
        ids.append(torch.cat([torch.full((n,), next_id + i) for i, n in enumerate(row)]))
        next_id += len(row)
    return torch.stack(ids)


def _inputs(drafter, vocab: int) -> dict:
    """The whole batch's tensors, ``[ROWS * SEQ, ...]`` (float64, seeded: the same on every rank)."""
    g = torch.Generator().manual_seed(4)
    args, t = drafter.args, ROWS * SEQ
    cu = layout_from_document_ids(_document_ids()).cu_seqlens
    start, _ = document_bounds(cu, "cpu")
    region = torch.rand(t, generator=g) < 0.8
    region[start] = False  # no document's first token is trained
    return {"features": torch.randn(t, args.n_ctx * args.dim, generator=g, dtype=torch.float64),
            "embeddings": torch.randn(t, args.dim, generator=g, dtype=torch.float64),
            "positions": torch.arange(t) - start, "cu": cu, "region": region,
            "hidden": torch.randn(t, args.dim, generator=g, dtype=torch.float64),
            "head": torch.randn(vocab, args.dim, generator=g, dtype=torch.float64),
            "tokens": torch.randint(0, vocab, (t,), generator=g)}


def _sums_and_grads(drafter, x: dict, anchors: torch.Tensor, **where) -> tuple[list[torch.Tensor], list]:
    stats = block_draft_sums(drafter, x["features"], x["embeddings"], x["positions"], x["cu"], x["region"],
                             x["hidden"], x["head"], anchors, chunk_rows=5, **where)
    loss = (block_weights(BLOCK, DECAY).double() * stats.ce_sum).sum()
    grads = torch.autograd.grad(loss, list(drafter.parameters()))
    return [stats.ce_sum.detach(), stats.count.double(), stats.correct.double(), stats.overlap.double()], list(grads)


def _check_group(group) -> None:
    drafter, target = _drafter(block_size=BLOCK)
    whole = _inputs(drafter, target.vocab_size)
    want_anchors = sample_anchors(whole["cu"], whole["region"], PER_DOC, SEED, positions=whole["positions"],
                                  tokens=whole["tokens"])
    want_sums, want_grads = _sums_and_grads(drafter, whole, want_anchors)

    shard = shard_packed_rows(_document_ids(), group)
    halo = shard.ttt_halo(BLOCK - 1)

    def local(x, fill=0):
        return shard.shard(x.view(ROWS, SEQ, *x.shape[1:]), fill=fill).reshape(-1, *x.shape[1:])

    mine = {"features": local(whole["features"]), "embeddings": local(whole["embeddings"]),
            "positions": shard.positions.reshape(-1), "cu": shard.cu_seqlens, "region": local(whole["region"], False),
            "hidden": local(whole["hidden"]), "head": whole["head"], "tokens": local(whole["tokens"])}
    anchors = sample_anchors(mine["cu"], mine["region"], PER_DOC, SEED, positions=mine["positions"],
                             tokens=mine["tokens"], shift=halo)
    drawn = [None] * dist.get_world_size(group)
    dist.all_gather_object(drawn, halo.global_rows[anchors].tolist(), group=group)
    assert sorted(sum(drawn, [])) == want_anchors.tolist(), (drawn, want_anchors.tolist())
    assert min(len(d) for d in drawn) < len(want_anchors)  # the blocks are really spread

    sums, grads = _sums_and_grads(drafter, mine, anchors, shift=halo)
    sums, grads = [x.contiguous() for x in sums], [g.contiguous() for g in grads]  # autograd may expand a zero
    for got in [*sums, *grads]:
        dist.all_reduce(got, group=group)
    assert want_sums[1].sum() > 0
    for name, got, want, tol in zip(("ce_sum", "count", "correct", "overlap"), sums, want_sums,
                                    (1e-10, 0, 0, 1e-6)):  # the acceptance chance is summed in fp32
        torch.testing.assert_close(got, want, rtol=tol, atol=tol, msg=name)
    for (name, _), got, want in zip(drafter.named_parameters(), grads, want_grads):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10, msg=name)

    # A microbatch where no rank has a block (a padding row's): zero sums, no exchange to hang on.
    none = {**mine, "region": torch.zeros_like(mine["region"])}
    anchors = sample_anchors(none["cu"], none["region"], PER_DOC, SEED, positions=none["positions"],
                             tokens=none["tokens"], shift=halo)
    assert anchors.numel() == 0
    sums, grads = _sums_and_grads(drafter, none, anchors, shift=halo)
    assert all(not x.any() for x in [*sums, *grads])


def _rank_main(rank: int, world_size: int) -> None:
    torch.set_default_dtype(torch.float32)
    for size in (2, 4, 8):
        group = dist.new_group(list(range(size)))  # every rank creates every group
        if rank < size:
            _check_group(group)
        dist.barrier()


def test_the_block_objective_under_cp_2_4_8_equals_one_device():
    run_on_ranks(_rank_main, 8)
