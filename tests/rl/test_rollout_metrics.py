"""Acceptance where it is seen: the measured rollout acceptance beside the draft's training
``tau`` (the ratio, the console line) and the warning when the first stays well below the
second, the symptom of an engine that feeds the draft the wrong keys."""

import pytest
import torch

from titan_cotrain.cotrain.ttt import tau
from titan_cotrain.rl.draft_health import AcceptanceWatch
from titan_cotrain.rl.progress import step_line
from titan_cotrain.rl.rollout_metrics import acceptance_over_tau, tau_at

ACCURACY = (0.9, 0.8, 0.5)  # draft/acc_pass1..3 of a draft trained with ttt_steps = 3


def _rl_step(acceptance: float, k: int = 3, accuracy=ACCURACY) -> dict[str, float]:
    metrics = {f"draft/acc_pass{d}": a for d, a in enumerate(accuracy, start=1)}
    metrics |= {"draft/tau": float(tau(torch.tensor(accuracy))), "rollout/acceptance_length": acceptance,
                "rollout/draft_tokens": float(k)}
    return metrics | acceptance_over_tau(metrics)


def test_tau_at_k_is_the_training_tau_over_the_passes_a_round_drafts():
    metrics = _rl_step(3.0)
    assert tau_at(metrics, 3) == pytest.approx(metrics["draft/tau"])
    assert tau_at(metrics, 1) == pytest.approx(1.9)
    assert tau_at(metrics, 2) == pytest.approx(1 + 0.9 + 0.72)
    assert tau_at(metrics, 6) == pytest.approx(metrics["draft/tau"])  # no passes past ttt_steps to count
    assert tau_at({"rollout/acceptance_length": 2.0}, 3) is None
    assert _rl_step(1.9, k=1)["rollout/acceptance_over_tau"] == pytest.approx(1.0)


def test_sampled_rollouts_are_predicted_by_the_acceptance_chance_and_greedy_ones_by_top1():
    """A sampled round accepts a drafted token with probability sum_x min(p, q) (draft/accept_pass),
    a greedy one when it is the argmax (draft/acc_pass): each prediction uses its own."""
    metrics = _rl_step(2.0, k=2) | {"draft/accept_pass1": 0.95, "draft/accept_pass2": 0.9, "draft/accept_pass3": 0.6}
    assert tau_at(metrics, 2, sampled=True) == pytest.approx(1 + 0.95 + 0.95 * 0.9)
    assert tau_at(metrics, 2) == pytest.approx(1 + 0.9 + 0.72)
    sampled = acceptance_over_tau(metrics, sampled=True)
    assert sampled["rollout/predicted_acceptance"] == pytest.approx(2.805)
    assert sampled["rollout/acceptance_over_tau"] == pytest.approx(2.0 / 2.805)
    assert acceptance_over_tau(metrics)["rollout/acceptance_over_tau"] == pytest.approx(2.0 / 2.62)


def test_no_ratio_without_drafting_or_a_trained_draft():
    assert "rollout/acceptance_over_tau" not in _rl_step(1.0, k=0)
    assert acceptance_over_tau({"rollout/acceptance_length": 2.5, "rollout/draft_tokens": 3.0}) == {}


def test_the_warning_comes_once_after_patience_low_steps_in_a_row():
    watch = AcceptanceWatch(fraction=0.8, patience=3)
    trained = tau_at(_rl_step(0.0), 3)  # 2.98
    low, fine = _rl_step(0.7 * trained), _rl_step(0.9 * trained)
    plain = _rl_step(1.0, k=0)
    # A fine step ends a run of low ones; plain-decoding steps neither count nor end it.
    steps = [low, low, fine, low, plain, low, plain, low, low, low, fine, low]
    warnings = {step: watch.observe(step, metrics) for step, metrics in enumerate(steps, start=1)}
    assert [step for step, warning in warnings.items() if warning] == [8]
    assert "for 3 speculative RL steps in a row" in warnings[8]
    assert f"{0.7 * trained:.2f} tokens per round against {trained:.2f}" in warnings[8]
    assert "0.8 x" in warnings[8] and "acceptance_warning_fraction" in warnings[8]


def test_a_zero_fraction_never_warns():
    watch = AcceptanceWatch(fraction=0.0, patience=1)
    assert all(watch.observe(step, _rl_step(1.0)) is None for step in range(5))


def test_the_console_line_shows_measured_acceptance_beside_tau():
    common = {"loss/policy": 0.5, "loss/draft": 1.25, "time/step_s": 1.0, "reward/mean": 0.5,
              "rollout/tokens_per_s": 900.0}
    line = step_line("rl ", 3, 10, common | _rl_step(1.81))
    assert "accept_len 1.81 / tau 2.98" in line
    assert line.count("tau") == 1
    assert "plain decoding" in step_line("rl ", 3, 10, common | _rl_step(1.0, k=0))
    sft = {key: value for key, value in (common | _rl_step(0.0)).items()
           if not key.startswith(("reward/", "rollout/"))}
    assert "accept_len" not in step_line("sft", 3, 10, sft) and "tau 2.98" in step_line("sft", 3, 10, sft)
