"""Adaptive speculation, chosen every decoding round: per live-rows bucket the tuner measures
what a round costs at each k and how often drafts are accepted, runs each round at the k of the
highest expected tokens/s, 0 included, explores the neighbours, decides per call whether the
draft follows at all, and follows a draft that falls behind."""

import pytest
import torch

from titan_cotrain.engine.round_stats import RoundTable, live_bucket
from titan_cotrain.engine.speculation import SpeculationTuner, expected_tokens

K = 3


def _round_s(live, k, follows=True, decode_s=1.0, per_row_position_s=0.0, draft_step_s=0.05, catch_up_s=0.1):
    """A cost model: a target forward over ``k + 1`` positions of ``live`` rows (a roofline: the
    weights' read, ``decode_s``, or the arithmetic, ``per_row_position_s`` per row-position,
    whichever is longer: memory-bound at small ``live``, compute-bound at large), ``k`` draft
    steps and the draft's catch-up when it follows."""
    target = max(decode_s, per_row_position_s * live * (k + 1))
    return target + (k * draft_step_s + catch_up_s if follows else 0.0)


def _call(tuner, lives, acceptance, prefill_s=(1.0, 0.5), **cost):
    """One call whose rounds decode ``lives`` sequences in turn: the tuner picks the draft's
    following and every round's k, the call's ``RoundTable`` holds the cost model's seconds and
    the expected tokens and judged/accepted counts. Returns (follows, the k of each round)."""
    follows = tuner.start_call()
    buckets = live_bucket(max(lives)) + 1
    table = RoundTable.empty(buckets, tuner.k_max)
    chosen = []
    for live in lives:
        k = tuner.choose_round(live) if follows else 0
        chosen.append(k)
        b, mode = live_bucket(live), 1 + k if follows else 0
        table.rounds[b, mode] += 1
        table.seconds[b, mode] += _round_s(live, k, follows, **cost)
        table.tokens[b, mode] += live * expected_tokens(acceptance, k)
        table.live[b, mode] += live
        survive = float(live)
        for d in range(k):
            table.judged[b, d] += survive
            table.accepted[b, d] += survive * acceptance[d]
            survive *= acceptance[d]
    tuner.observe(table, prefill_s[0] if follows else prefill_s[1], follows)
    return follows, chosen


def _best_by_formula(live, acceptance, **cost):
    speeds = {k: expected_tokens(acceptance, k) / _round_s(live, k, **cost) for k in range(K + 1)}
    return max(speeds, key=speeds.get), speeds


def test_expected_tokens_is_one_plus_the_survival_sum():
    assert expected_tokens([0.8, 0.5, 0.5], 0) == 1.0
    assert expected_tokens([0.8, 0.5, 0.5], 3) == pytest.approx(1 + 0.8 + 0.4 + 0.2)


def test_a_new_bucket_measures_every_k_in_turn_deepest_first():
    tuner = SpeculationTuner(k_max=K)
    assert tuner.start_call() is True  # the first call drafts, to measure
    assert [tuner.choose_round(8) for _ in range(6)] == [3, 0, 1, 2, 3, 0]
    assert tuner.choose_round(1) == 3  # another bucket, its own turn


def test_the_round_choice_is_the_formula_per_bucket_within_one_call():
    # Small batches are memory-bound (a verify over k + 1 positions costs about one decode), big
    # ones compute-bound: the same call drafts deep in its tail and nothing in its bulk.
    cost = dict(per_row_position_s=0.02)
    acceptance = [0.8, 0.7, 0.6]
    tuner = SpeculationTuner(k_max=K, smoothing=1.0, explore_every=1000)
    lives = [64] * 8 + [2] * 8
    _call(tuner, lives, acceptance, **cost)
    for live in (64, 2):
        best, speeds = _best_by_formula(live, acceptance, **cost)
        b = live_bucket(live)
        for k, speed in speeds.items():  # tokens per second per sequence: E_b(k) / c_b(1 + k)
            assert tuner.speed(b, k) == pytest.approx(speed, rel=1e-12)
        assert tuner.best_round(b) == best
    assert _best_by_formula(64, acceptance, **cost)[0] == 0 and _best_by_formula(2, acceptance, **cost)[0] == 3
    tuner.start_call()
    assert [tuner.choose_round(64) for _ in range(3)] == [0, 0, 0]
    assert [tuner.choose_round(2) for _ in range(3)] == [3, 3, 3]


