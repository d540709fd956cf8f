"""The rollout engine's memory: its own copies built from the trainer's models (meta, then
one tensor at a time), a KV budget that sizes the block pool (or the static layout's rows),
continuous batching and waves under a budget, prompt blocks shared by a group, decode
attention that never repeats K/V off CPU, and the whole engine on the simulated accelerator
(bf16, fake tensors, vocabulary maps on the device, KV bytes as counted)."""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor

from tests.engine.test_rollout import _eos_for_some_rows, _models, _prompts
from titan_cotrain.models import kv_cache
from titan_cotrain.models.args import model_args_for
from titan_cotrain.models.draft import Draft, DraftArgs, DraftKVCache
from titan_cotrain.models.draft_vocab import draft_vocab_from_counts
from titan_cotrain.models.transformer import Transformer
from titan_cotrain.engine.kv_budget import kv_bytes_per_position, kv_bytes_per_sequence
from titan_cotrain.engine.rollout import RolloutEngine
from titan_cotrain.engine.sampling import SamplingParams
from titan_cotrain.simulate.device import SimulatedDevice, sim_device

GIB = 2**30


# Tiny models are launch-bound: one intra-op thread, so shared cores do not spin-wait.
pytestmark = pytest.mark.usefixtures("one_intra_op_thread")


def _kv_bytes(engine: RolloutEngine) -> int:
    return sum(t.numel() * t.element_size() for t in engine.cache_tensors())


def _per_position(target_args, draft_args, itemsize: int) -> int:
    """Counted by hand: keys and values of target layers x kv heads x head dim, and of the
    draft's kv heads x head dim."""
    return 2 * (target_args.n_layers * target_args.n_kv_heads * target_args.head_dim
                + draft_args.n_kv_heads * draft_args.head_dim) * itemsize


def _chain(draft_args, k: int, itemsize: int) -> int:
    """One row's draft chain: keys and values of k - 1 slots."""
    return 2 * draft_args.n_kv_heads * draft_args.head_dim * (k - 1) * itemsize


def _per_sequence(target_args, draft_args, max_seq_len: int, k: int, itemsize: int) -> int:
    """One sequence at its longest: S + k + 1 positions and its chain."""
    return (max_seq_len + k + 1) * _per_position(target_args, draft_args, itemsize) + _chain(draft_args, k, itemsize)


def test_from_models_copies_weights_and_generates_like_the_models():
    """fp32 on CPU: an engine built from the models decodes exactly what an engine around
    the models themselves decodes, greedy and sampled; the sources are left alone and the
    copies share nothing with them but keep their own tied embeddings tied."""
    target, draft = _models(vocab=6, draft_vocab=5)
    engine = RolloutEngine.from_models(target, draft, device="cpu", max_batch_size=6, max_seq_len=30,
                                       max_draft_tokens=3)
    reference = RolloutEngine(target, draft, max_batch_size=6, max_seq_len=30, max_draft_tokens=3)
    assert engine.policy is not target and engine.draft is not draft
    assert engine.policy.embed_tokens.weight.dtype == torch.float32
    assert torch.equal(engine.draft.d2t, draft.d2t) and torch.equal(engine.draft.t2d, draft.t2d)
    assert torch.equal(engine.policy.rope_inv_freq, target.rope_inv_freq)
    assert engine.policy.rope_inv_freq.dtype == torch.float32
    prompts = _prompts([2, 8, 5, 1, 6, 3], 6, seed=1)
    for params in (SamplingParams(temperature=0, max_new_tokens=16),
                   SamplingParams(temperature=0.7, max_new_tokens=16, eos_token_id=5)):
        for k in (0, 3):
            got, want = (e.generate(prompts, params, draft_tokens=k, generator=torch.Generator().manual_seed(0))
                         for e in (engine, reference))
            assert torch.equal(got.tokens, want.tokens) and torch.equal(got.logprobs, want.logprobs)

    tied = Transformer(model_args_for("qwen3", "debugmodel"))
    tied.init_weights(generator=torch.Generator().manual_seed(0))
    copy = RolloutEngine.from_models(tied, device="cpu", max_batch_size=1, max_seq_len=8).policy
    assert copy.lm_head.weight is copy.embed_tokens.weight
    assert torch.equal(copy.lm_head.weight, tied.lm_head.weight)


