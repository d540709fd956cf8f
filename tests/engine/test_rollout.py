"""The rollout engine: drafting matches TTT, greedy speculative == greedy plain, lossless
sampling (with a broken rule that must fail the same test), behaviour logprobs, filters,
weight refresh, an engine built from FSDP-sharded models; the first, the second and the last
for a mixture-of-experts policy too. Memory (engine copies, KV budget,
waves, decode attention off CPU): ``test_engine_memory.py``."""

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

from tests.multiprocess import run_on_ranks
from titan_cotrain.models.args import model_args_for
from titan_cotrain.models.draft import Draft, DraftArgs, DraftKVCache
from titan_cotrain.models.draft_vocab import draft_vocab_from_counts
from titan_cotrain.models.transformer import Transformer
from titan_cotrain.engine import rollout
from titan_cotrain.engine.kv_budget import kv_bytes_per_sequence
from titan_cotrain.engine.rollout import RolloutEngine
from titan_cotrain.engine.sampling import SamplingParams, greedy_accept, processed_logits, speculative_accept


N_SAMPLES = 5000  # per distribution test: 625 cells, most expecting 5 draws or more
DENSE = ("llama3", "debugmodel")
MOE = ("qwen3", "debugmoe")  # layers 1, 3, 7 sparse: 8 experts, top 2 (torchtitan's MoE)


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """These models are tiny, so every op is launch-bound: one thread is as fast as two and
    does not collapse when the machine's cores are shared (OpenMP spin-waits)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _models(vocab: int = 0, draft_vocab: int = 0, seed: int = 0, flavor=DENSE) -> tuple[Transformer, Draft]:
    """The llama3 debug model (or another ``(name, flavor)``; optionally with a smaller
    vocabulary) and a draft for it, random weights, a reduced draft vocabulary when
    ``draft_vocab`` is given."""
    args = model_args_for(*flavor)
    target = Transformer(args.replace(vocab_size=vocab) if vocab else args)
    target.init_weights(std=0.3, generator=torch.Generator().manual_seed(seed))
    draft_args = DraftArgs.from_target(target.args, n_taps=3, draft_vocab_size=draft_vocab)
    maps = (None, None)
    if draft_vocab:
        maps = draft_vocab_from_counts(torch.arange(target.args.vocab_size).float(), draft_vocab)  # keeps high ids
    draft = Draft(draft_args, *maps)
    draft.init_weights(std=0.1, generator=torch.Generator().manual_seed(seed + 1))
    return target, draft


def _prompts(lengths, vocab, seed=0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g) for n in lengths]


def _teacher_forced_logprobs(target: Transformer, prompts, out, params: SamplingParams) -> torch.Tensor:
    """``[B, N]`` log-probabilities of the generated tokens under one training forward per sequence."""
    result = torch.zeros_like(out.logprobs)
    for b, prompt in enumerate(prompts):
        n = int(out.response_lens[b])
        seq = torch.cat([prompt, out.tokens[b, :n]]).unsqueeze(0)
        with torch.no_grad():
            logits = processed_logits(target(seq)[0, len(prompt) - 1: -1], params)
        result[b, :n] = logits.log_softmax(-1).gather(-1, out.tokens[b, :n, None]).squeeze(-1)
    return result


def _eos_for_some_rows(tokens: torch.Tensor, other_than: int | None = None) -> int:
    """A token that occurs in some rows of ``tokens [B, N]`` (after their first 2 tokens) but
    not in all, and is not ``other_than``."""
    rows_with = F.one_hot(tokens[:, 2:], int(tokens.max()) + 1).any(1).sum(0)
    if other_than is not None:
        rows_with[other_than] = 0
    candidates = ((rows_with > 0) & (rows_with < tokens.shape[0])).nonzero().flatten()
    assert candidates.numel(), "no token splits the batch; pick other prompts"
    return int(candidates[rows_with[candidates].argmax()])


def test_drafting_computes_the_ttt_passes():
    """Draft.extend + chain_step at anchor i == the TTT unroll's pass d at anchor i (d = 1..D),
    for two sequences at different anchors sharing one extend call (ragged offsets)."""
    target, draft = _models(draft_vocab=200)
    tokens = torch.stack(_prompts([14, 14], 256, seed=3))
    with torch.no_grad():
        out = target(tokens, return_taps=True)
        taps, embeds = torch.cat(out.taps, -1), out.embeddings
        depth = 4
        select = torch.ones(depth, tokens.numel(), dtype=torch.bool)
        cu = torch.tensor([0, 14, 28], dtype=torch.int32)
        ttt = draft(taps.flatten(0, 1), embeds.flatten(0, 1), tokens.flatten(), torch.arange(14).repeat(2), cu, select)

        anchors = torch.tensor([6, 9])
        # Paged trunk, blocks of 4 positions out of order; chains for passes 2..depth.
        table = torch.tensor([[5, 2, 7, 1, 3, 8, 4, 6], [9, 11, 10, 12, 14, 13, 16, 15]])
        chain = [torch.zeros(2, depth - 1, draft.args.n_kv_heads, draft.args.head_dim) for _ in range(2)]
        cache = DraftKVCache(draft.new_kv_pool(17, 4).view(table), *chain)
        width = int(anchors.max()) + 1  # row 0 writes stale slots past its anchor, which it must not see
        hidden = draft.extend(taps[:, :width], embeds[:, 1:width + 1], torch.zeros(2, dtype=torch.int64), cache)
        rows = torch.arange(2)
        hidden = hidden[rows, anchors]
        for d in range(1, depth + 1):
            if d > 1:
                hidden = draft.chain_step(embeds[rows, anchors + d], hidden, anchors, d, cache)
            expected = ttt[d - 1].view(2, 14, -1)[rows, anchors]
            torch.testing.assert_close(draft.logits(hidden), expected, rtol=1e-4, atol=1e-4, msg=f"pass {d}")


def _constant_draft(target: Transformer, token: int, draft_vocab: int) -> Draft:
    """A draft that always proposes target token ``token``: a zero final norm makes its logits
    all zero, so the argmax is draft id 0, which ``d2t`` maps to ``token``."""
    vocab = target.args.vocab_size
    others = [t for t in range(vocab) if t != token][: draft_vocab - 1]
    target_ids = torch.tensor([token, *others])
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[target_ids] = True
    draft = Draft(DraftArgs.from_target(target.args, n_taps=3, draft_vocab_size=draft_vocab),
                  target_ids - torch.arange(draft_vocab), t2d)
    draft.init_weights(generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        draft.norm.weight.zero_()
    return draft


@pytest.mark.parametrize("flavor, seed", [(DENSE, 0), (MOE, 4)], ids=["dense", "moe"])
@pytest.mark.parametrize("vocab, draft_vocab, k", [(256, 200, 3), (6, 5, 3)])
def test_greedy_speculative_equals_greedy_plain(vocab, draft_vocab, k, flavor, seed):
    """Token for token, ragged prompts, an EOS that stops some rows mid-batch. With 256
    tokens the random draft is rarely right; with 6, a draft that always proposes the
    target's most frequent token makes ragged multi-token acceptances common. A mixture of
    experts routes each token alone, so its verify of ``k + 1`` positions routes them as
    decoding them one at a time does. (``seed``: weights whose greedy text repeats a token
    that is not the EOS.)"""
    target, draft = _models(vocab, draft_vocab, seed, flavor)
    prompts = _prompts([3, 9, 5, 1, 7, 4], vocab)
    engine = RolloutEngine(target, draft, max_batch_size=8, max_seq_len=40, max_draft_tokens=k)
    plain = engine.generate(prompts, SamplingParams(temperature=0, max_new_tokens=24), draft_tokens=0)
    proposed = None
    if vocab == 6:
        proposed = int(plain.tokens.flatten().mode().values)
        draft = _constant_draft(target, proposed, draft_vocab)
        engine = RolloutEngine(target, draft, max_batch_size=8, max_seq_len=40, max_draft_tokens=k)
    params = SamplingParams(temperature=0, max_new_tokens=24, eos_token_id=_eos_for_some_rows(plain.tokens, proposed))
    plain = engine.generate(prompts, params, draft_tokens=0)
    calls = []
    spec = engine.generate(prompts, params, draft_tokens=k, progress=lambda done, total: calls.append((done, total)))
    assert plain.finished.any() and not plain.finished.all(), "EOS should stop some rows, not all"
    # One progress report per round: finished counts never fall and end at the batch size.
    assert len(calls) > 1 and calls[-1] == (6, 6) and {t for _, t in calls} == {6}
    assert all(a <= b for (a, _), (b, _) in zip(calls, calls[1:])) and calls[0][0] < 6
    assert torch.equal(spec.tokens, plain.tokens)
    assert torch.equal(spec.response_lens, plain.response_lens)
    assert torch.equal(spec.finished, plain.finished)
    torch.testing.assert_close(spec.logprobs, plain.logprobs, rtol=1e-4, atol=1e-4)
    # k chosen every round (the adaptive tuner's way), from the live rows and a turn: 0 included.
    turn = iter(range(10**6))
    per_round = engine.generate(prompts, params, draft_tokens=lambda live: (next(turn) + live) % (k + 1))
    assert torch.equal(per_round.tokens, plain.tokens) and torch.equal(per_round.finished, plain.finished)
    torch.testing.assert_close(per_round.logprobs, plain.logprobs, rtol=1e-4, atol=1e-4)
    assert per_round.stats.drafting and per_round.stats.rounds.rounds[:, 1:].sum(0).count_nonzero() == k + 1
    if vocab == 6:
        assert spec.stats.acceptance_length > 1.2
        assert spec.stats.acceptance_rate[1] > 0  # some rounds accepted two drafted tokens or more
        assert spec.stats.target_forwards < plain.stats.target_forwards
    # Continuous batching and prefix sharing on: 2 samples per prompt sharing its blocks (of 4
    # positions), a pool that holds 2 sequences at their longest, so groups wait and refill.
    per_sequence = kv_bytes_per_sequence(target.args, draft.args, 40, k, torch.float32)
    shared = RolloutEngine(target, draft, max_batch_size=8, max_seq_len=40, max_draft_tokens=k, block_size=4,
                           kv_cache_gib=2 * per_sequence / 2**30)
    for draft_tokens in (0, k):
        out = shared.generate(prompts, params, samples_per_prompt=2, draft_tokens=draft_tokens)
        assert torch.equal(out.tokens, plain.tokens.repeat_interleave(2, 0)), draft_tokens
        assert torch.equal(out.response_lens, plain.response_lens.repeat_interleave(2))
        torch.testing.assert_close(out.logprobs, plain.logprobs.repeat_interleave(2, 0), rtol=1e-4, atol=1e-4)
        one_batch = plain if draft_tokens == 0 else spec  # every sequence at once, in its own rows
        assert out.stats.target_forwards > one_batch.stats.target_forwards  # some waited for room
        assert out.stats.kv_peak_bytes <= 2 * per_sequence
        # Admitted by the blocks they use, more sequences run than the pool holds at their
        # longest; some are preempted and recomputed, and no token changes.
        assert out.stats.preemptions > 0 and out.stats.recomputed_tokens > 0


def _chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's test of ``counts [C]`` against ``probs [C]``; cells expecting fewer than 5
    draws are pooled. P-value by the Wilson-Hilferty normal approximation (df >> 1 here)."""
    n = counts.sum()
    expected = probs.double() * n
    small = expected < 5
    observed = torch.cat([counts[~small].double(), counts[small].double().sum().view(1)])
    expected = torch.cat([expected[~small], expected[small].sum().view(1)])
    stat = float(((observed - expected) ** 2 / expected.clamp(min=1e-12)).sum())
    df = observed.numel() - 1
    z = ((stat / df) ** (1 / 3) - (1 - 2 / (9 * df))) / math.sqrt(2 / (9 * df))
    return 0.5 * math.erfc(z / math.sqrt(2))


