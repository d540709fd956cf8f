"""Adaptive speculation: the tuner explores, then picks the k of the highest expected tokens/s
from measured costs and acceptance, 0 included, and follows a draft that falls behind."""

import pytest

from titan_cotrain.rl.speculation import SpeculationTuner, expected_tokens


def _measure(tuner, batch, draft_step_s, verify_s, verify_per_position_s, acceptance, calls):
    """Run ``calls`` calls against a cost model: a round at k costs k draft steps plus a verify
    over k + 1 positions. Returns the k chosen at each call."""
    chosen = []
    for _ in range(calls):
        k = tuner.choose(batch)
        chosen.append(k)
        tuner.observe(batch, k, k * draft_step_s + verify_s + verify_per_position_s * (k + 1), acceptance[:k])
    return chosen


def test_expected_tokens_is_one_plus_the_survival_sum():
    assert expected_tokens([0.8, 0.5, 0.5], 0) == 1.0
    assert expected_tokens([0.8, 0.5, 0.5], 3) == pytest.approx(1 + 0.8 + 0.4 + 0.2)


def test_a_cheap_good_draft_runs_deep_and_an_expensive_one_is_switched_off():
    # Memory-bound (verify about the cost of one decode step at any k), cheap draft, high acceptance.
    good = SpeculationTuner(k_max=4)
    chosen = _measure(good, 8, draft_step_s=0.05, verify_s=1.0, verify_per_position_s=0.0,
                      acceptance=[0.9, 0.9, 0.9, 0.9], calls=12)
    assert chosen[:2] == [4, 0]  # explore the deepest, then plain
    assert set(chosen[2:]) == {4}
    # Compute-bound: a verify over k + 1 positions costs k + 1 decode steps; speculation cannot pay.
    bound = SpeculationTuner(k_max=4)
    chosen = _measure(bound, 64, draft_step_s=0.05, verify_s=0.0, verify_per_position_s=1.0,
                      acceptance=[0.9, 0.9, 0.9, 0.9], calls=18)
    exploit = [k for i, k in enumerate(chosen[2:], start=1) if i % bound.explore_every]
    assert set(exploit) == {0}
    # Exploration costs at most one call in explore_every, one token deeper than the best.
    assert [k for i, k in enumerate(chosen[2:], start=1) if not i % bound.explore_every] == [1, 1]


def test_the_best_k_is_the_argmax_of_the_estimate():
    tuner = SpeculationTuner(k_max=6)
    acceptance = [0.8, 0.7, 0.6, 0.5, 0.4, 0.3]
    _measure(tuner, 4, draft_step_s=0.1, verify_s=1.0, verify_per_position_s=0.02, acceptance=acceptance, calls=2)
    rates = {k: expected_tokens(acceptance, k) / (0.1 * k + 1.0 + 0.02 * (k + 1)) for k in range(7)}
    assert tuner.best(4) == max(rates, key=rates.get)
    estimate = tuner.estimate(tuner.bucket(4))
    for k, rate in rates.items():  # interpolated costs: exact for an affine cost
        assert estimate[k] == pytest.approx(rate, rel=1e-9)


def test_it_follows_a_draft_that_falls_behind_and_batch_sizes_are_tuned_apart():
    tuner = SpeculationTuner(k_max=3, smoothing=1.0)
    _measure(tuner, 2, 0.05, 1.0, 0.0, [0.9, 0.9, 0.9], calls=4)
    assert tuner.best(2) == 3
    _measure(tuner, 2, 0.05, 1.0, 0.0, [0.02, 0.02, 0.02], calls=1)  # the policy moved away
    assert tuner.best(2) == 0
    # A new batch-size bucket explores its own costs first (acceptance is shared).
    assert tuner.choose(32) == 3 and tuner.bucket(32) != tuner.bucket(2)


def test_no_draft_means_plain_decoding_and_bad_settings_are_refused():
    assert SpeculationTuner(k_max=0).choose(8) == 0
    with pytest.raises(ValueError, match="explore_every"):
        SpeculationTuner(k_max=2, explore_every=1)


def _a_bad_draft_is_switched_off(rank, world_size, folder):
    import torch

    from titan_cotrain.config import load_job_config
    from titan_cotrain.rl.trainer import Trainer

    args = ["--task.sft_steps", "0", "--training.steps", "4", "--rl.prompts_per_step", "2", "--rl.group_size", "2",
            "--rollout.max_new_tokens", "24", "--rollout.adaptive_speculation", "--checkpoint.no-enable",
            "--metrics.no-enable_tensorboard", "--job.dump_folder", folder]
    trainer = Trainer(load_job_config(args, world_size=world_size), world_size, rank)
    trainer.refresh_engine()
    # An untrained target is nearly uniform, and so is an untrained draft: they agree. A draft
    # made sharp on its own random choices is nearly never accepted.
    with torch.no_grad():
        trainer.engine.draft.lm_head.weight.mul_(200.0)
    chosen = [trainer.rollout_phase(step)[1]["rollout/draft_tokens"] for step in (1, 2, 3, 4)]
    # After measuring k = 3 and plain decoding, drafting does not pay: plain decoding.
    assert trainer.speculation.acceptance[0] < 0.3, trainer.speculation.acceptance
    assert chosen == [3.0, 0.0, 0.0, 0.0], chosen


def test_the_trainer_switches_a_draft_that_does_not_pay_off(tmp_path):
    from tests.multiprocess import run_on_ranks

    run_on_ranks(_a_bad_draft_is_switched_off, 1, str(tmp_path))
