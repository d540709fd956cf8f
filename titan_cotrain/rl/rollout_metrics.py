"""A rollout phase's metrics, reduced over every rank with each rollout counted once, and the
watch on the gap between the acceptance rollouts measure and the one the draft trains to."""

from collections.abc import Callable

import torch

from titan_cotrain.cotrain.ttt import tau
from titan_cotrain.rl.batching import Sample
from titan_cotrain.rl.rollout import RolloutStats

__all__ = ["AcceptanceWatch", "acceptance_over_tau", "rollout_metrics", "tau_at"]


def rollout_metrics(all_reduce: Callable[[list[float]], list[float]], samples: list[Sample], details: list[dict],
                    stats: RolloutStats | None, k: int, k_max: int, *, counted: bool) -> dict[str, float]:
    """Rewards, response lengths and the task's details of ``samples`` (this rank's batch)
    where ``counted`` (one rank of those that hold the same batch), and the generation's
    ``stats`` (None where this rank's do not count: it generated nothing, or a rank of its
    tensor-parallel engine group reports them), summed over every rank by ``all_reduce``
    (one call). ``k``: the tokens drafted per round this step, ``k_max`` the most."""
    weight = float(counted)
    rewards = torch.tensor([s.reward for s in samples]) * weight
    keys = sorted(details[0]) if details else []
    generated = stats is not None
    totals = all_reduce([
        float(rewards.sum()), float((rewards ** 2).sum()), len(samples) * weight,
        float(sum(len(s.response) for s in samples)) * weight,
        stats.acceptance_length if generated else 0.0, stats.tokens_per_s if generated else 0.0, float(generated),
        float(k) if generated else 0.0, stats.kv_peak_bytes / 2**30 if generated else 0.0,
        # Positions a rank did not draft this step count as not judged (rate 0, weight 0).
        *((stats.acceptance_rate if generated else []) + [0.0] * k_max)[:k_max],
        *(float(generated and d < k) for d in range(k_max)),
        *(sum(d[key] for d in details) * weight for key in keys)])
    count, ranks = totals[2], totals[6]
    mean = totals[0] / count
    metrics = {
        "reward/mean": mean,
        "reward/std": max(totals[1] / count - mean ** 2, 0.0) ** 0.5,
        "rollout/response_len": totals[3] / count,
        "rollout/acceptance_length": totals[4] / ranks,
        "rollout/tokens_per_s": totals[5],  # every rollout is generated once, by one engine
        "rollout/draft_tokens": totals[7] / ranks,
        "rollout/kv_peak_gib": totals[8] / ranks,  # KV blocks held at once, per generating rank
    }
    rates, judged = totals[9:9 + k_max], totals[9 + k_max:9 + 2 * k_max]
    metrics |= {f"rollout/acceptance_rate_{d}": rate / n for d, (rate, n) in enumerate(zip(rates, judged), start=1)
                if n}
    metrics |= {f"task/{key}": total / count for key, total in zip(keys, totals[9 + 2 * k_max:])}
    return metrics


def tau_at(metrics: dict[str, float], k: int) -> float | None:
    """What the draft's training metric predicts for rounds of ``k`` drafted tokens:
    ``draft/tau`` over its first ``k`` passes, ``1 + sum_{j<=k} prod_{d<=j} acc_d`` from the
    step's ``draft/acc_pass<d>`` (all of them when ``k`` exceeds ``draft.ttt_steps``); None
    without them (no draft trained this step)."""
    if "draft/acc_pass1" not in metrics:
        return None
    passes = [f"draft/acc_pass{d}" for d in range(1, k + 1)]
    accuracy = [metrics[key] for key in passes if key in metrics]  # none past draft.ttt_steps
    return float(tau(torch.tensor(accuracy, dtype=torch.float64)))


def acceptance_over_tau(metrics: dict[str, float]) -> dict[str, float]:
    """``{"rollout/acceptance_over_tau": measured / predicted}`` for an RL step's ``metrics``:
    the rollouts' acceptance length over ``tau_at`` their ``k``. The two measure the same draft
    on the same sequences (the update scores the draft on the rollouts it drafted, before its
    own step), so a ratio well below 1 means the engine feeds the draft other inputs than
    training does. Empty for a step that decoded plainly or trained no draft."""
    k = round(metrics.get("rollout/draft_tokens", 0.0))
    predicted = tau_at(metrics, k) if k > 0 else None
    if predicted is None:
        return {}
    return {"rollout/acceptance_over_tau": metrics["rollout/acceptance_length"] / predicted}


class AcceptanceWatch:
    """Warns when speculative rollouts realise much less than the draft's training metric
    predicts: ``rollout/acceptance_over_tau`` below ``fraction`` for ``patience`` speculative
    RL steps in a row (``[rollout] acceptance_warning_fraction``, ``acceptance_warning_steps``).
    Steps without the ratio (plain decoding, no draft trained) neither count nor break a run of
    low ones; a step at or above ``fraction`` ends it. One warning per run of low steps. The
    count is not checkpointed: after a resume it starts again."""

    def __init__(self, fraction: float, patience: int) -> None:
        self.fraction, self.patience = fraction, patience
        self.low_steps = 0

    def observe(self, step: int, metrics: dict[str, float]) -> str | None:
        """The warning to print after step ``step``, or None."""
        ratio = metrics.get("rollout/acceptance_over_tau")
        if ratio is None or self.fraction <= 0:
            return None
        if ratio >= self.fraction:
            self.low_steps = 0
            return None
        self.low_steps += 1
        if self.low_steps != self.patience:
            return None
        k = round(metrics["rollout/draft_tokens"])
        return (f"step {step}: for {self.patience} speculative RL steps in a row the rollouts accepted less than "
                f"{self.fraction:g} x what the draft's training metric predicts on the same rollouts (now "
                f"{metrics['rollout/acceptance_length']:.2f} tokens per round against {tau_at(metrics, k):.2f}, "
                f"draft/tau over {k} passes): the engine's draft may read other inputs than training gives it "
                "(stale KV blocks, a missed weight refresh). rollout/acceptance_over_tau in TensorBoard shows the "
                "gap; [rollout] acceptance_warning_fraction sets the threshold.")
