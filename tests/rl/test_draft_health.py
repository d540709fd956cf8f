"""Draft health: a collapse of the rollouts' acceptance (its length against its running mean,
or a drafted position that is never accepted) is reported, as ``draft/collapse`` and one
warning, after ``patience`` speculative steps in a row; a healthy draft never is."""

from titan_cotrain.rl.draft_health import DraftCollapseWatch


def _step(acceptance: float, k: int = 3, rates=(0.8, 0.6, 0.4)) -> dict[str, float]:
    metrics = {"rollout/acceptance_length": acceptance, "rollout/draft_tokens": float(k)}
    return metrics | {f"rollout/acceptance_rate_{d}": r for d, r in enumerate(rates[:k], start=1)}


def _run(watch, steps):
    """(draft/collapse or None, warning or None) per step."""
    out = []
    for step, metrics in enumerate(steps, start=1):
        metrics = metrics | watch.judge(metrics)
        out.append((metrics.get("draft/collapse"), watch.observe(step, metrics)))
    return out


def test_a_healthy_draft_is_never_reported():
    watch = DraftCollapseWatch(fraction=0.5, position_rate=0.05, patience=3)
    noisy = [2.4, 2.7, 2.2, 2.9, 2.5, 1.9, 2.6, 2.3, 2.8, 2.0]  # gains within 2x of each other
    assert all(flag == 0.0 and warning is None for flag, warning in _run(watch, [_step(a) for a in noisy]))


def test_a_sudden_drop_is_reported_once_after_patience_steps_and_a_recovery_resets():
    watch = DraftCollapseWatch(fraction=0.5, position_rate=0.0, patience=3)
    plain = {"rollout/acceptance_length": 1.0, "rollout/draft_tokens": 0.0}
    steps = [_step(2.5)] * 4 + [_step(1.0), plain, _step(1.05), _step(1.0), _step(1.0)] + [_step(2.5), _step(1.0)]
    out = _run(watch, steps)
    flags = [flag for flag, _ in out]
    # Plain steps are not judged and do not end the run of collapsed steps.
    assert flags == [0.0] * 4 + [0.0, None, 0.0, 1.0, 1.0, 0.0, 0.0]
    warnings = [(i + 1, w) for i, (_, w) in enumerate(out) if w]
    assert len(warnings) == 1 and warnings[0][0] == 8
    assert "3 speculative RL steps in a row" in warnings[0][1] and "below 0.5 x its running mean 2.50" in warnings[0][1]
    assert "collapse_fraction" in warnings[0][1] and "max_position_embeddings" in warnings[0][1]


def test_a_position_that_is_never_accepted_is_reported():
    watch = DraftCollapseWatch(fraction=0.5, position_rate=0.05, patience=2)
    dead = _step(2.1, rates=(0.8, 0.9, 0.0))  # the length looks fine, position 3 is dead
    out = _run(watch, [dead] + [_step(2.2)] * 2 + [dead, dead])
    assert [flag for flag, _ in out] == [0.0, 0.0, 0.0, 0.0, 1.0]  # a k's first 3 steps are not judged
    assert "drafted position 3 accepted 0.000 of the time" in out[-1][1]


def test_the_running_mean_is_kept_per_k_and_zero_thresholds_disable():
    watch = DraftCollapseWatch(fraction=0.5, position_rate=0.05, patience=1)
    _run(watch, [_step(3.0)] * 3)
    # k = 1 gains less per round than k = 3 by design: its own mean, not a collapse.
    assert [flag for flag, _ in _run(watch, [_step(1.6, k=1)] * 4)] == [0.0] * 4
    assert _run(watch, [_step(1.2)])[0][0] == 1.0  # against k = 3's mean of 2.0 gained
    off = DraftCollapseWatch(fraction=0.0, position_rate=0.0, patience=1)
    assert [flag for flag, _ in _run(off, [_step(3.0)] * 3 + [_step(1.0, rates=(0.0, 0.0, 0.0))] * 3)] == [0.0] * 6
