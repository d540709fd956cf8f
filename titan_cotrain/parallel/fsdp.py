"""FSDP2 for the target and the draft: one FSDP unit per decoder layer plus the root."""

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from titan_cotrain.components.titan import fsdp_sum_gradients

__all__ = ["apply_fsdp"]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def apply_fsdp(model: nn.Module, mesh, param_dtype: str = "float32", reduce_dtype: str = "float32",
               reshard_after_forward: bool = True) -> nn.Module:
    """Shard each of ``model.layers`` (if any) as a unit, then the root (for the target:
    embeddings, norm, head; the draft, one layer, is a single root unit).

    ``mesh`` is the ``fsdp`` mesh (``dp_shard x cp``), or the 2-D ``dp_replicate x fsdp``
    mesh for HSDP (parameters sharded over ``fsdp``, replicated over ``dp_replicate``).
    Gradients are *summed* across it, not averaged, so every loss is normalised by the
    global token count before backward.
    """
    mp = MixedPrecisionPolicy(param_dtype=_DTYPES[param_dtype], reduce_dtype=_DTYPES[reduce_dtype])
    for layer in getattr(model, "layers", ()):
        fully_shard(layer, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward)
    fsdp_sum_gradients(model.modules())
    return model
