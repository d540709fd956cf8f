"""Tensor parallelism of the rollout engine's policy copy (``[rollout] tensor_parallel_degree``).

A policy too big for one GPU's engine (a 70B model's bf16 copy is 140 GB) is split over
``t`` ranks with DTensor's ``parallelize_module``, Megatron's layout:

* ``q/k/v_proj``, ``gate/up_proj``: colwise (each rank holds ``1/t`` of the heads and of the
  FFN width; their outputs stay local);
* ``o_proj``, ``down_proj``: rowwise (the partial sums are all-reduced, so every layer's
  output, and hence every tap, is whole and the same on every rank);
* ``embed_tokens``: rowwise over the vocabulary (all-reduced lookup); ``lm_head``: colwise
  over the vocabulary with the logits all-gathered, so sampling sees whole rows. Both shard
  the ``[V, H]`` weight on dim 0, so a tied embedding stays one parameter.

A mixture of experts' sparse layers split every expert the same way, over its width: each
rank holds ``1/t`` of the rows of every ``w1`` / ``w3`` ``[E, moe_inter_dim, dim]`` (dim 1) and
of the columns of ``w2`` ``[E, dim, moe_inter_dim]`` (dim 2), so each rank computes its part of
every routed token's expert output, and the MoE's output is all-reduced as ``down_proj``'s is.
The router stays whole: fed the same whole input on every rank, every rank routes alike.

A policy with fewer KV heads than ``t`` (Qwen3-235B-A22B has 4) keeps ``k_proj`` and ``v_proj``
whole on every rank and each rank takes its one KV head from their output: rank ``r`` holds
query heads ``r Hq / t ...`` whose GQA group is KV head ``r // (t / Hkv)``, so each KV head is
computed (and cached) on ``t / Hkv`` ranks. Whole ``k/v`` weights cost a rank ``2 Hkv Dh x dim``
a layer (under 1% of a 235B-A22B layer's share); they let an engine split such a policy 8
ways, where splitting by KV heads stops at 4.

Norm weights and the draft stay whole on every rank (the draft is one layer). Every rank of
an engine group runs the same generation on the same inputs, with the same seed: the
collectives' results are identical on every rank, so are the logits and the draws.

The groups are drawn from the ranks that train the same rows (``rl.generation_group``): the
CP and PP peers of a data-parallel coordinate, ``t`` consecutive ones per engine.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleOutput, RowwiseParallel, parallelize_module

__all__ = ["engine_tp_errors", "engine_tp_mesh", "fill_from_whole", "kv_heads_per_rank",
           "tensor_parallel_engine_policy", "whole_host_state", "whole_tensor"]


def engine_tp_mesh(device_type: str, groups: Sequence[Sequence[int]]) -> DeviceMesh:
    """The 1-D mesh of this rank's engine group. ``groups``: every engine group of the job
    (lists of ``t`` global ranks, together every rank once), so all ranks create the same
    process groups (a collective: every rank calls this)."""
    grid = torch.tensor([list(g) for g in groups], dtype=torch.int64)
    mesh = DeviceMesh(device_type, grid, mesh_dim_names=("engine_groups", "engine_tp"))
    return mesh["engine_tp"]


def engine_tp_errors(args, t: int) -> list[str]:
    """What keeps the layout above from splitting a policy of ``args`` (``ModelArgs``) ``t``
    ways: every split dimension must divide evenly, and the KV heads split or replicate."""
    split = [("heads", args.n_heads), ("vocabulary", args.vocab_size)]
    if args.n_sparse_layers < args.n_layers:  # a dense layer's SwiGLU splits too
        split.append(("ffn width", args.ffn_dim))
    if args.n_experts:
        split.append(("expert width", args.moe_inter_dim))
    errors = [f"rollout.tensor_parallel_degree ({t}) must divide the policy's {what} ({n})" for what, n in split if n % t]
    if args.n_kv_heads % t and t % args.n_kv_heads:
        errors.append(f"rollout.tensor_parallel_degree ({t}) must divide the policy's kv heads ({args.n_kv_heads}) "
                      "or be a multiple of them (each kv head then computed on t / kv heads ranks)")
    return errors


def kv_heads_per_rank(n_kv_heads: int, t: int) -> int:
    """The KV heads a rank of a ``t``-way engine computes and caches: ``n_kv_heads / t``, or
    one when ``t`` is a multiple of them (module docstring)."""
    return max(n_kv_heads // t, 1)


def tensor_parallel_engine_policy(policy: nn.Module, mesh: DeviceMesh) -> None:
    """Apply the layout above to a ``Transformer`` in place (on the meta device, before its
    storage is materialised). Ties between the embedding and the head are kept."""
    errors = engine_tp_errors(policy.args, mesh.size())
    if errors:
        raise ValueError("; ".join(errors))
    tied = policy.lm_head.weight is policy.embed_tokens.weight
    plan = {
        "embed_tokens": RowwiseParallel(input_layouts=Replicate()),
        "lm_head": ColwiseParallel(output_layouts=Replicate()),
    }
    t, n_kv = mesh.size(), policy.args.n_kv_heads
    head = mesh.get_local_rank() // (t // n_kv) if t > n_kv else None  # this rank's one KV head
    for i, layer in enumerate(policy.layers):
        if head is None:
            plan |= {f"layers.{i}.self_attn.{name}": ColwiseParallel() for name in ("q_proj", "k_proj", "v_proj")}
        else:
            plan[f"layers.{i}.self_attn.q_proj"] = ColwiseParallel()
            for proj in (layer.self_attn.k_proj, layer.self_attn.v_proj):
                _keep_one_head(proj, head, policy.args.head_dim)
        plan[f"layers.{i}.self_attn.o_proj"] = RowwiseParallel()
        if layer.sparse:
            _split_experts(layer.mlp.experts, mesh)
            plan[f"layers.{i}.mlp"] = PrepareModuleOutput(output_layouts=Partial(), desired_output_layouts=Replicate())
        else:
            plan |= {f"layers.{i}.mlp.{name}": ColwiseParallel() for name in ("gate_proj", "up_proj")}
            plan[f"layers.{i}.mlp.down_proj"] = RowwiseParallel()
    parallelize_module(policy, mesh, plan)
    if tied:
        policy.lm_head.weight = policy.embed_tokens.weight


def _keep_one_head(proj: nn.Linear, head: int, head_dim: int) -> None:
    """``proj`` (a whole ``k_proj`` / ``v_proj``, its weight a plain tensor on every rank)
    returns only KV head ``head`` of its output (module docstring)."""
    proj.register_forward_hook(lambda module, args, out: out.narrow(-1, head * head_dim, head_dim))


def _split_experts(experts: nn.Module, mesh: DeviceMesh) -> None:
    """torchtitan's ``GroupedExperts`` split over the expert width (module docstring). Its
    forward runs on the local shards (it takes ``to_local()`` of DTensor weights), so its
    output is this rank's partial sum."""
    def shard_width(name: str, module: nn.Module, mesh: DeviceMesh) -> None:
        for weight, dim in (("w1", 1), ("w3", 1), ("w2", 2)):
            module.register_parameter(weight, nn.Parameter(
                distribute_tensor(getattr(module, weight), mesh, [Shard(dim)])))

    distribute_module(experts, mesh, shard_width)