def test_exploration_runs_a_neighbour_of_the_best_every_explore_every_rounds():
    acceptance = [0.9, 0.5, 0.1]
    cost = dict(draft_step_s=0.1)
    assert _best_by_formula(4, acceptance, **cost)[0] == 2
    tuner = SpeculationTuner(k_max=K, explore_every=4, smoothing=1.0)
    assert _call(tuner, [4] * 4, acceptance, **cost) == (True, [3, 0, 1, 2])  # every k measured
    assert _call(tuner, [4] * 4, acceptance, **cost)[0] is False  # and plain decoding
    follows, chosen = _call(tuner, [4] * 16, acceptance, **cost)
    assert follows
    explored = [k for k in chosen if k != 2]
    assert len(explored) == 4 and set(explored) == {1, 3}, chosen  # one in 4, both neighbours
    assert all(chosen[i] == 2 for i in range(16) if (i + 1 + tuner.calls) % 4)


def test_a_new_best_must_win_by_the_margin():
    tuner = SpeculationTuner(k_max=1, smoothing=1.0, min_gain=0.05, explore_every=1000)
    _call(tuner, [4, 4], [0.14], draft_step_s=0.05, catch_up_s=0.0)  # k = 1: 1.14 / 1.05, k = 0: 1 / 1
    b = live_bucket(4)
    assert tuner.best_round(b) == 1 and tuner.current[b] == 1
    for gain, best in ((1.02, 1), (1.10, 0)):  # k = 0 now looks 2%, then 10% faster than k = 1
        tuner.round_s[b, 1] = 1.0 / (gain * tuner.speed(b, 1))
        assert tuner.speed(b, 0) == pytest.approx(gain * tuner.speed(b, 1))
        assert tuner.best_round(b) == best


def test_the_draft_follows_a_call_only_where_that_beats_plain_decoding():
    good, bad = [0.9, 0.9, 0.9], [0.02, 0.02, 0.02]
    for acceptance, follows in ((good, True), (bad, False)):
        tuner = SpeculationTuner(k_max=K, explore_every=8, smoothing=1.0)
        calls = [_call(tuner, [8] * 4 + [1] * 4, acceptance)[0] for _ in range(10)]
        assert calls[:2] == [True, False]  # measure drafting, then plain decoding
        exploit = [f for i, f in enumerate(calls) if (i + 1) % 8]
        assert set(exploit[2:]) == {follows}, (acceptance, calls)
        assert calls[7] is not follows  # the 8th call runs the other choice
        plain, drafting = tuner.call_seconds(False), tuner.call_seconds(True)
        assert (drafting * (1 + tuner.min_gain) < plain) == follows


def test_plain_decoding_is_explored_less_often_while_the_draft_wins_by_a_wide_margin():
    """Every 8th call while the two choices are close; while drafting stays more than 20% ahead,
    each exploration doubles the wait for the next (8, then 16, 32, 64 calls, at most 64); once
    the draft falls behind, the explorations come every 8 calls again."""
    good, close = [0.9, 0.9, 0.9], [0.34, 0.0, 0.0]
    tuner = SpeculationTuner(k_max=K, explore_every=8, smoothing=1.0)
    calls = [_call(tuner, [8] * 4 + [1] * 4, good)[0] for _ in range(200)]
    plain, drafting = tuner.call_seconds(False), tuner.call_seconds(True)
    assert plain > 1.2 * drafting  # a wide margin
    assert [i + 1 for i, f in enumerate(calls) if not f] == [2, 8, 24, 56, 120, 184]  # was 2, 8, 16, ... 200: 26
    assert tuner.interval == 64
    # The draft falls behind: the margin narrows (or flips), and the wait is back to explore_every.
    follows = [_call(tuner, [8] * 4 + [1] * 4, close)[0] for _ in range(200)]
    ratio = tuner.call_seconds(False) / tuner.call_seconds(True)
    assert ratio < 1.2 and tuner.interval == 8, (ratio, tuner.interval)
    last = follows[100:]
    usual = max(set(last), key=last.count)
    minority = [i for i, f in enumerate(last) if f != usual]
    assert 11 <= len(minority) <= 14, minority  # one call in 8 of the last 100 explores the other choice


