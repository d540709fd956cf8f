"""The rollout engine's own copies of the trainer's models: built on the meta device (split
over a tensor-parallel mesh when asked), materialised uninitialised, and filled one whole
tensor at a time from the trainer's (possibly FSDP-sharded) state dicts."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TypeVar

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from titan_cotrain.models.draft import Draft
from titan_cotrain.models.moe import reset_expert_tallies
from titan_cotrain.models.transformer import Transformer, rope_inv_freq
from titan_cotrain.parallel.engine_tp import fill_from_whole, tensor_parallel_engine_policy, whole_tensor

__all__ = ["copy_state", "empty_copy"]


@torch.no_grad()
def copy_state(module: nn.Module, state: Mapping[str, torch.Tensor]) -> None:
    """``module``'s tensors <- ``state``'s, one whole tensor at a time; a tensor-parallel
    engine keeps its slice of each."""
    own = module.state_dict()
    missing, unexpected = own.keys() - state.keys(), state.keys() - own.keys()
    if missing or unexpected:
        raise KeyError(f"state dict does not match the engine's {type(module).__name__}: "
                       f"missing {sorted(missing)}, unexpected {sorted(unexpected)}")
    for name, dst in own.items():  # the module's order: the same on every rank, as collectives need
        fill_from_whole(dst, whole_tensor(state[name], dst.dtype))


Model = TypeVar("Model", Transformer, Draft)


def empty_copy(build: Callable[[], Model], device: torch.device, dtype: torch.dtype,
                tp_mesh: DeviceMesh | None = None) -> Model:
    """``build()`` on the meta device (split over ``tp_mesh`` when given), materialised
    uninitialised on ``device`` with its parameters in ``dtype``; the weights are the
    caller's to load. The RoPE frequencies (a non-persistent buffer, in no state dict) are
    recomputed, in fp32 as the trainer's are, and a mixture of experts' per-expert tallies
    (torchtitan's, likewise) start at zero in fp32. Its expert stacks and routers are
    parameters like any other: ``copy_state`` fills them."""
    with torch.device("meta"):
        model = build().to(dtype)
    if tp_mesh is not None:
        tensor_parallel_engine_policy(model, tp_mesh)
    # to_empty gives each alias of a shared parameter (tied embeddings) a tensor of its own.
    ties: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        ties.setdefault(id(param), []).append(name)
    model.to_empty(device=device)
    for first, *aliases in ties.values():
        for alias in aliases:
            owner, _, leaf = alias.rpartition(".")
            setattr(model.get_submodule(owner), leaf, model.get_parameter(first))
    a = model.args
    model.rope_inv_freq = rope_inv_freq(a.head_dim, a.rope_theta, a.rope_scaling).to(device)
    reset_expert_tallies(model)
    return model