@torch.no_grad()
def whole_tensor(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A whole tensor in ``dtype`` from a state-dict entry: DTensors (FSDP2 shards) are cast
    first, then all-gathered, so the gather moves the engine's bytes (bf16), not fp32; other
    tensors are returned as they are (the reader's copy casts them)."""
    return t.to(dtype).full_tensor() if isinstance(t, DTensor) else t


def fill_from_whole(dst: torch.Tensor, whole: torch.Tensor) -> None:
    """``dst`` <- ``whole`` (one whole tensor, as every rank of the group has it): a plain
    copy, or for a DTensor this rank's slice of it (no communication)."""
    if isinstance(dst, DTensor):
        local = distribute_tensor(whole.to(dst.device), dst.device_mesh, dst.placements, src_data_rank=None)
        dst.to_local().copy_(local.to_local())
    else:
        dst.copy_(whole)


@torch.no_grad()
def whole_host_state(module: nn.Module, keep: bool) -> dict[str, torch.Tensor]:
    """``module``'s state dict as whole host tensors (an export's), a tensor-parallel copy's
    slices gathered one tensor at a time: a collective over its mesh, so every rank of it
    calls this; only where ``keep`` are the tensors kept (else an empty dict)."""
    out = {}
    for name, t in module.state_dict().items():
        whole = t.full_tensor() if isinstance(t, DTensor) else t
        if keep:
            out[name] = whole.to("cpu")
    return out
