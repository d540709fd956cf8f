"""A rollout phase's metrics, reduced over every rank with each rollout counted once."""

from collections.abc import Callable

import torch

from titan_cotrain.rl.batching import Sample
from titan_cotrain.rl.rollout import RolloutStats

__all__ = ["rollout_metrics"]


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