def test_kv_cache_gib_sizes_the_caches():
    """Static layout: rows of a whole sequence each, as many as the budget holds. Paged:
    blocks of 16 positions, as many as the budget holds beside the rows' chains (or enough
    for every row at its longest, plus the scratch block); a budget below one sequence is
    refused with the numbers."""
    target, draft = _models()
    per_sequence = _per_sequence(target.args, draft.args, 40, 3, itemsize=4)
    per_position, chain = _per_position(target.args, draft.args, 4), _chain(draft.args, 3, 4)
    assert kv_bytes_per_sequence(target.args, draft.args, 40, 3, torch.float32) == per_sequence
    assert kv_bytes_per_position(target.args, draft.args, torch.float32) == per_position

    def engine(paged, gib=0.0):
        return RolloutEngine(target, draft, max_batch_size=8, max_seq_len=40, max_draft_tokens=3, paged=paged,
                             kv_cache_gib=gib)

    whole = engine(paged=False)
    assert whole.max_batch_size == 8 and _kv_bytes(whole) == 8 * per_sequence
    budget = engine(paged=False, gib=2.5 * per_sequence / GIB)
    assert budget.max_batch_size == 2 and _kv_bytes(budget) == 2 * per_sequence
    assert engine(paged=False, gib=1.0).max_batch_size == 8

    paged = engine(paged=True)  # 44 positions: 3 blocks a row
    assert paged.max_batch_size == 8 and paged.target_pool.n_blocks == 8 * 3 + 1
    assert _kv_bytes(paged) == 25 * 16 * per_position + 8 * chain
    gib = 2.5 * per_sequence / GIB
    small = engine(paged=True, gib=gib)
    blocks = (int(gib * GIB) - 8 * chain) // (16 * per_position)
    assert small.max_batch_size == 8 and small.target_pool.n_blocks == blocks and _kv_bytes(small) <= gib * GIB
    assert engine(paged=True, gib=1.0).target_pool.n_blocks == 25
    for paged in (False, True):
        with pytest.raises(ValueError, match=rf"\[rollout\] kv_cache_gib = .* holds no sequence: .*\({per_sequence} "
                                             r"bytes: max_seq_len 40 \+ 3 draft tokens \+ 1 positions"):
            engine(paged, gib=0.9 * per_sequence / GIB)


