"""The scale simulator's rollout: the real engine's step pieces, driven for a bounded number of
rounds.

On the simulated accelerator every device value is unknown, so no round can be post-processed
(which sequences finished is a host read of device values) and the schedule cannot follow
the sequences' lengths. What sets the rollout's peak memory is the widest round, so the
simulator runs ``RolloutEngine``'s pieces itself: ``start`` the call, ``admit`` what fits the
empty batch (its prefills), then ``plan`` and ``run`` a round ``rounds`` times, never
``postprocess``. The rows are taken to be at their last round: every one reads a block table
as wide as a sequence at its longest (a gathered round's largest transient); nothing grows,
retires or is preempted, and the call's caches are left as the rounds wrote them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from titan_cotrain.engine.rollout import RolloutEngine
from titan_cotrain.engine.sampling import SamplingParams

__all__ = ["bounded_rollout"]


@torch.no_grad()
def bounded_rollout(engine: RolloutEngine, prompts: Sequence[Sequence[int]], params: SamplingParams, *,
                    rounds: int, samples_per_prompt: int = 1, draft_tokens: int | Callable[[int], int] | None = None,
                    generator: torch.Generator | None = None) -> None:
    """Admit what of ``prompts`` (``samples_per_prompt`` sequences each; the other arguments as
    ``RolloutEngine.generate``'s) fits ``engine``'s empty batch and run exactly ``rounds``
    decoding rounds over it, every row reading the widest table; nothing is read back."""
    call = engine.start(prompts, params, samples_per_prompt=samples_per_prompt, draft_tokens=draft_tokens,
                        generator=generator)
    engine.admit(call)
    for _ in range(rounds):
        engine.run(call, engine.plan(call, width=engine.blocks_per_sequence))
