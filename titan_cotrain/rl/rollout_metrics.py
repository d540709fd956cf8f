"""A rollout phase's metrics, reduced over every rank with each rollout counted once, and the
watch on the gap between the acceptance rollouts measure and the one the draft trains to."""

from collections.abc import Callable

import torch
import torch.distributed as dist

from titan_cotrain.cotrain.ttt import tau
from titan_cotrain.rl.batching import Sample
from titan_cotrain.engine.rollout import RolloutStats
from titan_cotrain.engine.round_stats import RoundTable
from titan_cotrain.rl.rewards import COUNTS

__all__ = ["acceptance_over_tau", "predicted_acceptance", "rollout_metrics", "tau_at"]


def rollout_metrics(all_reduce: Callable[..., list[float]], samples: list[Sample], details: list[dict],
                    stats: RolloutStats | None, k_max: int, *, buckets: int, counted: bool, group_size: int = 1,
                    eos_id: int | None = None) -> dict[str, float]:
    """Rewards, response lengths and the task's details of ``samples`` (this rank's batch)
    where ``counted`` (one rank of those that hold the same batch), and the generation's
    ``stats`` (None where this rank's do not count: it generated nothing, or a rank of its
    tensor-parallel engine group reports them), summed over every rank by ``all_reduce``
    (one call, after the details' names are agreed: ``_detail_names``), and the longest
    response (a second call, a max). ``k_max``: the most a round drafts; ``buckets``: the
    engine's live-rows buckets (``RoundTable``); ``group_size``: consecutive samples that are
    one group; ``eos_id``: the tokenizer's EOS.

    Of the responses: ``rollout/response_len`` (mean) and ``response_len_max``,
    ``truncated_share`` (those that reached ``max_new_tokens`` without a stop),
    ``stop_eos_share`` and ``stop_id_share`` (those ended by the EOS, by another stop id);
    ``rl/zero_advantage_groups``, the share of groups whose advantages are all 0 (their
    rewards all equal: no signal).

    From the details: ``task/<name>``, the mean of each reward part over the responses whose
    call returned it, and the sum of each of the scorer's counts (``rl.rewards.COUNTS``:
    ``task/reward_timeouts``, ``task/reward_errors``, calls of the step).

    From the rounds (``RolloutStats.rounds``, summed over the engines): ``acceptance_length``
    over the rounds that drafted (1 where none did), ``acceptance_rate_<d>``, ``draft_tokens``
    (the mean k over every (sequence, round) pair, plain rounds 0) and ``draft_share_k<k>``
    (the share of pairs at each k, so a step whose rounds chose several k is predicted right);
    per live-rows bucket ``live_le<n>``: its wall seconds (mean over the engines), tokens (sum)
    and mean k; ``tail_share`` (the wall time with at most a quarter of the rows live, over
    the rollouts' wall time); ``preemptions`` and ``recomputed_tokens`` (summed,
    ``RolloutStats``); ``time/draft_per_round_s`` and ``time/verify_per_round_s``: the
    seconds a round the draft followed spent in the draft (drafting and catching up) and in
    the target's verification, over every engine's such rounds (what a round of the draft
    costs); ``acceptance_length_q<q>``: tokens per drafting round of the
    sequences in quarter ``q`` of ``max_new_tokens`` (mean over the engines that drafted there)."""
    weight = float(counted)
    rewards = torch.tensor([s.reward for s in samples]) * weight
    names = _detail_names(details)
    generated = stats is not None
    table = stats.rounds if generated and stats.rounds is not None else RoundTable.empty(buckets, k_max)
    by_position = torch.tensor(stats.acceptance_by_position if generated and stats.acceptance_by_position
                               else [float("nan")] * 4, dtype=torch.float64)
    seen = ~by_position.isnan()
    totals = all_reduce([
        float(rewards.sum()), float((rewards ** 2).sum()), len(samples) * weight,
        float(sum(len(s.response) for s in samples)) * weight,
        stats.tokens_per_s if generated else 0.0, float(generated), stats.kv_peak_bytes / 2**30 if generated else 0.0,
        stats.tail_s if generated else 0.0, stats.total_s if generated else 0.0,
        float(stats.preemptions) if generated else 0.0, float(stats.recomputed_tokens) if generated else 0.0,
        stats.draft_s if generated else 0.0, stats.verify_s if generated else 0.0,
        *by_position.nan_to_num(0.0).tolist(), *seen.double().tolist(), *table.flat(),
        *(total for name in names for total in (sum(d[name] for d in details if name in d) * weight,
                                                 sum(name in d for d in details) * weight)),
        *(x * weight for x in _response_counts(samples, group_size, eos_id))])
    longest, = all_reduce([float(max((len(s.response) for s in samples), default=0))], op=dist.ReduceOp.MAX)
    count, ranks = totals[2], max(totals[5], 1.0)
    mean = totals[0] / count
    flat_at = 13 + 8
    table = RoundTable.from_flat(totals[flat_at:flat_at + len(table.flat())], buckets, k_max)
    pairs = table.live.sum(0)  # [M] (sequence, round) pairs per mode
    k_of_mode = torch.tensor([0.0, *range(k_max + 1)], dtype=torch.float64)
    drafted = pairs[2:].sum()
    metrics = {
        "reward/mean": mean,
        "reward/std": max(totals[1] / count - mean ** 2, 0.0) ** 0.5,
        "rollout/response_len": totals[3] / count,
        "rollout/acceptance_length": float(table.tokens.sum(0)[2:].sum() / drafted) if drafted else 1.0,
        "rollout/tokens_per_s": totals[4],  # every rollout is generated once, by one engine
        "rollout/draft_tokens": float((pairs * k_of_mode).sum() / pairs.sum()) if pairs.sum() else 0.0,
        "rollout/kv_peak_gib": totals[6] / ranks,  # KV blocks held at once, per generating rank
        "rollout/tail_share": totals[7] / totals[8] if totals[8] else 0.0,
        "rollout/preemptions": totals[9],  # sequences preempted when an engine's KV pool ran dry
        "rollout/recomputed_tokens": totals[10],  # positions their resumes prefilled again
    }
    if drafted:
        metrics |= {f"rollout/draft_share_k{k}": float(pairs[1 + k] / pairs.sum()) for k in range(k_max + 1)}
    followed = float(table.rounds[:, 1:].sum())  # rounds the draft followed, over every engine
    if followed:
        metrics["time/draft_per_round_s"] = totals[11] / followed
        metrics["time/verify_per_round_s"] = totals[12] / followed
    judged, accepted = table.judged.sum(0), table.accepted.sum(0)
    metrics |= {f"rollout/acceptance_rate_{d}": float(accepted[d - 1] / judged[d - 1])
                for d in range(1, k_max + 1) if judged[d - 1]}
    q_sum, q_seen = totals[13:17], totals[17:21]
    metrics |= {f"rollout/acceptance_length_q{q}": q_sum[q - 1] / q_seen[q - 1] for q in range(1, 5) if q_seen[q - 1]}
    for b in range(buckets):
        rows = table.live[b]
        if table.rounds[b].sum():
            name = f"rollout/live_le{2 ** b}"
            metrics[f"{name}_s"] = float(table.seconds[b].sum()) / ranks
            metrics[f"{name}_tokens"] = float(table.tokens[b].sum())
            metrics[f"{name}_k"] = float((rows * k_of_mode).sum() / rows.sum()) if rows.sum() else 0.0
    parts = totals[flat_at + len(table.flat()):]
    parts, (truncated, eos, stop_id, groups, zero_groups) = parts[:-5], parts[-5:]
    metrics |= {f"task/{name}": total if name in COUNTS else total / calls
                for name, total, calls in zip(names, parts[0::2], parts[1::2]) if calls}
    metrics |= {"rollout/response_len_max": longest, "rollout/truncated_share": truncated / count,
                "rollout/stop_eos_share": eos / count, "rollout/stop_id_share": stop_id / count,
                "rl/zero_advantage_groups": zero_groups / groups if groups else 0.0}
    return metrics


