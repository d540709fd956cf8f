"""Drafting reads what training wrote: the engine's acceptance, round by round, is the
training code's own accuracy on the same sequences.

Under greedy decoding an accepted draft token is the true next token, so a drafting round
at anchor ``i`` of a sequence sees exactly the inputs of the TTT unroll at anchor ``i`` on
the finished sequence (``Draft.forward``, the passes ``ttt_unroll`` scores): the engine
accepts ``a`` drafted tokens iff the unroll's first ``a`` passes at ``i`` predict the next
tokens and pass ``a + 1`` does not (``a`` capped at ``k``). On CPU in fp32 the counts agree
exactly, round for round, on every engine path. Losslessness and greedy equality
(``test_rollout.py``) hold whatever the draft computes; this is the test that notices a
draft fed the wrong keys (e.g. samples of a shared prompt reading a stale block).

The pair is the rollout benchmark's (``fitted_pair``, ``conftest.py``): a target fitted to a
phrase language and a draft fitted to it by TTT, so that acceptance is high and any wrong
key shows.
"""

import functools

import pytest
import torch

from tests.multiprocess import run_on_ranks
from titan_cotrain.data.packing import layout_from_cu_seqlens
from titan_cotrain.models.args import model_args_for
from titan_cotrain.models.draft import Draft, DraftArgs
from titan_cotrain.models.transformer import Transformer
from titan_cotrain.engine.kv_budget import kv_bytes_per_sequence
from titan_cotrain.engine.rollout import RolloutEngine
from titan_cotrain.engine.sampling import SamplingParams

VOCAB, K_MAX, NEW_TOKENS, SEQ_LEN = 128, 6, 40, 64
PARAMS = SamplingParams(temperature=0, max_new_tokens=NEW_TOKENS)


class TracingEngine(RolloutEngine):
    """Records every drafting round: ``(output row, anchor, accepted)`` of each active row."""

    rounds: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]

    def generate(self, *args, **kwargs):
        self.rounds = []
        return super().generate(*args, **kwargs)

    def _speculative_round(self, seqs, *args, **kwargs):
        active = seqs.active.clone()
        out_row, anchor = seqs.out_row[active].clone(), (seqs.length - 2)[active].clone()
        accepted = super()._speculative_round(seqs, *args, **kwargs)
        self.rounds.append((out_row, anchor, accepted[active].clone()))
        return accepted


def _packed_target_forward(target: Transformer, sequences: list[torch.Tensor]):
    """``(cu_seqlens, tokens [1, T], positions, the target's TargetOutput)``: one packed forward
    over ``sequences`` with the taps, as the trainer runs it."""
    lengths = [s.numel() for s in sequences]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    tokens = torch.cat(sequences).unsqueeze(0)
    positions = layout_from_cu_seqlens(cu, 1, cu[-1].item()).positions
    with torch.no_grad():
        return cu, tokens, positions, target(tokens, cu_seqlens=cu.tolist(), positions=positions, return_taps=True)


def unroll_correct(target: Transformer, draft: Draft, sequences: list[torch.Tensor], depth: int) -> list[torch.Tensor]:
    """Per sequence, ``bool [depth, n]``: TTT pass ``d`` at anchor ``i`` predicts ``x_{i+d+1}``
    (False where that token is past the end), from one packed forward of the target and the
    draft's unroll over all the sequences, as the trainer runs them."""
    cu, tokens, positions, out = _packed_target_forward(target, sequences)
    with torch.no_grad():
        taps = torch.cat(out.taps, -1)[0]
        select = torch.ones(depth, tokens.shape[1], dtype=torch.bool)
        logits = draft(taps, out.embeddings[0], tokens[0], positions[0], cu.tolist(), select)
    predicted = torch.stack([draft.d2t[lg.argmax(-1)] + lg.argmax(-1) for lg in logits])  # [depth, T] target ids
    result = []
    for seq, start in zip(sequences, cu[:-1].tolist()):
        n = seq.numel()
        correct = torch.zeros(depth, n, dtype=torch.bool)
        for d in range(1, depth + 1):
            if n - d - 1 > 0:
                correct[d - 1, : n - d - 1] = predicted[d - 1, start: start + n - d - 1] == seq[d + 1:]
        result.append(correct)
    return result


