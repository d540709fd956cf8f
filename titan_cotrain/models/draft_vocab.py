"""The draft's reduced vocabulary (EAGLE-3): maps between draft and target token ids.

A draft with ``V_d`` output ids predicts only the ``V_d`` most frequent target tokens of a
corpus. Two maps say which: ``d2t: int64 [V_d]`` with ``target_id = draft_id + d2t[draft_id]``
(the EAGLE-3 checkpoint's convention) and ``t2d: bool [V]``, True at the target ids the draft
can emit. Here: counting a corpus, choosing the maps from the counts, the identity maps of a
full vocabulary, checking stored maps, and writing new ones into a draft. Which corpus and
which size a job asks for is read by its builders (``models.build.draft_vocab_maps``,
``rl.draft_vocab_setup``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # draft.py imports this module
    from titan_cotrain.models.draft import Draft

__all__ = [
    "MIN_SEEN_FRACTION",
    "checked_vocab_maps",
    "count_tokens",
    "draft_vocab_from_counts",
    "identity_vocab_maps",
    "set_vocab_maps_",
    "t2d_from_d2t",
    "vocab_map_problem",
]

# Ids listed in an error about the maps, at most.
_MAX_LISTED = 8


def identity_vocab_maps(vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``d2t`` (all zeros) and ``t2d`` (all true) of a draft vocabulary equal to the target's."""
    # On the host explicitly: a draft built on the meta device keeps its maps (host buffers).
    return (torch.zeros(vocab_size, dtype=torch.int64, device="cpu"),
            torch.ones(vocab_size, dtype=torch.bool, device="cpu"))


# A reduced vocabulary is refused when fewer than this share of its ids are tokens the corpus
# contains: the rest would be picked by the id tie-break, not by frequency.
MIN_SEEN_FRACTION = 0.5


def count_tokens(sequences: Iterable[Sequence[int]], vocab_size: int) -> torch.Tensor:
    """``int64 [vocab_size]``: occurrences of each token id over ``sequences`` (token-id lists),
    the corpus ``draft_vocab_from_counts`` chooses from."""
    ids = [torch.as_tensor(s, dtype=torch.int64) for s in sequences]
    return torch.bincount(torch.cat(ids) if ids else torch.zeros(0, dtype=torch.int64), minlength=vocab_size)


def draft_vocab_from_counts(token_counts: torch.Tensor, draft_vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """EAGLE-3 vocab maps for the ``draft_vocab_size`` most frequent target tokens.

    ``token_counts: [V]`` (occurrences in a corpus). Draft ids follow increasing target id;
    ties in frequency go to the lower target id. Returns ``d2t: int64 [V_d]`` with
    ``target_id = draft_id + d2t[draft_id]`` and ``t2d: bool [V]``.

    Raises ``ValueError`` when the corpus saw fewer than ``MIN_SEEN_FRACTION x V_d`` distinct
    tokens (all-zero counts included): more than half of the vocabulary would then be the
    lowest unseen ids, not frequent ones, so the corpus is too small for a vocabulary that big.
    """
    vocab_size = token_counts.numel()
    if not 0 < draft_vocab_size <= vocab_size:
        raise ValueError(f"draft vocab size {draft_vocab_size} must be in 1..{vocab_size}")
    seen = int((token_counts > 0).sum())
    if seen < MIN_SEEN_FRACTION * draft_vocab_size:
        raise ValueError(f"the corpus counted for the draft vocabulary holds {seen} distinct tokens, fewer than "
                         f"{MIN_SEEN_FRACTION:g} x the {draft_vocab_size} draft ids: the rest would be the lowest "
                         "unseen ids, not frequent tokens")
    # Stable sort on -count keeps the lower id first among equal counts.
    order = torch.sort(-token_counts.to(torch.float64), stable=True).indices[:draft_vocab_size]
    target_ids = order.sort().values
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[target_ids] = True
    return target_ids - torch.arange(draft_vocab_size), t2d


@torch.no_grad()
def set_vocab_maps_(draft: Draft, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
    """Write new vocab maps (same shapes) into ``draft``'s buffers, on whatever device they are:
    a vocabulary chosen once the draft exists (from the policy's own generations)."""
    draft.d2t.copy_(d2t)
    draft.t2d.copy_(t2d)


def checked_vocab_maps(d2t: torch.Tensor | None, t2d: torch.Tensor | None, draft_vocab_size: int,
                       vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Stored maps, checked: ``(d2t int64 [V_d], t2d bool [V])``; a missing ``t2d`` is rebuilt
    from ``d2t``, a missing ``d2t`` (full draft vocabulary only) is the identity. Raises
    ``ValueError`` naming what is wrong."""
    if d2t is None:
        d2t = torch.zeros(draft_vocab_size, dtype=torch.int64)
    elif d2t.is_floating_point() or d2t.is_complex() or d2t.dtype == torch.bool:
        raise ValueError(f"d2t must hold integer offsets, got {d2t.dtype}")
    if t2d is not None and t2d.dtype != torch.bool:
        raise ValueError(f"t2d must be a bool mask, got {t2d.dtype}")
    d2t = d2t.to(torch.int64)
    problem = vocab_map_problem(d2t, t2d, vocab_size)
    if problem:
        raise ValueError(problem)
    return d2t, t2d_from_d2t(d2t, vocab_size) if t2d is None else t2d


def t2d_from_d2t(d2t: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``t2d: bool [V]`` marking the target ids ``arange(V_d) + d2t`` of ``d2t: int64 [V_d]``."""
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[torch.arange(d2t.numel()) + d2t] = True
    return t2d


def vocab_map_problem(d2t: torch.Tensor, t2d: torch.Tensor | None, vocab_size: int) -> str | None:
    """What is wrong with the maps, if anything: ``arange(V_d) + d2t`` must be distinct ids in
    ``[0, V)``, and ``t2d`` (when given) must mark exactly those ids."""
    target_ids = torch.arange(d2t.numel()) + d2t
    outside = ((target_ids < 0) | (target_ids >= vocab_size)).nonzero().flatten().tolist()
    if outside:
        return (
            f"d2t maps draft ids {outside[:_MAX_LISTED]} to target ids outside [0, {vocab_size}) "
            "(target id = draft id + d2t[draft id])"
        )
    ids, counts = target_ids.unique(return_counts=True)
    repeated = ids[counts > 1].tolist()
    if repeated:
        return f"d2t maps more than one draft id to each of the target ids {repeated[:_MAX_LISTED]}"
    if t2d is not None and not torch.equal(t2d, t2d_from_d2t(d2t, vocab_size)):
        return "t2d does not mark exactly the target ids that d2t maps the draft vocabulary to"
    return None
