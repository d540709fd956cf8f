"""Adaptive speculation: the tuner explores, then picks the k of the highest expected tokens/s
from measured costs and acceptance, 0 included, and follows a draft that falls behind."""

import pytest

from titan_cotrain.rl.speculation import SpeculationTuner, expected_tokens


def _measure(tuner, batch, draft_step_s, verify_s, verify_per_position_s, acceptance, calls, drafting_s=0.0,
             served_when_drafting=1.0):
    """Run ``calls`` calls against a cost model: a round at k costs k draft steps plus a verify
    over k + 1 positions (plus ``drafting_s`` for any k >= 1), and commits E(k) tokens for each
    of the ``batch`` sequences (``served_when_drafting`` x the batch at k >= 1). Returns the
    k chosen at each call."""
    chosen = []
    for _ in range(calls):
        k = tuner.choose(batch)
        chosen.append(k)
        tuner.observe(batch, k, _round_s(k, draft_step_s, verify_s, verify_per_position_s, drafting_s),
                      batch * (served_when_drafting if k else 1.0) * expected_tokens(acceptance, k), acceptance[:k])
    return chosen


def _round_s(k, draft_step_s, verify_s, verify_per_position_s, drafting_s=0.0):
    return k * draft_step_s + verify_s + verify_per_position_s * (k + 1) + (drafting_s if k else 0.0)


def test_expected_tokens_is_one_plus_the_survival_sum():
    assert expected_tokens([0.8, 0.5, 0.5], 0) == 1.0
    assert expected_tokens([0.8, 0.5, 0.5], 3) == pytest.approx(1 + 0.8 + 0.4 + 0.2)


def test_a_cheap_good_draft_runs_deep_and_an_expensive_one_is_switched_off():
    # Memory-bound (verify about the cost of one decode step at any k), cheap draft, high acceptance.
    good = SpeculationTuner(k_max=4)
    chosen = _measure(good, 8, draft_step_s=0.05, verify_s=1.0, verify_per_position_s=0.0,
                      acceptance=[0.9, 0.9, 0.9, 0.9], calls=12)
    assert chosen[:2] == [4, 0]  # explore the deepest, then plain
    assert chosen[2:] == [4] * 7 + [3, 4, 4], chosen  # the 8th call explores the only neighbour
    # Compute-bound: a verify over k + 1 positions costs k + 1 decode steps; speculation cannot pay.
    bound = SpeculationTuner(k_max=4)
    chosen = _measure(bound, 64, draft_step_s=0.05, verify_s=0.0, verify_per_position_s=1.0,
                      acceptance=[0.9, 0.9, 0.9, 0.9], calls=18)
    exploit = [k for i, k in enumerate(chosen[2:], start=1) if i % bound.explore_every]
    assert set(exploit) == {0}
    # Exploration costs at most one call in explore_every, a neighbour of the best (0 has one).
    assert [k for i, k in enumerate(chosen[2:], start=1) if not i % bound.explore_every] == [1, 1]


def test_exploration_alternates_between_the_neighbours_of_the_best():
    tuner = SpeculationTuner(k_max=4, explore_every=2, smoothing=1.0)
    # Memory-bound with a cheap draft whose acceptance falls with depth: k = 2 is best.
    acceptance = [0.9, 0.5, 0.1, 0.1]
    chosen = _measure(tuner, 8, draft_step_s=0.1, verify_s=1.0, verify_per_position_s=0.0, acceptance=acceptance,
                      calls=10)
    assert tuner.best(8) == 2
    assert chosen[2:] == [2, 3, 2, 1, 2, 3, 2, 1], chosen


def test_a_fixed_cost_of_drafting_is_tried_once_and_then_known():
    # Any k >= 1 pays a fixed cost per round (catch-up, the draft's prefill): the line from
    # k = 0 to k_max makes k = 1 look better than plain decoding, which it is not.
    tuner = SpeculationTuner(k_max=3)
    costs = dict(draft_step_s=0.05, verify_s=1.0, verify_per_position_s=0.0, drafting_s=0.5)
    acceptance = [0.4, 0.4, 0.4]
    assert expected_tokens(acceptance, 1) / _round_s(1, **costs) < 1 / _round_s(0, **costs)
    chosen = _measure(tuner, 8, acceptance=acceptance, calls=12, **costs)
    assert chosen[:3] == [3, 0, 1], chosen  # k = 1 is tried once, on the interpolated guess
    assert chosen[3:] == [0] * 6 + [1, 0, 0], chosen  # then plain, but for the 8th call's exploration