def _first_tokens_test(params: SamplingParams, k: int, n_samples: int, per_round=None,
                       pool_sequences: int = 0, flavor=DENSE) -> float:
    """P-value of "the first ``1 + (k + 1)`` response tokens of speculative sampling follow the
    target's exact joint distribution", on a 5-token vocabulary with a 4-token draft
    vocabulary (token 0 can only come from a residual or a bonus draw). A response cut at a
    stop token of ``params`` is one cell, whatever the continuations after it. ``per_round``: the
    engine's per-round choice of ``k`` (``draft_tokens``), else ``k`` every round.
    ``pool_sequences``: a KV pool of that many sequences at their longest, for 16 rows, so
    that sequences are preempted and recomputed (0: blocks for every row). ``flavor``: the
    target's ``(name, flavor)``."""
    vocab, m = 5, k + 2
    target, draft = _models(vocab, draft_vocab=4, seed=4, flavor=flavor)
    prompt = torch.tensor([3, 1, 4])
    # Exact joint of the first m tokens: teacher-force every one of the vocab^m continuations.
    grid = torch.cartesian_prod(*[torch.arange(vocab)] * m)  # [vocab^m, m], first token slowest
    seqs = torch.cat([prompt.expand(len(grid), -1), grid], 1)
    with torch.no_grad():
        logits = target.forward_cached(seqs, target.new_kv_pool(len(grid), seqs.shape[1]).rows(0, len(grid)),
                                       torch.zeros(len(grid), dtype=torch.int64))[:, len(prompt) - 1: -1]
    logp = processed_logits(logits, params).log_softmax(-1).gather(-1, grid.unsqueeze(-1)).squeeze(-1)
    stop = torch.isin(grid, torch.tensor(params.stops, dtype=torch.int64)).long()
    response = grid * ((stop.cumsum(-1) - stop) == 0)  # zeros after the first stop token, as the engine pads
    place = vocab ** torch.arange(m - 1, -1, -1)
    exact = torch.zeros(vocab**m, dtype=logp.dtype).index_add_(0, (response * place).sum(-1), logp.sum(-1).exp())

    # Groups of 100 samples sharing their prompt's first block (blocks of 2 positions), a
    # running batch of a fifth of them: copy-on-write and continuous batching are in the path.
    rows, budget = n_samples // 5, 0.0
    if pool_sequences:
        rows = 16
        budget = pool_sequences * kv_bytes_per_sequence(target.args, draft.args, len(prompt) + m, k,
                                                        torch.float32) / 2**30
    engine = RolloutEngine(target, draft, max_batch_size=rows, max_seq_len=len(prompt) + m,
                           max_draft_tokens=k, block_size=2, kv_cache_gib=budget)
    params = dataclasses.replace(params, max_new_tokens=m)
    out = engine.generate([prompt] * (n_samples // 100), params, samples_per_prompt=100,
                          generator=torch.Generator().manual_seed(0), draft_tokens=per_round)
    assert min(out.stats.acceptance_rate) > 0.1  # drafts are accepted and rejected: the rule matters
    assert (out.stats.preemptions > 0) == bool(pool_sequences)
    assert not params.stops or out.finished.float().mean() > 0.25  # stops cut a good share of responses
    return _chi_square_p_value(torch.bincount((out.tokens * place).sum(-1), minlength=vocab**m), exact)


@pytest.mark.parametrize("params, flavor", [(SamplingParams(temperature=1.0), DENSE),
                                            (SamplingParams(temperature=0.8, top_p=0.9), DENSE),
                                            (SamplingParams(temperature=1.0), MOE)],
                         ids=["t1", "t0.8-top_p0.9", "t1-moe"])
def test_speculative_sampling_is_lossless(params, flavor):
    assert _first_tokens_test(params, k=2, n_samples=N_SAMPLES, flavor=flavor) > 1e-3


def test_speculative_sampling_is_lossless_under_preemption():
    # 16 rows and blocks for 3 sequences at their longest: sequences are preempted mid-response
    # and recomputed from their committed tokens, then drafted and verified on from there.
    assert _first_tokens_test(SamplingParams(temperature=1.0), k=2, n_samples=N_SAMPLES, pool_sequences=3) > 1e-3


def _every_k_in_turn(k: int):
    """A per-round choice of ``k`` that changes every round: ``k, 0, 1, .., k - 1``, again."""
    turn = iter(range(10**6))
    return lambda live: [k, *range(k)][next(turn) % (k + 1)]


def test_speculative_sampling_keeps_its_law_when_k_changes_between_rounds():
    # Each sequence's first 4 tokens span rounds at k = 2, then 0, then 1 (or another turn).
    assert _first_tokens_test(SamplingParams(temperature=1.0), k=2, n_samples=N_SAMPLES,
                              per_round=_every_k_in_turn(2)) > 1e-3


def _always_accept(draft_tokens, draft_probs, draft_to_target, target_probs, generator):
    b, k = draft_tokens.shape
    return torch.full((b,), k), rollout.sample(target_probs[:, k], generator)


def _resample_from_p(draft_tokens, draft_probs, draft_to_target, target_probs, generator):
    """The right acceptance test, but a rejection redraws from p instead of norm(max(p - q, 0))."""
    n_accepted, _ = speculative_accept(draft_tokens, draft_probs, draft_to_target, target_probs, generator)
    return n_accepted, rollout.sample(target_probs[torch.arange(len(n_accepted)), n_accepted], generator)


@pytest.mark.parametrize("broken_rule, per_round", [(_always_accept, False), (_resample_from_p, False),
                                                     (_resample_from_p, True)],
                         ids=["always_accept", "resample_from_p", "resample_from_p-k_per_round"])
def test_a_broken_acceptance_rule_fails_the_lossless_test(monkeypatch, broken_rule, per_round):
    monkeypatch.setattr(rollout, "speculative_accept", broken_rule)
    assert _first_tokens_test(SamplingParams(temperature=1.0), k=2, n_samples=N_SAMPLES,
                              per_round=_every_k_in_turn(2) if per_round else None) < 1e-6


def test_greedy_accept_is_the_one_hot_limit_of_speculative_accept():
    g = torch.Generator().manual_seed(0)
    b, k, vocab = 64, 4, 5
    target_logits = torch.randn(b, k + 1, vocab, generator=g)
    draft_tokens = torch.randint(0, vocab, (b, k), generator=g)
    draft_tokens[: b // 2] = target_logits[: b // 2, :k].argmax(-1)  # half start with accepted drafts
    draft_tokens[: b // 2, 2] = torch.randint(0, vocab, (b // 2,), generator=g)
    one_hot_p = F.one_hot(target_logits.argmax(-1), vocab).float()
    one_hot_q = F.one_hot(draft_tokens, vocab).float()
    expected = greedy_accept(draft_tokens, target_logits)
    got = speculative_accept(draft_tokens, one_hot_q, torch.arange(vocab), one_hot_p, g)
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
    assert set(expected[0].tolist()) >= {0, 2, k}


@pytest.mark.parametrize("draft_tokens", [0, 3])
def test_behaviour_logprobs_equal_a_teacher_forced_forward(draft_tokens):
    target, draft = _models(vocab=6, draft_vocab=5)
    engine = RolloutEngine(target, draft, max_batch_size=6, max_seq_len=30, max_draft_tokens=3)
    prompts = _prompts([2, 8, 5, 1, 6, 3], 6, seed=1)
    params = SamplingParams(temperature=0.7, max_new_tokens=20, eos_token_id=5)
    out = engine.generate(prompts, params, draft_tokens=draft_tokens, generator=torch.Generator().manual_seed(0))
    mask = out.response_mask()
    assert mask.any(1).all() and out.finished.any()
    torch.testing.assert_close(out.logprobs, _teacher_forced_logprobs(target, prompts, out, params),
                               rtol=1e-4, atol=1e-4)
    assert (out.logprobs[~mask] == 0).all() and (out.tokens[~mask] == 0).all()
    if draft_tokens:
        assert out.stats.acceptance_length > 1.2


def test_top_k_and_top_p_filters():
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0]])
    kept = lambda **kw: torch.isfinite(processed_logits(logits, SamplingParams(**kw)))[0].tolist()  # noqa: E731
    assert kept(top_k=2) == [True, True, False, False, False]
    probs = logits.softmax(-1)[0]  # 0.52, 0.19, 0.12, 0.07, 0.03
    assert kept(top_p=float(probs[0]) - 0.01) == [True, False, False, False, False]
    assert kept(top_p=float(probs[0] + probs[1]) - 0.01) == [True, True, False, False, False]
    assert kept(top_p=0.999) == [True] * 5


