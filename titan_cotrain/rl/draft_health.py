"""The draft's health in the rollouts: a warning when the rollouts accept much less than the
draft's training metric predicts on the same sequences (``AcceptanceWatch``), and a warning
and the ``draft/collapse`` metric when the acceptance the rollouts measure collapses
(``DraftCollapseWatch``). Speculative sampling stays lossless whatever the
draft computes, so a draft that stopped predicting (past its ``max_position_embeddings``, on
weights the engine never refreshed, or left behind by a policy that moved) only makes rollouts
slower, with no error; the tuner then falls back to plain decoding, and the user must be told."""

from __future__ import annotations


__all__ = ["AcceptanceWatch", "DraftCollapseWatch"]


class DraftCollapseWatch:
    """Judges every speculative RL step from its metrics: a *length collapse* when the tokens a
    drafting round gains (``rollout/acceptance_length - 1``) fall below ``fraction`` x their
    running mean at the step's ``k`` (an exponential average, weight ``smoothing``), or a
    *position collapse* when a drafted position's acceptance rate
    (``rollout/acceptance_rate_<d>``, ``d <= k``) is below ``position_rate``; the first
    ``warm_steps`` steps at a ``k`` only make its mean. ``patience`` collapsed steps in a row make a collapse: ``judge`` then
    reports ``draft/collapse = 1`` and ``observe`` the warning, once per run of collapsed steps
    (``[rollout] collapse_fraction``, ``collapse_position_rate``, ``collapse_steps``). Steps
    that decode plainly neither count nor end a run; a healthy step ends it. A collapsed step
    does not move the running mean. ``fraction = 0`` disables the length test and
    ``position_rate = 0`` the position test. The state is not checkpointed: after a resume it
    learns the mean again."""

    def __init__(self, fraction: float = 0.5, position_rate: float = 0.05, patience: int = 3,
                 smoothing: float = 0.2, warm_steps: int = 3) -> None:
        self.fraction, self.position_rate, self.patience = fraction, position_rate, patience
        self.smoothing, self.warm_steps = smoothing, warm_steps
        self.mean: dict[int, float] = {}  # k -> running mean of acceptance_length - 1
        self.seen: dict[int, int] = {}  # k -> healthy steps that made the mean
        self.collapsed_steps = 0
        self.reason = ""
        self._judged: tuple[int, dict] | None = None

    def _collapse(self, metrics: dict[str, float]) -> str:
        """Why this step collapsed ("" if it did not); learns from a healthy one."""
        k = round(metrics["rollout/draft_tokens"])
        gain = metrics["rollout/acceptance_length"] - 1.0
        rates = {d: metrics[f"rollout/acceptance_rate_{d}"] for d in range(1, max(k, 1) + 1)
                 if f"rollout/acceptance_rate_{d}" in metrics}
        dead = [d for d, rate in rates.items() if rate < self.position_rate]
        mean = self.mean.get(k)
        warm = self.seen.get(k, 0) >= self.warm_steps  # neither test judges a k's first steps
        if warm and self.fraction > 0 and gain < self.fraction * mean:
            return (f"acceptance length {gain + 1:.2f} tokens per round, below {self.fraction:g} x its running mean "
                    f"{mean + 1:.2f} at k = {k}")
        if warm and self.position_rate > 0 and dead:
            return (f"drafted position {dead[0]} accepted {rates[dead[0]]:.3f} of the time, below "
                    f"{self.position_rate:g}")
        self.mean[k] = gain if mean is None else mean + self.smoothing * (gain - mean)
        self.seen[k] = self.seen.get(k, 0) + 1
        return ""

    def judge(self, metrics: dict[str, float]) -> dict[str, float]:
        """``{"draft/collapse": 0.0 | 1.0}`` for a speculative step, ``{}`` for a plain one."""
        if metrics.get("rollout/draft_tokens", 0.0) <= 0 or "rollout/acceptance_length" not in metrics:
            return {}
        reason = self._collapse(metrics)
        if reason:
            self.collapsed_steps += 1
            self.reason = reason
        else:
            self.collapsed_steps = 0
        return {"draft/collapse": float(self.collapsed_steps >= self.patience)}

    def observe(self, step: int, metrics: dict[str, float]) -> str | None:
        """The warning to print after step ``step`` (whose ``metrics`` went through ``judge``),
        or None."""
        if metrics.get("draft/collapse") != 1.0 or self.collapsed_steps != self.patience:
            return None
        return (f"step {step}: the draft's acceptance collapsed for {self.patience} speculative RL steps in a row "
                f"({self.reason}). Rollouts stay exact but speculation no longer pays: the draft may be past its "
                "max_position_embeddings (long responses), run on weights the engine did not refresh, or have "
                "stopped training ([draft] freeze_after_sft) while the policy moved. draft/collapse and "
                "rollout/acceptance_length_q1..q4 in TensorBoard show it; [rollout] collapse_fraction, "
                "collapse_position_rate and collapse_steps set the test.")


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
        return (f"step {step}: for {self.patience} speculative RL steps in a row the rollouts accepted less than "
                f"{self.fraction:g} x what the draft's training metric predicts on the same rollouts (now "
                f"{metrics['rollout/acceptance_length']:.2f} tokens per round against "
                f"{metrics['rollout/predicted_acceptance']:.2f}, the draft's training accuracy over the passes the "
                "rounds drafted): the engine's "
                "draft may read other inputs than training gives it "
                "(stale KV blocks, a missed weight refresh). rollout/acceptance_over_tau in TensorBoard shows the "
                "gap; [rollout] acceptance_warning_fraction sets the threshold.")