def test_measured_tokens_per_second_beats_the_model_when_the_batch_drains_slower():
    # Drafting at k = 1 should pay by E(1) / c(1) alone (1.6 / 1.3 = 1.23 x plain), but the
    # call ends with its unluckiest sequence: rounds serve 20% fewer sequences when drafting
    # (measured: tokens per round). The tuner ranks by what it measured and picks plain.
    tuner = SpeculationTuner(k_max=1, smoothing=1.0)
    costs = dict(draft_step_s=0.3, verify_s=1.0, verify_per_position_s=0.0)
    acceptance = [0.6]
    chosen = _measure(tuner, 64, acceptance=acceptance, calls=6, served_when_drafting=0.75, **costs)
    assert chosen[:2] == [1, 0] and set(chosen[2:]) == {0}, chosen
    estimate = tuner.estimate(tuner.bucket(64))
    assert estimate[0] == pytest.approx(64 / 1.0)
    assert estimate[1] == pytest.approx(0.75 * 64 * 1.6 / 1.3)


def test_the_best_k_is_the_argmax_of_the_estimate():
    tuner = SpeculationTuner(k_max=6)
    acceptance = [0.8, 0.7, 0.6, 0.5, 0.4, 0.3]
    _measure(tuner, 4, draft_step_s=0.1, verify_s=1.0, verify_per_position_s=0.02, acceptance=acceptance, calls=2)
    rates = {k: 4 * expected_tokens(acceptance, k) / _round_s(k, 0.1, 1.0, 0.02) for k in range(7)}
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


def test_drafting_must_beat_plain_decoding_by_the_margin():
    # Memory-bound, a draft step costs 0.1: k = 1 earns (1 + a) / 1.1 x plain decoding.
    for acceptance, drafts in ((0.12, False), (0.25, True)):  # 1.018 x and 1.136 x
        tuner = SpeculationTuner(k_max=1, min_gain=0.05)
        chosen = _measure(tuner, 8, draft_step_s=0.1, verify_s=1.0, verify_per_position_s=0.0,
                          acceptance=[acceptance], calls=5)
        assert chosen[2:] == ([1, 1, 1] if drafts else [0, 0, 0]), (acceptance, chosen)
    assert SpeculationTuner(k_max=1, min_gain=0.0).best(8) == 1


def test_a_noisy_neighbouring_depth_does_not_move_the_choice():
    # A cheap draft that is always right: k = 6 commits 7 tokens in 1.6 s, k = 5 6 in 1.5 s.
    costs = dict(draft_step_s=0.1, verify_s=1.0, verify_per_position_s=0.0)
    for luck, switches in ((0.89, False), (0.84, True)):  # k = 5 then looks 1.03x, 1.09x as fast
        tuner = SpeculationTuner(k_max=6, explore_every=4, smoothing=1.0)
        chosen = _measure(tuner, 64, acceptance=[1.0] * 6, calls=6, **costs)
        assert chosen == [6, 0, 6, 6, 6, 5], chosen  # the 4th call after the first two explores 5
        # Another call at k = 5 catches a quiet spell: ``luck`` x its seconds per round.
        tuner.observe(64, 5, luck * _round_s(5, **costs), 64 * 6.0, [1.0] * 5)
        estimate = tuner.estimate(tuner.bucket(64))
        assert estimate[5] > estimate[6] and (estimate[5] >= 1.05 * estimate[6]) == switches, estimate
        assert tuner.choose(64) == (5 if switches else 6)


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


def _every_rank_learns_the_average(rank, world_size):
    from types import SimpleNamespace

    import torch

    from titan_cotrain.rl.rollout_state import RolloutStats
    from titan_cotrain.rl.trainer import Trainer

    # Each rank's call measured something else (rank r: r + 1 seconds, acceptance 0.2 + 0.4 r).
    stats = RolloutStats(new_tokens=40, target_forwards=10, acceptance_length=1.0,
                         acceptance_rate=[0.2 + 0.4 * rank] * 2, prefill_s=0.0, draft_s=0.0, verify_s=0.0,
                         total_s=10.0 * (rank + 1))
    host = SimpleNamespace(speculation=SpeculationTuner(k_max=3), generation=SimpleNamespace(sends=lambda: True),
                           device=torch.device("cpu"), _to_host=lambda values: {k: float(v) for k, v in values.items()})
    host._all_reduce = lambda values: Trainer._all_reduce(host, values)
    Trainer._observe_speculation(host, 8, 2, SimpleNamespace(stats=stats))
    measured = host.speculation.measured[8][2]
    assert measured.round_s == pytest.approx(1.5)  # the mean of 1 and 2 seconds per round
    assert host.speculation.acceptance[:2] == pytest.approx([0.4, 0.4])
    assert measured.served == pytest.approx(4.0 / expected_tokens([0.4, 0.4], 2))


def test_every_rank_learns_the_average_of_the_jobs_measurements():
    from tests.multiprocess import run_on_ranks

    run_on_ranks(_every_rank_learns_the_average, 2)
