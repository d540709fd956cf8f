"""The TTT unroll, its masks, the draft loss, and the draft's isolation from the policy."""

import math

import pytest
import torch
import torch.nn.functional as F

from titan_cotrain.cotrain.step import clip_grad_norms, forward_backward, step_optimizers
from titan_cotrain.cotrain.ttt import draft_loss, pass_weights, tau, ttt_masks, ttt_unroll
from titan_cotrain.data.packing import layout_from_document_ids, shift_in_document
from titan_cotrain.models.args import model_args_for
from titan_cotrain.models.draft import Draft, DraftArgs
from titan_cotrain.models.draft_vocab import draft_vocab_from_counts
from titan_cotrain.models.transformer import Transformer, apply_rope, rope_cos_sin
from tests.batches import synthetic_packed_batch
from titan_cotrain.rl.grpo import next_token_loss


def _target(seed=0, dtype=torch.float32) -> Transformer:
    model = Transformer(model_args_for("llama3", "debugmodel")).to(dtype)
    model.init_weights(std=0.2, generator=torch.Generator().manual_seed(seed))
    return model


def _draft(target: Transformer, seed=1, reduced_vocab: int = 0, dtype=torch.float32) -> Draft:
    args = DraftArgs.from_target(target.args, n_taps=3, draft_vocab_size=reduced_vocab)
    maps = (None, None)
    if reduced_vocab:
        counts = torch.arange(target.args.vocab_size).flip(0).float()  # low ids most frequent
        maps = draft_vocab_from_counts(counts, reduced_vocab)
    draft = Draft(args, *maps).to(dtype)
    draft.init_weights(std=0.1, generator=torch.Generator().manual_seed(seed))
    return draft


def _packed(doc_lengths, seed=2):
    seq = sum(doc_lengths)
    tokens = torch.randint(0, 256, (1, seq), generator=torch.Generator().manual_seed(seed))
    doc = torch.tensor([[i for i, n in enumerate(doc_lengths) for _ in range(n)]])
    return tokens, doc


def _inputs(target, tokens, doc):
    layout = layout_from_document_ids(doc)
    out = target(tokens, document_ids=doc, return_taps=True)
    t = tokens.numel()
    return dict(
        taps=torch.cat(out.taps, -1).reshape(t, -1),
        embeddings=out.embeddings.reshape(t, -1),
        tokens=tokens.reshape(-1),
        positions=layout.positions.reshape(-1),
        cu_seqlens=layout.cu_seqlens,
        teacher_logits=out.logits.reshape(t, -1),
    )


def test_shift_in_document_stops_at_document_edges():
    x = torch.arange(7)
    cu = torch.tensor([0, 3, 4, 7], dtype=torch.int32)
    assert shift_in_document(x, 1, cu, fill=-1).tolist() == [1, 2, -1, -1, 5, 6, -1]
    assert shift_in_document(x, 2, cu, fill=-1).tolist() == [2, -1, -1, -1, 6, -1, -1]


def test_masks_follow_the_table_on_a_hand_made_row():
    # Two documents: [0..5] (n=6) and [6..9] (n=4). Loss region: tokens 3..5 and 8..9.
    cu = torch.tensor([0, 6, 10], dtype=torch.int32)
    region = torch.zeros(10, dtype=torch.bool)
    region[[3, 4, 5, 8, 9]] = True
    in_vocab = torch.ones(10, dtype=torch.bool)
    in_vocab[4] = False  # the teacher's argmax at position 4 is outside the draft vocab
    masks = ttt_masks(cu, region, in_vocab, ttt_steps=3)
    expected = {1: [], 2: [], 3: []}
    for d in (1, 2, 3):
        for start, n in ((0, 6), (6, 4)):
            for i in range(n):
                t = start + i
                if i + d + 1 < n and region[t + d + 1] and in_vocab[t + d]:
                    expected[d].append(t)
    assert expected == {1: [1, 2, 6, 7], 2: [0, 1, 6], 3: [0]}  # spelled out by hand as well
    for d in (1, 2, 3):
        assert masks[d - 1].nonzero().flatten().tolist() == expected[d]


