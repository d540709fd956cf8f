"""One ``generate`` call's state: ``Generation`` (made by ``RolloutEngine.start``, advanced a
round at a time by ``RolloutEngine.step``), the ``Round`` its scheduler planned, the running
batch's decoding state between rounds (``Sequences``), and what the call returns (``Rollouts``).

``n`` = committed tokens of a sequence (prompt + response); see ``engine.rollout`` for what the
target's and the draft's caches hold at ``n``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch

from titan_cotrain.engine.kv_blocks import Scheduler
from titan_cotrain.engine.round_stats import RolloutStats, StepCounters
from titan_cotrain.engine.sampling import SamplingParams
from titan_cotrain.models.draft import DraftKVCache
from titan_cotrain.models.kv_cache import PagedKV, RowsKV

__all__ = ["Generation", "Rollouts", "Round", "Sequences"]


@dataclass
class Generation:
    """One ``generate`` call in progress, everything its rounds read and write.

    The call's prompts, host-side: ``prompt [P, P_max]`` right-padded, ``prompt_lens [P]``,
    ``samples`` (``G``) sequences each, ``P x G`` in all (the static layout has no shared
    blocks: it holds each prompt ``G`` times, ``samples = 1``). ``k``: the most tokens a round
    drafts; the draft follows the whole call when it is not 0 (``drafting``), and ``choose``
    (None: every round drafts ``k``) picks each round's ``k`` from its live sequences.
    ``stops: int64 [n_stop]``: ``params.stops`` on the device (made once per call), the ids
    that end a sequence. ``draft_to_target [V_draft]``: target id of each draft id.
    ``scheduler`` holds the rows, the queue and the blocks (host), ``seqs`` the rows' decoding
    state and the outputs (device), ``counters`` what the rounds measured.
    ``progress(finished, total)`` is told after every round."""

    params: SamplingParams
    stops: torch.Tensor
    generator: torch.Generator | None
    prompt: torch.Tensor
    prompt_lens: torch.Tensor
    samples: int
    k: int
    choose: Callable[[int], int] | None
    draft_to_target: torch.Tensor | None
    scheduler: Scheduler
    seqs: Sequences
    counters: StepCounters
    progress: Callable[[int, int], None] | None = None

    @property
    def drafting(self) -> bool:
        return bool(self.k)

    @property
    def total(self) -> int:
        """Sequences of the call."""
        return len(self.prompt_lens) * self.samples

    def done(self) -> bool:
        """Every sequence finished (none waits, none runs)."""
        return self.scheduler.done()


@dataclass
class Round:
    """One decoding round as scheduled: ``k`` tokens drafted (0: a plain decode, or one the
    draft catches up over), ``live`` sequences decoding in the first ``rows`` rows, which read
    the pools through ``target_cache`` and ``draft_cache`` (None when the draft does not
    follow); ``started``: its wall-clock start (``time.perf_counter``)."""

    k: int
    live: int
    rows: int
    target_cache: PagedKV | RowsKV
    draft_cache: DraftKVCache | None
    started: float


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
class Rollouts:
    """Responses of one ``generate`` call, row ``b`` answering prompt ``b``.

    ``tokens: int64 [B, max_new_tokens]`` and ``logprobs: fp32 [B, max_new_tokens]`` are
    valid for ``t < response_lens[b]`` and 0 after. ``logprobs[b, t]`` is the behaviour
    log-probability of ``tokens[b, t]``: the target's, under the processed logits it was
    sampled from (temperature, top-k, top-p; temperature 1 when greedy), whether the token
    was drafted and accepted or drawn by the target. ``finished[b]``: the response ended
    at a stop token, the EOS or one of ``stop_token_ids`` (else it ran out of
    ``max_new_tokens``); the stop token is its last, ``tokens[b, response_lens[b] - 1]``,
    which tells the stop reasons apart.
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