@pytest.mark.parametrize("params", [SamplingParams(top_k=3, max_new_tokens=12),
                                    SamplingParams(temperature=1.3, top_p=0.5, max_new_tokens=12)],
                         ids=["top_k3", "top_p0.5"])
def test_filtered_sampling_only_emits_allowed_tokens(params):
    target, draft = _models(draft_vocab=200)
    engine = RolloutEngine(target, draft, max_batch_size=8, max_seq_len=24, max_draft_tokens=3)
    prompts = _prompts([4, 7, 2, 9, 5, 3, 8, 6], 256, seed=2)
    for k in (0, 3):
        out = engine.generate(prompts, params, draft_tokens=k, generator=torch.Generator().manual_seed(k))
        for b, prompt in enumerate(prompts):
            seq = torch.cat([prompt, out.tokens[b]]).unsqueeze(0)
            with torch.no_grad():
                allowed = torch.isfinite(processed_logits(target(seq)[0, len(prompt) - 1: -1], params))
            assert allowed.gather(-1, out.tokens[b, :, None]).all(), f"k={k}, row {b}"
            if params.top_k:
                assert (allowed.sum(-1) == params.top_k).all()


def test_load_weights_refreshes_in_place():
    old_target, old_draft = _models(vocab=6, draft_vocab=5, seed=0)
    new_target, new_draft = _models(vocab=6, draft_vocab=5, seed=10)
    engine = RolloutEngine(old_target, old_draft, max_batch_size=4, max_seq_len=24, max_draft_tokens=2)
    caches = (engine.target_pool.k.data_ptr(), engine.draft_pool.k.data_ptr())
    prompts = _prompts([3, 5, 2], 6)
    params = SamplingParams(temperature=0, max_new_tokens=12)
    before = engine.generate(prompts, params)
    engine.load_weights(new_target.state_dict(), new_draft.state_dict())
    after = engine.generate(prompts, params)
    fresh = RolloutEngine(new_target, new_draft, max_batch_size=4, max_seq_len=24, max_draft_tokens=2)
    assert torch.equal(after.tokens, fresh.generate(prompts, params).tokens)
    assert not torch.equal(after.tokens, before.tokens)
    assert (engine.target_pool.k.data_ptr(), engine.draft_pool.k.data_ptr()) == caches
    with pytest.raises(KeyError, match="missing"):
        engine.load_weights({k: v for k, v in new_target.state_dict().items() if "layers.0." not in k})