def check_rounds(engine: TracingEngine, target, draft, prompts, out, samples: int, k: int) -> float:
    """Every round's accepted count equals the unroll's leading correct passes at its anchor;
    returns the mean accepted per round (so a caller can see the pair drafts well)."""
    sequences = [torch.cat([prompts[b // samples], out.tokens[b, : int(out.response_lens[b])]])
                 for b in range(out.tokens.shape[0])]
    correct = unroll_correct(target, draft, sequences, k)
    mismatches, total, accepted_sum = [], 0, 0
    for out_row, anchor, accepted in engine.rounds:
        for b, i, a in zip(out_row.tolist(), anchor.tolist(), accepted.tolist()):
            n = sequences[b].numel()
            checkable = min(k, n - (i + 2))  # drafted tokens x_{i+2} .. x_{i+1+k} inside the sequence
            leading = int(correct[b][:checkable, i].long().cumprod(0).sum())
            total += 1
            accepted_sum += a
            if min(a, checkable) != leading:
                mismatches.append(f"sequence {b} anchor {i}: engine accepted {a}, TTT passes right {leading}")
    assert total > 0, "the engine ran no drafting round"
    assert not mismatches, f"{len(mismatches)} of {total} rounds differ:\n" + "\n".join(mismatches[:10])
    return accepted_sum / total


CASES = {
    # name: (engine keyword arguments, samples per prompt, k)
    "paged, G=1": (dict(block_size=16), 1, 3),
    "paged, G=8, blocks of 16": (dict(block_size=16), 8, 3),
    "paged, G=8, blocks of 4": (dict(block_size=4), 8, 3),
    "paged, G=8, blocks of 1": (dict(block_size=1), 8, 3),
    "static, G=1": (dict(paged=False), 1, 3),
    "static, G=8": (dict(paged=False), 8, 3),
    **{f"paged, G=8, k={k}": (dict(block_size=4), 8, k) for k in (1, 2, 4, 5, 6)},
    # 12 rows for 32 sequences and blocks for 6 at their longest: groups wait, enter as rows
    # and blocks free up, and a group of 4 can be split.
    "continuous batching": (dict(block_size=4, max_batch_size=12, kv_blocks_for=6), 4, 3),
    # Blocks for 2 sequences at their longest and 12 rows: sequences are preempted and
    # recomputed (target KV and draft trunk rebuilt from their committed tokens).
    "preemption": (dict(block_size=4, max_batch_size=12, kv_blocks_for=2), 4, 3),
}


def _engine(target, draft, engine_kwargs: dict, cls=TracingEngine, **extra) -> RolloutEngine:
    kwargs = dict(max_batch_size=64, max_seq_len=SEQ_LEN, max_draft_tokens=K_MAX) | engine_kwargs | extra
    sequences = kwargs.pop("kv_blocks_for", 0)
    if sequences:
        kwargs["kv_cache_gib"] = sequences * kv_bytes_per_sequence(target.args, draft.args, SEQ_LEN, K_MAX,
                                                                   torch.float32) / 2**30
    return cls.from_models(target, draft, device="cpu", **kwargs)


@pytest.mark.parametrize("case", list(CASES))
def test_engine_acceptance_is_the_ttt_accuracy(fitted_pair, case):
    target, draft, prompts = fitted_pair
    engine_kwargs, samples, k = CASES[case]
    engine = _engine(target, draft, engine_kwargs)
    out = engine.generate(prompts, PARAMS, samples_per_prompt=samples, draft_tokens=k)
    mean_accepted = check_rounds(engine, target, draft, prompts, out, samples, k)
    if case == "preemption":  # the recomputed keys are read, not only written
        assert out.stats.preemptions > 0 and out.stats.recomputed_tokens > 0
    if "kv_blocks_for" not in engine_kwargs:  # blocks for every row at its longest
        assert out.stats.preemptions == 0
    # The pair drafts well, so a draft reading wrong keys cannot agree by accident.
    assert mean_accepted > 0.6 * k, f"the fitted draft accepts only {mean_accepted:.2f} of {k} per round"


def test_acceptance_survives_a_dirty_pool(fitted_pair):
    """A second call on the same engine (pools holding the first call's keys) accepts what a
    fresh engine does: nothing a rollout leaves behind is read by the next."""
    target, draft, prompts = fitted_pair
    engine = _engine(target, draft, dict(block_size=4))
    engine.generate(prompts[::-1], PARAMS, samples_per_prompt=8, draft_tokens=3)
    out = engine.generate(prompts, PARAMS, samples_per_prompt=8, draft_tokens=3)
    check_rounds(engine, target, draft, prompts, out, 8, 3)
    fresh = _engine(target, draft, dict(block_size=4))
    again = fresh.generate(prompts, PARAMS, samples_per_prompt=8, draft_tokens=3)
    assert torch.equal(out.tokens, again.tokens)
    assert out.stats.acceptance_length == again.stats.acceptance_length


def test_compiled_engine_acceptance_is_the_ttt_accuracy(fitted_pair, monkeypatch):
    """The compiled engine's own schedule (every row decoded, whole-sequence block tables,
    free rows riding along) under dynamo. Its ``eager`` backend keeps this to seconds on CPU;
    inductor's kernels are ``tests/parallel/test_compile.py``'s subject."""
    target, draft, prompts = fitted_pair
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="eager"))
    engine = _engine(target, draft, dict(block_size=4, max_batch_size=16), compile=True)
    out = engine.generate(prompts[:4], PARAMS, samples_per_prompt=4, draft_tokens=2)
    check_rounds(engine, target, draft, prompts[:4], out, 4, 2)


def unroll_overlap(target: Transformer, draft: Draft, sequences: list[torch.Tensor]) -> list[torch.Tensor]:
    """Per sequence, float64 ``[n]``: at anchor ``i``, ``sum_x min(p(x), q(x))`` of the
    target's distribution for ``x_{i+2}`` (its logits at ``i + 1``) and TTT pass 1's draft
    distribution at ``i`` (mapped to target ids); 0 where ``x_{i+2}`` is past the end. A
    brute-force float64 reference, independent of ``chunked_soft_ce``'s."""
    cu, tokens, positions, out = _packed_target_forward(target, sequences)
    with torch.no_grad():
        select = torch.ones(1, tokens.shape[1], dtype=torch.bool)
        [draft_logits] = draft(torch.cat(out.taps, -1)[0], out.embeddings[0], tokens[0], positions[0], cu.tolist(),
                               select)
    p = out.logits[0].double().softmax(-1)
    q = torch.zeros_like(p)
    q[:, torch.arange(draft.args.draft_vocab_size) + draft.d2t] = draft_logits.double().softmax(-1)
    result = []
    for start, n in zip(cu[:-1].tolist(), (len(seq) for seq in sequences)):
        overlap = torch.zeros(n, dtype=torch.float64)
        overlap[: n - 2] = torch.minimum(p[start + 1: start + n - 1], q[start: start + n - 2]).sum(-1)
        result.append(overlap)
    return result


def test_sampled_acceptance_is_the_ttt_acceptance_chance(fitted_pair):
    """Under speculative sampling (temperature 1, one drafted token a round) the round at anchor
    ``i`` accepts with probability ``sum_x min(p, q)`` of the same distributions the TTT pass
    scores at ``i``: over all rounds, the accepted count is that sum's total within 4 standard
    deviations of the Poisson-binomial law, while the top-1 agreement rate the greedy test
    reads is a worse prediction here."""
    target, draft, prompts = fitted_pair
    engine = _engine(target, draft, dict(block_size=4))
    params = SamplingParams(temperature=1.0, max_new_tokens=NEW_TOKENS)
    out = engine.generate(prompts, params, samples_per_prompt=8, draft_tokens=1,
                          generator=torch.Generator().manual_seed(0))
    sequences = [torch.cat([prompts[b // 8], out.tokens[b, : int(out.response_lens[b])]])
                 for b in range(out.tokens.shape[0])]
    overlap, correct = unroll_overlap(target, draft, sequences), unroll_correct(target, draft, sequences, 1)
    accepted = chance = variance = top1 = 0.0
    rounds = 0
    for out_row, anchor, taken in engine.rounds:
        for b, i, a in zip(out_row.tolist(), anchor.tolist(), taken.tolist()):
            if i + 2 >= sequences[b].numel():  # the drafted token fell past the sequence's end
                continue
            rounds, accepted = rounds + 1, accepted + a
            chance, variance = chance + overlap[b][i].item(), variance + overlap[b][i].item() * (1 - overlap[b][i].item())
            top1 += float(correct[b][0, i])
    assert rounds > 500, rounds
    z = (accepted - chance) / variance ** 0.5
    assert abs(z) < 4, f"accepted {accepted:.0f} of {rounds} rounds, the TTT acceptance chance predicts {chance:.1f} (z = {z:.2f})"
    # The control: the greedy predictor misses by more (a sampled token need not be the argmax).
    assert abs(accepted - top1) > abs(accepted - chance), (accepted, top1, chance)


def _tp_acceptance(rank: int, world_size: int, states, prompts) -> None:
    from titan_cotrain.parallel.engine_tp import engine_tp_mesh

    target = Transformer(model_args_for("llama3", "debugmodel").replace(vocab_size=VOCAB))
    target.load_state_dict(states[0])
    draft = Draft(DraftArgs.from_target(target.args, n_taps=3))
    draft.load_state_dict(states[1])
    mesh = engine_tp_mesh("cpu", [list(range(world_size))])
    engine = _engine(target, draft, dict(block_size=4), tp_mesh=mesh)
    out = engine.generate(prompts, PARAMS, samples_per_prompt=8, draft_tokens=3)
    check_rounds(engine, target, draft, prompts, out, 8, 3)


@pytest.mark.parametrize("world_size", [2, 4], ids=["kv_heads_split", "kv_heads_replicated"])
def test_tensor_parallel_engine_acceptance_is_the_ttt_accuracy(fitted_pair, world_size):
    """2 ranks split the debug model's 2 KV heads; 4 ranks compute each on two of them, from
    whole k/v projections: either way the draft reads the keys the training code's taps saw."""
    target, draft, prompts = fitted_pair
    assert target.args.n_kv_heads == 2
    run_on_ranks(_tp_acceptance, world_size, (target.state_dict(), draft.state_dict()), prompts[:4])
