"""Adaptive speculation: how many tokens the draft proposes, chosen from measurements.

Speculation pays when the tokens a round commits outweigh what the round costs. With
per-position acceptance rates ``a_d`` (the chance that drafted token ``d`` is accepted, given
that tokens ``1..d-1`` were), a round that drafts ``k`` tokens commits on average

    E(k) = 1 + sum_{j=1..k} prod_{d<=j} a_d        (E(0) = 1: plain decoding)

tokens per running sequence. A call at ``k`` runs some number of rounds, each costing ``c(k)``
seconds of wall time (``k`` draft steps, one verify forward over ``k + 1`` positions, the
draft's catch-up, and the round's share of the prefill, which with a draft also runs the draft
over every prompt), and commits ``n(k) E(k)`` tokens per round, where ``n(k)`` is the number
of sequences a round effectively serves: fewer than the batch while the batch drains, and
fewer at ``k >= 1`` than at 0 when the longest response's acceptance is unlucky (the call
lasts as long as its slowest sequence). Its tokens per second are

    T(k) = n(k) E(k) / c(k),

and ``k = 0`` is best whenever the draft costs more than it saves: on a compute-bound batch,
where a verify forward of ``k + 1`` positions costs ``k + 1`` decode steps, or with a draft the
policy has left behind. ``c`` moves with the batch size (compute-bound at large batches,
memory-bound at small ones), ``a_d`` as the policy and the draft train.

``SpeculationTuner`` keeps, per batch-size bucket (powers of two) and per ``k`` it ran, the
measured ``c(k)`` and ``n(k)`` (the call's committed tokens per round over ``E(k)`` at the
call's own acceptance), and one set of acceptance rates (a property of the policy and the
draft, not of the batch). At a measured ``k`` the estimate is therefore the measured wall
tokens/s, rescaled only by how acceptance has moved since. An unmeasured ``k`` takes ``c``
and ``n`` on the line between its measured neighbours: an optimistic guess when drafting
has a fixed cost (catch-up, the draft's prefill), so the tuner tries it once and from then
on uses what it measured. Drafting is chosen only where it is estimated ``min_gain`` (5%)
faster than plain decoding (measurements are noisy, and plain decoding is the choice that
cannot make a rollout slower), and a depth it drafts with is replaced by another only when
that is estimated ``min_gain`` faster. For a bucket it has not seen it runs ``k_max`` (which measures
every ``a_d``), then ``k = 0``, then the best estimate; every ``explore_every``-th call it
runs a neighbour of the best instead (one token more and one less, in turn), so a draft
that catches up is noticed and a stale measurement is refreshed. Exploration is the only
time it runs a ``k`` it does not expect to be best: at most one call in ``explore_every``.

Chosen ``k`` depend on timings, so sampled rollouts are not reproducible run to run (they
have the same distribution: speculative sampling is lossless at every ``k``).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["SpeculationTuner", "expected_tokens"]


def expected_tokens(acceptance: list[float], k: int) -> float:
    """``E(k)``: tokens a round drafting ``k`` commits per sequence, from rates ``a_1..a_k``."""
    total, survive = 1.0, 1.0
    for rate in acceptance[:k]:
        survive *= rate
        total += survive
    return total


@dataclass
class Measured:
    """What the calls at one ``(bucket, k)`` measured (running averages): ``round_s``, the wall
    seconds per round ``c(k)``; ``served``, the sequences a round effectively served ``n(k)``."""

    round_s: float
    served: float


class SpeculationTuner:
    """Picks ``k`` in ``0..k_max`` for each ``generate`` call (``choose``) and learns from the
    call's statistics (``observe``). ``smoothing``: weight of a new measurement in the
    running averages. ``min_gain``: drafting is chosen only where its estimate beats plain
    decoding's by this fraction (one call's timing is noisy; a wrong switch-on makes rollouts
    slower, a missed gain below the margin costs at most that much)."""

    def __init__(self, k_max: int, explore_every: int = 8, smoothing: float = 0.5, min_gain: float = 0.05) -> None:
        if k_max < 0 or explore_every < 2 or not 0 < smoothing <= 1 or min_gain < 0:
            raise ValueError(f"k_max {k_max} must be >= 0, explore_every {explore_every} >= 2, smoothing "
                             f"{smoothing} in (0, 1], min_gain {min_gain} >= 0")
        self.k_max, self.explore_every, self.smoothing, self.min_gain = k_max, explore_every, smoothing, min_gain
        self.acceptance: list[float | None] = [None] * k_max
        self.measured: dict[int, dict[int, Measured]] = {}  # bucket -> k -> what its calls measured
        self.drafting: dict[int, int] = {}  # bucket -> the k >= 1 it last chose to draft with
        self.calls: dict[int, int] = {}

    @staticmethod
    def bucket(batch_size: int) -> int:
        return 1 << max(batch_size - 1, 0).bit_length()

    def _at(self, bucket: int, k: int) -> Measured | None:
        """``c(k)`` and ``n(k)``: measured, or on the line between the nearest measured ``k``."""
        measured = self.measured.get(bucket, {})
        if k in measured:
            return measured[k]
        below = [j for j in measured if j < k]
        above = [j for j in measured if j > k]
        if not below or not above:
            return None
        lo, hi = measured[max(below)], measured[min(above)]
        t = (k - max(below)) / (min(above) - max(below))
        return Measured(lo.round_s + t * (hi.round_s - lo.round_s), lo.served + t * (hi.served - lo.served))

    def estimate(self, bucket: int) -> dict[int, float]:
        """Expected tokens per second, ``n(k) E(k) / c(k)``, for every ``k`` it can estimate."""
        out = {}
        for k in range(self.k_max + 1):
            at = self._at(bucket, k)
            if at is not None and all(a is not None for a in self.acceptance[:k]):
                out[k] = at.served * expected_tokens(self.acceptance, k) / max(at.round_s, 1e-12)
        return out

    def best(self, batch_size: int) -> int:
        """The ``k`` with the highest estimated throughput (``k_max`` while nothing is known),
        with two margins of ``min_gain``: a ``k >= 1`` replaces the depth it drafted with last
        only when that much faster, and drafting replaces plain decoding only when that much
        faster (one noisy call at a neighbouring depth does not move the choice)."""
        bucket = self.bucket(batch_size)
        estimates = self.estimate(bucket)
        if not estimates:
            return self.k_max
        best = max(estimates, key=estimates.get)
        current = self.drafting.get(bucket)
        if best and current in estimates and estimates[best] < (1 + self.min_gain) * estimates[current]:
            best = current
        if 0 in estimates and estimates[best] < (1 + self.min_gain) * estimates[0]:
            return 0
        return best

    def choose(self, batch_size: int) -> int:
        """``k`` for the next call with ``batch_size`` sequences in its first wave."""
        if self.k_max == 0:
            return 0
        bucket = self.bucket(batch_size)
        measured = self.measured.get(bucket, {})
        if self.k_max not in measured:
            return self.k_max
        if 0 not in measured:
            return 0
        self.calls[bucket] = self.calls.get(bucket, 0) + 1
        best = self.best(batch_size)
        exploration, due = divmod(self.calls[bucket], self.explore_every)
        if due:
            if best:
                self.drafting[bucket] = best
            return best
        up, down = min(best + 1, self.k_max), max(best - 1, 0)
        if up == best or (exploration % 2 == 0 and down != best):
            return down
        return up

    def observe(self, batch_size: int, k: int, seconds_per_round: float, tokens_per_round: float,
                acceptance_rate: list[float]) -> None:
        """What a call at ``k`` measured (``RolloutStats``): its wall seconds per round, prefill
        included (``seconds_per_round``), the tokens it committed per round over the batch
        (``tokens_per_round``), and the acceptance rate of each drafted position (``k`` values)."""
        served = tokens_per_round / expected_tokens(acceptance_rate, k)
        bucket = self.measured.setdefault(self.bucket(batch_size), {})
        old = bucket.get(k)
        if old is None:
            bucket[k] = Measured(seconds_per_round, served)
        else:
            old.round_s += self.smoothing * (seconds_per_round - old.round_s)
            old.served += self.smoothing * (served - old.served)
        for d, rate in enumerate(acceptance_rate[:k]):
            old_rate = self.acceptance[d]
            self.acceptance[d] = rate if old_rate is None else old_rate + self.smoothing * (rate - old_rate)