def _load_sharded_rank(rank, world_size, flavor):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.set_num_threads(1)
    trained = _models(vocab=6, draft_vocab=5, seed=10, flavor=flavor)
    expected = [{k: v.clone() for k, v in m.state_dict().items()} for m in trained]
    mesh = init_device_mesh("cpu", (world_size,))
    for module in trained:
        for layer in getattr(module, "layers", ()):
            fully_shard(layer, mesh=mesh)
        fully_shard(module, mesh=mesh)
    engine = RolloutEngine.from_models(*trained, device="cpu", max_batch_size=2, max_seq_len=16, max_draft_tokens=2)
    for module, source, reference in zip((engine.policy, engine.draft), trained, expected):
        for name, tensor in module.state_dict().items():
            torch.testing.assert_close(tensor, reference[name], rtol=0, atol=0, msg=name)
        assert torch.equal(module.rope_inv_freq, source.rope_inv_freq)  # in no state dict: recomputed


@pytest.mark.parametrize("flavor", [DENSE, MOE], ids=["dense", "moe"])
def test_an_engine_built_from_fsdp_sharded_models_holds_their_weights(flavor):
    """Every tensor of the state dicts, a mixture of experts' ``[E, ...]`` expert stacks
    (sharded over experts) and routers included."""
    run_on_ranks(_load_sharded_rank, 2, flavor)


