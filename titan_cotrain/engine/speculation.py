"""Adaptive speculation: how many tokens the draft proposes, chosen every decoding round.

Speculation pays when the tokens a round commits outweigh what the round costs. With
per-position acceptance rates ``a_d`` (the chance that drafted token ``d`` is accepted, given
that tokens ``1..d-1`` were), a round that drafts ``k`` tokens commits on average

    E(k) = 1 + sum_{j=1..k} prod_{d<=j} a_d        (E(0) = 1: plain decoding)

tokens per live sequence. What a round costs, ``c``, depends on how many sequences it decodes:
a verify forward over ``k + 1`` positions costs about one decode step while the batch is small
(memory- and launch-bound), and ``k + 1`` steps once it is large (compute-bound). An RL
rollout moves through both: its batch is full while GRPO groups wait, then drains, and its
last few long responses decode at a concurrency of a handful of rows, which is where
speculation pays most (and where, with long-tailed response lengths, much of the rollout's
wall time goes). So ``k`` is chosen every round, from the live rows of that round.

``SpeculationTuner`` measures, per live-rows bucket ``b`` (``round_stats.live_bucket``:
powers of two) and per mode ``m`` (``RoundTable``: 0 plain decoding without the draft, ``1 + k``
a round drafting ``k`` with the draft following the call), the wall seconds of a round
``c_b(m)``; per bucket the acceptance rates ``a_{b,d}`` (long responses reach the small buckets
late, and a draft accepts less deep into a response) and the live sequences of a round
``n_b``; and per bucket ``V_b``, the tokens a call commits there. A round at ``k`` serves its
sequences at ``E_b(k) / c_b(1 + k)`` tokens per second each:

* ``choose_round(live)``: during a call the draft follows, the ``k`` in ``0..k_max`` (0: a
  target decode plus the draft's catch-up) of the highest ``E_b(k) / c_b(1 + k)``. A ``k`` not
  yet measured in the bucket is run in turn first (``k_max``, which measures every ``a_d``,
  then ``0, 1, ...``); a new best replaces the bucket's current one only when ``min_gain``
  faster; every ``explore_every``-th round of a bucket runs a neighbour of the best instead
  (one token more and one less, in turn), so a draft that catches up or falls behind is seen.
* ``start_call()``: whether the draft follows the next call at all. Following costs the
  draft's pass over every prompt and its catch-up in rounds that draft nothing; plain
  decoding costs neither. The expected call times are ``sum_b V_b c_b(m_b) / (n_b E_b)`` plus
  the call's prefill, with each bucket at its best mode either way; the draft follows only
  where that is ``min_gain`` (5%) faster than plain decoding (measurements are noisy, and plain
  decoding is the choice that cannot make a rollout slower). The first call drafts (and
  measures), the second decodes plainly, and from the ``explore_every``-th call on a call runs
  the other choice every ``interval`` calls: ``explore_every`` while the two are within
  ``wide_margin`` (20%) of each other, doubled at each exploration that finds the current
  choice still that far ahead, up to ``max_interval_factor x explore_every`` (64 calls). An
  exploration of plain decoding costs a whole call at plain speed; once a draft has proved
  itself by a wide margin a few times, it is re-checked rarely, and as soon as the margin
  narrows (a moving policy, a draft falling behind) the checks are frequent again.
* ``choose_call(batch)``: one ``k`` for a whole call (``[rollout] speculation_granularity =
  "call"``), from the bucket of its first wave: plain decoding against ``E_b(k) / c_b(1 + k)``,
  with the margins above; every ``interval``-th call runs a neighbour of the best ``k`` (one
  more and one fewer in turn, 0 included), the interval doubling, as ``start_call``'s, at each
  exploration that finds the best more than ``wide_margin`` faster than the neighbour it ran.
  Its tail runs at the bulk's ``k``.

Measurements are running averages (``smoothing``), learnt from whole calls (``observe``, a
``RoundTable``): within a call the state is frozen, so every rank of a tensor-parallel engine
group, which sees the same live rows, makes the same choices. The tuner is a DCP ``Stateful``
(its tables as tensors whose shapes depend on ``k_max`` only): a job resumes with what it had
learnt, at any layout. Chosen ``k`` depend on timings,
so sampled rollouts are not reproducible run to run (they have the same distribution:
speculative sampling is lossless at every ``k``, and in every round).
"""

from __future__ import annotations

import torch

from titan_cotrain.engine.round_stats import RoundTable, live_bucket

__all__ = ["SpeculationTuner", "expected_tokens"]

