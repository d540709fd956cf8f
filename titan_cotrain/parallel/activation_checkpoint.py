"""Activation checkpointing of the target: each decoder layer's activations are recomputed
in backward instead of kept (``[activation_checkpoint] mode = "full"``)."""

import functools

from torch import nn
from torch.utils.checkpoint import checkpoint

__all__ = ["apply_activation_checkpointing"]


def apply_activation_checkpointing(model: nn.Module, mode: str) -> None:
    """``mode``: ``"none"`` or ``"full"`` (every layer of ``model.layers``).

    The layer's ``forward`` is wrapped in place, so parameter names (checkpoints, exports,
    the rollout engine's weight refresh) do not change; apply before FSDP.
    """
    if mode == "none":
        return
    if mode != "full":
        raise ValueError(f"activation checkpointing mode {mode!r} is not supported; use 'full' or 'none'")
    for layer in model.layers:
        layer.forward = functools.partial(checkpoint, layer.forward, use_reentrant=False)
