"""``parallelize``: the trainer's models built, parallelised from outside and filled, once.

In torchtitan's order, on models built on the meta device: expert parallelism (the routed
experts of a mixture of experts sharded over ``ep``, tokens dispatched by all-to-all,
``parallel.expert_parallel``), then context parallelism (torch's CP
dispatcher running our ring, hooked onto every attention module of the policy and the draft,
``parallel.context_parallel.apply_context_parallel``; the batch side is the returned
``prepare_microbatch``), then activation checkpointing, then
``torch.compile`` per block (``[compile] enable``), then FSDP2 (the compute and reduce dtypes
of ``[training] mixed_precision_*``) over ``dp_shard x cp`` (HSDP's ``dp_replicate x fsdp``
with replicas; expert-parallel experts over ``efsdp``), or over this rank alone when only
the compute dtype asks for it;
under PP the model is first split into this rank's stages, which are sharded the same way.
Then the shards are materialised on the device and filled one whole tensor at a time on the
host (a Hugging Face folder is read slice by slice): no rank ever holds a whole model, and
every layout gets the values of the single-device init. The models' own code carries no
parallelism.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from functools import partial

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from titan_cotrain.components.shards import local_shard
from titan_cotrain.cotrain.step import prepare_microbatch
from titan_cotrain.data.batch import PrepareMicrobatch
from titan_cotrain.models.build import build_draft, build_target, init_draft_, init_target_
from titan_cotrain.models.draft import Draft
from titan_cotrain.models.moe import reset_expert_tallies
from titan_cotrain.models.transformer import Transformer, rope_inv_freq
from titan_cotrain.parallel.activation_checkpoint import apply_activation_checkpointing
from titan_cotrain.parallel.compile import apply_compile
from titan_cotrain.parallel.context_parallel import apply_context_parallel, cp_forward_scope, prepare_cp_microbatch
from titan_cotrain.parallel.expert_parallel import apply_expert_parallel, experts_fsdp_mesh
from titan_cotrain.parallel.fsdp import apply_fsdp, copy_whole_into_, reduce_every_microbatch
from titan_cotrain.parallel.pipeline import Pipeline, build_pipeline

__all__ = ["ParallelModels", "copy_shards", "parallelize"]


@dataclass
class ParallelModels:
    """What ``parallelize`` built for this rank. ``policy``: the policy (FSDP-sharded), or
    under PP this rank's stages' modules under the whole model's names (``LocalPolicy``);
    ``draft``: None when off, and under PP off the last stage's rank; ``reference``: the KL
    reference, sharded like the policy (None without KL); ``pipeline`` under PP;
    ``engine_policy`` / ``engine_draft``: what the rollout engine copies its shapes (and,
    when ``engine_loadable``, its weights) from; ``prepare_microbatch``: how the update's host
    rows become this rank's model inputs (``forward_backward``'s ``prepare``: under CP the
    zigzag shard the hooked models expect, else the rows whole); ``forward_scope``: the block
    the update's forward-backward runs in (under CP, torch's CP dispatcher on for it)."""

    policy: nn.Module
    draft: Draft | None
    reference: Transformer | None
    pipeline: Pipeline | None
    engine_policy: Transformer
    engine_draft: Draft | None
    engine_loadable: bool
    prepare_microbatch: PrepareMicrobatch = prepare_microbatch
    forward_scope: Callable[[], AbstractContextManager] = nullcontext


def fsdp_mesh(parallel_dims):
    """``fsdp`` (dp_shard x cp), or HSDP's ``dp_replicate x fsdp`` when there are replicas:
    without the replicate dimension replicas would never reduce their gradients."""
    dims = parallel_dims
    return dims.get_mesh(["dp_replicate", "fsdp"]) if dims.dp_replicate_enabled else dims.get_mesh("fsdp")


def _fsdp_mesh_or_none(config, parallel_dims, world_size: int, device: torch.device):
    """The mesh FSDP2 wraps the models over: ``dp_shard x cp`` (or HSDP's) when there is data
    or context parallelism; else, when the compute dtype is not fp32, a mesh of this rank
    alone, so one GPU (or PP without data parallelism) trains under the same mixed-precision
    policy as a sharded job (bf16 compute, fp32 master weights and reductions); else None."""
    if world_size > 1 and (parallel_dims.dp_enabled or parallel_dims.cp_enabled):
        return fsdp_mesh(parallel_dims)
    if config.training.mixed_precision_param == "float32":
        return None
    if not dist.is_initialized():
        raise ValueError(f'[training] mixed_precision_param = "{config.training.mixed_precision_param}" applies '
                         "through FSDP2, which needs a process group: launch with torchrun "
                         "(NPROC=1 bash scripts/train.sh ...), or set it to \"float32\"")
    own_group, _ = dist.new_subgroups(group_size=1)  # collective: every rank makes every one-rank group
    return DeviceMesh.from_group(own_group, device.type)


def parallelize(config, parallel_dims, world_size: int, device: torch.device, *, policy_loss_fn,
                token_counts: torch.Tensor | None = None, fill: bool = True) -> ParallelModels:
    """Build, parallelise and fill the policy, the draft and the KL reference for this rank.

    ``token_counts [V]``: the corpus of a reduced draft vocabulary; ``policy_loss_fn``: the
    pipeline's first loss (its steps may switch it); ``fill=False`` leaves the shards
    uninitialised (the scale simulator: fake values, and a whole model's host-side draws
    would only cost it minutes)."""
    t = config.training
    if device.type == "cuda" and t.mixed_precision_param == "float32":
        raise ValueError('[training] mixed_precision_param = "float32" on a CUDA device: the flash kernels the '
                         'models attend with take bf16/fp16 only; set it to "bfloat16" (fp32 master weights and '
                         'reductions are kept)')
    policy = build_target(config, device="meta")
    draft = build_draft(config, policy, token_counts=token_counts, device="meta")
    prepare, scope = prepare_microbatch, nullcontext
    ep_mesh = parallel_dims.get_mesh("ep") if parallel_dims.ep_enabled else None
    if ep_mesh is not None:
        apply_expert_parallel(policy, ep_mesh)
    if parallel_dims.cp_enabled and not parallel_dims.pp_enabled:  # under PP, build_pipeline applies it
        cp_mesh = parallel_dims.get_mesh("cp")
        apply_context_parallel(cp_mesh, policy, draft)
        prepare, scope = partial(prepare_cp_microbatch, group=cp_mesh), cp_forward_scope
    apply_activation_checkpointing(policy, config.activation_checkpoint.mode, draft)
    if config.compile.enable:
        apply_compile(policy, draft, config.compile.components, config.compile.backend)
    mesh = _fsdp_mesh_or_none(config, parallel_dims, world_size, device)
    sharded = mesh is not None
    experts_mesh = experts_fsdp_mesh(parallel_dims) if ep_mesh is not None else None

    def shard(module: nn.Module) -> None:
        apply_fsdp(module, mesh, t.mixed_precision_param, t.mixed_precision_reduce, experts_mesh=experts_mesh)

    if parallel_dims.pp_enabled:
        def shard_stage(module: nn.Module) -> None:
            shard(module)
            if config.parallelism.pipeline_fsdp_reduce_every_microbatch:
                reduce_every_microbatch(module)

        return _pipelined(config, parallel_dims, device, policy, draft, shard_stage if sharded else None,
                          policy_loss_fn, fill)
    reference = build_target(config, device="meta").requires_grad_(False) if config.rl.kl_coef > 0 else None
    if reference is not None and ep_mesh is not None:
        apply_expert_parallel(reference, ep_mesh)
    for module in (policy, draft, reference):
        if module is None:
            continue
        host = _take_host_buffers(module)
        if sharded:
            shard(module)
        _materialize(module, device, host)
    if fill:
        init_target_(policy, config, fill=copy_whole_into_)
        if draft is not None:
            init_draft_(draft, config, policy, fill=copy_whole_into_)
        if reference is not None:
            init_target_(reference, config, fill=copy_whole_into_)
    return ParallelModels(policy, draft, reference, None, policy, draft, engine_loadable=True,
                          prepare_microbatch=prepare, forward_scope=scope)


def _pipelined(config, dims, device, policy: Transformer, draft: Draft | None, shard, policy_loss_fn,
               fill: bool) -> ParallelModels:
    """PP: this rank's stages of the meta-built models, sharded, materialised, and filled
    from the whole-model init keeping only what this rank holds."""
    host = _take_host_buffers(draft) if draft is not None else {}
    replicas = dims.get_mesh("loss").get_group() if dims.dp_enabled or dims.cp_enabled else None
    pipeline = build_pipeline(
        policy, draft, config, dims.get_mesh("pp"), policy_loss_fn=policy_loss_fn, loss_group=replicas,
        cp_mesh=dims.get_mesh("cp") if dims.cp_enabled else None,
        cp_row_len=config.training.seq_len if dims.cp_enabled else None, device=device, shard=shard)
    for part in pipeline.model_parts:
        _materialize(part, device, {})
    if pipeline.draft is not None:
        _materialize(pipeline.draft, device, host)
    if fill:
        def fill_local(param, whole):
            if param.device.type != "meta":  # not another rank's stage
                copy_whole_into_(param, whole)

        init_target_(policy, config, fill=fill_local)
        if pipeline.draft is not None:
            init_draft_(pipeline.draft, config, policy, fill=copy_whole_into_)
    args = policy.args
    with torch.no_grad():
        for part in pipeline.model_parts:
            part.rope_inv_freq.copy_(rope_inv_freq(args.head_dim, args.rope_theta, args.rope_scaling))
    # The engine copies the whole models' shapes; its weights come from the stages at refresh.
    return ParallelModels(pipeline.local_policy, pipeline.draft, None, pipeline, policy, draft,
                          engine_loadable=False, prepare_microbatch=pipeline.prepare,
                          forward_scope=pipeline.forward_scope)


def _take_host_buffers(module: nn.Module) -> dict[str, torch.Tensor]:
    """Swap a meta-built module's host buffers (the draft's vocabulary maps) for meta ones and
    return them: FSDP moves buffers to the device by ``.data =``, which host tensors refuse."""
    host = {}
    for name, buffer in list(module.named_buffers()):
        if buffer.device.type == "cpu":
            owner_name, _, leaf = name.rpartition(".")
            owner = module.get_submodule(owner_name)
            host[name] = buffer
            owner.register_buffer(leaf, torch.empty_like(buffer, device="meta"),
                                  persistent=leaf not in owner._non_persistent_buffers_set)
    return host


def _materialize(module: nn.Module, device: torch.device, host: dict[str, torch.Tensor]) -> None:
    """A meta-built (and possibly sharded) module's storage on ``device``, uninitialised,
    with the ``host`` buffers ``_take_host_buffers`` kept copied back. Parameters are swapped
    in place (``swap_tensors``), so tied ones (embedding and head) stay one parameter; where
    a swap is refused (the simulator's plain fake tensors carry weakrefs), the ties are
    restored by hand. A MoE's per-expert tallies start at zero."""
    owners: dict[int, list[tuple[nn.Module, str]]] = {}
    for sub in module.modules():
        for name, param in sub.named_parameters(recurse=False):
            owners.setdefault(id(param), []).append((sub, name))
    ties = [group for group in owners.values() if len(group) > 1]
    swap = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        module.to_empty(device=device)
    except RuntimeError:
        torch.__future__.set_swap_module_params_on_conversion(False)
        module.to_empty(device=device)
        for (first, first_name), *others in ties:
            for sub, name in others:
                setattr(sub, name, getattr(first, first_name))
    finally:
        torch.__future__.set_swap_module_params_on_conversion(swap)
    _restore_buffers(module, host)
    reset_expert_tallies(module)  # a MoE's per-expert count, in no state dict


@torch.no_grad()
def _restore_buffers(module: nn.Module, host: dict[str, torch.Tensor]) -> None:
    for name, buffer in module.named_buffers():
        if name in host:
            buffer.copy_(host[name])


@torch.no_grad()
def copy_shards(source: nn.Module, target: nn.Module) -> None:
    """``target``'s parameters <- ``source``'s, shard by shard (both sharded alike)."""
    for dst, src in zip(target.parameters(), source.parameters()):
        local_shard(dst).copy_(local_shard(src))