def test_it_follows_a_draft_that_falls_behind():
    tuner = SpeculationTuner(k_max=K, smoothing=1.0)
    for _ in range(3):
        _call(tuner, [2] * 8, [0.9, 0.9, 0.9])
    assert tuner.best_round(live_bucket(2)) == 3
    _call(tuner, [2] * 8, [0.02, 0.02, 0.02])  # the policy moved away (the draft follows this call)
    assert tuner.best_round(live_bucket(2)) == 0
    assert tuner.call_seconds(True) > tuner.call_seconds(False)


def test_per_call_granularity_picks_one_k_from_the_first_wave():
    tuner = SpeculationTuner(k_max=K, smoothing=1.0, explore_every=1000)
    acceptance, cost = [0.9, 0.9, 0.9], dict(per_row_position_s=0.02)
    assert tuner.choose_call(64) == K  # unmeasured: the deepest first
    # What the calls measure comes from the same tables as the rounds'.
    table = RoundTable.empty(live_bucket(64) + 1, K)
    b = live_bucket(64)
    for k, follows in ((K, True), (0, False)):
        mode = 1 + k if follows else 0
        table.rounds[b, mode], table.seconds[b, mode] = 1, _round_s(64, k, follows, **cost)
        table.tokens[b, mode], table.live[b, mode] = 64 * expected_tokens(acceptance, k), 64
    table.judged[b], table.accepted[b] = 64.0, 64 * 0.9
    tuner.observe(table, 1.0, True)
    speeds = {k: tuner.speed(b, k) for k in (0, K)}
    plain = tuner.speed(b, 0, follows=False)
    assert tuner.choose_call(64) == (K if speeds[K] > 1.05 * plain else 0)


def _granular_call(tuner, live, acceptance, rounds=4):
    """One call of ``[rollout] speculation_granularity = "call"``: ``choose_call`` picks its k
    (0: plain decoding, the draft not following), then ``rounds`` rounds of ``live`` sequences at
    the cost model's seconds. Returns the k."""
    k = tuner.choose_call(live)
    b, mode = live_bucket(live), 1 + k if k else 0
    table = RoundTable.empty(b + 1, tuner.k_max)
    table.rounds[b, mode], table.seconds[b, mode] = rounds, rounds * _round_s(live, k, bool(k))
    table.tokens[b, mode], table.live[b, mode] = rounds * live * expected_tokens(acceptance, k), rounds * live
    survive = float(rounds * live)
    for d in range(k):
        table.judged[b, d], table.accepted[b, d] = survive, survive * acceptance[d]
        survive *= acceptance[d]
    tuner.observe(table, 1.0 if k else 0.5, bool(k))
    return k


def test_per_call_granularity_explores_less_often_while_the_best_k_wins_by_a_wide_margin():
    """Per-call k: the first call drafts k_max, the second decodes plainly; then a neighbour of
    the best k every 8th call while the best is within 20% of it, the wait doubling (up to 64)
    at each exploration that finds the best more than 20% ahead; back to every 8th call when
    the margin narrows."""
    tuner = SpeculationTuner(k_max=K, explore_every=8, smoothing=1.0)
    chosen = [_granular_call(tuner, 4, [0.9, 0.9, 0.9]) for _ in range(200)]
    other = [i + 1 for i, k in enumerate(chosen) if k != K]
    # Call 10 explores k = 2 unmeasured (no margin known: 8 calls to the next), then 16, 32, 64.
    assert other == [2, 10, 18, 34, 66, 130, 194], other
    assert [chosen[i - 1] for i in other] == [0] + [K - 1] * 6
    speeds = {k: tuner.speed(live_bucket(4), k) for k in (K - 1, K)}
    assert speeds[K] > 1.2 * speeds[K - 1] and tuner.interval == 64
    # A draft that falls behind: k = 3 and k = 2 within 20% of each other, explorations every 8th call.
    chosen = [_granular_call(tuner, 4, [0.34, 0.0, 0.0]) for _ in range(200)]
    speeds = {k: tuner.speed(live_bucket(4), k) for k in (K - 1, K)}
    assert max(speeds.values()) < 1.2 * min(speeds.values()) and tuner.interval == 8
    last = chosen[100:]
    usual = max(set(last), key=last.count)
    assert 12 <= sum(k != usual for k in last) <= 13, last  # one call in 8