def _reference_unroll(draft: Draft, taps, embeddings, tokens, positions, cu_seqlens, ttt_steps):
    """Float64 brute force: explicit per-document shifts and one dense mask over the
    concatenated [trunk keys ; branch keys of passes 2..d] for every pass."""
    t = tokens.numel()
    cu = cu_seqlens.tolist()
    doc_of = torch.zeros(t, dtype=torch.long)
    for i, (s, e) in enumerate(zip(cu[:-1], cu[1:])):
        doc_of[s:e] = i
    layer = draft.midlayer
    attn = layer.self_attn
    hidden = draft.fc(taps)
    keys, values, logits = [], [], []
    for d in range(1, ttt_steps + 1):
        emb = torch.zeros_like(embeddings)
        for j in range(t):
            if j + d < t and doc_of[j + d] == doc_of[j]:
                emb[j] = embeddings[j + d]
        x = torch.cat([layer.input_layernorm(emb), layer.hidden_norm(hidden)], -1)
        cos, sin = rope_cos_sin(draft.rope_inv_freq, positions + d - 1, x.dtype)
        q = apply_rope(attn.q_proj(x).view(t, attn.n_heads, -1), cos, sin)
        k = apply_rope(attn.k_proj(x).view(t, attn.n_kv_heads, -1), cos, sin)
        v = attn.v_proj(x).view(t, attn.n_kv_heads, -1)
        keys.append(k)
        values.append(v)
        all_k = torch.cat(keys).repeat_interleave(attn.n_heads // attn.n_kv_heads, 1)  # [d*T, Hq, Dh]
        all_v = torch.cat(values).repeat_interleave(attn.n_heads // attn.n_kv_heads, 1)
        allowed = torch.zeros(t, d * t, dtype=torch.bool)
        for i in range(t):
            for j in range(t):
                allowed[i, j] = doc_of[i] == doc_of[j] and j <= i
            for p in range(1, d):
                allowed[i, p * t + i] = True
        scores = torch.einsum("qhd,khd->hqk", q, all_k) / math.sqrt(q.shape[-1])
        probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
        out = torch.einsum("hqk,khd->qhd", probs, all_v)
        hidden = layer.finish(hidden, out)
        logits.append(draft.logits(hidden))
    return logits


@pytest.mark.parametrize("ttt_steps", [1, 3])
def test_unroll_equals_brute_force_reference(ttt_steps):
    target = _target(dtype=torch.float64)
    draft = _draft(target, dtype=torch.float64)
    tokens, doc = _packed([5, 1, 9, 3])
    inp = _inputs(target, tokens, doc)
    select = torch.ones(ttt_steps, tokens.numel(), dtype=torch.bool)
    got = draft(inp["taps"], inp["embeddings"], inp["tokens"], inp["positions"], inp["cu_seqlens"], select)
    ref = _reference_unroll(draft, inp["taps"], inp["embeddings"], inp["tokens"], inp["positions"],
                            inp["cu_seqlens"], ttt_steps)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b.float(), rtol=1e-6, atol=1e-6)


def test_one_pass_is_a_plain_eagle3_step():
    """D = 1: fc(taps) -> one causal, document-masked layer pass on e(x_{i+1}) -> soft CE
    against softmax(policy logits at i+1), on anchors with x_{i+2} in the document."""
    target = _target()
    draft = _draft(target)
    tokens, doc = _packed([7, 12])
    inp = _inputs(target, tokens, doc)
    region = torch.ones(tokens.numel(), dtype=torch.bool)
    stats = ttt_unroll(draft, **inp, loss_region=region, ttt_steps=1)

    # Plain step, per document, no packing machinery.
    ce_sum, count = 0.0, 0
    for s, e in ((0, 7), (7, 19)):
        n = e - s
        taps, emb = inp["taps"][s:e], inp["embeddings"][s:e]
        next_emb = torch.cat([emb[1:], torch.zeros_like(emb[:1])])
        hidden = draft.fc(taps)
        layer = draft.midlayer
        x = torch.cat([layer.input_layernorm(next_emb), layer.hidden_norm(hidden)], -1)
        cos, sin = rope_cos_sin(draft.rope_inv_freq, torch.arange(n), x.dtype)
        q = apply_rope(layer.self_attn.q_proj(x).view(n, 4, -1), cos, sin).transpose(0, 1)
        k = apply_rope(layer.self_attn.k_proj(x).view(n, 2, -1), cos, sin).transpose(0, 1)
        v = layer.self_attn.v_proj(x).view(n, 2, -1).transpose(0, 1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).transpose(0, 1)
        logits = draft.logits(layer.finish(hidden, out))[: n - 2]
        teacher = inp["teacher_logits"][s + 1 : e - 1].softmax(-1)
        ce_sum = ce_sum + (-(teacher * logits.log_softmax(-1)).sum(-1)).sum()
        count += n - 2
    assert stats.count.tolist() == [count]
    torch.testing.assert_close(stats.ce_sum[0], ce_sum, rtol=1e-5, atol=1e-5)


def test_reduced_vocab_teacher_and_mask():
    target = _target()
    draft = _draft(target, reduced_vocab=64)
    assert draft.t2d.sum() == 64 and draft.t2d[:64].all()  # the 64 most "frequent" ids
    assert ((torch.arange(64) + draft.d2t) < 256).all()
    tokens, doc = _packed([16])
    inp = _inputs(target, tokens, doc)
    stats = ttt_unroll(draft, **inp, loss_region=torch.ones(16, dtype=torch.bool), ttt_steps=2)
    in_vocab = draft.t2d[inp["teacher_logits"].argmax(-1)]
    assert stats.count[0] == int(in_vocab[1:15].sum())  # teacher at i+1 for anchors 0..13


def test_draft_vocab_from_counts_breaks_ties_by_id():
    counts = torch.tensor([5, 9, 5, 0, 9, 1])
    d2t, t2d = draft_vocab_from_counts(counts, 3)
    assert t2d.tolist() == [True, True, False, False, True, False]
    assert (torch.arange(3) + d2t).tolist() == [0, 1, 4]
    with pytest.raises(ValueError):
        draft_vocab_from_counts(counts, 7)


def test_tau_and_weights():
    assert tau(torch.tensor([1.0, 1.0, 1.0])).item() == 4.0
    assert tau(torch.tensor([0.5, 0.5])).item() == pytest.approx(1 + 0.5 + 0.25)
    assert pass_weights(3, 0.8).tolist() == pytest.approx([1.0, 0.8, 0.64])
    from titan_cotrain.cotrain.ttt import TTTStats

    stats = TTTStats(torch.tensor([2.0, 4.0]), torch.tensor([2, 4]), torch.tensor([0, 0]))
    w = pass_weights(2, 0.5)
    assert draft_loss(stats, w, (w * stats.count).sum()).item() == pytest.approx((2 + 0.5 * 4) / (2 + 0.5 * 4))


def _policy_grads(with_draft: bool):
    torch.manual_seed(0)
    target = _target()
    draft = _draft(target) if with_draft else None
    batch = synthetic_packed_batch(2, 24, 256, torch.Generator().manual_seed(3))
    metrics = forward_backward(target, draft, batch, next_token_loss, ttt_steps=3, pass_decay=0.8,
                               draft_loss_weight=1.0)
    return {n: p.grad.clone() for n, p in target.named_parameters()}, draft, metrics


def test_draft_loss_leaves_policy_gradients_bitwise_unchanged():
    with_draft, draft, metrics = _policy_grads(True)
    without, _, _ = _policy_grads(False)
    assert with_draft.keys() == without.keys()
    for name in with_draft:
        assert torch.equal(with_draft[name], without[name]), name
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in draft.parameters())
    assert {"loss/draft", "draft/acc_pass3", "draft/loss_pass1", "draft/tau"} <= metrics.keys()


