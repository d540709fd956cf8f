"""Stop tokens (``SamplingParams.stop_token_ids``): a response ends at its first EOS or stop id,
kept as its last token, on every engine path. A stop inside an accepted draft prefix ends the
sequence there: greedy speculative decoding stays plain greedy decoding token for token, and
sampled responses keep the target's law (the chi-square test of ``test_rollout.py``)."""

import functools

import pytest
import torch
import torch.nn.functional as F

from tests.engine.test_rollout import N_SAMPLES, _eos_for_some_rows, _first_tokens_test, _prompts
from titan_cotrain.engine.rollout import RolloutEngine
from titan_cotrain.engine.sampling import SamplingParams

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

K, NEW_TOKENS, SEQ_LEN = 3, 40, 64


class RoundTrace(RolloutEngine):
    """Records every speculative round: ``(output row, response length before the round,
    drafted tokens accepted)`` of each row it decodes."""

    rounds: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]

    def start(self, *args, **kwargs):
        self.rounds = []
        return super().start(*args, **kwargs)

    def _speculative_round(self, seqs, *args, **kwargs):
        active = seqs.active.clone()
        out_row, before = seqs.out_row[active].clone(), seqs.response_len[active].clone()
        accepted = super()._speculative_round(seqs, *args, **kwargs)
        self.rounds.append((out_row, before, accepted[active].clone()))
        return accepted


