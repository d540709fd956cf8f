"""The recipe's loss settings against direct computations on hand-made batches: the four
loss aggregations (and their exactness under 1 and 2 microbatches, CP 2 and PP 2 against one
device), the RLOO and unnormalised advantages, DAPO's overlong rules, GSPO's sequence ratio
and its clip, and the entropy metric."""

import math
from datetime import timedelta
from functools import partial

import pytest
import torch
import torch.distributed as dist

from tests.multiprocess import one_thread, run_on_ranks
from titan_cotrain.cotrain.step import forward_backward
from titan_cotrain.data.batch import labels_of
from titan_cotrain.models.args import ModelArgs
from titan_cotrain.models.transformer import Transformer
from titan_cotrain.rl.batching import Sample, pack_samples, sequence_logratios
from titan_cotrain.rl.grpo import AGGREGATIONS, entropy_sum, group_advantages, overlong_penalty, ppo_loss

ARGS = ModelArgs(dim=32, n_layers=8, n_heads=4, n_kv_heads=2, head_dim=8, ffn_dim=64, vocab_size=64)
MAX_NEW = 9
STEP = dict(ttt_steps=3, pass_decay=0.8, draft_loss_weight=0.5)
# Responses of different lengths, so the aggregations differ; prompts of 2-3 tokens.
SHAPES = [(3, 2), (2, 7), (3, 4), (2, 9), (2, 1), (3, 5)]
FP32 = dict(rtol=1e-5, atol=1e-7)  # the loss's log-softmax runs in fp32


def _samples(seed: int = 0) -> list[Sample]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for prompt_len, response_len in SHAPES:
        tokens = torch.randint(1, ARGS.vocab_size, (prompt_len + response_len,), generator=g).tolist()
        logprobs = (-2 - torch.rand(response_len, generator=g)).tolist()
        out.append(Sample(tokens[:prompt_len], tokens[prompt_len:], logprobs, 0.0,
                          float(torch.randn((), generator=g))))
    return out


def _loss(aggregation: str):
    return ppo_loss(0.2, 0.28, aggregation=aggregation, max_new_tokens=MAX_NEW)


def _direct(samples, logits_of, aggregation: str, eps=(0.2, 0.28)) -> torch.Tensor:
    """The aggregation's formula, response by response (float64): ``l_it`` the clipped PPO
    term times the advantage, ``logits_of(i)`` the logits predicting response i's tokens."""
    terms = []
    for i, s in enumerate(samples):
        logp = torch.log_softmax(logits_of(i).double(), -1).gather(1, torch.tensor(s.response)[:, None])[:, 0]
        ratio = torch.exp(logp - torch.tensor(s.logprobs, dtype=torch.float64))
        clipped = ratio.clamp(1 - eps[0], 1 + eps[1])
        terms.append(-torch.minimum(ratio * s.advantage, clipped * s.advantage))
    n, tokens = len(samples), sum(len(s.response) for s in samples)
    if aggregation == "token_mean":
        return sum(t.sum() for t in terms) / tokens
    if aggregation == "seq_mean_token_mean":
        return sum(t.mean() for t in terms) / n
    if aggregation == "seq_mean_token_sum":
        return sum(t.sum() for t in terms) / n
    return sum(t.sum() for t in terms) / (n * MAX_NEW)


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_each_aggregation_is_its_formula(aggregation):
    """``ppo_loss``'s ``loss_sum / norm`` on packed rows equals the formula computed response
    by response from the same logits (float64; the loss computes in fp32), and its value does not depend on the split
    of the rows into pieces (each piece's sums added, as microbatches and ranks are)."""
    samples = _samples()
    batch = pack_samples(samples, seq_len=16, pad_id=0, inv_lens=True)
    logits = torch.randn(*batch.tokens.shape, ARGS.vocab_size, generator=torch.Generator().manual_seed(1),
                         dtype=torch.float64)
    loss_fn = _loss(aggregation)
    whole = loss_fn(logits, labels_of(batch))
    norm = whole.count if whole.norm is None else whole.norm

    # Where each sample landed: its document's rows and positions (pack_samples is first-fit).
    def logits_of(i):
        s = samples[i]
        for r in range(batch.tokens.shape[0]):
            for start in range(batch.tokens.shape[1] - len(s) + 1):
                if batch.tokens[r, start:start + len(s)].tolist() == s.prompt + s.response:
                    p = len(s.prompt)
                    return logits[r, start + p - 1:start + len(s) - 1]
        raise AssertionError(f"sample {i} not packed")

    expected = _direct(samples, logits_of, aggregation)
    torch.testing.assert_close((whole.loss_sum / norm).double(), expected, **FP32)
    # Rows one at a time: the sums add up to the whole's.
    labels = labels_of(batch)
    parts = [loss_fn(logits[r:r + 1], type(labels)(*(None if f is None else f[r:r + 1] for f in vars(labels).values())))
             for r in range(batch.tokens.shape[0])]
    total_norm = sum(p.count if p.norm is None else p.norm for p in parts)
    torch.testing.assert_close((sum(p.loss_sum for p in parts) / total_norm).double(), expected, **FP32)


