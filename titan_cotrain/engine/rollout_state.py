"""The rollout engine's bookkeeping: the running batch's decoding state between rounds, the per-round
counters (kept on the device, reduced once), and what ``generate`` returns.

``n`` = committed tokens of a sequence (prompt + response); see ``engine.rollout`` for what the
target's and the draft's caches hold at ``n``.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

__all__ = ["RolloutStats", "Rollouts", "RoundTable", "Sequences", "StepCounters", "live_bucket"]


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
class Rollouts:
    """Responses of one ``generate`` call, row ``b`` answering prompt ``b``.

    ``tokens: int64 [B, max_new_tokens]`` and ``logprobs: fp32 [B, max_new_tokens]`` are
    valid for ``t < response_lens[b]`` and 0 after. ``logprobs[b, t]`` is the behaviour
    log-probability of ``tokens[b, t]``: the target's, under the processed logits it was
    sampled from (temperature, top-k, top-p; temperature 1 when greedy), whether the token
    was drafted and accepted or drawn by the target. ``finished[b]``: the response ended
    with EOS (else it ran out of ``max_new_tokens``).
    """

    prompt_lens: torch.Tensor
    tokens: torch.Tensor
    logprobs: torch.Tensor
    response_lens: torch.Tensor
    finished: torch.Tensor
    stats: RolloutStats

    def response_mask(self) -> torch.Tensor:
        """``bool [B, max_new_tokens]``: True on response tokens."""
        return torch.arange(self.tokens.shape[1], device=self.tokens.device) < self.response_lens.unsqueeze(1)


@dataclass
class Sequences:
    """Decoding state of the running batch's ``R`` rows (see ``engine.rollout`` for what
    ``length`` and ``draft_hidden`` mean) and the outputs of the call's ``N`` sequences.

    Row state, ``[R]`` each: ``out_row`` (the sequence's output row; ``N``, a scratch row,
    for a free row), ``length``, ``last_token``, ``response_len``, ``active``, ``finished``,
    and ``draft_hidden [R, H]``. Outputs ``tokens, logprobs [N + 1, max_new_tokens + k + 1]``
    by output row (``k + 1`` columns of slack, so a round writes all its candidates and
    ``response_len`` says which are real), and ``out_len, out_finished [N + 1]``, written
    when a sequence leaves its row. A free row has ``length`` 1 and is inactive: it rides
    along, writing nowhere anyone reads."""

    out_row: torch.Tensor
    length: torch.Tensor
    last_token: torch.Tensor
    response_len: torch.Tensor
    active: torch.Tensor
    finished: torch.Tensor
    draft_hidden: torch.Tensor
    tokens: torch.Tensor
    logprobs: torch.Tensor
    out_len: torch.Tensor
    out_finished: torch.Tensor

    @classmethod
    def start(cls, rows: int, total: int, max_new_tokens: int, k: int, hidden_dim: int,
              device: torch.device, dtype: torch.dtype) -> Sequences:
        """Every row free; ``draft_hidden [rows, hidden_dim]`` in the draft's ``dtype``."""
        def ints(*shape, fill=0):
            return torch.full(shape, fill, dtype=torch.int64, device=device)

        def flags(n):
            return torch.zeros(n, dtype=torch.bool, device=device)

        return cls(out_row=ints(rows, fill=total), length=ints(rows, fill=1), last_token=ints(rows),
                   response_len=ints(rows), active=flags(rows), finished=flags(rows),
                   draft_hidden=torch.zeros(rows, hidden_dim, device=device, dtype=dtype),
                   tokens=ints(total + 1, max_new_tokens + k + 1),
                   logprobs=torch.zeros(total + 1, max_new_tokens + k + 1, device=device),
                   out_len=ints(total + 1), out_finished=flags(total + 1))

    _ROWS = ("out_row", "length", "last_token", "response_len", "active", "finished", "draft_hidden")

    def head(self, rows: int) -> Sequences:
        """The first ``rows`` rows (views) with the same outputs; ``absorb`` it back after a round."""
        return dataclasses.replace(self, **{name: getattr(self, name)[:rows] for name in self._ROWS})

    def absorb(self, head: Sequences) -> None:
        """Take back the row state of ``head`` (a round may have replaced its tensors)."""
        rows = len(head.length)
        for name in self._ROWS:
            getattr(self, name)[:rows].copy_(getattr(head, name))

    def move(self, src: list[int], dst: list[int], device: torch.device) -> None:
        """Rows ``dst`` take over the sequences of rows ``src``, which become free."""
        if not src:
            return
        a, b = torch.tensor(src, device=device), torch.tensor(dst, device=device)
        for name in self._ROWS:
            tensor = getattr(self, name)
            tensor[b] = tensor[a]
        self._free(a)

    def _free(self, index: torch.Tensor) -> None:
        self.out_row[index] = len(self.out_len) - 1
        self.length[index] = 1
        self.response_len[index] = 0
        self.active[index] = False

    def free(self, rows: list[int], device: torch.device) -> None:
        """Rows ``rows`` let go of their sequences unfinished (preempted: what they wrote to
        the outputs stays, and ``resume`` picks it up)."""
        if rows:
            self._free(torch.tensor(rows, device=device))

    def resume(self, rows: torch.Tensor, out_rows: torch.Tensor, length: torch.Tensor, response_len: torch.Tensor,
               last_token: torch.Tensor) -> None:
        """Rows ``rows`` go on with the unfinished sequences ``out_rows`` (``length``
        committed tokens, ``response_len`` of them the response's, the last ``last_token``)."""
        self.out_row[rows] = out_rows
        self.length[rows] = length
        self.response_len[rows] = response_len
        self.last_token[rows] = last_token
        self.active[rows] = True
        self.finished[rows] = False

    def admit(self, rows: torch.Tensor, out_rows: torch.Tensor, prompt_lens: torch.Tensor) -> None:
        """Rows ``rows`` start sequences ``out_rows`` after prompts of ``prompt_lens`` tokens
        (nothing committed yet: ``engine.rollout`` commits the first token)."""
        self.out_row[rows] = out_rows
        self.length[rows] = prompt_lens
        self.response_len[rows] = 0
        self.active[rows] = True
        self.finished[rows] = False

    def new_tokens(self, rows: torch.Tensor, token: torch.Tensor, logprob: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(candidates [R, 1], logprobs [R, 1], n_new [R])`` committing ``token [r]`` to ``rows``
        and nothing to the others."""
        candidates = self.last_token.new_zeros(len(self.length), 1)
        candidates[rows, 0] = token
        logprobs = torch.zeros(candidates.shape, device=candidates.device)
        logprobs[rows, 0] = logprob.float()
        n_new = torch.zeros_like(self.length)
        n_new[rows] = 1
        return candidates, logprobs, n_new

    def retire(self, rows: list[int], device: torch.device) -> None:
        """The sequences of ``rows`` are done: record their lengths and free the rows."""
        if not rows:
            return
        index = torch.tensor(rows, device=device)
        out = self.out_row[index]
        self.out_len[out] = self.response_len[index]
        self.out_finished[out] = self.finished[index]
        self._free(index)

    def result(self, prompt_lens: torch.Tensor, max_new_tokens: int, stats: RolloutStats) -> Rollouts:
        n = len(self.out_len) - 1
        lens = self.out_len[:n]
        mask = torch.arange(max_new_tokens, device=self.tokens.device) < lens.unsqueeze(1)
        return Rollouts(prompt_lens=prompt_lens, tokens=self.tokens[:n, :max_new_tokens] * mask,
                        logprobs=self.logprobs[:n, :max_new_tokens] * mask, response_lens=lens,
                        finished=self.out_finished[:n], stats=stats)


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