class _NormRecorder:
    """Optimizer stand-in: records the gradient norm it sees at ``step``."""

    def __init__(self, params):
        self.params, self.norms = list(params), []

    def step(self):
        self.norms.append(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in self.params])).item())

    def zero_grad(self):
        for p in self.params:
            p.grad = None


def test_policy_and_draft_are_clipped_separately():
    target = _target()
    draft = _draft(target)
    batch = synthetic_packed_batch(2, 24, 256, torch.Generator().manual_seed(3))
    forward_backward(target, draft, batch, next_token_loss, ttt_steps=2, pass_decay=0.8, draft_loss_weight=1.0)
    policy_opt, draft_opt = _NormRecorder(target.parameters()), _NormRecorder(draft.parameters())
    norms = clip_grad_norms(target.parameters(), draft.parameters(), policy_max_norm=1e-3, draft_max_norm=5e-4)
    step_optimizers(policy_opt, draft_opt)
    assert norms["grad_norm/policy"] > 1e-2 and norms["grad_norm/draft"] > 1e-2  # pre-clip norms
    assert policy_opt.norms[0] == pytest.approx(1e-3, rel=1e-4)
    assert draft_opt.norms[0] == pytest.approx(5e-4, rel=1e-4)


def test_overfitting_a_fixed_batch_trains_the_draft():
    target = _target()
    draft = _draft(target)
    tokens, doc = _packed([24, 40])
    inp = _inputs(target, tokens, doc)
    region = torch.ones(tokens.numel(), dtype=torch.bool)
    opt = torch.optim.Adam(draft.parameters(), lr=1e-2)
    w = pass_weights(2, 0.8)
    for _ in range(80):
        stats = ttt_unroll(draft, **inp, loss_region=region, ttt_steps=2)
        loss = draft_loss(stats, w, (w * stats.count).sum())
        opt.zero_grad()
        loss.backward()
        opt.step()
    stats = ttt_unroll(draft, **inp, loss_region=region, ttt_steps=2)
    accuracy = stats.correct.float() / stats.count
    assert accuracy[0] > 0.9, accuracy