def test_the_aggregations_differ_on_this_batch():
    """The test above could not tell the modes apart if they agreed here: they do not."""
    samples = _samples()
    logits = torch.randn(16, ARGS.vocab_size, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    values = [float(_direct(samples, lambda i: logits[:len(samples[i].response)], a)) for a in AGGREGATIONS]
    assert len({round(v, 9) for v in values}) == len(values), values


def test_token_mean_needs_no_lengths_and_keeps_its_count():
    batch = pack_samples(_samples(), seq_len=16, pad_id=0)
    assert batch.inv_lens is None
    logits = torch.randn(*batch.tokens.shape, ARGS.vocab_size)
    out = ppo_loss(0.2, 0.2)(logits, labels_of(batch))
    assert out.norm is None and int(out.count) == sum(r for _, r in SHAPES)


def _policy() -> Transformer:
    policy = Transformer(ARGS)
    policy.init_weights(std=0.2, generator=torch.Generator().manual_seed(0))
    return policy.double()


def _grads(policy) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in policy.named_parameters()}


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_two_microbatches_equal_one(aggregation):
    """An update in 2 microbatches (rows split) gives one batch's loss and gradients (fp64
    models, fp32 logits: 1e-6)."""
    batch = pack_samples(_samples(), seq_len=16, pad_id=0, inv_lens=True, rows_multiple_of=2)
    loss_fn = _loss(aggregation)
    results = []
    for rows in (0, batch.tokens.shape[0] // 2):
        policy = _policy()
        metrics = forward_backward(policy, None, batch, loss_fn, microbatch_rows=rows, **STEP)
        results.append((metrics, _grads(policy)))
    (m1, g1), (m2, g2) = results
    for key in m1:
        torch.testing.assert_close(m2[key], m1[key], rtol=1e-6, atol=1e-7, msg=key)
    for name in g1:
        torch.testing.assert_close(g2[name], g1[name], rtol=1e-6, atol=1e-7, msg=name)
    assert any(g.abs().sum() > 0 for g in g1.values())


CP_SEQ = 24


def _cp_batch():
    return pack_samples(_samples(), seq_len=CP_SEQ, pad_id=0, inv_lens=True, pad_to=4)


def _one_device(batch, aggregation: str):
    """The single-device update's metrics and gradients over ``batch``: the reference."""
    policy = _policy()
    metrics = forward_backward(policy, None, batch, _loss(aggregation), **STEP)
    return metrics, _grads(policy)


def _cp_rank(rank, world_size, references):
    from titan_cotrain.parallel.context_parallel import (
        apply_context_parallel,
        cp_forward_scope,
        init_cp_mesh,
        prepare_cp_microbatch,
    )

    mesh = init_cp_mesh(world_size)
    group = mesh.get_group()
    for aggregation, (ref_metrics, ref_grads) in references.items():
        policy = _policy()
        apply_context_parallel(mesh, policy)
        with cp_forward_scope():
            metrics = forward_backward(policy, None, _cp_batch(), _loss(aggregation), group=group,
                                       prepare=partial(prepare_cp_microbatch, group=mesh), **STEP)
        for key, value in ref_metrics.items():
            torch.testing.assert_close(metrics[key], value, rtol=1e-5, atol=1e-6, msg=f"{aggregation} {key}")
        for name, param in policy.named_parameters():
            grad = param.grad.detach().clone()
            dist.all_reduce(grad, group=group)
            torch.testing.assert_close(grad, ref_grads[name], rtol=1e-5, atol=1e-7, msg=f"{aggregation} {name}")


def test_every_aggregation_under_context_parallelism_matches_one_device():
    """CP 2 (zigzag shards: a response's tokens on both ranks) against one device."""
    with one_thread():
        references = {a: _one_device(_cp_batch(), a) for a in AGGREGATIONS}
    run_on_ranks(_cp_rank, 2, references)


PP_ROWS, PP_SEQ = 4, 16


def _pp_batch():
    return pack_samples(_samples() + _samples(1), seq_len=PP_SEQ, pad_id=0, inv_lens=True, rows_multiple_of=PP_ROWS)


def _pp_rank(rank, world_size, references):
    from torch.distributed.device_mesh import init_device_mesh

    from titan_cotrain.parallel.pipeline import PipelineSettings, make_pipeline, pipeline_step, plan_pipeline

    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("pp",))
    for aggregation, (ref_metrics, ref_grads) in references.items():
        loss_fn = _loss(aggregation)
        plan = plan_pipeline(ARGS.n_layers, world_size, "1F1B", layers_per_stage=[4, 4])
        settings = PipelineSettings(microbatch_size=1, n_microbatches=PP_ROWS, seq_len=PP_SEQ,
                                    tap_timeout=timedelta(seconds=60), **STEP)
        pipe = make_pipeline(_policy(), None, mesh, plan, settings, policy_loss_fn=loss_fn)
        metrics = pipeline_step(pipe, _pp_batch(), policy_loss_fn=loss_fn, train_draft=False)
        for key, value in ref_metrics.items():
            torch.testing.assert_close(metrics[key], value.to(metrics[key]), rtol=1e-5, atol=1e-6,
                                       msg=f"{aggregation} {key}")
        for part in pipe.model_parts:
            for name, param in part.named_parameters():
                torch.testing.assert_close(param.grad, ref_grads[name], rtol=1e-5, atol=1e-7,
                                           msg=f"{aggregation} {name}")