def test_the_call_explorations_survive_a_checkpoint():
    tuner = SpeculationTuner(k_max=K, explore_every=8, smoothing=1.0)
    for _ in range(40):
        _granular_call(tuner, 4, [0.9, 0.9, 0.9])
    resumed = SpeculationTuner(k_max=K, explore_every=8, smoothing=1.0)
    resumed.load_state_dict(tuner.state_dict())
    assert [_granular_call(resumed, 4, [0.9, 0.9, 0.9]) for _ in range(60)] == [
        _granular_call(tuner, 4, [0.9, 0.9, 0.9]) for _ in range(60)]
    assert (resumed.interval, resumed.explorations) == (tuner.interval, tuner.explorations) == (64, 4)


def test_no_draft_means_plain_decoding_and_bad_settings_are_refused():
    assert SpeculationTuner(k_max=0).start_call() is False
    assert SpeculationTuner(k_max=0).choose_call(8) == 0
    with pytest.raises(ValueError, match="explore_every"):
        SpeculationTuner(k_max=2, explore_every=1)


def test_round_tables_add_and_travel_flat():
    a, b = RoundTable.empty(3, 2), RoundTable.empty(3, 2)
    a.rounds[1, 2], a.seconds[1, 2], b.rounds[1, 2], b.seconds[1, 2] = 2, 1.0, 1, 4.0
    summed = RoundTable.from_flat([x + y for x, y in zip(a.flat(), b.flat())], 3, 2)
    assert summed.rounds[1, 2] == 3 and summed.seconds[1, 2] == 5.0 and summed.rounds.sum() == 3
    assert [live_bucket(n) for n in (1, 2, 3, 4, 5, 8, 9)] == [0, 1, 2, 2, 3, 3, 4]


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
    chosen = [trainer.rollouts(step)[1]["rollout/draft_tokens"] for step in (1, 2, 3, 4)]
    # The first call measures every k per round, the second plain decoding. Then drafting does
    # not pay: plain decoding, or (a tiny draft's catch-up costs about nothing here, so the two
    # are a coin toss on these cores) the draft follows and its rounds draft 0, but for the
    # exploration of k = 1 in one round of explore_every.
    tuner = trainer.rollouts.speculation
    assert tuner.pooled[0] < 0.3, tuner.pooled
    assert chosen[0] > 1 and chosen[1] == 0.0, chosen
    assert all(k <= 1.5 / tuner.explore_every for k in chosen[2:]), chosen


def test_the_trainer_switches_a_draft_that_does_not_pay_off(tmp_path):
    from tests.multiprocess import run_on_ranks

    run_on_ranks(_a_bad_draft_is_switched_off, 1, str(tmp_path))


def _every_rank_learns_the_sum(rank, world_size):
    from types import SimpleNamespace

    from titan_cotrain.rl.host_sync import HostSync
    from titan_cotrain.rl.run_mode import RealRun
    from titan_cotrain.rl.rollout_phase import RolloutPhase
    from titan_cotrain.engine.round_stats import RolloutStats

    # Each rank's call measured something else: rank r ran r + 1 rounds of 2 live rows at k = 2,
    # (r + 1) seconds each; drafted token 1 was judged 2 (r + 1) times, accepted r + 1 times.
    table = RoundTable.empty(live_bucket(4) + 1, K)
    table.rounds[1, 3], table.seconds[1, 3] = rank + 1, (rank + 1) ** 2
    table.live[1, 3], table.tokens[1, 3] = 2 * (rank + 1), 3 * (rank + 1)
    table.judged[1, 0], table.accepted[1, 0] = 2 * (rank + 1), rank + 1
    stats = RolloutStats(new_tokens=40, target_forwards=10, acceptance_length=1.0, acceptance_rate=[0.5],
                         prefill_s=float(rank + 1), draft_s=0.0, verify_s=0.0, total_s=10.0, rounds=table)
    host = SimpleNamespace(speculation=SpeculationTuner(k_max=K), generation=SimpleNamespace(sends=lambda: True),
                           engine=SimpleNamespace(max_batch_size=4), sync=HostSync(torch.device("cpu"), RealRun()))
    RolloutPhase._observe_speculation(host, SimpleNamespace(stats=stats), True)
    assert host.speculation.round_s[1, 3] == pytest.approx((1 + 4) / (1 + 2))  # the job's seconds per round
    assert host.speculation.prefill_s[True] == pytest.approx(1.5)  # the mean prefill of a call
    assert host.speculation.acceptance[1][0] == pytest.approx(3 / 6)
    assert host.speculation.live[1] == pytest.approx(2.0)


def test_every_rank_learns_the_sum_of_the_jobs_measurements():
    from tests.multiprocess import run_on_ranks

    run_on_ranks(_every_rank_learns_the_sum, 2)