STATE_BUCKETS = 32  # live-rows buckets a checkpoint holds: up to 2^31 live sequences


def expected_tokens(acceptance: list[float], k: int) -> float:
    """``E(k)``: tokens a round drafting ``k`` commits per sequence, from rates ``a_1..a_k``."""
    total, survive = 1.0, 1.0
    for rate in acceptance[:k]:
        survive *= rate
        total += survive
    return total


class SpeculationTuner:
    """Picks ``k`` in ``0..k_max`` for each decoding round (``start_call``, ``choose_round``) or
    each call (``choose_call``) and learns from the calls' ``RoundTable`` (``observe``).
    ``smoothing``: weight of a new measurement in the running averages. ``min_gain``: the
    margin a new choice must beat the current one by (and drafting, plain decoding)."""

    def __init__(self, k_max: int, explore_every: int = 8, smoothing: float = 0.5, min_gain: float = 0.05,
                 wide_margin: float = 0.2, max_interval_factor: int = 8) -> None:
        if (k_max < 0 or explore_every < 2 or not 0 < smoothing <= 1 or min_gain < 0 or wide_margin < 0
                or max_interval_factor < 1):
            raise ValueError(f"k_max {k_max} must be >= 0, explore_every {explore_every} >= 2, smoothing "
                             f"{smoothing} in (0, 1], min_gain {min_gain} >= 0, wide_margin {wide_margin} >= 0, "
                             f"max_interval_factor {max_interval_factor} >= 1")
        self.k_max, self.explore_every, self.smoothing, self.min_gain = k_max, explore_every, smoothing, min_gain
        self.wide_margin, self.max_interval = wide_margin, max_interval_factor * explore_every
        self.interval = explore_every  # calls between explorations of the other choice
        self.next_exploration = explore_every  # the call count of the next one
        self.round_s: dict[tuple[int, int], float] = {}  # (bucket, mode) -> c_b(m)
        self.live: dict[int, float] = {}  # bucket -> n_b
        self.volume: dict[int, float] = {}  # bucket -> V_b
        self.acceptance: dict[int, list[float | None]] = {}  # bucket -> a_{b,d}
        self.pooled: list[float | None] = [None] * k_max  # a_d over every bucket
        self.prefill_s: dict[bool, float] = {}  # draft follows -> a call's prefill seconds
        self.current: dict[int, int] = {}  # bucket -> the k its rounds run (the margin's reference)
        self.current_call: dict[int, int] = {}  # bucket -> the k its calls run
        self.follows = True  # whether the draft follows calls (the margin's reference)
        self.calls = 0
        self.explorations = 0  # of choose_call: which neighbour the next one runs
        self._rounds: dict[int, int] = {}  # bucket -> rounds of the current call

    # The estimates.

    def rates(self, bucket: int) -> list[float | None]:
        """``a_{b,d}``: the bucket's own where measured, else the pooled rate, else (a depth
        never judged: its predecessors are rarely accepted, so it weighs little) the rate of
        the depth before it; None before any drafted token was judged."""
        own = self.acceptance.get(bucket, [None] * self.k_max)
        rates = [a if a is not None else p for a, p in zip(own, self.pooled)]
        for d in range(1, self.k_max):
            if rates[d] is None:
                rates[d] = rates[d - 1]
        return rates

    def speed(self, bucket: int, k: int, follows: bool = True) -> float | None:
        """Tokens per second per live sequence of a round at ``k`` in ``bucket``:
        ``E_b(k) / c_b(m)``, ``m = 1 + k`` with the draft following, ``0`` plain (``k = 0``);
        None where not measured."""
        cost = self.cost(bucket, 1 + k if follows else 0)
        rates = self.rates(bucket)[:k]
        if cost is None or any(a is None for a in rates):
            return None
        return expected_tokens(rates, k) / max(cost, 1e-12)

    def cost(self, bucket: int, mode: int) -> float | None:
        """``c_b(m)``: the bucket's own where measured, else the nearest bucket's that is (a
        bucket the calls rarely reach), None where no bucket ran ``mode``."""
        measured = [b for b, m in self.round_s if m == mode]
        if not measured:
            return None
        return self.round_s[min(measured, key=lambda b: (abs(b - bucket), b)), mode]

    def _best(self, speeds: dict[int, float], current: int | None) -> int:
        """The fastest ``k`` of ``speeds``, unless it beats ``current`` by less than ``min_gain``."""
        best = max(speeds, key=speeds.get)
        if current in speeds and speeds[best] < (1 + self.min_gain) * speeds[current]:
            return current
        return best

    def best_round(self, bucket: int) -> int | None:
        """The ``k`` a round in ``bucket`` runs outside exploration, None before it is measured."""
        speeds = {k: self.speed(bucket, k) for k in range(self.k_max + 1)}
        if any(v is None for v in speeds.values()):
            return None
        return self._best(speeds, self.current.get(bucket))

    def call_seconds(self, follows: bool) -> float | None:
        """Expected wall seconds of a call, its prefill and every bucket ``V_b`` at its best
        ``k`` (with the draft following) or plainly; None where a bucket is unmeasured."""
        if follows not in self.prefill_s:
            return None
        total = self.prefill_s[follows]
        for bucket, volume in self.volume.items():
            if not volume:
                continue
            if follows:
                k = self.best_round(bucket)
                speed = self.speed(bucket, k) if k is not None else None
            else:
                speed = self.speed(bucket, 0, follows=False)
            if speed is None:
                return None
            total += volume / (self.live[bucket] * speed)
        return total

    # The choices.

    def start_call(self) -> bool:
        """Whether the draft follows the next call (``choose_round`` then picks each round's
        ``k``); False: it decodes plainly. Resets the call's round counts."""
        self._rounds = {}
        if self.k_max == 0:
            return False
        self.calls += 1
        if True not in self.prefill_s or False not in self.prefill_s:
            self.follows = True not in self.prefill_s  # measure drafting, then plain decoding
            return self.follows
        drafting, plain = self.call_seconds(True), self.call_seconds(False)
        if drafting is None or plain is None:
            best = drafting is None  # measure what is missing
        elif self.follows:
            best = drafting * (1 + self.min_gain) < plain * (1 + 2 * self.min_gain)  # stay unless worse
        else:
            best = drafting * (1 + self.min_gain) < plain
        if self.calls >= self.next_exploration:
            wide = drafting is not None and plain is not None and max(drafting, plain) > (
                1 + self.wide_margin) * min(drafting, plain)
            self.interval = min(2 * self.interval, self.max_interval) if wide else self.explore_every
            self.next_exploration = self.calls + self.interval
            return not best
        self.follows = best
        return best

    def choose_round(self, live: int) -> int:
        """``k`` for the next round of a call the draft follows, with ``live`` sequences."""
        bucket = live_bucket(live)
        r = self._rounds[bucket] = self._rounds.get(bucket, 0) + 1
        order = [self.k_max, *range(self.k_max)]
        unmeasured = [k for k in order if (bucket, 1 + k) not in self.round_s]
        best = self.best_round(bucket)
        if unmeasured or best is None:
            return (unmeasured or order)[(r - 1) % len(unmeasured or order)]
        exploration, due = divmod(r + self.calls, self.explore_every)
        if due:
            return best
        return self._neighbour(best, exploration)

    def choose_call(self, batch_size: int) -> int:
        """One ``k`` for the next call, whose first wave has ``batch_size`` sequences."""
        self._rounds = {}
        if self.k_max == 0:
            return 0
        bucket = live_bucket(batch_size)
        if self.speed(bucket, self.k_max) is None:
            return self.k_max
        plain = self.speed(bucket, 0, follows=False)
        if plain is None:
            return 0
        self.calls += 1
        speeds = {0: plain} | {k: s for k in range(1, self.k_max + 1) if (s := self.speed(bucket, k)) is not None}
        drafting = {k: s for k, s in speeds.items() if k}
        best = self._best(drafting, self.current_call.get(bucket))
        if speeds[best] < (1 + self.min_gain) * plain:
            best = 0
        if self.calls < self.next_exploration:
            if best:
                self.current_call[bucket] = best
            return best
        # An exploration: a neighbour of the best, one more and one fewer in turn. While the best
        # stays more than wide_margin faster than the one explored, the next waits twice as long.
        other = self._neighbour(best, self.explorations)
        self.explorations += 1
        wide = other in speeds and speeds[best] > (1 + self.wide_margin) * speeds[other]
        self.interval = min(2 * self.interval, self.max_interval) if wide else self.explore_every
        self.next_exploration = self.calls + self.interval
        return other

    def _neighbour(self, best: int, exploration: int) -> int:
        """One more or one fewer than ``best``, in turn (the one that exists at an end)."""
        up, down = min(best + 1, self.k_max), max(best - 1, 0)
        if up == best or (exploration % 2 == 0 and down != best):
            return down
        return up

    # Learning.

    def observe(self, table: RoundTable, prefill_s: float, follows: bool) -> None:
        """What a call measured (or several: the sums of every rank's, ``RoundTable``): its
        rounds, and its prefill seconds ``prefill_s``; ``follows``: the draft followed it."""
        def average(store, key, value):
            old = store.get(key)
            store[key] = value if old is None else old + self.smoothing * (value - old)

        average(self.prefill_s, follows, prefill_s)
        rounds = table.rounds.sum(1)
        for bucket in range(table.rounds.shape[0]):
            average(self.volume, bucket, float(table.tokens[bucket].sum()))
            if rounds[bucket]:
                average(self.live, bucket, float(table.live[bucket].sum() / rounds[bucket]))
            for mode in range(table.rounds.shape[1]):
                if table.rounds[bucket, mode]:
                    average(self.round_s, (bucket, mode),
                            float(table.seconds[bucket, mode] / table.rounds[bucket, mode]))
            own = self.acceptance.setdefault(bucket, [None] * self.k_max)
            self._average_rates(own, table.judged[bucket], table.accepted[bucket])
        self._average_rates(self.pooled, table.judged.sum(0), table.accepted.sum(0))
        for bucket in range(table.rounds.shape[0]):
            best = self.best_round(bucket)
            if best is not None:
                self.current[bucket] = best

    # The checkpoint.

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Every table as a host fp64 tensor over ``STATE_BUCKETS`` live-rows buckets, NaN where
        not measured (``current``, ``current_call``: int64, -1 where none): ``round_s [B, k_max +
        2]``, ``live, volume [B]``, ``acceptance [B, k_max]``, ``pooled [k_max]``, ``prefill_s [2]``
        (plain, following), ``current, current_call [B]``; ``follows``, ``calls``, ``interval``,
        ``next_exploration``, ``explorations`` scalars."""
        b, k = STATE_BUCKETS, self.k_max

        def table(shape, entries, fill=float("nan"), dtype=torch.float64):
            out = torch.full(shape, fill, dtype=dtype)
            for index, value in entries:
                if value is not None:
                    out[index] = value
            return out

        return {
            "round_s": table((b, k + 2), self.round_s.items()),
            "live": table((b,), self.live.items()),
            "volume": table((b,), self.volume.items()),
            "acceptance": table((b, k), (((bucket, d), r) for bucket, rates in self.acceptance.items()
                                         for d, r in enumerate(rates))),
            "pooled": table((k,), enumerate(self.pooled)),
            "prefill_s": table((2,), ((int(f), v) for f, v in self.prefill_s.items())),
            "current": table((b,), self.current.items(), -1, torch.int64),
            "current_call": table((b,), self.current_call.items(), -1, torch.int64),
            "follows": torch.tensor(self.follows),
            "calls": torch.tensor(self.calls),
            "interval": torch.tensor(self.interval),
            "next_exploration": torch.tensor(self.next_exploration),
            "explorations": torch.tensor(self.explorations),
        }

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """``state_dict``'s tables back; a state missing any of them (a checkpoint written before
        the tuner was saved, or with another ``k_max``) leaves the tuner as it is, fresh."""
        if state.keys() != self.state_dict().keys():
            return

        def measured(t: torch.Tensor) -> dict:
            """``{index: value}`` where ``t`` holds a measurement (not NaN, not -1)."""
            held = ~t.isnan() if t.is_floating_point() else t != -1
            return {(tuple(i) if t.dim() > 1 else i[0]): t[tuple(i)].item() for i in held.nonzero().tolist()}

        self.round_s = measured(state["round_s"])
        self.live, self.volume = measured(state["live"]), measured(state["volume"])
        self.acceptance = {bucket: [None if r.isnan() else r.item() for r in rates]
                           for bucket, rates in enumerate(state["acceptance"]) if not rates.isnan().all()}
        self.pooled = [None if r.isnan() else r.item() for r in state["pooled"]]
        self.prefill_s = {bool(f): v for f, v in measured(state["prefill_s"]).items()}
        self.current, self.current_call = measured(state["current"]), measured(state["current_call"])
        self.follows, self.calls = bool(state["follows"]), int(state["calls"])
        self.interval, self.next_exploration = int(state["interval"]), int(state["next_exploration"])
        self.explorations = int(state["explorations"])

    def _average_rates(self, rates: list[float | None], judged, accepted) -> None:
        for d in range(self.k_max):
            if judged[d]:
                rate = float(accepted[d] / judged[d])
                rates[d] = rate if rates[d] is None else rates[d] + self.smoothing * (rate - rates[d])
