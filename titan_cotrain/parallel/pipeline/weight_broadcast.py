"""The whole models' weights for the rollout engine, broadcast from the stages one tensor at a time.

Each PP rank holds its stages' weights (FSDP-sharded over its data-parallel x CP ranks); the
engine on every rank needs the whole policy and draft. ``broadcast_stage_weights`` walks a
whole-model template's state dict and broadcasts each entry over the PP column from the rank
whose stage holds it, so a rank holds one whole tensor beyond its own at a time.
``broadcast_state_dicts`` wraps those streams as the state dicts ``RolloutEngine.load_weights``
reads, each read in the stream's order, each entry once.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import nn

from titan_cotrain.parallel.engine_tp import whole_tensor
from titan_cotrain.parallel.pipeline.build import Pipeline

__all__ = ["StreamedStateDict", "broadcast_stage_weights", "broadcast_state_dicts"]


def broadcast_stage_weights(pipeline: Pipeline, like: nn.Module, *,
                            draft: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` for every entry of ``like.state_dict()`` (a whole-model copy of the
    policy, or with ``draft`` of the draft, e.g. the rollout engine's), in its order: the
    trained weight, broadcast over the PP group from the rank of the stage that holds it
    (its FSDP shards gathered there first), a fresh whole tensor in ``like``'s dtype on
    ``pipeline.device`` on every rank.

    One broadcast per entry, run when the generator is advanced: every PP rank (and every
    data-parallel peer) must run it to the end in step with the others."""
    p = pipeline
    pp_rank = dist.get_rank(p.pp_group)
    if draft:
        local = p.draft.state_dict() if p.draft is not None else {}
    else:
        local = {name: t for part in p.model_parts for name, t in part.state_dict().items()}
    for name, template in like.state_dict().items():
        owner = p.plan.stage_ranks[-1 if draft else p.plan.stage_of(name)]
        if owner == pp_rank:
            # Cast before the FSDP gather: the engine's bytes move, not fp32 (70B: 2 x 3.9 GiB
            # for the embedding and the output head gathered whole).
            t = whole_tensor(local[name], template.dtype).to(p.device, template.dtype).contiguous()
        else:
            t = torch.empty(template.shape, dtype=template.dtype, device=p.device)
        dist.broadcast(t, group=p.pp_group, group_src=owner)
        yield name, t


class StreamedStateDict(Mapping):
    """A state dict over a stream of ``(name, tensor)`` pairs, read once, in the stream's
    order: looking an entry up advances the stream, which for ``broadcast_stage_weights``
    runs the next broadcast (a collective). Its keys are ``names``, the stream's, known
    without advancing it. Reading out of order fails instead of taking another entry's
    tensor (or, across ranks, waiting on another broadcast)."""

    def __init__(self, pairs: Iterator[tuple[str, torch.Tensor]], names: Sequence[str]) -> None:
        self._pairs, self._names = pairs, tuple(names)
        self._keys = frozenset(self._names)

    def __getitem__(self, name: str) -> torch.Tensor:
        streamed, tensor = next(self._pairs, (None, None))
        if streamed != name:
            raise KeyError(f"{name!r} read from a streamed state dict whose next entry is {streamed!r}: "
                           "read each entry once, in the stream's order")
        return tensor

    def __contains__(self, name: object) -> bool:
        return name in self._keys

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


def broadcast_state_dicts(
    pipeline: Pipeline, policy_like: nn.Module, draft_like: nn.Module | None = None
) -> tuple[StreamedStateDict, StreamedStateDict | None]:
    """The whole policy's and draft's trained state on every PP rank, ``(policy, draft or
    None)``, keyed and shaped like ``policy_like.state_dict()`` and ``draft_like``'s, as
    ``StreamedStateDict``s over ``broadcast_stage_weights``: every rank reads each of them
    whole, in ``*_like``'s order (as ``RolloutEngine.load_weights`` does), and each read is a
    broadcast."""
    policy = StreamedStateDict(broadcast_stage_weights(pipeline, policy_like), list(policy_like.state_dict()))
    if draft_like is None:
        return policy, None
    return policy, StreamedStateDict(broadcast_stage_weights(pipeline, draft_like, draft=True),
                                     list(draft_like.state_dict()))
