"""Sampling: temperature / top-k / top-p, seeded draws, and lossless speculative acceptance.

Every distribution here is a ``[..., V]`` fp32 tensor of probabilities, never renormalised
in place: callers keep the *processed* logits (after temperature and filtering) so that
behaviour log-probabilities are those of the distribution actually sampled from.

Greedy decoding (``temperature == 0``) is the one-hot distribution on the argmax. With
one-hots, ``speculative_accept`` accepts a drafted token iff it is the target's argmax and
otherwise emits the target's argmax, so greedy speculative decoding is exactly greedy
decoding; ``greedy_accept`` is that limit written out with argmaxes (a few ops instead of
a few dozen, which matters when decoding is launch-bound), and ``draw`` likewise.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = [
    "SamplingParams",
    "draw",
    "greedy_accept",
    "processed_logits",
    "sample",
    "speculative_accept",
]


@dataclass(frozen=True)
class SamplingParams:
    """How responses are sampled (mirrors the ``[rollout]`` config section).

    ``temperature == 0`` is greedy. ``top_k == 0`` and ``top_p == 1`` switch those filters
    off. Generation of a sequence stops after ``eos_token_id`` or any of ``stop_token_ids``
    (the stop token is kept in the response) or after ``max_new_tokens`` tokens.
    ``stop_token_ids`` are non-negative token ids (any iterable of them; kept as a tuple); the
    engine refuses ids outside its policy's vocabulary.
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    max_new_tokens: int = 64
    eos_token_id: int | None = None
    stop_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be non-negative int token ids, got {self.stop_token_ids}")

    @classmethod
    def of(cls, settings, eos_token_id: int | None) -> "SamplingParams":
        """The sampling of a settings object with ``temperature``, ``top_k``, ``top_p``,
        ``max_new_tokens`` and ``stop_token_ids`` (a rollout's, an evaluation's, the draft
        prefit's), whose responses also end at ``eos_token_id``."""
        return cls(temperature=settings.temperature, top_k=settings.top_k, top_p=settings.top_p,
                   max_new_tokens=settings.max_new_tokens, eos_token_id=eos_token_id,
                   stop_token_ids=settings.stop_token_ids)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def stops(self) -> tuple[int, ...]:
        """Every token id that ends a sequence: ``eos_token_id`` (when set), then
        ``stop_token_ids``, each once."""
        eos = () if self.eos_token_id is None else (self.eos_token_id,)
        return tuple(dict.fromkeys(eos + self.stop_token_ids))


def processed_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """``logits [..., V]`` -> fp32 logits of the sampling distribution: divided by the
    temperature, ``-inf`` outside the top-k and the top-p nucleus (the smallest set of the
    most likely tokens whose mass reaches ``top_p``; the most likely token always stays).

    Greedy returns the raw logits: its behaviour log-probabilities are reported under
    temperature 1 (the one-hot it samples from has no useful log-probabilities).
    """
    logits = logits.float()
    if params.greedy:
        return logits
    logits = logits / params.temperature
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = sorted_logits.softmax(-1)
        mass_before = probs.cumsum(-1) - probs
        drop_sorted = mass_before >= params.top_p
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One draw per row of ``probs [..., V]`` (need not be normalised): ``argmax(probs / E)``
    with ``E ~ Exponential(1)``, which picks ``i`` with probability ``probs_i / sum(probs)``.
    Zero-probability entries are never picked. Returns int64 ``[...]``."""
    noise = torch.empty_like(probs).exponential_(generator=generator)
    # A draw of exactly 0 would turn 0 / 0 into NaN, which argmax would pick.
    return (probs / noise.clamp_(min=torch.finfo(noise.dtype).tiny)).argmax(-1)


def draw(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> torch.Tensor:
    """One token per row from ``processed_logits`` output ``[..., V]``: the argmax when greedy."""
    if params.greedy:
        return logits.argmax(-1)
    return sample(logits.softmax(-1), generator)


def speculative_accept(
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor,
    draft_to_target: torch.Tensor,
    target_probs: torch.Tensor,
    generator: torch.Generator | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Lossless speculative sampling over a chain of ``k`` drafted tokens, ragged over the batch.

    ``draft_tokens: int64 [B, k]`` draft-vocabulary ids, drawn from ``draft_probs [B, k, V_d]``;
    ``draft_to_target: int64 [V_d]`` maps draft ids to target ids; ``target_probs [B, k + 1, V]``
    is the target's distribution at the ``k`` drafted positions and the one after them.

    Token ``i`` is accepted with probability ``min(1, p_i(t) / q_i(t))`` while all before it
    were. At the first rejection the next token is drawn from ``norm(max(p - q, 0))``, where
    ``q`` is zero outside the draft vocabulary; when all ``k`` are accepted, a bonus token is
    drawn from ``p_{k+1}``. Every emitted token is then distributed exactly as under ``p``.
    Returns ``n_accepted: int64 [B]`` in ``0..k`` and ``next_token: int64 [B]`` (target id).
    """
    b, k = draft_tokens.shape
    rows = torch.arange(b, device=draft_tokens.device)
    p_draft = target_probs[:, :k].gather(-1, draft_to_target[draft_tokens].unsqueeze(-1)).squeeze(-1)
    q_draft = draft_probs.gather(-1, draft_tokens.unsqueeze(-1)).squeeze(-1)
    uniform = torch.rand(b, k, generator=generator, device=draft_probs.device)
    accepted = (uniform * q_draft < p_draft).long().cumprod(-1)  # u < p / q, without dividing by q
    n_accepted = accepted.sum(-1)
    p_next = target_probs[rows, n_accepted]  # [B, V]
    q_next = torch.zeros_like(p_next)
    if k:
        rejected = (n_accepted < k).unsqueeze(-1)
        q_next[:, draft_to_target] = draft_probs[rows, n_accepted.clamp(max=k - 1)] * rejected
    residual = (p_next - q_next).clamp(min=0)
    # p == q up to rounding can leave a zero residual on a rejection of probability ~0: use p.
    residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p_next)
    return n_accepted, sample(residual, generator)


def greedy_accept(draft_tokens: torch.Tensor, target_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``speculative_accept`` with one-hot ``p`` and ``q``: keep drafted tokens while they are
    the target's argmax, then emit the target's argmax.

    ``draft_tokens: int64 [B, k]`` (target ids), ``target_logits [B, k + 1, V]``. Returns
    ``n_accepted [B]`` and ``next_token [B]``, as ``speculative_accept``.
    """
    k = draft_tokens.shape[1]
    best = target_logits.argmax(-1)  # [B, k + 1]
    n_accepted = (draft_tokens == best[:, :k]).long().cumprod(-1).sum(-1)
    return n_accepted, best.gather(1, n_accepted.unsqueeze(1)).squeeze(1)
