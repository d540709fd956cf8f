"""Rollouts speculating with the block drafter: greedy speculative equals greedy plain token
for token (paged with shared prompts, static, continuous batching, preemption), every round
accepts exactly what the training forward predicts at its anchor, and sampled rollouts follow
the target's law (chi-square), while a broken acceptance rule fails the same test."""

import dataclasses

import pytest
import torch

from tests.engine.test_rollout import N_SAMPLES, _chi_square_p_value
from titan_cotrain.cotrain.block_loss import block_draft_sums, document_bounds, sample_anchors
from titan_cotrain.engine import rollout
from titan_cotrain.engine.block_rollout import BlockDraftEngine
from titan_cotrain.engine.kv_budget import kv_bytes_per_sequence
from titan_cotrain.engine.rollout import RolloutEngine
from titan_cotrain.engine.sampling import SamplingParams, processed_logits
from titan_cotrain.models.args import model_args_for
from titan_cotrain.models.block_draft import BlockDraftArgs, BlockDrafter, head_logits
from titan_cotrain.models.transformer import Transformer

VOCAB, BLOCK, NEW_TOKENS = 16, 5, 24


def _pair(vocab: int, block: int, seed: int = 0, std: float = 0.3) -> tuple[Transformer, BlockDrafter]:
    target = Transformer(model_args_for("llama3", "debugmodel").replace(vocab_size=vocab))
    target.init_weights(std=std, generator=torch.Generator().manual_seed(seed))
    args = BlockDraftArgs.from_target(target.args, n_layers=2, block_size=block, target_layer_ids=target.tap_layers)
    drafter = BlockDrafter(args)
    drafter.init_weights(std=0.1, generator=torch.Generator().manual_seed(seed + 1))
    return target.eval(), drafter.eval()


def _packed_features(target: Transformer, sequences: list[torch.Tensor]):
    """One packed forward over ``sequences``: cu_seqlens, positions, the taps, embeddings, the
    head's input and weight (what the trainer's forward gives the drafter)."""
    cu = torch.tensor([0, *torch.tensor([s.numel() for s in sequences]).cumsum(0).tolist()], dtype=torch.int32)
    start, _ = document_bounds(cu, "cpu")
    positions = torch.arange(int(cu[-1])) - start
    out = target(torch.cat(sequences)[None], cu_seqlens=cu.tolist(), positions=positions[None], return_taps=True,
                 head=lambda hidden, weight: (hidden.detach(), weight.detach()))
    return cu, positions, torch.cat(out.taps, -1)[0], out.embeddings[0], *out.head


@pytest.fixture(scope="module")
def fitted():
    """A target over 16 tokens, 8 prompts of 3-9 tokens, and a block drafter fitted to the
    target's greedy continuations of them (block_draft_sums, 150 Adam steps), so that the
    rounds of the tests below accept several tokens and a drafter reading wrong keys would
    show."""
    torch.manual_seed(0)
    target, drafter = _pair(VOCAB, BLOCK)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, VOCAB, (int(n),), generator=g) for n in torch.randint(3, 10, (8,), generator=g)]
    plain = RolloutEngine(target, None, max_batch_size=8, max_seq_len=40, block_size=4)
    out = plain.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=NEW_TOKENS))
    sequences = [torch.cat([p, out.tokens[i, : int(out.response_lens[i])]]) for i, p in enumerate(prompts)]
    with torch.no_grad():
        cu, positions, features, embeddings, hidden, weight = _packed_features(target, sequences)
    region = torch.ones(len(positions), dtype=torch.bool)
    drafter.train()
    optimizer = torch.optim.Adam(drafter.parameters(), lr=1e-2)
    for step in range(150):
        anchors = sample_anchors(cu, region, 8, step, positions=positions, tokens=torch.cat(sequences))
        stats = block_draft_sums(drafter, features, embeddings, positions, cu, region, hidden, weight, anchors)
        optimizer.zero_grad()
        (stats.ce_sum.sum() / stats.count.sum()).backward()
        optimizer.step()
    return target, drafter.eval(), prompts