def test_a_bf16_copy_of_a_mixture_of_experts_tallies_its_experts_in_fp32():
    """torchtitan's per-expert tallies (a buffer in no state dict) start at zero in fp32 in a
    copy materialised uninitialised in bf16, and count every routed token of every forward."""
    target, draft = _models(vocab=6, draft_vocab=5, seed=4, flavor=MOE)
    engine = RolloutEngine.from_models(target, draft, device="cpu", dtype=torch.bfloat16, max_batch_size=4,
                                       max_seq_len=24, max_draft_tokens=2)
    assert engine.policy.layers[1].mlp.experts.w1.dtype == torch.bfloat16
    tallies = [layer.mlp.tokens_per_expert for layer in engine.policy.layers if layer.sparse]
    assert len(tallies) == 3 and all(t.dtype == torch.float32 and not t.any() for t in tallies)
    out = engine.generate(_prompts([3, 5, 2], 6), SamplingParams(temperature=0, max_new_tokens=8), draft_tokens=2)
    assert out.response_lens.sum() > 0
    routed = {float(t.sum()) for t in tallies}  # top_k per token forwarded, the same in every layer
    assert len(routed) == 1 and routed.pop() % target.args.top_k == 0


def test_rollout_progress_bar_draws_after_its_delay_and_clears():
    import io

    from titan_cotrain.rl.progress import RolloutProgress

    quiet = RolloutProgress(delay_s=3600, stream=io.StringIO())
    quiet(1, 4)
    quiet.close()
    assert quiet.stream.getvalue() == ""
    bar = RolloutProgress(delay_s=0, interval_s=0, stream=io.StringIO())
    bar(1, 4)
    bar(4, 4)
    bar.close()
    text = bar.stream.getvalue()
    assert "   1/4 responses" in text and "   4/4 responses" in text and text.endswith("\r\033[K")



def test_requests_the_engine_cannot_hold_fail_with_the_limits():
    target, draft = _models()
    engine = RolloutEngine(target, draft, max_batch_size=2, max_seq_len=16, max_draft_tokens=2)
    params = SamplingParams(temperature=0, max_new_tokens=8)
    with pytest.raises(ValueError, match=r"longest prompt \(9\) \+ max_new_tokens \(8\) exceeds .* max_seq_len 16"):
        engine.generate(_prompts([3, 9], target.args.vocab_size), params)
    with pytest.raises(ValueError, match=r"draft_tokens must be in 0..2"):
        engine.generate(_prompts([3], target.args.vocab_size), params, draft_tokens=3)
    assert engine.generate(_prompts([3, 8], target.args.vocab_size), params).tokens.shape[0] == 2  # 8 + 8 fits
