"""Adaptive speculation: how many tokens the draft proposes, chosen from measurements.

Speculation pays when the tokens a round commits outweigh what the round costs. With
per-position acceptance rates ``a_d`` (the chance that drafted token ``d`` is accepted, given
that tokens ``1..d-1`` were), a round that drafts ``k`` tokens commits on average

    E(k) = 1 + sum_{j=1..k} prod_{d<=j} a_d        (E(0) = 1: plain decoding)

tokens per sequence, and costs ``c(k)`` seconds: ``k`` draft steps, one verify forward over
``k + 1`` positions and the draft's catch-up, plus its share of the call's prefill (with a
draft, the prefill also runs the draft over every prompt): ``c`` is measured as the call's
wall time over its rounds. The best ``k`` maximises ``E(k) / c(k)``, which
is 0 whenever the draft costs more than it saves: on a compute-bound batch, where a verify
forward of ``k + 1`` positions costs ``k + 1`` decode steps, or with a draft the policy has
left behind. Both sides move: ``c`` with the batch size (compute-bound at large batches,
memory-bound at small ones), ``a_d`` as the policy and the draft train.

``SpeculationTuner`` keeps, per batch-size bucket (powers of two), the measured seconds per
round at each ``k`` it ran, and one set of acceptance rates (a property of the policy and the
draft, not of the batch). For a bucket it has not seen it runs ``k_max`` (which measures
every ``a_d``), then ``k = 0``; from then on it runs the best ``k`` by the estimate, costs
of unmeasured ``k`` read off the line through the measured ones (a round's cost is affine in
``k``: ``k`` draft steps and ``k + 1`` verified positions), and every ``explore_every``-th call
it tries one more token than the best, so a draft that catches up is noticed. Exploration
is the only time it runs a ``k`` it does not expect to be best: at most one call in
``explore_every``.

Chosen ``k`` depend on timings, so sampled rollouts are not reproducible run to run (they
have the same distribution: speculative sampling is lossless at every ``k``).
"""

from __future__ import annotations

__all__ = ["SpeculationTuner", "expected_tokens"]


def expected_tokens(acceptance: list[float], k: int) -> float:
    """``E(k)``: tokens a round drafting ``k`` commits per sequence, from rates ``a_1..a_k``."""
    total, survive = 1.0, 1.0
    for rate in acceptance[:k]:
        survive *= rate
        total += survive
    return total


class SpeculationTuner:
    """Picks ``k`` in ``0..k_max`` for each ``generate`` call (``choose``) and learns from the
    call's statistics (``observe``). ``smoothing``: weight of a new measurement in the
    running averages."""

    def __init__(self, k_max: int, explore_every: int = 8, smoothing: float = 0.5) -> None:
        if k_max < 0 or explore_every < 2 or not 0 < smoothing <= 1:
            raise ValueError(f"k_max {k_max} must be >= 0, explore_every {explore_every} >= 2, smoothing "
                             f"{smoothing} in (0, 1]")
        self.k_max, self.explore_every, self.smoothing = k_max, explore_every, smoothing
        self.acceptance: list[float | None] = [None] * k_max
        self.round_s: dict[int, dict[int, float]] = {}  # bucket -> k -> seconds per round
        self.calls: dict[int, int] = {}

    @staticmethod
    def bucket(batch_size: int) -> int:
        return 1 << max(batch_size - 1, 0).bit_length()

    def cost(self, bucket: int, k: int) -> float | None:
        """Seconds per round at ``k``: measured, or on the line through the measured ``k``."""
        measured = self.round_s.get(bucket, {})
        if k in measured:
            return measured[k]
        below = [j for j in measured if j < k]
        above = [j for j in measured if j > k]
        if not below or not above:
            return None
        lo, hi = max(below), min(above)
        return measured[lo] + (measured[hi] - measured[lo]) * (k - lo) / (hi - lo)

    def estimate(self, bucket: int) -> dict[int, float]:
        """Expected tokens per second per sequence, ``E(k) / c(k)``, for every ``k`` it can estimate."""
        out = {}
        for k in range(self.k_max + 1):
            cost = self.cost(bucket, k)
            if cost is not None and all(a is not None for a in self.acceptance[:k]):
                out[k] = expected_tokens(self.acceptance, k) / max(cost, 1e-12)
        return out

    def best(self, batch_size: int) -> int:
        """The ``k`` with the highest estimated throughput (``k_max`` while nothing is known)."""
        estimates = self.estimate(self.bucket(batch_size))
        return max(estimates, key=estimates.get) if estimates else self.k_max

    def choose(self, batch_size: int) -> int:
        """``k`` for the next call with ``batch_size`` sequences in its first wave."""
        if self.k_max == 0:
            return 0
        bucket = self.bucket(batch_size)
        measured = self.round_s.get(bucket, {})
        if self.k_max not in measured:
            return self.k_max
        if 0 not in measured:
            return 0
        self.calls[bucket] = self.calls.get(bucket, 0) + 1
        best = self.best(batch_size)
        if self.calls[bucket] % self.explore_every == 0:
            return min(best + 1, self.k_max)
        return best

    def observe(self, batch_size: int, k: int, seconds_per_round: float, acceptance_rate: list[float]) -> None:
        """What a call at ``k`` measured: its seconds per round (``RolloutStats.seconds_per_round``:
        wall time, prefill included, over decoding rounds) and the acceptance rate of each
        drafted position (``k`` values)."""
        bucket = self.round_s.setdefault(self.bucket(batch_size), {})
        old = bucket.get(k)
        bucket[k] = seconds_per_round if old is None else old + self.smoothing * (seconds_per_round - old)
        for d, rate in enumerate(acceptance_rate[:k]):
            old = self.acceptance[d]
            self.acceptance[d] = rate if old is None else old + self.smoothing * (rate - old)
