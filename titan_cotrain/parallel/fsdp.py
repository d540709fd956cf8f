"""FSDP2 for the target and the draft: one FSDP unit per decoder layer (and one for its
expert-parallel experts) plus the root, and filling sharded parameters from whole tensors
one at a time (initialisation, loading)."""

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard

from titan_cotrain.components.private_torch import check_private_api
from titan_cotrain.components.shards import local_shard
from titan_cotrain.components.titan import fsdp_sum_gradients
from titan_cotrain.parallel.expert_parallel import is_expert_parallel

__all__ = ["apply_fsdp", "copy_whole_into_", "local_slices", "reduce_every_microbatch"]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def apply_fsdp(model: nn.Module, mesh, param_dtype: str | None = "float32", reduce_dtype: str | None = "float32",
               reshard_after_forward: bool = True, experts_mesh=None) -> nn.Module:
    """Shard each of ``model.layers`` (if any; a list, or a pipeline stage's dict) as a unit,
    then the root (for the target: embeddings, norm, head; the draft, one layer, is a single
    root unit; a stage's draft, sharded before it, stays a unit of its own).

    ``mesh`` is the ``fsdp`` mesh (``dp_shard x cp``), or the 2-D ``dp_replicate x fsdp``
    mesh for HSDP (parameters sharded over ``fsdp``, replicated over ``dp_replicate``).
    ``param_dtype`` / ``reduce_dtype`` None keep the parameters' own (fp64 references).
    Gradients are *summed* across it, not averaged: the co-training objective scales them by
    the global token counts once an update's microbatches are done.

    Expert parallelism (``parallel.expert_parallel``): a layer's expert-parallel experts are
    a unit of their own, sharded over ``experts_mesh`` (``efsdp``, or ``dp_replicate x
    efsdp``) on top of their ``ep`` sharding; on their expert dimension while each ``efsdp``
    rank still gets one, else on dimension 1 (torchtitan's rule: fewer local experts than
    ``efsdp`` ranks would leave ranks empty).
    """
    mp = MixedPrecisionPolicy(param_dtype=_DTYPES.get(param_dtype), reduce_dtype=_DTYPES.get(reduce_dtype))
    layers = getattr(model, "layers", ())
    for layer in layers.values() if isinstance(layers, nn.ModuleDict) else layers:
        if experts_mesh is not None:
            _shard_experts(layer, experts_mesh, mp, reshard_after_forward)
        fully_shard(layer, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward)
    fsdp_sum_gradients(model.modules())
    return model


def _shard_experts(layer: nn.Module, mesh, mp: MixedPrecisionPolicy, reshard_after_forward: bool) -> None:
    for experts in filter(is_expert_parallel, layer.modules()):
        local_experts = next(experts.parameters()).to_local().shape[0]
        by_width = (lambda param: Shard(1)) if mesh.shape[-1] > local_experts else None
        fully_shard(experts, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward,
                    shard_placement_fn=by_width)


def reduce_every_microbatch(module: nn.Module) -> None:
    """Keep FSDP2's own behaviour on ``module`` (a pipeline stage) under torch's pipeline
    schedules: reshard after every backward and reduce-scatter every microbatch's gradients.

    The schedules switch both off for every microbatch but the last (``set_reshard_after_backward
    (False)``, ``set_requires_gradient_sync(False)`` on the stage module), so the unsharded
    parameters *and* unsharded gradients of all of a rank's stages live through the whole
    backward: for a 70B policy on 4 PP ranks, 2 x 17.5B elements per rank. Here those two
    setters do nothing on the module, so it keeps the defaults ``fully_shard`` gave it: an
    all-gather and a reduce-scatter per microbatch instead. The gradients are the same sums
    (FSDP2 accumulates each microbatch's reduced shard); the schedule's final post-backward
    then finds nothing left to reduce."""
    def keep_default(*args, **kwargs) -> None:
        return None

    for setter in ("set_reshard_after_backward", "set_requires_gradient_sync"):
        setattr(module, setter, keep_default)  # an instance attribute shadows the method


def local_slices(param: torch.Tensor) -> tuple[slice, ...] | None:
    """The index of this rank's part of ``param`` in the whole tensor: a DTensor's
    (FSDP2 shards: ``Shard(d)`` cuts like ``torch.chunk``, the last chunks possibly short or
    empty), or everything for a plain tensor. None when this rank holds nothing of it."""
    if not isinstance(param, DTensor):
        return tuple(slice(None) for _ in param.shape)
    shape, offset = _local_shape_and_offset(param)
    if any(n == 0 and whole > 0 for n, whole in zip(shape, param.shape)):
        return None
    return tuple(slice(start, start + n) for start, n in zip(offset, shape))


# torch answers "which box of the whole tensor does this rank hold" (for DCP's planner) only
# privately, in ``torch.distributed.tensor._utils``; this is our one use of it. Its signature
# ``(global_shape, mesh, placements)`` is the same from 2.5 on; the project runs on 2.11-2.13
# (the GPU machines have 2.11), where every real job's weight loading reads it.
_LOCAL_SHAPE_TORCH = ("2.11", "2.12", "2.13")


def _local_shape_and_offset(param: DTensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(local shape, global offset)`` of this rank's part of ``param``, every placement
    (uneven ``Shard``, ``_StridedShard``, nested meshes) as DTensor itself lays it out."""
    check_private_api("torch.distributed.tensor._utils.compute_local_shape_and_global_offset",
                      "titan_cotrain.parallel.fsdp (shard bounds)", _LOCAL_SHAPE_TORCH)
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    return compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)


@torch.no_grad()
def copy_whole_into_(param: torch.Tensor, whole) -> None:
    """Fill ``param`` (a DTensor shard or a plain tensor) from the whole tensor: ``whole`` is
    a host tensor, or a function of an index tuple that reads just that part (a safetensors
    slice). One tensor at a time, so a rank never holds a whole model."""
    index = local_slices(param)
    local = local_shard(param)
    if index is None or local.numel() == 0:
        return
    part = whole(index) if callable(whole) else whole[index]
    local.copy_(part.to(dtype=local.dtype).reshape(local.shape))