class TracingBlockEngine(BlockDraftEngine):
    """Records every drafting round: ``(output row, anchor, accepted)`` of each active row."""

    def generate(self, *args, **kwargs):
        self.rounds, self.ks = [], []
        return super().generate(*args, **kwargs)

    def _speculative_round(self, seqs, call, round_):
        active = seqs.active.clone()
        out_row, anchor = seqs.out_row[active].clone(), (seqs.length - 1)[active].clone()
        accepted = super()._speculative_round(seqs, call, round_)
        self.rounds.append((out_row, anchor, accepted[active].clone()))
        self.ks.append(round_.k)
        return accepted


CASES = {
    "paged, G=4": (dict(block_size=4), 4),
    "paged, k per round": (dict(block_size=4), 4),
    "static, G=4": (dict(paged=False), 4),
    "continuous batching": (dict(block_size=4, max_batch_size=6), 4),
    "preemption": (dict(block_size=4, max_batch_size=12, kv_blocks_for=3), 4),
}


def _engines(target, drafter, case, k):
    engine_kwargs, samples = CASES[case]
    kwargs = dict(max_batch_size=64, max_seq_len=40, block_size=16) | engine_kwargs
    sequences = kwargs.pop("kv_blocks_for", 0)
    if sequences:
        kwargs["kv_cache_gib"] = sequences * kv_bytes_per_sequence(target.args, drafter.args, 40, k,
                                                                   torch.float32) / 2**30
    return (TracingBlockEngine(target, drafter, max_draft_tokens=k, **kwargs),
            RolloutEngine(target, None, **{key: v for key, v in kwargs.items() if key != "kv_cache_gib"}), samples)


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_block_speculation_equals_greedy_plain_and_accepts_what_training_predicts(fitted, case):
    target, drafter, prompts = fitted
    k = BLOCK - 1
    engine, plain, samples = _engines(target, drafter, case, k)
    params = SamplingParams(temperature=0.0, max_new_tokens=NEW_TOKENS)
    # A per-round choice (as the speculation tuner makes): k, 0, 1, .., k - 1 in turn.
    turn = iter(range(10**6))
    per_round = (lambda live: [k, *range(k)][next(turn) % (k + 1)]) if case == "paged, k per round" else None
    out = engine.generate(prompts, params, samples_per_prompt=samples, draft_tokens=per_round)
    reference = plain.generate(prompts, params, samples_per_prompt=samples)
    assert torch.equal(out.response_lens, reference.response_lens)
    for b in range(out.tokens.shape[0]):
        n = int(out.response_lens[b])
        assert torch.equal(out.tokens[b, :n], reference.tokens[b, :n]), b
    if case == "preemption":
        assert out.stats.preemptions > 0
    # Every round accepts the leading block positions whose argmax the training forward at
    # the same anchor gets right (capped at k and at the sequence's end).
    sequences = [torch.cat([prompts[b // samples], out.tokens[b, : int(out.response_lens[b])]])
                 for b in range(out.tokens.shape[0])]
    with torch.no_grad():
        cu, positions, features, embeddings, _, weight = _packed_features(target, sequences)
    starts = cu[:-1].long()
    rounds, mismatches, accepted_sum = 0, [], 0
    for (out_row, anchor, accepted), k in zip(engine.rounds, engine.ks):
        rows = starts[out_row] + anchor
        with torch.no_grad():
            hidden = drafter(features, positions, embeddings[rows], positions[rows], starts[out_row], rows)
            predicted = head_logits(drafter.norm, hidden[:, 1:], weight).argmax(-1)  # [n, B - 1], training's head
        for i, (b, a, got) in enumerate(zip(out_row.tolist(), anchor.tolist(), accepted.tolist())):
            seq = sequences[b]
            checkable = min(k, seq.numel() - 1 - a)
            right = predicted[i, :checkable] == seq[a + 1: a + 1 + checkable]
            leading = int(right.long().cumprod(0).sum())
            rounds, accepted_sum = rounds + 1, accepted_sum + got
            if min(got, checkable) != leading:
                mismatches.append(f"sequence {b} anchor {a}: engine accepted {got}, training predicts {leading}")
    assert rounds > 0 and not mismatches, f"{len(mismatches)} of {rounds} rounds differ:\n" + "\n".join(mismatches[:8])
    assert accepted_sum / rounds > 1.0, f"the fitted drafter accepts only {accepted_sum / rounds:.2f} a round"


def _first_tokens_p_value(params: SamplingParams, k: int, n_samples: int) -> float:
    """P-value of "the first ``k + 2`` response tokens of block-drafted sampling follow the
    target's exact joint law", on a 5-token vocabulary (as ``tests/engine/test_rollout.py``'s
    EAGLE-3 test): groups of 100 samples sharing their prompt's blocks (copy-on-write), a
    running batch of a fifth of them (continuous batching)."""
    vocab, m = 5, k + 2
    target, drafter = _pair(vocab, block=k + 1, seed=4)
    prompt = torch.tensor([3, 1, 4])
    grid = torch.cartesian_prod(*[torch.arange(vocab)] * m)
    seqs = torch.cat([prompt.expand(len(grid), -1), grid], 1)
    with torch.no_grad():
        logits = target.forward_cached(seqs, target.new_kv_pool(len(grid), seqs.shape[1]).rows(0, len(grid)),
                                       torch.zeros(len(grid), dtype=torch.int64))[:, len(prompt) - 1: -1]
    logp = processed_logits(logits, params).log_softmax(-1).gather(-1, grid.unsqueeze(-1)).squeeze(-1)
    place = vocab ** torch.arange(m - 1, -1, -1)
    exact = torch.zeros(vocab**m, dtype=logp.dtype).index_add_(0, (grid * place).sum(-1), logp.sum(-1).exp())
    engine = BlockDraftEngine(target, drafter, max_batch_size=n_samples // 5, max_seq_len=len(prompt) + m,
                              max_draft_tokens=k, block_size=2)
    params = dataclasses.replace(params, max_new_tokens=m)
    out = engine.generate([prompt] * (n_samples // 100), params, samples_per_prompt=100,
                          generator=torch.Generator().manual_seed(0))
    assert min(out.stats.acceptance_rate) > 0.1  # drafts are accepted and rejected: the rule matters
    return _chi_square_p_value(torch.bincount((out.tokens * place).sum(-1), minlength=vocab**m), exact)


# Preemption's recompute is covered by the greedy test's "preemption" case (token-for-token
# and round-for-round); its sampled version costs minutes here, for no other path.
@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7)],
                         ids=["t1", "t0.7"])
def test_block_drafted_sampling_is_lossless(params):
    assert _first_tokens_p_value(params, k=2, n_samples=N_SAMPLES) > 1e-3


def test_a_broken_acceptance_rule_fails_the_block_lossless_test(monkeypatch):
    def always_accept(draft_tokens, draft_probs, draft_to_target, target_probs, generator):
        b, k = draft_tokens.shape
        return torch.full((b,), k), rollout.sample(target_probs[:, k], generator)

    monkeypatch.setattr(rollout, "speculative_accept", always_accept)
    assert _first_tokens_p_value(SamplingParams(temperature=1.0), k=2, n_samples=N_SAMPLES) < 1e-6


def test_the_engine_refuses_what_it_cannot_do():
    target, drafter = _pair(VOCAB, BLOCK)
    with pytest.raises(ValueError, match="max_draft_tokens must be in 1..4"):
        BlockDraftEngine(target, drafter, max_batch_size=2, max_seq_len=16, max_draft_tokens=5)
    with pytest.raises(NotImplementedError, match="compiled"):
        BlockDraftEngine(target, drafter, max_batch_size=2, max_seq_len=16, compile=True)
    other = Transformer(target.args, tap_layers=(0, 2, 4))
    with pytest.raises(ValueError, match="the drafter reads"):
        BlockDraftEngine(other, drafter, max_batch_size=2, max_seq_len=16)