def _response_counts(samples: list[Sample], group_size: int, eos_id: int | None) -> list[float]:
    """``[truncated, ended by the EOS, ended by another stop id, groups, groups with all
    advantages 0]`` of this rank's ``samples``."""
    truncated = sum(s.truncated for s in samples)
    eos = sum(not s.truncated and bool(s.response) and s.response[-1] == eos_id for s in samples)
    groups = [samples[i:i + group_size] for i in range(0, len(samples), group_size)]
    zero = sum(all(s.advantage == 0 for s in group) for group in groups)
    return [float(truncated), float(eos), float(len(samples) - truncated - eos), float(len(groups)), float(zero)]


def _detail_names(details: list[dict]) -> list[str]:
    """The names in the responses' details over every rank, sorted: the sums are one list that
    every rank must lay out alike, and a rank's own details may lack a name (a reward may
    return different parts on different calls, and a call that failed returns none). An
    all-gather where the job is distributed."""
    names = sorted({name for d in details for name in d})
    if dist.is_initialized() and dist.get_world_size() > 1:
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, names)
        names = sorted({name for rank_names in gathered for name in rank_names})
    return names


def tau_at(metrics: dict[str, float], k: int, sampled: bool = False) -> float | None:
    """What the draft's training metric predicts for rounds of ``k`` drafted tokens,
    ``1 + sum_{j<=k} prod_{d<=j} a_d`` over its first ``k`` passes (all of them when ``k``
    exceeds ``draft.ttt_steps``): greedy rounds' ``a_d`` is ``draft/acc_pass<d>``, the draft's
    top-1 agreement with the teacher (``draft/tau`` at ``k = ttt_steps``); ``sampled`` rounds'
    is ``draft/accept_pass<d>``, ``sum_x min(teacher, draft)``, speculative sampling's
    acceptance chance (exact at temperature 1, where training's teacher and draft are the
    engine's two distributions; an approximation at other temperatures or with top-p/top-k).
    None without them (no draft trained this step)."""
    kind = "accept" if sampled else "acc"
    if f"draft/{kind}_pass1" not in metrics:
        return None
    passes = [f"draft/{kind}_pass{d}" for d in range(1, k + 1)]
    accuracy = [metrics[key] for key in passes if key in metrics]  # none past draft.ttt_steps
    return float(tau(torch.tensor(accuracy, dtype=torch.float64)))


