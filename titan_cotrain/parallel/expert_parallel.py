"""Expert parallelism: the routed experts of every sparse layer sharded over the ``ep`` ranks,
each token's hidden state sent to its top-k experts' ranks and back by all-to-all
(torchtitan's ``ExpertParallel`` style, ``components.titan.expert_parallel_style``).

Which ranks: torchtitan's sparse mesh ``[pp, dp_replicate, efsdp, ep]`` cuts the ``fsdp``
ranks (``dp_shard x cp``) of a PP coordinate and replica into ``efsdp x ep``, ``ep`` innermost.
An ``ep`` group holds ``E / ep`` experts per rank and serves the tokens of all its ranks,
whatever they hold: other rows (data parallel) or other zigzag chunks of the same rows
(context parallel; the MoE is token-wise, so CP needs nothing more). Everything but the
experts (attention, norms, routers, embeddings, head) stays FSDP-sharded over ``fsdp`` as in
a dense model; the experts get an FSDP unit of their own over ``efsdp`` (with
``dp_replicate``, HSDP), which reduces their gradients over the ranks that hold the same
experts (``parallel.fsdp.apply_fsdp``'s ``experts_mesh``). Gradients are summed, as for every
other parameter: the all-to-all's backward brings an expert the gradients of all its group's
tokens, FSDP adds those of the other groups.

Applied from outside the model, before activation checkpointing and FSDP (torchtitan's
order); the model's code does not change. Dropless: no capacity factor, every top-k
assignment is computed, so there is no dropped-token count to log.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import parallelize_module

from titan_cotrain.components.titan import expert_parallel_style, on_expert_parallel_mesh

__all__ = ["apply_expert_parallel", "experts_fsdp_mesh", "is_expert_parallel", "routed_experts"]


def routed_experts(model: nn.Module) -> list[nn.Module]:
    """The routed experts (torchtitan's ``GroupedExperts``, ``w1/w2/w3 [E, ...]``) of the
    sparse layers of ``model`` (a ``Transformer``)."""
    return [layer.mlp.experts for layer in model.layers if layer.sparse]


def apply_expert_parallel(model: nn.Module, ep_mesh: DeviceMesh) -> None:
    """Shard ``model``'s routed experts over ``ep_mesh`` (``E / ep`` whole experts per rank,
    ``Shard(0)`` DTensors) and hook their token dispatch and combine; a model built on the
    meta device stays there (``parallelize`` materialises it after FSDP)."""
    ep = ep_mesh.size()
    for experts in routed_experts(model):
        if experts.num_experts % ep:
            raise ValueError(f"{experts.num_experts} experts cannot be split evenly over {ep} expert-parallel ranks")
        parallelize_module(experts, ep_mesh, expert_parallel_style())


def is_expert_parallel(module: nn.Module) -> bool:
    """Whether ``module``'s own parameters are sharded over an ``ep`` mesh (the experts
    ``apply_expert_parallel`` sharded)."""
    return any(map(on_expert_parallel_mesh, module.parameters(recurse=False)))


def experts_fsdp_mesh(parallel_dims) -> DeviceMesh:
    """The mesh FSDP2 shards the expert-parallel experts over: ``efsdp`` (``dp_shard x cp /
    ep``; torchtitan builds it, of size 1 too, whenever ``ep > 1``), or HSDP's
    ``dp_replicate x efsdp`` when there are replicas."""
    names = ["dp_replicate", "efsdp"] if parallel_dims.dp_replicate_enabled else ["efsdp"]
    return parallel_dims.get_mesh(names)