@pytest.mark.parametrize("paged", [True, False], ids=["continuous", "waves"])
@pytest.mark.parametrize("k", [0, 3])
def test_a_budget_below_the_batch_decodes_what_one_batch_decodes(k, paged):
    """Greedy, ragged prompts, an EOS that stops some rows: 7 prompts under a budget of 3.5
    sequences at their longest (paged: admitted by the blocks they use, all 7 decode at once;
    static: waves of 3, 3, 1) give the one-batch result, and acceptance statistics pooled over
    the rounds equal the one batch's (each sequence accepts the same tokens in the same
    rounds). Sampling is not compared: the generator is drawn in another order, so other
    draws, same law."""
    target, draft = _models(vocab=6, draft_vocab=5)
    prompts = _prompts([3, 9, 5, 1, 7, 4, 2], 6)
    one = RolloutEngine(target, draft, max_batch_size=8, max_seq_len=40, max_draft_tokens=3, block_size=4)
    per_sequence = _per_sequence(target.args, draft.args, 40, 3, itemsize=4)
    limited = RolloutEngine(target, draft, max_batch_size=8, max_seq_len=40, max_draft_tokens=3, block_size=4,
                            kv_cache_gib=3.5 * per_sequence / GIB, paged=paged)
    assert limited.max_batch_size == (8 if paged else 3)
    eos = _eos_for_some_rows(one.generate(prompts, SamplingParams(temperature=0, max_new_tokens=24)).tokens)
    params = SamplingParams(temperature=0, max_new_tokens=24, eos_token_id=eos)
    calls = []
    want = one.generate(prompts, params, draft_tokens=k)
    got = limited.generate(prompts, params, draft_tokens=k, progress=lambda done, total: calls.append((done, total)))
    assert want.finished.any() and not want.finished.all()
    for name in ("prompt_lens", "tokens", "response_lens", "finished"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    torch.testing.assert_close(got.logprobs, want.logprobs, rtol=1e-5, atol=1e-5)
    assert got.stats.new_tokens == want.stats.new_tokens
    assert got.stats.acceptance_length == pytest.approx(want.stats.acceptance_length, rel=1e-6)
    assert got.stats.acceptance_rate == pytest.approx(want.stats.acceptance_rate, rel=1e-6)
    if paged:  # every sequence in the running batch from the start, none preempted
        assert got.stats.target_forwards == want.stats.target_forwards and got.stats.preemptions == 0
    else:  # waves wait for room
        assert got.stats.target_forwards > want.stats.target_forwards
    assert 0 < got.stats.kv_peak_bytes <= 3.5 * per_sequence
    # Progress counts the whole call: never falls and ends at 7; waves report 3 after the first.
    assert {t for _, t in calls} == {7} and calls[-1] == (7, 7)
    assert all(a <= b for (a, _), (b, _) in zip(calls, calls[1:]))
    assert paged or (3, 7) in calls


def test_a_group_shares_its_prompt_blocks():
    """G greedy samples of one prompt are one sequence G times. Their prompt's full blocks
    are held once: the peak is G x one sample's, less (G - 1) x the shared blocks, and the
    samples equal a lone sample's."""
    target, draft = _models(vocab=6, draft_vocab=5)
    prompt = _prompts([10], 6, seed=2)
    engine = RolloutEngine(target, draft, max_batch_size=8, max_seq_len=40, max_draft_tokens=3, block_size=4)
    params = SamplingParams(temperature=0, max_new_tokens=12)
    alone = engine.generate(prompt, params)
    group = engine.generate(prompt, params, samples_per_prompt=5)
    assert torch.equal(group.tokens, alone.tokens.expand(5, -1))
    torch.testing.assert_close(group.logprobs, alone.logprobs.expand(5, -1), rtol=1e-5, atol=1e-5)
    shared = (10 - 1) // 4  # blocks wholly before the prompt's last position
    assert group.stats.kv_peak_bytes == 5 * alone.stats.kv_peak_bytes - 4 * shared * engine.kv_block_bytes
    static = RolloutEngine(target, draft, max_batch_size=8, max_seq_len=40, max_draft_tokens=3, paged=False)
    assert torch.equal(static.generate(prompt, params, samples_per_prompt=5).tokens, group.tokens)
    # A pool of 13 blocks (+ scratch) holds two samples at their longest (2 shared + 2 x 5 of
    # 26 positions): the 5 samples start together on their shared blocks, the youngest are
    # preempted as they grow and recomputed later, and every sample is still the lone one.
    chain = 8 * _chain(draft.args, 3, 4)
    small = RolloutEngine(target, draft, max_batch_size=8, max_seq_len=40, max_draft_tokens=3, block_size=4,
                          kv_cache_gib=(14 * engine.kv_block_bytes + chain) / GIB)
    split = small.generate(prompt, params, samples_per_prompt=5)
    assert small.target_pool.n_blocks == 14 and torch.equal(split.tokens, group.tokens)
    assert split.stats.preemptions > 0 and split.stats.kv_peak_bytes <= 13 * engine.kv_block_bytes
    assert split.stats.target_forwards > alone.stats.target_forwards


def test_grouped_decode_attention_equals_sdpa(monkeypatch):
    """The gather path off CPU (query heads of a KV head stacked as rows, fp32 softmax, and
    the lse the draft's chain merge needs) against SDPA with ``enable_gqa`` and a float64
    reference, forced on CPU: one attention call over a cache view with ragged lengths, then
    whole greedy rollouts through the target and the draft."""
    g = torch.Generator().manual_seed(0)
    b, s, hq, hkv, dh, length = 3, 4, 6, 2, 8, 11
    q = torch.randn(b, s, hq, dh, generator=g)
    cache = torch.randn(2, b + 1, hkv, length + 3, dh, generator=g)
    keys, values = cache[0, :b, :, :length], cache[1, :b, :, :length]  # strided, as the engine's views
    seqused = torch.tensor([4, 11, 7])  # row b's query i sits at seqused[b] - s + i
    sdpa = kv_cache.cached_attention(q, keys, values, seqused)
    monkeypatch.setattr(kv_cache, "_use_sdpa", lambda q: False)
    grouped, lse = kv_cache.cached_attention(q, keys, values, seqused, return_lse=True)
    torch.testing.assert_close(grouped, sdpa, rtol=1e-5, atol=1e-5)
    rep = hq // hkv
    scores = torch.einsum("bshd,bhld->bshl", q.double(), keys.double().repeat_interleave(rep, 1)) * dh ** -0.5
    query_pos = seqused.view(b, 1) - s + torch.arange(s)
    scores = scores.masked_fill(torch.arange(length).view(1, 1, 1, -1) > query_pos.view(b, s, 1, 1), float("-inf"))
    want_lse = torch.logsumexp(scores, -1)
    want = torch.einsum("bshl,bhld->bshd", torch.softmax(scores, -1), values.double().repeat_interleave(rep, 1))
    torch.testing.assert_close(lse.double(), want_lse, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grouped.double(), want, rtol=1e-5, atol=1e-5)

    target, draft = _models(draft_vocab=200)
    prompts = _prompts([3, 9, 5, 1], 256, seed=2)
    params = SamplingParams(temperature=0, max_new_tokens=12)
    engine = RolloutEngine(target, draft, max_batch_size=4, max_seq_len=24, max_draft_tokens=3)
    monkeypatch.setattr(kv_cache, "_use_sdpa", lambda q: True)
    want = engine.generate(prompts, params)
    monkeypatch.setattr(kv_cache, "_use_sdpa", lambda q: False)
    got = engine.generate(prompts, params)
    assert torch.equal(got.tokens, want.tokens)
    torch.testing.assert_close(got.logprobs, want.logprobs, rtol=1e-5, atol=1e-5)


def _tiny_models(device) -> tuple[Transformer, Draft]:
    """The llama3 debug model and a reduced-vocabulary draft built on ``device`` (weights
    uninitialised: on the simulated device they are fake anyway)."""
    args = model_args_for("llama3", "debugmodel")
    draft_args = DraftArgs.from_target(args, n_taps=3, draft_vocab_size=200)
    maps = draft_vocab_from_counts(torch.arange(args.vocab_size).float(), 200)
    with torch.device(device):
        return Transformer(args), Draft(draft_args, *(m.to(device) for m in maps))


@pytest.mark.parametrize("source", ["device", "cpu"])
def test_the_engine_on_the_simulated_accelerator(source):
    """From models on the device (the trainer's case) or on the host: bf16 fake copies, the
    draft's vocabulary maps on the device, KV bytes exactly the analytic count, and one
    verify forward, catch-up and chain step through the grouped attention."""
    with SimulatedDevice():
        device = sim_device()
        target, draft = _tiny_models(device if source == "device" else "cpu")
        per_sequence = _per_sequence(target.args, draft.args, 64, 3, itemsize=2)
        gib = 5.5 * per_sequence / GIB
        engine = RolloutEngine.from_models(target, draft, device=device, max_batch_size=8, max_seq_len=64,
                                           max_draft_tokens=3, kv_cache_gib=gib)
        tensors = [*engine.policy.state_dict().values(), *engine.draft.state_dict().values(),
                   engine.policy.rope_inv_freq, engine.draft.rope_inv_freq]
        assert all(isinstance(t, FakeTensor) and t.device == device for t in tensors)
        assert engine.policy.embed_tokens.weight.dtype == engine.draft.fc.weight.dtype == torch.bfloat16
        assert engine.policy.rope_inv_freq.dtype == torch.float32
        assert engine.draft.d2t.device == engine.draft.t2d.device == device
        chain, block = 8 * _chain(draft.args, 3, 2), 16 * _per_position(target.args, draft.args, 2)
        blocks = (int(gib * GIB) - chain) // block
        assert engine.max_batch_size == 8 and engine.target_pool.n_blocks == blocks
        assert _kv_bytes(engine) == blocks * block + chain
        assert engine.target_pool.k.dtype == engine.draft_pool.k.dtype == torch.bfloat16

        start = torch.full((5,), 10, device=device)
        table = torch.arange(1, 11, device=device).view(5, 2)  # 32 positions a row
        target_cache = engine.target_pool.view(table)
        draft_cache = DraftKVCache(engine.draft_pool.view(table), engine.chain_k[:5], engine.chain_v[:5])
        out = engine.policy.forward_cached(torch.zeros(5, 4, dtype=torch.int64, device=device),
                                           target_cache, start, return_taps=True)
        assert out.logits.shape == (5, 4, target.args.vocab_size)
        embeds = engine.draft.embed(None, engine.policy.embed_tokens(torch.zeros(5, 4, dtype=torch.int64,
                                                                                 device=device)))
        hidden = engine.draft.extend(torch.cat(out.taps, -1), embeds, start, draft_cache)
        hidden = engine.draft.chain_step(embeds[:, 0], hidden[:, 0], start, 2, draft_cache)
        assert hidden.shape == (5, draft.args.dim) and hidden.dtype == torch.bfloat16


def test_released_engine_frees_its_memory_and_refuses_to_generate_until_reloaded():
    """``release`` frees weights and caches (what the update phase gets back); generating
    before ``load_weights`` is refused; after it, greedy decoding is the unreleased engine's."""
    import copy as _copy

    import pytest as _pytest

    from titan_cotrain.engine.rollout import RolloutEngine
    from titan_cotrain.engine.sampling import SamplingParams
    from titan_cotrain.models.args import ModelArgs
    from titan_cotrain.models.transformer import Transformer

    policy = Transformer(ModelArgs(dim=32, n_layers=8, n_heads=4, n_kv_heads=2, head_dim=8, ffn_dim=64,
                                   vocab_size=64, max_seq_len=64))
    policy.init_weights(generator=torch.Generator().manual_seed(0))
    engine = RolloutEngine.from_models(policy, None, device="cpu", max_batch_size=2, max_seq_len=32)
    params = SamplingParams(temperature=0.0, max_new_tokens=6)
    before = engine.generate([[1, 2, 3], [4, 5]], params).tokens
    def held(tensors):
        return sum(t.untyped_storage().nbytes() for t in tensors)

    weights = held(engine.policy.parameters())
    assert weights == 4 * sum(p.numel() for p in engine.policy.parameters()) and held(engine.cache_tensors()) > 0
    engine.release()
    assert held(engine.cache_tensors()) == 0 and held(engine.policy.parameters()) == 0
    with _pytest.raises(RuntimeError, match="load_weights first"):
        engine.generate([[1, 2, 3]], params)
    engine.load_weights(_copy.deepcopy(policy).state_dict())
    assert held(engine.policy.parameters()) == weights
    assert torch.equal(engine.generate([[1, 2, 3], [4, 5]], params).tokens, before)