def test_every_aggregation_under_pipeline_parallelism_matches_one_device():
    """PP 2 (1F1B, 4 one-row microbatches) against one device."""
    with one_thread():
        references = {a: _one_device(_pp_batch(), a) for a in AGGREGATIONS}
    run_on_ranks(_pp_rank, 2, references)


def test_rloo_and_unnormalised_advantages():
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.5, 2.0, 2.0, 2.0, 2.0])
    rloo = group_advantages(rewards, 4, estimator="rloo")
    for i in range(8):
        group = rewards[(i // 4) * 4:(i // 4) * 4 + 4].tolist()
        others = group[:i % 4] + group[i % 4 + 1:]
        assert rloo[i].item() == pytest.approx(rewards[i].item() - sum(others) / 3, abs=1e-6)
    centred = group_advantages(rewards, 4, normalize_std=False)
    torch.testing.assert_close(centred, torch.tensor([0.5, -0.5, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]))
    normalised = group_advantages(rewards, 4)
    assert normalised[0].item() == pytest.approx(0.5 / (torch.tensor([1.0, 0.0, 0.5, 0.5]).std().item() + 1e-6))
    with pytest.raises(ValueError, match="unknown advantage"):
        group_advantages(rewards, 4, estimator="ppo")


@pytest.mark.parametrize("length,expected", [(1, 0.0), (6, 0.0), (7, -0.25), (8, -0.5), (10, -1.0)])
def test_the_soft_overlong_penalty_is_dapos(length, expected):
    """L = 10, B = 4: free up to 6 tokens, then -1/4 per token, -1 at L."""
    assert overlong_penalty(length, 10, 4) == pytest.approx(expected)


def test_the_overlong_buffer_must_fit_the_budget():
    with pytest.raises(ValueError, match="overlong buffer"):
        overlong_penalty(3, 10, 11)


def test_an_untrained_sample_has_no_loss_tokens():
    samples = _samples()
    samples[1].trained = False
    batch = pack_samples(samples, seq_len=16, pad_id=0)
    assert int(batch.loss_mask.sum()) == sum(r for _, r in SHAPES) - SHAPES[1][1]
    # Its tokens are still in the rows (the draft and the KL reference see the context).
    assert int((batch.tokens != 0).sum()) == sum(p + r for p, r in SHAPES)


def test_gspo_sequence_ratio_and_its_clip():
    """The sequence ratio: ``sequence_logratios`` is each response's mean log-ratio; with it,
    ``ppo_loss(ratio_level="sequence")``'s value and gradient (w.r.t. the logits) equal GSPO's
    objective ``-mean_i min(s_i A_i, clip(s_i) A_i)``, ``s_i = exp(mean_t (log pi - log pi_old))``,
    differentiated directly (float64; the loss computes in fp32); the clip is active for some responses and not others."""
    samples = _samples()
    eps = (3e-2, 4e-2)
    batch = pack_samples(samples, seq_len=16, pad_id=0, inv_lens=True)
    logits = torch.randn(*batch.tokens.shape, ARGS.vocab_size, generator=torch.Generator().manual_seed(1),
                         dtype=torch.float64) * 0.3
    # Behaviour log-probs near the policy's, so that some ratios fall inside the clip range.
    with torch.no_grad():
        logp_all = torch.log_softmax(logits, -1)
        current = torch.zeros(batch.tokens.shape, dtype=torch.float64)
        current[:, 1:] = logp_all[:, :-1].gather(2, batch.tokens[:, 1:, None])[..., 0]
    noise = torch.randn(batch.tokens.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    batch.old_logprobs = torch.where(batch.loss_mask, current + 0.05 * noise, torch.zeros_like(current))
    batch.seq_logratios = sequence_logratios(batch, current)

    # Direct: per document, s_i from the whole response, GSPO's min.
    leaf = logits.clone().requires_grad_(True)
    logp = torch.log_softmax(leaf, -1)[:, :-1].gather(2, batch.tokens[:, 1:, None])[..., 0]
    mask = batch.loss_mask[:, 1:]
    objective, clipped_any, unclipped_any = 0.0, False, False
    for r in range(batch.tokens.shape[0]):
        for doc in batch.document_ids[r].unique():
            region = (batch.document_ids[r, 1:] == doc) & mask[r]
            if not region.any():
                continue
            delta = (logp[r][region] - batch.old_logprobs[r, 1:][region]).mean()
            s = torch.exp(delta)
            adv = batch.advantages[r, 1:][region][0].double()
            inside = 1 - eps[0] <= s.item() <= 1 + eps[1]
            clipped_any, unclipped_any = clipped_any or not inside, unclipped_any or inside
            mean_logratio = batch.seq_logratios[r, 1:][region]
            torch.testing.assert_close(mean_logratio, delta.detach().expand_as(mean_logratio))
            objective = objective - torch.minimum(s * adv, s.clamp(1 - eps[0], 1 + eps[1]) * adv)
    objective = objective / len(samples)
    objective.backward()
    assert clipped_any and unclipped_any

    ours = logits.clone().requires_grad_(True)
    out = ppo_loss(*eps, aggregation="seq_mean_token_mean", ratio_level="sequence")(ours, labels_of(batch))
    loss = out.loss_sum / out.norm
    loss.backward()
    torch.testing.assert_close(loss.double(), objective, **FP32)
    torch.testing.assert_close(ours.grad, leaf.grad, rtol=1e-5, atol=1e-8)


def test_gspo_refuses_other_aggregations_and_tis():
    with pytest.raises(ValueError, match="seq_mean_token_mean"):
        ppo_loss(3e-4, 4e-4, aggregation="token_mean", ratio_level="sequence")
    with pytest.raises(ValueError, match="tis_cap"):
        ppo_loss(3e-4, 4e-4, tis_cap=2.0, aggregation="seq_mean_token_mean", ratio_level="sequence")


def test_entropy_is_the_mean_entropy_of_response_positions():
    """``rl/entropy`` sums each masked position's entropy: a uniform distribution's is
    ``log V``, a one-hot one's 0; chunks of rows give the same sum."""
    V = 32
    logits = torch.zeros(1, 5, V)
    logits[0, 1, 3] = 1e4  # one-hot
    log_probs = torch.log_softmax(logits, -1)
    mask = torch.tensor([[True, True, False, True, False]])
    assert entropy_sum(log_probs, mask).item() == pytest.approx(2 * math.log(V), rel=1e-6)
    random_lp = torch.log_softmax(torch.randn(1, 7, V), -1)
    every = torch.ones(1, 7, dtype=torch.bool)
    direct = -(random_lp.exp() * random_lp).sum()
    torch.testing.assert_close(entropy_sum(random_lp, every, rows_at_once=3), direct)


def _scored(overlong: str, buffer: int = 0):
    """``RolloutPhase._score`` on hand-made rollouts of one group of 4 (max_new_tokens 8):
    lengths 3, 6, 8 (truncated), 8 (ended by a stop at the budget's last token)."""
    from types import SimpleNamespace

    from titan_cotrain.rl.rollout_phase import RolloutPhase, RolloutSettings

    settings = RolloutSettings(group_size=4, sft_steps=0, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=8,
                               stop_token_ids=(), draft_tokens=0, adaptive=False, per_round=True,
                               overlong=overlong, overlong_buffer=buffer)
    phase = RolloutPhase.__new__(RolloutPhase)
    phase.settings = settings
    phase.problems = SimpleNamespace(tokenizer=SimpleNamespace(decode=lambda ids: "x" * len(ids)),
                                     score=lambda problems, texts: ([1.0, 0.0, 1.0, 0.0], [{} for _ in texts]))
    lengths = torch.tensor([3, 6, 8, 8])
    rollouts = SimpleNamespace(response_lens=lengths, tokens=torch.ones(4, 8, dtype=torch.long),
                               logprobs=torch.zeros(4, 8), finished=torch.tensor([True, True, False, True]))
    ((samples, details),) = phase._score([object()], [[1, 2]], rollouts)
    return samples, details


def test_the_overlong_rules_touch_exactly_the_responses_they_name():
    plain, _ = _scored("none")
    assert [s.trained for s in plain] == [True] * 4 and [s.truncated for s in plain] == [False, False, True, False]
    masked, _ = _scored("mask")
    assert [s.trained for s in masked] == [True, True, False, True]  # only the truncated one leaves the loss
    assert [s.reward for s in masked] == [s.reward for s in plain]
    soft, details = _scored("soft", buffer=4)  # L - B = 4: lengths 6 and 8 are penalised, by length
    assert [s.reward for s in soft] == [1.0 + 0.0, 0.0 - 0.5, 1.0 - 1.0, 0.0 - 1.0]
    assert [d["overlong_penalty"] for d in details] == [0.0, -0.5, -1.0, -1.0]
    assert all(s.trained for s in soft)
    # The advantages are the group's over the penalised rewards.
    torch.testing.assert_close(torch.tensor([s.advantage for s in soft]),
                               group_advantages(torch.tensor([1.0, -0.5, 0.0, -1.0]), 4))
