"""No engine state outlives a rollout: what the KV pools and the draft's chain slots hold when
``generate`` starts never reaches its results. A fresh process starts with zeroed pools and a
running one with the last rollouts' keys, so this is what makes a resumed job repeat the
uninterrupted one (``tests/test_train.py``); a pool slot is read only after the rollout that
reads it wrote it."""

import pytest
import torch

from titan_cotrain.engine.rollout import RolloutEngine
from titan_cotrain.engine.sampling import SamplingParams

VOCAB, SAMPLES = 128, 4
PARAMS = SamplingParams(temperature=1.0, max_new_tokens=12)


def _rollouts(models, paged: bool, junk: bool):
    """Sampled rollouts (G = 4, k = 3) of prompts ending inside blocks of 4, from a fresh
    engine whose caches hold zeros or, with ``junk``, large random values."""
    engine = RolloutEngine.from_models(*models, device="cpu", max_batch_size=16, max_seq_len=28,
                                       max_draft_tokens=3, block_size=4, paged=paged)
    if junk:
        g = torch.Generator().manual_seed(3)
        for cache in engine.cache_tensors():
            cache.copy_(1e4 * torch.randn(cache.shape, generator=g))
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g) for n in (5, 9, 14, 7)]
    return engine.generate(prompts, PARAMS, samples_per_prompt=SAMPLES, generator=torch.Generator().manual_seed(5))


@pytest.mark.parametrize("paged", [True, False], ids=["paged", "static"])
def test_rollouts_do_not_depend_on_what_the_caches_held(models, paged):
    """Bit for bit: sampled tokens, behaviour log-probs and acceptance. Sampled, because a
    draft that read a stale key proposes other tokens and the draws then differ, where greedy
    output would not (speculative decoding is lossless whatever the draft computes)."""
    clean, dirty = _rollouts(models, paged, junk=False), _rollouts(models, paged, junk=True)
    assert torch.equal(clean.tokens, dirty.tokens)
    assert torch.equal(clean.logprobs, dirty.logprobs)
    assert clean.stats.acceptance_length == dirty.stats.acceptance_length
    assert clean.stats.acceptance_rate == dirty.stats.acceptance_rate


def test_a_rollout_leaves_its_caches_zeroed(models):
    """What a rollout wrote, even a non-finite key, is gone when it returns: masked slots are
    never read, but 0 * inf in a masked product would poison the next rollout."""
    engine = RolloutEngine.from_models(*models, device="cpu", max_batch_size=16, max_seq_len=28,
                                       max_draft_tokens=3, block_size=4)
    for cache in engine.cache_tensors():
        cache.fill_(float("inf"))
    prompts = [torch.arange(1, n + 1) for n in (5, 9)]
    engine.generate(prompts, PARAMS, samples_per_prompt=SAMPLES, generator=torch.Generator().manual_seed(5))
    assert all(not cache.any() for cache in engine.cache_tensors())
    out = engine.generate(prompts, PARAMS, samples_per_prompt=SAMPLES, generator=torch.Generator().manual_seed(5))
    assert torch.isfinite(out.logprobs).all()


def test_a_compiled_engine_leaves_dynamos_recompile_limit_as_it_found_it(models, monkeypatch):
    """The compiled steps keep a graph per ``k`` (more than dynamo's limit may allow): the
    limit is raised while a step runs, and the process's setting is the same after the
    engine's construction and after a rollout. (An identity ``torch.compile`` here: what
    dynamo makes of the steps is ``test_acceptance.py``'s subject.)"""
    seen = []

    def compile_(fn, **kwargs):
        def step(*args, **kw):
            seen.append(torch._dynamo.config.recompile_limit)
            return fn(*args, **kw)

        return step

    monkeypatch.setattr(torch, "compile", compile_)
    with torch._dynamo.config.patch(recompile_limit=3):
        engine = RolloutEngine.from_models(*models, device="cpu", max_batch_size=8, max_seq_len=28,
                                           max_draft_tokens=3, block_size=4, compile=True)
        assert torch._dynamo.config.recompile_limit == 3
        engine.generate([torch.arange(1, 6)], PARAMS, samples_per_prompt=2, generator=torch.Generator().manual_seed(5))
        assert torch._dynamo.config.recompile_limit == 3
    assert seen and set(seen) == {2 * (3 + 2)}
