"""The block drafter (DFlash family): its attention against a brute-force float64 reference,
the block-sparse flex path's mask against the exact path, the anchors' draw, what a block
reads, its training sums against a direct computation, and the policy's gradients untouched."""

import pytest
import torch
import torch.nn.functional as F

from titan_cotrain.cotrain.block_loss import block_draft_sums, block_weights, document_bounds, sample_anchors
from titan_cotrain.models.args import model_args_for
from titan_cotrain.models.block_draft import BlockDraftArgs, BlockDrafter, block_target_layers
from titan_cotrain.models.transformer import Transformer
from titan_cotrain.ops.block_attention import (
    block_attention_exact,
    block_attention_flex,
    context_partial_backward_exact,
    context_partial_exact,
)

CU = torch.tensor([0, 13, 20, 37], dtype=torch.int32)  # three documents, 37 packed rows
T = int(CU[-1])
TOKENS = torch.randint(0, 64, (T,), generator=torch.Generator().manual_seed(9))


def _anchors(region, per_doc, seed=0):
    """``sample_anchors`` over ``CU`` with in-document positions and the fixed ``TOKENS``."""
    start, _ = document_bounds(CU, "cpu")
    return sample_anchors(CU, region, per_doc, seed, positions=torch.arange(T) - start, tokens=TOKENS)


def test_target_layers_are_spread_from_layer_1_to_L_minus_3():
    assert block_target_layers(36, 5) == (1, 9, 17, 25, 33)  # SGLang's default rule for these depths
    assert block_target_layers(28, 1) == (14,)
    assert block_target_layers(8, 3) == (1, 3, 5)
    with pytest.raises(ValueError, match="at least 4 layers"):
        block_target_layers(3, 2)
    with pytest.raises(ValueError, match="block_size"):
        BlockDraftArgs.from_target(model_args_for("qwen3", "debugmodel"), block_size=1)


