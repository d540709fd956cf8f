"""This rank's part of a (possibly distributed) tensor.

A DTensor's local shard is read as its inner tensor itself, not through ``to_local()``: that
makes a view, and under fake tensors (the scale simulator) a view of a storage shrunk to
nothing grows it back to the view's size, so reading a released weight would allocate it
(``parallel/storage.py``). The inner tensor is outside autograd: this is for code that runs
without gradients (gradients themselves, copies into parameters, storages, checks).
"""

import torch
from torch.distributed.tensor import DTensor

__all__ = ["local_shard"]


def local_shard(t: torch.Tensor) -> torch.Tensor:
    """This rank's tensor of ``t``: a DTensor's local shard itself (its inner tensor under
    the tensor-subclass flattening protocol, which torch 2.13 lists beside the mesh), not a
    view of it; any other tensor as it is."""
    if isinstance(t, DTensor):
        names, _ = t.__tensor_flatten__()
        return next(inner for inner in map(t.__getattribute__, names) if isinstance(inner, torch.Tensor))
    return t