def _cut_at_stops(tokens: torch.Tensor, stops: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(response_lens, finished)`` that responses ``tokens [B, N]``, generated without stops,
    get under ``stops``: through their first stop token, else all ``N``."""
    hit = torch.isin(tokens, torch.tensor(stops))
    finished = hit.any(1)
    return torch.where(finished, hit.long().argmax(1) + 1, tokens.shape[1]), finished


def _late_stops(tokens: torch.Tensor, n: int) -> tuple[int, ...]:
    """``n`` stop ids that end the responses ``tokens [B, N]`` as late as they can: in turn,
    of the tokens in the rows no earlier pick ends, the one that first occurs latest (its
    earliest first occurrence over those rows)."""
    hits = F.one_hot(tokens, int(tokens.max()) + 1).bool()  # [B, N, V]
    first = torch.where(hits.any(1), hits.long().argmax(1), -1)  # [B, V]: -1 where absent
    running, stops = torch.ones(len(tokens), dtype=torch.bool), []
    for _ in range(n):
        earliest = first[running].where(first[running] >= 0, tokens.shape[1]).amin(0)
        earliest[earliest == tokens.shape[1]] = -1  # in no running row
        stops.append(int(earliest.argmax()))
        running &= first[:, stops[-1]] < 0
    return tuple(stops)


def _stops_in_accepted_drafts(rounds, out) -> int:
    """Responses of ``out`` whose stop token was a drafted token the verify accepted: the
    round that started at response length ``r`` and accepted ``a`` committed it at ``r + j``,
    ``j < a`` (the tokens after it, drafted or drawn, were dropped)."""
    last = out.response_lens - 1
    inside = torch.zeros_like(out.finished)
    for out_row, before, accepted in rounds:
        stop = last[out_row]
        inside[out_row] |= (before <= stop) & (stop < before + accepted)
    return int((inside & out.finished).sum())


def _every_k_in_turn():
    turn = iter(range(10**6))
    return lambda live: next(turn) % (K + 1)


ENGINES = {
    # name: (engine keyword arguments, samples per prompt)
    "paged": (dict(), 1),
    "paged, shared prompts, blocks of 4": (dict(block_size=4), 2),
    "static": (dict(paged=False), 1),
    "compiled": (dict(block_size=4, compile=True), 1),
}


@pytest.mark.parametrize("layout", list(ENGINES))
def test_greedy_speculative_equals_greedy_plain_with_stops_inside_drafts(fitted_pair, layout, monkeypatch):
    """Two stop ids that the greedy text reaches mid-response; the fitted draft is mostly
    right, so most responses meet their stop inside an accepted draft prefix (checked, round
    by round). Every response ends exactly at its first stop, under plain and speculative
    decoding alike (``k`` fixed, and chosen per round with 0 in turn)."""
    target, draft, prompts = fitted_pair
    engine_kwargs, samples = ENGINES[layout]
    if engine_kwargs.get("compile"):  # dynamo's graphs, eager kernels: seconds on CPU
        monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="eager"))
    engine = RoundTrace(target, draft, max_batch_size=16, max_seq_len=SEQ_LEN, max_draft_tokens=K, **engine_kwargs)
    free = engine.generate(prompts, SamplingParams(temperature=0, max_new_tokens=NEW_TOKENS), draft_tokens=0)
    stops = _late_stops(free.tokens, 2)
    lens, finished = _cut_at_stops(free.tokens, stops)
    assert finished.all() and (lens > 6).all(), f"the stops should end every response mid-way: {lens.tolist()}"
    mask = torch.arange(NEW_TOKENS) < lens.unsqueeze(1)
    expected_tokens, expected_logprobs = free.tokens * mask, free.logprobs * mask

    params = SamplingParams(temperature=0, max_new_tokens=NEW_TOKENS, stop_token_ids=stops)
    for draft_tokens in (0, K, _every_k_in_turn()):
        out = engine.generate(prompts, params, samples_per_prompt=samples, draft_tokens=draft_tokens)
        assert torch.equal(out.tokens, expected_tokens.repeat_interleave(samples, 0)), draft_tokens
        assert torch.equal(out.response_lens, lens.repeat_interleave(samples))
        assert torch.equal(out.finished, finished.repeat_interleave(samples))
        torch.testing.assert_close(out.logprobs, expected_logprobs.repeat_interleave(samples, 0), rtol=1e-4,
                                   atol=1e-4)
        if draft_tokens == K:
            inside = _stops_in_accepted_drafts(engine.rounds, out)
            assert inside >= out.finished.sum() // 2, f"{inside} of {int(out.finished.sum())} stops in drafts"


def test_speculative_sampling_is_lossless_with_a_stop_token():
    """Token 4 ends more than half the responses within their first 4 tokens."""
    assert _first_tokens_test(SamplingParams(temperature=1.0, stop_token_ids=(4,)), k=2, n_samples=N_SAMPLES) > 1e-3


@pytest.mark.parametrize("draft_tokens", [0, K])
def test_a_stop_id_ends_a_response_as_the_eos_does(models, draft_tokens):
    """Greedy, an EOS and a stop id: some responses end at the stop id, some at the EOS
    (``finished`` either way), the rest run to ``max_new_tokens`` (not ``finished``)."""
    target, draft = models
    prompts = _prompts([3, 9, 5, 1, 7, 4, 6, 2], 128, seed=1)
    engine = RolloutEngine(target, draft, max_batch_size=8, max_seq_len=32, max_draft_tokens=K)
    free = engine.generate(prompts, SamplingParams(temperature=0, max_new_tokens=20), draft_tokens=0)
    stop = _eos_for_some_rows(free.tokens)
    without_stop = ~torch.isin(free.tokens, stop).any(1)
    eos = _eos_for_some_rows(free.tokens[without_stop], other_than=stop)
    params = SamplingParams(temperature=0, max_new_tokens=20, eos_token_id=eos, stop_token_ids=(stop,))
    out = engine.generate(prompts, params, draft_tokens=draft_tokens)
    lens, finished = _cut_at_stops(free.tokens, (eos, stop))
    assert torch.equal(out.response_lens, lens) and torch.equal(out.finished, finished)
    last = out.tokens.gather(1, (out.response_lens - 1).unsqueeze(1)).squeeze(1)
    assert (last[out.finished] == stop).any() and (last[out.finished] == eos).any()
    assert (~out.finished).any() and (out.response_lens[~out.finished] == 20).all()


@pytest.mark.parametrize("draft_tokens", [0, K])
@pytest.mark.parametrize("paged", [True, False], ids=["paged", "static"])
def test_sampled_responses_end_at_their_first_stop(models, paged, draft_tokens):
    """Sampled: no response holds a stop token before its last, a finished one ends with one,
    an unfinished one is ``max_new_tokens`` long."""
    target, draft = models
    prompts = _prompts([3, 9, 5, 1, 7, 4, 6, 2], 128, seed=2)
    engine = RolloutEngine(target, draft, max_batch_size=8, max_seq_len=32, max_draft_tokens=K, paged=paged)
    free = engine.generate(prompts, SamplingParams(max_new_tokens=16), samples_per_prompt=4, draft_tokens=0,
                           generator=torch.Generator().manual_seed(0))
    counts = torch.bincount(free.tokens[:, 4:].flatten(), minlength=128)
    stops = tuple(counts.topk(2).indices.tolist())
    params = SamplingParams(max_new_tokens=16, stop_token_ids=stops)
    out = engine.generate(prompts, params, samples_per_prompt=4, draft_tokens=draft_tokens,
                          generator=torch.Generator().manual_seed(1))
    stop = torch.isin(out.tokens, torch.tensor(stops)) & out.response_mask()
    last = torch.arange(16) == (out.response_lens - 1).unsqueeze(1)
    assert not (stop & ~last).any()
    assert torch.equal(out.finished, (stop & last).any(1))
    assert (out.response_lens[~out.finished] == 16).all()
    assert out.finished.any() and (~out.finished).any()


@pytest.mark.parametrize("ids", [(-1,), (3, -2), (1.0,), (True,), ("5",)])
def test_stop_ids_must_be_non_negative_ints(ids):
    with pytest.raises(ValueError, match="stop_token_ids must be non-negative int token ids"):
        SamplingParams(stop_token_ids=ids)


def test_stops_are_the_eos_and_the_stop_ids_once_each():
    params = SamplingParams(eos_token_id=7, stop_token_ids=[3, 7, 3])
    assert params.stop_token_ids == (3, 7, 3) and params.stops == (7, 3)
    assert SamplingParams().stops == () and SamplingParams(eos_token_id=0).stops == (0,)


def test_the_engine_refuses_stop_ids_outside_its_vocabulary(models):
    target, draft = models
    engine = RolloutEngine(target, draft, max_batch_size=2, max_seq_len=16, max_draft_tokens=K)
    with pytest.raises(ValueError, match=r"stop_token_ids \[128, 300\] are outside the policy's vocabulary of 128"):
        engine.generate([[1, 2]], SamplingParams(max_new_tokens=4, stop_token_ids=(5, 128, 300)))
    assert engine.generate([[1, 2]], SamplingParams(max_new_tokens=4, stop_token_ids=(127,))).tokens.shape == (1, 4)