def predicted_acceptance(metrics: dict[str, float], sampled: bool = False) -> float | None:
    """What the draft's training metric predicts for the step's drafting rounds: ``tau_at``
    each ``k`` weighted by the share of rounds that drafted it (``rollout/draft_share_k<k>``;
    a step without them drafted ``rollout/draft_tokens`` every round). None for a step that
    decoded plainly or trained no draft."""
    prefix = "rollout/draft_share_k"
    shares = {k: v for key, v in metrics.items() if key.startswith(prefix) and v
              and (k := int(key[len(prefix):])) > 0}
    if not shares:
        k = round(metrics.get("rollout/draft_tokens", 0.0))
        shares = {k: 1.0} if k > 0 else {}
    predicted = {k: tau_at(metrics, k, sampled) for k in shares}
    if not shares or None in predicted.values():
        return None
    return sum(shares[k] * predicted[k] for k in shares) / sum(shares.values())


def acceptance_over_tau(metrics: dict[str, float], sampled: bool = False) -> dict[str, float]:
    """``rollout/predicted_acceptance`` (``predicted_acceptance``: ``tau_at`` the rounds' ``k``,
    ``sampled`` when the rollouts sampled, temperature > 0) and ``rollout/acceptance_over_tau``,
    the rollouts' acceptance length over it, for an RL step's ``metrics``. The two measure the
    same draft on the same sequences (the update scores the draft on the rollouts it drafted,
    before its own step), so a ratio well below 1 means the engine feeds the draft other
    inputs than training does. Empty for a step that decoded plainly or trained no draft."""
    predicted = predicted_acceptance(metrics, sampled)
    if predicted is None:
        return {}
    return {"rollout/predicted_acceptance": predicted,
            "rollout/acceptance_over_tau": metrics["rollout/acceptance_length"] / predicted}
