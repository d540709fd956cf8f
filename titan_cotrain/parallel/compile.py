"""``torch.compile`` of the training models, block by block (``[compile] enable``, ``components``).

torchtitan's per-block style: every decoder block of the target, and the draft's TTT pass,
is compiled on its own with ``fullgraph=True``, after activation checkpointing and before
FSDP (``parallel.parallelize``). The block's ``forward`` is what is compiled, in place, so
parameter names (checkpoints, the engine's refresh, exports) do not change and FSDP's hooks
stay outside the graphs.

What keeps a block in one graph and out of recompiles:

* attention is one opaque custom op with a fake implementation: the trunk
  (``titan_cotrain::varlen_causal_attention``), the draft's branch, and under CP the whole
  ring (``titan_cotrain::ring_attention``: its messages and its host-side document plan never
  enter a graph; the ring is named by a string, one per process group, so the guard on it
  holds from step to step). Under CP the attention module's hooks make DTensors of its
  inputs and torch's CP dispatcher turns the op into the ring op on the local shards
  (``parallel.cp_dispatch``), inside the traced block;
* the packed layout's metadata is built once per batch on the host before the blocks run:
  ``cu_seqlens`` (an int32 host tensor, its length the batch's document count, marked
  dynamic by ``packed_cu_seqlens``) and the positions' RoPE tables (``[T, Dh]``, static);
* the shapes that do vary are the document count (dynamic from the first compile) and the
  draft's branch depth (one pass per depth: the first two passes, then one graph for the
  rest, by dynamo's automatic dynamic shapes);
* TapChannel sends happen between blocks (``parallel.pipeline.stage``), so a block that
  taps has no graph break, and an activation-checkpoint recompute (inside the block) sends
  nothing.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["COMPILE_COMPONENTS", "apply_compile"]

COMPILE_COMPONENTS = ("model", "draft")


def _blocks(model: nn.Module) -> list[nn.Module]:
    layers = model.layers
    return list(layers.values()) if isinstance(layers, nn.ModuleDict) else list(layers)


def apply_compile(policy: nn.Module, draft: nn.Module | None, components, backend: str = "inductor") -> None:
    """Compile ``policy``'s decoder blocks (``"model"`` in ``components``) and ``draft``'s TTT
    pass (``"draft"``) in place, each ``fullgraph=True``."""
    unknown = set(components) - set(COMPILE_COMPONENTS)
    if unknown:
        raise ValueError(f"[compile] components: unknown {sorted(unknown)}; known: {', '.join(COMPILE_COMPONENTS)}")
    if "model" in components:
        for block in _blocks(policy):
            block.forward = torch.compile(block.forward, backend=backend, fullgraph=True)
    if "draft" in components and draft is not None:
        draft.forward_pass = torch.compile(draft.forward_pass, backend=backend, fullgraph=True)
