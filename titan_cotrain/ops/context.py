"""The attention context: context parallelism enters the models from outside.

``with context_parallel(group):`` makes every packed attention of the models (the target's
trunk, the draft's branch attention) run over the CP ring of ``group`` on this rank's
zigzag shard; outside it they are local. So model code carries no process group: the
caller (the trainer's update, a pipeline's schedule step) opens the context around forward
*and* backward, and hands the models the shard's local ``cu_seqlens`` and positions.

It is process-wide state, as torch's own CP context is, not a ``contextvars`` variable: an
activation-checkpoint recompute runs in autograd's device threads, which must see it too.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

from titan_cotrain.ops.ring_attention import ring_name

__all__ = ["Ring", "active_ring", "context_parallel"]


@dataclass(frozen=True)
class Ring:
    """The CP ring of the open context: its ``group``, the ``name`` the ring ops know it by
    (``ops.ring_attention.ring_name``) and the shard ``layout`` (``"zigzag"``)."""

    group: object
    name: str
    layout: str = "zigzag"


_active: Ring | None = None
# One Ring per (ring, layout), reused each time a context opens: a compiled block guards on
# the object it read, so a fresh one per step would recompile it.
_rings: dict[tuple[str, str], Ring] = {}


def active_ring() -> Ring | None:
    """The ring of the open ``context_parallel``, None outside one."""
    return _active


@contextlib.contextmanager
def context_parallel(group, layout: str = "zigzag"):
    """Attention over ``group``'s ring (a process group or a ``RingComm``) inside the block
    (``group=None``: no CP, a no-op)."""
    global _active
    previous = _active
    if group is not None:
        name = ring_name(group)
        _active = _rings.setdefault((name, layout), Ring(group, name, layout))
    try:
        yield _active
    finally:
        _active = previous