def _attention_inputs(n=5, b=4, hq=4, hkv=2, d=8, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(n, b, hq, d, generator=g, dtype=dtype)
    ctx_k, ctx_v = (torch.randn(T, hkv, d, generator=g, dtype=dtype) for _ in range(2))
    blk_k, blk_v = (torch.randn(n, b, hkv, d, generator=g, dtype=dtype) for _ in range(2))
    start, end = document_bounds(CU, "cpu")
    anchors = torch.tensor([0, 5, 12, 20, 30])[:n]  # a block at a document's first row has no context
    return q, ctx_k, ctx_v, blk_k, blk_v, start[anchors], anchors


def _brute_force(q, ctx_k, ctx_v, blk_k, blk_v, ctx_start, ctx_end, scale):
    """Block by block: softmax over [the block's context rows ; its own rows], float64."""
    rep = q.shape[2] // ctx_k.shape[1]
    outs = []
    for n in range(q.shape[0]):
        s, e = int(ctx_start[n]), int(ctx_end[n])
        k = torch.cat([ctx_k[s:e], blk_k[n]]).repeat_interleave(rep, dim=1)
        v = torch.cat([ctx_v[s:e], blk_v[n]]).repeat_interleave(rep, dim=1)
        p = (torch.einsum("qhd,khd->hqk", q[n], k) * scale).softmax(-1)
        outs.append(torch.einsum("hqk,khd->qhd", p, v))
    return torch.stack(outs)


@pytest.mark.parametrize("chunk_scores", [1, 200, 1 << 22], ids=["one_block_a_chunk", "some", "all"])
def test_exact_block_attention_is_the_brute_force_one(chunk_scores):
    inputs = _attention_inputs()
    leaves = [x.clone().requires_grad_() for x in inputs[:5]]
    scale = 8 ** -0.5
    out = block_attention_exact(*leaves, *inputs[5:], scale, chunk_scores=chunk_scores)
    reference = _brute_force(*inputs, scale)
    torch.testing.assert_close(out, reference, rtol=1e-12, atol=1e-12)
    grad_out = torch.randn_like(out)
    grads = torch.autograd.grad(out, leaves, grad_out)
    ref_leaves = [x.clone().requires_grad_() for x in inputs[:5]]
    ref_grads = torch.autograd.grad(_brute_force(*ref_leaves, *inputs[5:], scale), ref_leaves, grad_out)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_a_chunk_spans_only_rows_its_blocks_mostly_read():
    """The exact path's chunks: blocks of two long documents are not scored against each
    other's rows (the span would be mostly masked), blocks of two short ones share a chunk."""
    from titan_cotrain.ops.block_attention import chunk_plan

    assert chunk_plan([0, 0, 1000, 1000], [900, 950, 1900, 1950], 4) == [0, 2, 0, 950, 2, 4, 1000, 1950]
    assert chunk_plan([0, 100], [90, 190], 4) == [0, 2, 0, 190]
    assert chunk_plan([0, 100], [90, 190], 4, chunk_scores=1) == [0, 1, 0, 90, 1, 2, 100, 190]


@pytest.mark.parametrize("chunk_scores", [1, 200, 1 << 22])
def test_the_context_parts_explicit_backward_is_autograds(chunk_scores):
    """The op's backward (``context_partial_backward_exact``: recomputed probabilities, chunks
    that share context rows adding into the same key gradients) against autograd through the
    forward, for an output and a log-sum-exp gradient together; a block without context
    (anchor 0) gets none."""
    q, ctx_k, ctx_v, _, _, start, end = _attention_inputs()
    scale = 8 ** -0.5
    leaves = [x.clone().requires_grad_() for x in (q, ctx_k, ctx_v)]
    out, lse = context_partial_exact(*leaves, start, end, scale)
    g = torch.Generator().manual_seed(4)
    grad_out = torch.randn(out.shape, generator=g, dtype=out.dtype)
    grad_lse = torch.randn(lse.shape, generator=g, dtype=lse.dtype)
    want = torch.autograd.grad((out, lse.masked_fill(lse.isinf(), 0.0)), leaves, (grad_out, grad_lse))
    got = context_partial_backward_exact(grad_out, grad_lse, q, ctx_k, ctx_v, start, end, scale,
                                         chunk_scores=chunk_scores)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    assert lse[0].isinf().all() and not got[0][0].any()


def test_the_flex_path_masks_what_the_exact_path_does():
    """flex_attention's block-sparse mask (the accelerator path) gives the exact path's output;
    torch's CPU build runs flex forward only, which is what this checks."""
    inputs = _attention_inputs(dtype=torch.float32)
    scale = 8 ** -0.5
    with torch.no_grad():
        flex = block_attention_flex(*inputs, scale, compiled=False)
        exact = block_attention_exact(*inputs, scale)
    torch.testing.assert_close(flex, exact, rtol=1e-5, atol=1e-5)


def test_anchors_are_drawn_among_rows_whose_next_token_is_trained():
    region = torch.zeros(T, dtype=torch.bool)
    region[4:13] = True  # document 0's response
    region[22:37] = True  # document 2's; document 1 has none
    draws = [_anchors(region, 3, s) for s in range(40)]
    for anchors in draws:
        assert torch.equal(anchors, anchors.sort().values)
        assert ((anchors >= 3) & (anchors <= 11) | (anchors >= 21) & (anchors <= 35)).all(), anchors
        assert ((anchors < 13).sum(), (anchors >= 20).sum()) == (3, 3)
    # Every valid anchor is drawn sometimes; the draw repeats under the same generator.
    assert set(torch.cat(draws).tolist()) == set(range(3, 12)) | set(range(21, 36))
    assert torch.equal(_anchors(region, 3, 7), draws[7])
    # More blocks than valid anchors: all of them, once each.
    assert _anchors(region, 100).tolist() == [*range(3, 12), *range(21, 36)]


def _drafter(block_size=4, n_layers=2, dtype=torch.float64):
    target = model_args_for("qwen3", "debugmodel").replace(vocab_size=64)
    args = BlockDraftArgs.from_target(target, n_layers=n_layers, block_size=block_size)
    drafter = BlockDrafter(args)
    drafter.init_weights(std=0.2, generator=torch.Generator().manual_seed(3))
    return drafter.to(dtype), target


def _packed(args, dtype=torch.float64, seed=1):
    g = torch.Generator().manual_seed(seed)
    features = torch.randn(T, args.n_ctx * args.dim, generator=g, dtype=dtype)
    embeddings = torch.randn(T, args.dim, generator=g, dtype=dtype)
    start, _ = document_bounds(CU, "cpu")
    return features, embeddings, torch.arange(T) - start


def test_a_block_reads_its_documents_context_before_its_anchor_and_nothing_else():
    drafter, _ = _drafter()
    features, embeddings, positions = _packed(drafter.args)
    start, _ = document_bounds(CU, "cpu")
    anchors = torch.tensor([0, 6, 12, 25, 36])

    def blocks(features, embeddings, anchors):
        with torch.no_grad():
            return drafter(features, positions, embeddings[anchors], positions[anchors], start[anchors], anchors)

    together = blocks(features, embeddings, anchors)
    alone = torch.cat([blocks(features, embeddings, anchors[i:i + 1]) for i in range(len(anchors))])
    torch.testing.assert_close(together, alone, rtol=1e-12, atol=1e-12)
    n = 3  # the block at row 25 (document 2, rows 20..36)
    changed = features.clone()
    changed[25:] += 1.0  # the anchor's own row and after: not yet run by the target
    changed[:20] += 1.0  # other documents
    torch.testing.assert_close(blocks(changed, embeddings, anchors)[n], together[n], rtol=1e-12, atol=1e-12)
    changed = features.clone()
    changed[24] += 1.0  # the last context row
    assert not torch.allclose(blocks(changed, embeddings, anchors)[n], together[n])
    changed = embeddings.clone()
    changed[25] += 1.0  # the anchor's token
    assert not torch.allclose(blocks(features, changed, anchors)[n], together[n])


def _direct_sums(drafter, features, embeddings, positions, region, policy_hidden, head_weight, anchors):
    """The block sums without chunks or masks-by-where: block by block, position by position."""
    b = drafter.args.block_size
    start, end = document_bounds(CU, "cpu")
    hidden = drafter(features, positions, embeddings[anchors], positions[anchors], start[anchors], anchors)
    ce_sum = [hidden.new_zeros(()) for _ in range(b - 1)]
    count, correct, overlap = (torch.zeros(b - 1, dtype=torch.float64) for _ in range(3))
    for n, a in enumerate(anchors.tolist()):
        for j in range(1, b):
            if a + j >= end[a] or not region[a + j]:
                continue
            q = F.log_softmax(F.linear(drafter.norm(hidden[n, j]), head_weight), -1)
            p = F.softmax(F.linear(policy_hidden[a + j - 1], head_weight), -1)
            ce_sum[j - 1] = ce_sum[j - 1] - (p * q).sum()
            count[j - 1] += 1
            correct[j - 1] += float(q.argmax() == p.argmax())
            overlap[j - 1] += torch.minimum(p, q.exp()).sum()
    return torch.stack(ce_sum), count, correct, overlap


@pytest.mark.parametrize("chunk_rows", [1, 5, 1024])
def test_the_training_sums_are_the_direct_ones(chunk_rows):
    drafter, target = _drafter()
    features, embeddings, positions = _packed(drafter.args)
    g = torch.Generator().manual_seed(5)
    policy_hidden = torch.randn(T, drafter.args.dim, generator=g, dtype=torch.float64)
    head_weight = torch.randn(target.vocab_size, drafter.args.dim, generator=g, dtype=torch.float64)
    region = torch.ones(T, dtype=torch.bool)
    region[:4] = False
    anchors = _anchors(region, 2, 0)
    params = list(drafter.parameters())
    stats = block_draft_sums(drafter, features, embeddings, positions, CU, region, policy_hidden, head_weight,
                             anchors, chunk_rows=chunk_rows)
    weights = block_weights(drafter.args.block_size, 0.7).double()
    grads = torch.autograd.grad((weights * stats.ce_sum).sum(), params)
    ce_sum, count, correct, overlap = _direct_sums(drafter, features, embeddings, positions, region, policy_hidden,
                                                   head_weight, anchors)
    ref_grads = torch.autograd.grad((weights * ce_sum).sum(), params)
    assert count.sum() > 0 and torch.equal(stats.count.double(), count)
    torch.testing.assert_close(stats.ce_sum, ce_sum, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(stats.correct.double(), correct)
    torch.testing.assert_close(stats.overlap.double(), overlap, rtol=1e-6, atol=1e-6)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


def test_no_anchor_gives_zero_sums_that_still_reach_every_parameter():
    drafter, _ = _drafter()
    features, embeddings, positions = _packed(drafter.args)
    stats = block_draft_sums(drafter, features, embeddings, positions, CU, torch.zeros(T, dtype=torch.bool),
                             torch.zeros(T, drafter.args.dim, dtype=torch.float64),
                             torch.zeros(64, drafter.args.dim, dtype=torch.float64), torch.zeros(0, dtype=torch.int64))
    assert stats.ce_sum.tolist() == [0.0] * 3 and stats.count.sum() == 0
    grads = torch.autograd.grad(stats.ce_sum.sum(), list(drafter.parameters()))
    assert all(g is not None and not g.any() for g in grads)


def test_the_policys_gradients_are_bitwise_those_without_the_drafter():
    """The drafter reads the policy's taps, embeddings, final hidden states and head weight
    detached: a step with its loss gives the policy exactly the gradients of a step without."""
    drafter, _ = _drafter(dtype=torch.float32)
    target_args = model_args_for("qwen3", "debugmodel").replace(vocab_size=64)
    policy = Transformer(target_args, tap_layers=drafter.args.target_layer_ids)
    policy.init_weights(generator=torch.Generator().manual_seed(0))
    tokens = torch.randint(0, 64, (1, T), generator=torch.Generator().manual_seed(2))
    region = torch.ones(T, dtype=torch.bool)
    anchors = _anchors(region, 2, 1)
    start, _ = document_bounds(CU, "cpu")
    positions = torch.arange(T) - start

    def step(with_drafter: bool):
        policy.zero_grad(set_to_none=True)
        drafter.zero_grad(set_to_none=True)
        out = policy(tokens, cu_seqlens=CU.tolist(), positions=positions[None], return_taps=True,
                     head=lambda hidden, weight: (F.linear(hidden, weight), hidden, weight))
        logits, hidden, weight = out.head
        loss = F.cross_entropy(logits[:-1].float(), tokens[0, 1:])
        if with_drafter:
            stats = block_draft_sums(drafter, torch.cat(out.taps, -1)[0], out.embeddings[0], positions, CU, region,
                                     hidden, weight, anchors)
            loss = loss + (stats.ce_sum * block_weights(drafter.args.block_size, 0.8)).sum() / stats.count.sum()
        loss.backward()
        return {name: p.grad.clone() for name, p in policy.named_parameters()}

    without, with_drafter = step(False), step(True)
    assert without.keys() == with_drafter.keys()
    assert all(torch.equal(without[k], with_drafter[k]) for k in without)
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in drafter.parameters())


@pytest.mark.parametrize("layout", ["paged", "rows"])
def test_drafting_from_the_kv_cache_is_the_training_forward_at_the_same_anchor(layout):
    """Drafting reads what training computes: a block drafted from the cached context (every
    position of each sequence written, so slots past the anchor hold keys no block may read)
    equals the training forward's block at that anchor, float64."""
    drafter, _ = _drafter(block_size=4, n_layers=2)
    features, embeddings, positions = _packed(drafter.args)
    cu = CU.tolist()
    lengths = [e - s for s, e in zip(cu[:-1], cu[1:])]
    anchors_in_doc = torch.tensor([9, 1, 16])  # sequence 1's context is its first token only
    anchor_rows = torch.tensor(cu[:-1]) + anchors_in_doc
    start, _ = document_bounds(CU, "cpu")
    with torch.no_grad():
        trained = drafter(features, positions, embeddings[anchor_rows], positions[anchor_rows], start[anchor_rows],
                          anchor_rows)
    width = 20  # every sequence's positions, padded
    padded = torch.zeros(3, width, features.shape[1], dtype=features.dtype)
    for i, (s, n) in enumerate(zip(cu[:-1], lengths)):
        padded[i, :n] = features[s:s + n]
    if layout == "paged":
        pool = drafter.new_kv_pool(n_blocks=1 + 3 * 5, block_size=4)
        cache = pool.view(torch.arange(1, 16).view(3, 5).flip(0))  # sequence i in blocks far from i's
    else:
        pool = drafter.new_kv_pool(n_blocks=4, block_size=width)
        cache = pool.rows(1, 3, width)
    with torch.no_grad():
        drafter.write_context(padded, torch.arange(width).expand(3, width), cache)
        drafted = drafter.draft_block(embeddings[anchor_rows], anchors_in_doc, cache)
    torch.testing.assert_close(drafted, trained, rtol=1e-10, atol=1e-10)
