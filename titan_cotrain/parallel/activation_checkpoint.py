"""Activation checkpointing: each decoder layer of the target, and each TTT pass of the draft,
keeps only its inputs and is recomputed in backward (``[activation_checkpoint] mode = "full"``)."""

import functools

from torch import nn
from torch.utils.checkpoint import checkpoint

__all__ = ["apply_activation_checkpointing"]


def apply_activation_checkpointing(model: nn.Module, mode: str, draft: nn.Module | None = None) -> None:
    """``mode``: ``"none"`` or ``"full"`` (every layer of ``model.layers`` and, given a
    ``draft``, its ``forward_pass``: the draft runs ``D`` passes of a full-width layer per
    step, whose MLP activations would otherwise be kept ``D`` times).

    The forwards are wrapped in place, so parameter names (checkpoints, exports, the rollout
    engine's weight refresh) do not change; apply before compile and FSDP.
    """
    if mode == "none":
        return
    if mode != "full":
        raise ValueError(f"activation checkpointing mode {mode!r} is not supported; use 'full' or 'none'")
    for layer in model.layers:
        layer.forward = functools.partial(checkpoint, layer.forward, use_reentrant=False)
    if draft is not None and hasattr(draft, "forward_pass"):  # EAGLE-3: each TTT pass
        draft.forward_pass = functools.partial(checkpoint, draft.forward_pass, use_reentrant=False)
    elif draft is not None:  # a block drafter: each layer
        for layer in draft.layers:
            layer.forward = functools.partial(checkpoint, layer.forward, use_reentrant=False)
