"""What a ``generate`` call measures: per-round counters kept on the device (``StepCounters``),
reduced once at the end into ``RolloutStats`` and its ``RoundTable`` of rounds by live rows and
mode (what ``engine.speculation`` learns from)."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

__all__ = ["RolloutStats", "RoundTable", "StepCounters", "live_bucket"]


def live_bucket(live: int) -> int:
    """The live-rows bucket of a round with ``live`` sequences decoding: ``b`` holds
    ``2^(b-1) < live <= 2^b`` (bucket 0: one sequence)."""
    return max(live - 1, 0).bit_length()


@dataclass
class RoundTable:
    """A call's decoding rounds, summed by live-rows bucket ``b`` (``live_bucket``, ``B``
    buckets) and mode ``m`` (``M = k_max + 2``): mode 0 is plain decoding without the draft;
    mode ``1 + k`` a round that drafted ``k`` tokens with the draft following along (``k = 0``:
    a target decode plus the draft's catch-up over it). Host fp64 tensors:

    ``rounds [B, M]``, ``seconds [B, M]`` (wall time of the rounds, prefills excluded),
    ``tokens [B, M]`` (tokens committed), ``live [B, M]`` (sequences decoding, summed over the
    rounds: (sequence, round) pairs); ``judged, accepted [B, K]``: how often drafted token
    ``d`` was judged (tokens ``1..d-1`` accepted) and accepted. Sums, so tables of several
    calls or ranks add."""

    rounds: torch.Tensor
    seconds: torch.Tensor
    tokens: torch.Tensor
    live: torch.Tensor
    judged: torch.Tensor
    accepted: torch.Tensor

    @classmethod
    def empty(cls, buckets: int, k_max: int) -> RoundTable:
        def zeros(width):
            return torch.zeros(buckets, width, dtype=torch.float64)

        return cls(zeros(k_max + 2), zeros(k_max + 2), zeros(k_max + 2), zeros(k_max + 2), zeros(k_max),
                   zeros(k_max))

    @property
    def k_max(self) -> int:
        return self.judged.shape[1]

    def flat(self) -> list[float]:
        """Every field, flattened in order: what ``from_flat`` reads back (one all-reduce)."""
        return torch.cat([getattr(self, f.name).flatten() for f in dataclasses.fields(self)]).tolist()

    @classmethod
    def from_flat(cls, values: list[float], buckets: int, k_max: int) -> RoundTable:
        table, flat, at = cls.empty(buckets, k_max), torch.tensor(values, dtype=torch.float64), 0
        for f in dataclasses.fields(table):
            field_ = getattr(table, f.name)
            field_.copy_(flat[at:at + field_.numel()].view_as(field_))
            at += field_.numel()
        return table


@dataclass
class RolloutStats:
    """What one ``generate`` call did and how long it took.

    ``acceptance_length``: tokens committed per target forward, averaged over the (sequence,
    round) pairs of unfinished sequences in the rounds that drafted (1 for plain decoding, at
    most ``k + 1``).
    ``acceptance_rate[d - 1]``: how often drafted token ``d`` was accepted when tokens
    ``1..d-1`` were. Times in seconds: ``prefill_s`` (target prefill and the draft's pass 1
    over the prompt), ``draft_s`` (drafting and catching up), ``verify_s`` (target decode or
    verify forwards, acceptance, bookkeeping), ``total_s`` (wall time of the call).
    ``kv_peak_bytes``: the most KV-cache blocks the call held at once, in bytes (the draft's
    chains, a fixed few positions per row, aside). ``preemptions``: sequences preempted when
    the pool ran dry (``engine.kv_blocks``), ``recomputed_tokens`` the positions their resumes
    prefilled again.

    The long tail: ``rounds`` (``RoundTable``) splits the rounds by how many sequences were
    live; ``tail_s`` is the wall time of the rounds with at most a quarter of the call's
    rows live (its batch width: ``max_batch_size``, or fewer sequences); ``prompts`` the
    prefilled prompts; ``drafting`` whether the draft followed the call (read every prompt
    and every committed token). ``acceptance_by_position[q]``: tokens per target forward of
    the drafting rounds whose sequence was in quarter ``q`` of ``max_new_tokens`` (NaN where
    none were), so a draft that falls behind deep into long responses shows.
    """

    new_tokens: int
    target_forwards: int
    acceptance_length: float
    acceptance_rate: list[float]
    prefill_s: float
    draft_s: float
    verify_s: float
    total_s: float
    kv_peak_bytes: int = 0
    rounds: RoundTable | None = None
    tail_s: float = 0.0
    prompts: int = 0
    drafting: bool = False
    acceptance_by_position: list[float] = field(default_factory=list)
    preemptions: int = 0
    recomputed_tokens: int = 0

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / max(self.total_s, 1e-9)

    @property
    def tail_share(self) -> float:
        """Share of the call's wall time spent with at most a quarter of its rows live."""
        return self.tail_s / max(self.total_s, 1e-9)

    def metrics(self, prefix: str = "rollout/") -> dict[str, float]:
        out = {
            "tokens_per_s": self.tokens_per_s,
            "acceptance_length": self.acceptance_length,
            "target_forwards": float(self.target_forwards),
            "prefill_s": self.prefill_s,
            "draft_s": self.draft_s,
            "verify_s": self.verify_s,
            "tail_share": self.tail_share,
            "preemptions": float(self.preemptions),
            "recomputed_tokens": float(self.recomputed_tokens),
        }
        out |= {f"acceptance_rate_{d}": r for d, r in enumerate(self.acceptance_rate, start=1)}
        return {prefix + k: v for k, v in out.items()}


@dataclass
class StepCounters:
    """Per-round ``n_accepted``, ``active`` and ``response_len`` ([R] each, R the rows the round
    ran), kept on the device and reduced once at the end (no host sync per round), the host
    facts of each round (its mode, live sequences and wall time), and the time split.
    ``synchronize`` waits for the device (a no-op on CPU). ``k_max``: the most a round drafts;
    ``buckets``: live-rows buckets of the engine's rows; ``width``: the call's batch width
    (the tail is at most a quarter of it live)."""

    synchronize: Callable[[], None]
    k_max: int = 0
    buckets: int = 1
    width: int = 1
    n_accepted: list[torch.Tensor] = field(default_factory=list)
    active: list[torch.Tensor] = field(default_factory=list)
    position: list[torch.Tensor] = field(default_factory=list)
    modes: list[int] = field(default_factory=list)
    lives: list[int] = field(default_factory=list)
    round_s: list[float] = field(default_factory=list)
    times: dict[str, float] = field(default_factory=lambda: {"prefill": 0.0, "draft": 0.0, "verify": 0.0})
    start: float = field(default_factory=time.perf_counter)

    def record(self, n_accepted: torch.Tensor, active: torch.Tensor, response_len: torch.Tensor) -> None:
        """A round's per-row outcome: ``n_accepted`` drafted tokens kept, which rows were
        ``active`` and how long their responses were when it started."""
        self.n_accepted.append(n_accepted)
        self.active.append(active.clone())
        self.position.append(response_len.clone())

    def round_done(self, mode: int, live: int, seconds: float) -> None:
        """The host facts of the round just recorded: mode (``RoundTable``), live sequences,
        wall seconds."""
        self.modes.append(mode)
        self.lives.append(live)
        self.round_s.append(seconds)

    def stats(self, new_tokens: int, max_new_tokens: int, *, prompts: int, drafting: bool,
              kv_peak_bytes: int = 0, preemptions: int = 0, recomputed_tokens: int = 0) -> RolloutStats:
        k_max, buckets = self.k_max, self.buckets
        table = RoundTable.empty(buckets, k_max)
        length, rates, by_position = 0.0, [], []
        if self.active:
            n, active = torch.cat(self.n_accepted), torch.cat(self.active)
            position = torch.cat(self.position)
            device = n.device
            counts = torch.tensor([len(a) for a in self.active], device=device)
            # One entry per (round, row) pair; free rows are inactive and not counted.
            mode = torch.tensor(self.modes, device=device).repeat_interleave(counts)
            bucket = torch.tensor([live_bucket(live) for live in self.lives], device=device).repeat_interleave(counts)
            k = (mode - 1).clamp(min=0)
            cell = bucket * (k_max + 2) + mode
            weight = active.double()
            sums = [torch.bincount(cell, weights=w, minlength=buckets * (k_max + 2)) for w in ((n + 1) * weight, weight)]
            depth = torch.arange(k_max, device=device)
            judged = (n.unsqueeze(-1) >= depth) & (depth < k.unsqueeze(-1)) & active.unsqueeze(-1)
            accepted = judged & (n.unsqueeze(-1) > depth)
            per_bucket = [torch.zeros(buckets, k_max, dtype=torch.float64, device=device).index_add_(0, bucket, x.double())
                          for x in (judged, accepted)]
            # Acceptance by response position: the drafting rounds, by quarter of max_new_tokens.
            quarter = (position * 4 // max(max_new_tokens, 1)).clamp(max=3)
            drafted = weight * (mode > 1)
            by_q = [torch.bincount(quarter, weights=w, minlength=4) for w in ((n + 1) * drafted, drafted)]
            # The one read back of the call's counters.
            host = torch.cat([x.flatten().double() for x in (*sums, *per_bucket, *by_q)]).cpu()
            m = buckets * (k_max + 2)
            table.tokens.view(-1).copy_(host[:m])
            table.live.view(-1).copy_(host[m:2 * m])
            table.judged.view(-1).copy_(host[2 * m:2 * m + buckets * k_max])
            table.accepted.view(-1).copy_(host[2 * m + buckets * k_max:2 * m + 2 * buckets * k_max])
            q_tokens, q_rows = host[-8:-4], host[-4:]
            by_position = [float(t / r) if r else float("nan") for t, r in zip(q_tokens, q_rows)]
            # Over the rounds that drafted (a round at k = 0 commits one token either way).
            drafted_any = bool(table.live[:, 2:].sum() > 0)
            tokens, pairs = (table.tokens[:, 2:], table.live[:, 2:]) if drafted_any else (table.tokens, table.live)
            length = float(tokens.sum() / pairs.sum().clamp(min=1))
            rates = (table.accepted.sum(0) / table.judged.sum(0).clamp(min=1)).tolist()
        tail_s = 0.0
        for mode, live, seconds in zip(self.modes, self.lives, self.round_s):
            b = live_bucket(live)
            table.rounds[b, mode] += 1
            table.seconds[b, mode] += seconds
            if 4 * live <= self.width:
                tail_s += seconds
        return RolloutStats(
            new_tokens=new_tokens, target_forwards=len(self.active), acceptance_length=length, acceptance_rate=rates,
            prefill_s=self.times["prefill"], draft_s=self.times["draft"], verify_s=self.times["verify"],
            total_s=time.perf_counter() - self.start, kv_peak_bytes=kv_peak_bytes, rounds=table, tail_s=tail_s,
            prompts=prompts, drafting=drafting, acceptance_by_position=by_position, preemptions=preemptions,
            recomputed_tokens=recomputed_tokens,
        )

    @contextmanager
    def timed(self, name: str):
        """Add the wall time of the block to ``times[name]``; the device is synchronised at
        both ends so its work is charged to the block that launched it."""
        self.synchronize()
        start = time.perf_counter()
        yield
        self.synchronize()
        self.times[name] += time.perf_counter() - start
