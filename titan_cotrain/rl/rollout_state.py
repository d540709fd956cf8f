"""The rollout engine's bookkeeping: per-sequence decoding state between rounds, the per-round
counters (kept on the device, reduced once), and what ``generate`` returns.

``n`` = committed tokens of a sequence (prompt + response); see ``rl.rollout`` for what the
target's and the draft's caches hold at ``n``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, fields

import torch

__all__ = ["RolloutStats", "Rollouts", "Sequences", "StepCounters"]


@dataclass
class RolloutStats:
    """What one ``generate`` call did and how long it took.

    ``acceptance_length``: tokens committed per target forward, averaged over the (sequence,
    round) pairs of unfinished sequences (1 for plain decoding, at most ``k + 1``).
    ``acceptance_rate[d - 1]``: how often drafted token ``d`` was accepted when tokens
    ``1..d-1`` were. Times in seconds: ``prefill_s`` (target prefill and the draft's pass 1
    over the prompt), ``draft_s`` (drafting and catching up), ``verify_s`` (target decode or
    verify forwards, acceptance, bookkeeping), ``total_s`` (wall time of the call).
    """

    new_tokens: int
    target_forwards: int
    acceptance_length: float
    acceptance_rate: list[float]
    prefill_s: float
    draft_s: float
    verify_s: float
    total_s: float

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / max(self.total_s, 1e-9)

    def metrics(self, prefix: str = "rollout/") -> dict[str, float]:
        out = {
            "tokens_per_s": self.tokens_per_s,
            "acceptance_length": self.acceptance_length,
            "target_forwards": float(self.target_forwards),
            "prefill_s": self.prefill_s,
            "draft_s": self.draft_s,
            "verify_s": self.verify_s,
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
    """Per-sequence decoding state; see the module docstring for what ``length`` and
    ``draft_hidden`` mean. Output buffers have ``k + 1`` columns of slack so a round can
    write all its candidates and let ``response_len`` say which are real."""

    length: torch.Tensor
    last_token: torch.Tensor
    response_len: torch.Tensor
    active: torch.Tensor
    finished: torch.Tensor
    tokens: torch.Tensor
    logprobs: torch.Tensor
    draft_hidden: torch.Tensor | None = None

    @classmethod
    def start(cls, prompt_lens: torch.Tensor, max_new_tokens: int, k: int) -> Sequences:
        b, device = prompt_lens.shape[0], prompt_lens.device
        return cls(
            length=prompt_lens.clone(), last_token=torch.zeros_like(prompt_lens),
            response_len=torch.zeros_like(prompt_lens), active=torch.ones(b, dtype=torch.bool, device=device),
            finished=torch.zeros(b, dtype=torch.bool, device=device),
            tokens=prompt_lens.new_zeros(b, max_new_tokens + k + 1),
            logprobs=torch.zeros(b, max_new_tokens + k + 1, device=device),
        )

    @classmethod
    def cat(cls, waves: Sequence[Sequences]) -> Sequences:
        """The rows of ``waves``, in order; ``draft_hidden`` is dropped (decoding is over)."""
        names = [f.name for f in fields(cls) if f.name != "draft_hidden"]
        return cls(**{name: torch.cat([getattr(w, name) for w in waves]) for name in names})

    def result(self, prompt_lens: torch.Tensor, max_new_tokens: int, stats: RolloutStats) -> Rollouts:
        mask = torch.arange(max_new_tokens, device=self.tokens.device) < self.response_len.unsqueeze(1)
        return Rollouts(prompt_lens=prompt_lens, tokens=self.tokens[:, :max_new_tokens] * mask,
                        logprobs=self.logprobs[:, :max_new_tokens] * mask, response_lens=self.response_len,
                        finished=self.finished, stats=stats)


@dataclass
class StepCounters:
    """Per-round ``n_accepted`` and ``active`` ([B] each, B the wave's size), kept on the
    device and reduced once at the end (no host sync per round), and the time split.
    ``synchronize`` waits for the device (a no-op on CPU)."""

    synchronize: Callable[[], None]
    n_accepted: list[torch.Tensor] = field(default_factory=list)
    active: list[torch.Tensor] = field(default_factory=list)
    times: dict[str, float] = field(default_factory=lambda: {"prefill": 0.0, "draft": 0.0, "verify": 0.0})
    start: float = field(default_factory=time.perf_counter)

    def record(self, n_accepted: torch.Tensor, active: torch.Tensor) -> None:
        self.n_accepted.append(n_accepted)
        self.active.append(active.clone())

    def stats(self, new_tokens: int, k: int) -> RolloutStats:
        length, rates = 0.0, []
        if self.active:
            # One entry per (round, sequence) pair of every wave, so waves of any size pool.
            n, active = torch.cat(self.n_accepted), torch.cat(self.active)
            length = float(((n + 1) * active).sum() / active.sum())
            depth = torch.arange(k, device=n.device)
            judged = (n.unsqueeze(-1) >= depth) & active.unsqueeze(-1)  # drafted token d + 1 was judged
            accepted = judged & (n.unsqueeze(-1) > depth)
            rates = (accepted.sum(0) / judged.sum(0).clamp(min=1)).tolist()
        return RolloutStats(
            new_tokens=new_tokens, target_forwards=len(self.active), acceptance_length=length, acceptance_rate=rates,
            prefill_s=self.times["prefill"], draft_s=self.times["draft"], verify_s=self.times["verify"],
            total_s=time.perf_counter() - self.start,
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
