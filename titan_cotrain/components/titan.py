"""The one adapter between titan_cotrain and torchtitan (pinned 0.2.2).

Everything the project takes from torchtitan goes through here: the TOML ``JobConfig``
and its parser, the process-group init, parallel dims and the device mesh, the optimizer
and LR-schedule containers, grad-norm clipping across meshes, the pipeline's default layer
split, the DCP checkpoint manager, the tokenizer, the TensorBoard logger and the
mixture-of-experts feed-forward and its expert-parallel style. This is also
the one place that resolves the device type, and where torchtitan's CPU gaps are closed
(each skipped when CUDA is present):

* torchtitan resolves ``device_type`` to ``"cuda"`` at import even without a GPU; the
  modules that copied it are rebound to ``"cpu"`` / ``torch.cpu``;
* its device-memory monitor needs ``torch.cuda``: ``device_memory_stats`` reports the
  process's peak RSS on CPU instead;
* gloo has no ``PREMUL_SUM`` reduction, which FSDP2 uses to scale gradients:
  ``fsdp_sum_gradients`` makes FSDP *sum* gradients with plain SUM collectives on every
  backend, so every loss of the project divides by the global token count itself;
* its ``set_pg_timeouts`` runs a barrier that fails on CPU: the project never calls it
  on CPU;
* its MoE router counts tokens per expert with ``torch.histc`` on int64 expert ids, which
  has no CPU kernel: on CPU the MoE runs under a torch-function mode that counts them as
  floats (``build_moe``); the expert-parallel dispatch runs inside the MoE's forward, so
  under the same mode;
* its expert-parallel dispatch orders the received tokens by expert with a Triton kernel
  that takes device tensors only: on CPU it asks for torchtitan's own host loop instead
  (``expert_parallel_style``).

The scale simulator's stand-in accelerator (``use_device_type``) counts as a GPU: the MoE
takes the grouped-matmul path there (torch's meta kernel of ``_grouped_mm`` gives its
shapes). Its tensors have no values, so the two MoE steps that need them get stand-ins
there and only there: the expert-order permutation (torchtitan's Triton kernel) is an
unfilled index vector of the kernel's length, and the expert-parallel dispatch's split
sizes, read on the host, are the balanced ones (``_balanced_dispatch``).
"""

import bisect
import contextlib
import functools
import importlib
import resource
import sys
from collections.abc import Iterable, Sequence

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

TORCHTITAN_VERSION = "0.2.2"

__all__ = [
    "build_checkpointer",
    "build_lr_schedulers",
    "build_moe",
    "build_optimizers",
    "build_parallel_dims",
    "clip_grad_norm_",
    "device_memory_stats",
    "device_type",
    "encode_without_special_tokens",
    "expert_parallel_style",
    "on_expert_parallel_mesh",
    "use_device_type",
    "fsdp_sum_gradients",
    "init_distributed",
    "init_torchtitan",
    "load_tokenizer",
    "model_stateful",
    "parse_job_config",
    "tensorboard_logger",
    "titan_job_config_class",
]

_initialized = False
_device_override: str | None = None

# torchtitan modules that copy ``device_type`` / ``device_module`` at import.
_DEVICE_COPIES = (
    "torchtitan.tools.utils",
    "torchtitan.distributed.utils",
    "torchtitan.distributed.parallel_dims",
    "torchtitan.components.metrics",
)


def device_type() -> str:
    """``"cuda"`` when a GPU is visible, else ``"cpu"``; the scale simulator's stand-in
    accelerator (``"simgpu"``) while it runs (``use_device_type``)."""
    if _device_override is not None:
        return _device_override
    return "cuda" if torch.cuda.is_available() else "cpu"


def use_device_type(name: str | None) -> None:
    """Make ``device_type()`` answer ``name`` (None: back to the real device), and rebind
    torchtitan's import-time copies to it. Only the simulator calls this: ``name`` is its
    stand-in accelerator, whose tensors have shapes and no values."""
    global _device_override
    _device_override = name
    init_torchtitan()
    _rebind_torchtitan_device()


def _rebind_torchtitan_device() -> None:
    kind = device_type()
    module_of_kind = torch.cpu if kind == "cpu" else getattr(torch, kind, torch.cpu)
    for name in _DEVICE_COPIES:
        module = importlib.import_module(name)
        if hasattr(module, "device_type"):
            module.device_type = kind
        if hasattr(module, "device_module"):
            module.device_module = module_of_kind


def _on_stand_in_device(t: torch.Tensor) -> bool:
    """Whether ``t`` lives on the simulator's stand-in accelerator (``use_device_type``)."""
    return _device_override is not None and t.device.type == _device_override


def init_torchtitan() -> None:
    """Import torchtitan, check its version, and close its CPU gaps (idempotent)."""
    global _initialized
    if _initialized:
        return
    import torchtitan  # noqa: F401  (imports triton)
    from importlib.metadata import version

    found = version("torchtitan")
    if found != TORCHTITAN_VERSION:
        raise RuntimeError(
            f"titan_cotrain needs torchtitan=={TORCHTITAN_VERSION} (TOML JobConfig era), found {found}; "
            "reinstall with `bash scripts/setup_env.sh`"
        )
    _initialized = True
    if device_type() != "cuda":
        _rebind_torchtitan_device()


def titan_job_config_class() -> type:
    """torchtitan's ``JobConfig`` dataclass, whose sections ``config/job_config.py`` extends."""
    init_torchtitan()
    from torchtitan.config import JobConfig

    return JobConfig


def parse_job_config(toml_values: dict, args: list[str]):
    """torchtitan's ``ConfigManager.parse_args`` (its dataclasses plus ``[job]
    custom_config_module``'s, ``--section.key value`` overrides) on already merged TOML
    values: left to itself it would read ``--job.config_file`` alone, without what that file
    extends."""
    init_torchtitan()
    from torchtitan.config import ConfigManager

    class MergedTomlConfigManager(ConfigManager):
        def _maybe_load_toml(self, args: list[str]) -> dict:
            return toml_values

    return MergedTomlConfigManager().parse_args(args)


def init_distributed(comm_config) -> int:
    """torchtitan's process-group init under torchrun (backend for the device, timeouts
    from ``[comm]``); the world size."""
    init_torchtitan()
    from torchtitan.distributed.utils import init_distributed as titan_init_distributed

    return titan_init_distributed(comm_config)


def build_parallel_dims(parallelism, world_size: int, mesh_ranks: Sequence[int] | None = None):
    """torchtitan ``ParallelDims`` from a ``[parallelism]`` section (TP fixed at 1; EP of
    ``expert_parallel_degree``, whose ``ep`` mesh is the innermost ranks of ``fsdp`` and
    ``efsdp`` the rest: ``efsdp x ep = dp_shard x cp``).

    ``mesh_ranks``: the global rank at each position of torchtitan's ``[pp, dp, cp]`` world
    mesh (``parallel.rank_layout.RankLayout.mesh_ranks``); None or ``arange(world_size)``:
    torchtitan's own placement. Every mesh the project reads (``pp``, ``batch``, ``cp``,
    ``fsdp``, ``loss``) keeps torchtitan's dims and names; only the process at each
    coordinate changes."""
    init_torchtitan()
    from torchtitan.distributed import ParallelDims

    degrees = dict(dp_replicate=parallelism.data_parallel_replicate_degree,
                   dp_shard=parallelism.data_parallel_shard_degree, cp=parallelism.context_parallel_degree,
                   tp=1, pp=parallelism.pipeline_parallel_degree,
                   ep=parallelism.expert_parallel_degree, etp=1, world_size=world_size)
    if mesh_ranks is None or list(mesh_ranks) == list(range(world_size)):
        return ParallelDims(**degrees)
    return _placed_parallel_dims_class()(**degrees, mesh_ranks=tuple(mesh_ranks))


@functools.cache
def _placed_parallel_dims_class():
    """``ParallelDims`` whose world mesh holds ``mesh_ranks`` instead of ``arange(world)``.

    torchtitan 0.2.2's ``build_mesh`` makes the 1-D world mesh with the ``init_device_mesh``
    of its module and unflattens every other mesh from it (``DeviceMesh._unflatten`` reshapes
    the world mesh's rank map), so handing it a world mesh over a permuted rank tensor for
    the length of the call places every mesh; the rest of ``build_mesh`` (names, fake
    backends for size-1 dims, size checks) stays torchtitan's. The world dim itself keeps
    the default group (its group ranks are global ranks, not positions); nothing reads it."""
    import dataclasses

    import torchtitan.distributed.parallel_dims as titan_parallel_dims
    from torch.distributed.device_mesh import DeviceMesh

    @dataclasses.dataclass
    class PlacedParallelDims(titan_parallel_dims.ParallelDims):
        mesh_ranks: tuple[int, ...] = ()

        def build_mesh(self):
            if sorted(self.mesh_ranks) != list(range(self.world_size)):
                raise ValueError(f"mesh_ranks must hold every rank of {self.world_size} once, got {self.mesh_ranks}")
            made_by_torchtitan = titan_parallel_dims.init_device_mesh

            def world_mesh(device, shape, mesh_dim_names):
                assert shape == (self.world_size,), shape
                return DeviceMesh(device, torch.tensor(self.mesh_ranks), mesh_dim_names=mesh_dim_names)

            titan_parallel_dims.init_device_mesh = world_mesh
            try:
                return super().build_mesh()
            finally:
                titan_parallel_dims.init_device_mesh = made_by_torchtitan

    return PlacedParallelDims


def build_optimizers(model_parts: list[nn.Module], optimizer_config, parallel_dims):
    """torchtitan's ``OptimizersContainer`` over ``model_parts`` (the policy and the draft get one
    each); their LRs are set by ``build_lr_schedulers``."""
    init_torchtitan()
    from torchtitan.components.optimizer import build_optimizers as titan_build_optimizers

    return titan_build_optimizers(model_parts, optimizer_config, parallel_dims)


def build_lr_schedulers(optimizers, phases: Sequence[tuple[object, int, float]]):
    """torchtitan's LR-schedule container over ``optimizers``, running ``phases`` one after the
    other: each ``(lr_scheduler_config, steps, peak_lr)`` is torchtitan's warm-up / stable /
    decay schedule for ``steps`` updates, peaking at ``peak_lr``, that starts (warm-up
    included) at the first update of its phase. Update ``i`` (0-based, the scheduler's step
    count) of phase ``p`` runs at ``peak_lr_p x factor_p(i - first update of p)``.

    The LR is a function of the step count alone: every param group's base LR is set to 1
    (``LambdaLR`` multiplies it by the factor, so the factor is the LR) and a checkpoint's
    ``base_lrs`` is ignored on load and the loaded optimizers' LRs are replaced by the
    schedule's, so a run resumed from any checkpoint follows the schedule of its config from
    its first update on."""
    init_torchtitan()
    from torchtitan.components.lr_scheduler import LRSchedulersContainer
    from torchtitan.components.lr_scheduler import build_lr_schedulers as titan_build_lr_schedulers

    starts, factors, first = [], [], 0
    for lr_config, steps, peak in phases:
        if steps == 0:  # a phase without updates (no warm start)
            continue
        # torchtitan's factor function, taken from a scheduler built on a stand-in optimizer.
        stand_in = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
        starts.append(first)
        factors.append((peak, titan_build_lr_schedulers([stand_in], lr_config, steps).schedulers[0].lr_lambdas[0]))
        first += steps

    def lr(step: int) -> float:  # a function, not a callable object: LambdaLR does not save it
        phase = bisect.bisect_right(starts, step) - 1
        peak, factor = factors[phase]
        return peak * factor(step - starts[phase])

    def follow_schedule(scheduler) -> None:
        value = lr(scheduler.last_epoch)
        for group in scheduler.optimizer.param_groups:
            group["lr"] = value
        scheduler._last_lr = [value] * len(scheduler.optimizer.param_groups)

    class PhasedLRSchedulers(LRSchedulersContainer):
        def load_state_dict(self, state_dict):
            super().load_state_dict({k: v for k, v in state_dict.items() if k != "base_lrs"})
            for scheduler in self.schedulers:
                follow_schedule(scheduler)

    for optimizer in optimizers:
        for group in optimizer.param_groups:
            group["lr"] = group["initial_lr"] = 1.0
    schedulers = PhasedLRSchedulers(optimizers, lr)
    # A loaded optimizer's param groups hold the LR that the *saving* job's schedule set for
    # the next update: a job resumed with other phases (a warm start reused with another
    # training.steps) would run its first update at it. Each load, the optimizer's or the
    # schedule's (DCP loads states in key order), sets this schedule's from the step count.
    for scheduler in schedulers.schedulers:
        scheduler.optimizer.register_load_state_dict_post_hook(lambda _, s=scheduler: follow_schedule(s))
    return schedulers


def clip_grad_norm_(parameters: Iterable[torch.Tensor], max_norm: float, pp_mesh=None) -> torch.Tensor:
    """Global grad-norm clip over DTensor (FSDP) and plain parameters, reduced across PP stages.

    Expert-parallel experts live on another mesh (``efsdp x ep``) than the rest (``fsdp``),
    and one norm cannot mix DTensors of two meshes: torchtitan's EP clip then takes the two
    norms apart and combines them. A rank with no gradients (under PP, a stage without the
    draft) still joins the PP reduction, with a zero on the device: torchtitan's
    ``get_total_norm([])`` is a host tensor, which NCCL cannot reduce."""
    init_torchtitan()
    from torchtitan.distributed.utils import clip_grad_norm_ as titan_clip

    parameters = list(parameters)
    if any(p.grad is not None for p in parameters):
        ep_enabled = any(map(on_expert_parallel_mesh, parameters))
        return titan_clip(parameters, max_norm, foreach=True, pp_mesh=pp_mesh, ep_enabled=ep_enabled)
    squares = torch.zeros((), dtype=torch.float32, device=device_type())
    if pp_mesh is not None:
        torch.distributed.all_reduce(squares, group=pp_mesh.get_group())
    return squares.sqrt()


def pipeline_layer_split(
    num_stages: int, n_layers: int, first_stage_less_layers: int = 1, last_stage_less_layers: int = 1
) -> list[int]:
    """Decoder layers per pipeline stage: torchtitan's even split, which counts the embedding
    and the head as ``first/last_stage_less_layers`` layers of the first and last stage."""
    init_torchtitan()
    from torchtitan.distributed.pipeline_parallel import generate_llm_fqn_per_model_part

    parts = generate_llm_fqn_per_model_part(num_stages, n_layers, first_stage_less_layers, last_stage_less_layers)
    return [sum(name.startswith("layers.") for name in part) for part in parts]


def fsdp_sum_gradients(modules: Iterable[nn.Module]) -> None:
    """Make FSDP2 modules sum gradients across ranks (divide factor 1) with SUM-only
    collectives on CPU, where gloo lacks ``PREMUL_SUM``."""
    from torch.distributed.fsdp import FSDPModule

    for module in modules:
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            if device_type() == "cpu":
                module.set_force_sum_reduction_for_comms(True)


def device_memory_stats() -> dict[str, float]:
    """Peak memory of this process in GiB: device allocator peak on GPU, peak RSS on CPU."""
    if device_type() not in ("cuda", "cpu"):
        return {}  # the simulator reports memory itself
    if device_type() == "cuda":
        return {
            "memory/max_active_gib": torch.cuda.max_memory_allocated() / 2**30,
            "memory/max_reserved_gib": torch.cuda.max_memory_reserved() / 2**30,
        }
    # ru_maxrss is KiB on Linux, bytes on macOS.
    scale = 1 if sys.platform == "darwin" else 1024
    return {"memory/max_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale / 2**30}


def on_expert_parallel_mesh(t: torch.Tensor) -> bool:
    """Whether ``t`` is a DTensor over a mesh with torchtitan's ``ep`` dimension (the experts
    ``expert_parallel_style`` sharded)."""
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor) and "ep" in (t.device_mesh.mesh_dim_names or ())


def build_moe(dim: int, hidden_dim: int, n_experts: int, top_k: int, route_norm: bool) -> nn.Module:
    """torchtitan's token-choice ``MoE`` routed as Qwen3-MoE routes, uninitialised.

    ``router.gate`` (``dim -> n_experts``, no bias) gives softmax scores in fp32; each token
    goes to its ``top_k`` experts, whose outputs are summed weighted by their scores,
    renormalised to sum to 1 when ``route_norm``. ``experts.w1`` / ``w3`` ``[E, hidden_dim,
    dim]`` and ``w2`` ``[E, dim, hidden_dim]`` are each expert's gate / up / down projection.
    No shared experts and no expert bias (torchtitan's aux-loss-free balancing): the balance
    is kept by an auxiliary loss outside. Input ``[B, S, dim]`` -> output ``[B, S, dim]``.

    On an accelerator (CUDA, or the simulator's stand-in for one) the experts run as grouped
    matmuls, which compute in bf16 whatever the weights' dtype; on CPU as torchtitan's loop over
    experts, in the weights' dtype (``torch._grouped_mm`` has a bf16-only CPU kernel, and fp32
    models must stay fp32 there). The loop reads the per-expert token counts on the host, one
    sync per MoE layer; the grouped matmuls take them as device offsets.
    """
    init_torchtitan()
    from torchtitan.models.moe import MoEArgs

    args = MoEArgs(
        num_experts=n_experts, num_shared_experts=0, score_func="softmax", route_norm=route_norm, route_scale=1.0,
        score_before_experts=False, top_k=top_k, use_grouped_mm=device_type() != "cpu", load_balance_coeff=None,
    )
    return _moe_class()(args, dim=dim, hidden_dim=hidden_dim)


class _HistcOfIdsAsFloats(TorchFunctionMode):
    """``torch.histc`` of an integer CPU tensor counted on its float copy and returned in its
    dtype, as CUDA's kernel returns it: exact for expert ids (integers below 2**24)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.histc and args[0].device.type == "cpu" and not args[0].is_floating_point():
            return func(args[0].float(), *args[1:], **(kwargs or {})).to(args[0].dtype)
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def _unfilled_expert_permutation():
    """torchtitan's expert-order permutation (``generate_permute_indices``) with its Triton
    fill replaced by the vector the kernel fills, ``[max_len]`` int32, left unfilled: on the
    simulator's stand-in device the indices have no values anyway, and their length (the
    routed rows plus the per-expert padding) is what the memory depends on."""
    import torchtitan.models.moe.kernels as titan_moe_kernels

    def unfilled(tokens_per_expert_group, start_index_values, write_offsets, experts_per_rank, num_ranks, max_len,
                 **kernel_options):
        return torch.full((max_len,), -1, dtype=torch.int32, device=tokens_per_expert_group.device)

    fill = titan_moe_kernels.fill_indices_wrapper
    titan_moe_kernels.fill_indices_wrapper = unfilled
    try:
        yield
    finally:
        titan_moe_kernels.fill_indices_wrapper = fill


@functools.cache
def _moe_class() -> type:
    """torchtitan's ``MoE``, whose forward on CPU counts expert ids as floats (its int64
    ``torch.histc`` has no CPU kernel) and on the simulator's stand-in device permutes without
    the Triton kernel (``_unfilled_expert_permutation``); unchanged on CUDA."""
    from torchtitan.models.moe import MoE

    class MoEWithCpuCounts(MoE):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if x.device.type == "cpu":
                with _HistcOfIdsAsFloats():
                    return super().forward(x)
            if _on_stand_in_device(x):
                with _unfilled_expert_permutation():
                    return super().forward(x)
            return super().forward(x)

    return MoEWithCpuCounts


def expert_parallel_style():
    """torchtitan's ``ExpertParallel`` style for one MoE's ``experts`` (``GroupedExperts``;
    one instance per layer: it keeps the layer's splits from dispatch to combine), applied
    with ``parallelize_module`` over the ``ep`` mesh.

    It shards ``w1/w2/w3`` ``Shard(0)`` over the experts (rank ``r`` of ``ep`` holds experts
    ``[r E/ep, (r+1) E/ep)``). Dispatch: the ``[N top_k, dim]`` routed tokens, sorted by
    expert, go to their experts' ranks in one ``all_to_all`` (splits exchanged first, read on
    the host: one sync per layer), are reordered by local expert and each expert's group
    padded with zero rows to a multiple of 8 (what grouped matmuls need; the per-expert loop
    off CUDA runs them too, and zero rows give zero outputs and gradients). Combine: the
    inverse all-to-all back to the tokens' own rank. Dropless: every assignment is computed.
    On CPU the reordering runs torchtitan's host loop in place of its Triton kernel; on the
    simulator's stand-in device the splits are the balanced ones (``_balanced_dispatch``)."""
    init_torchtitan()
    return _expert_parallel_class()()


@functools.cache
def _expert_parallel_class() -> type:
    """torchtitan's ``ExpertParallel``, whose dispatch on CPU builds its permutation with
    ``generate_permute_indices(use_cpu=True)`` (torchtitan's ``_permute`` leaves it at the
    Triton kernel, which refuses host tensors) and on the simulator's stand-in device is
    ``_balanced_dispatch``; unchanged on CUDA."""
    import torchtitan.models.moe.utils as titan_moe_utils
    from torchtitan.distributed.expert_parallel import ExpertParallel

    class ExpertParallelWithCpuPermute(ExpertParallel):
        def _token_dispatch(self, mod, inputs, device_mesh):
            if _on_stand_in_device(inputs[0]):
                return _balanced_dispatch(self, inputs, device_mesh)
            if inputs[0].device.type != "cpu":
                return super()._token_dispatch(mod, inputs, device_mesh)
            on_device = titan_moe_utils.generate_permute_indices
            titan_moe_utils.generate_permute_indices = functools.partial(on_device, use_cpu=True)
            try:
                return super()._token_dispatch(mod, inputs, device_mesh)
            finally:
                titan_moe_utils.generate_permute_indices = on_device

    return ExpertParallelWithCpuPermute


def _balanced_dispatch(style, inputs: tuple, device_mesh):
    """``ExpertParallel._token_dispatch`` on the simulator's stand-in device, whose split sizes
    (read on the host by torchtitan) have no values. A modelling assumption, balanced routing:
    each rank sends an equal share of its ``N top_k`` routed rows to every ``ep`` rank and
    receives as many from each, so every rank's experts get ``N top_k`` rows per layer (``N``:
    the rank's tokens), their even share; a router that favours one rank's experts sends it
    more. The rest is torchtitan's dispatch: the counts' all-to-all, the rows' all-to-all (with
    autograd), and the permutation by local expert with its padding. Sets ``style``'s splits
    and permutation for its ``_token_combine``."""
    from torch.distributed._functional_collectives import all_to_all_single, all_to_all_single_autograd
    from torchtitan.models.moe.utils import _permute

    routed_input, num_tokens_per_expert = inputs
    ep = device_mesh.shape[0]
    rows = routed_input.shape[0]
    splits = [rows // ep + (r < rows % ep) for r in range(ep)]
    style.input_splits, style.output_splits = splits, list(splits)
    group = device_mesh.get_group()
    with torch.no_grad():
        counts_from_ranks = torch.ops._c10d_functional.wait_tensor(
            all_to_all_single(num_tokens_per_expert, None, None, group=group))
    routed_input = all_to_all_single_autograd(routed_input, style.output_splits, style.input_splits, group)
    style.input_shape, routed_input, style.permuted_indices, counts_by_expert = _permute(
        routed_input, counts_from_ranks, ep, num_tokens_per_expert.shape[0] // ep)
    return routed_input, counts_by_expert


def tensorboard_logger(log_dir: str):
    """torchtitan's TensorBoard logger (``log(metrics: dict, step)``, ``close()``)."""
    init_torchtitan()
    from torchtitan.components.metrics import TensorBoardLogger

    return TensorBoardLogger(log_dir)


def model_stateful(module: nn.Module):
    """A DCP ``Stateful`` view of ``module``'s (possibly sharded) parameters."""
    init_torchtitan()
    from torchtitan.components.checkpoint import ModelWrapper

    return ModelWrapper(module)


def build_checkpointer(checkpoint_config, base_folder: str, model: nn.Module, optimizers, lr_schedulers,
                       states: dict, partial: dict[str, str] | None = None, announce=print):
    """torchtitan's DCP ``CheckpointManager`` for ``model`` plus extra ``Stateful`` ``states``
    (saved under their keys; ``model_stateful`` wraps further modules). DCP reshards what it
    loads: the keys are the whole model's names at any (dp_shard, cp, pp) layout.

    ``partial``: the states that load from a checkpoint lacking some of their keys (one written
    before they were saved) or holding them at other shapes, name -> what then happens: their
    ``load_state_dict`` gets the keys found, and ``announce`` says which were left out. Every
    other key must be in the checkpoint at its shape (DCP raises)."""
    return _partial_loading_checkpointer_class()(
        dataloader=None, model_parts=[model], optimizers=optimizers, lr_schedulers=lr_schedulers,
        states=states, checkpoint_config=checkpoint_config, sd_adapter=None, base_folder=base_folder,
        partial=partial or {}, announce=announce,
    )


@functools.cache
def _partial_loading_checkpointer_class():
    """torchtitan's ``CheckpointManager`` whose load (``dcp_load``: the DCP checkpoints it
    writes, never Hugging Face ones here) leaves out the keys of ``partial`` states that the
    checkpoint lacks or holds at another shape, through a DCP load planner that drops them
    from the state dicts it is handed before planning."""
    init_torchtitan()
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import DefaultLoadPlanner
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    from torchtitan.components.checkpoint import MODEL, CheckpointManager

    class PartialStatesPlanner(DefaultLoadPlanner):
        def __init__(self, partial) -> None:
            super().__init__()
            self.partial, self.left_out = partial, []

        def set_up_planner(self, state_dict, metadata=None, is_coordinator=False) -> None:
            saved = metadata.state_dict_metadata
            for name in self.partial:
                inner = state_dict.get(name) or {}
                for key, value in list(inner.items()):
                    found = saved.get(f"{name}.{key}")
                    if found is None or (isinstance(found, TensorStorageMetadata) and found.size != value.size()):
                        del inner[key]
                        self.left_out.append(f"{name}.{key}")
            super().set_up_planner(state_dict, metadata, is_coordinator)

    class PartialLoadingCheckpointer(CheckpointManager):
        def __init__(self, *args, partial: dict[str, str], announce, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            self.partial, self.announce = partial, announce

        def dcp_load(self, state_dict, checkpoint_id: str, from_hf: bool, from_quantized: bool) -> None:
            if from_hf:
                raise ValueError("loading a Hugging Face checkpoint through the checkpoint manager is not supported")
            planner = PartialStatesPlanner([name for name in self.partial if name in state_dict])
            dcp.load(state_dict, checkpoint_id=checkpoint_id, planner=planner)
            if MODEL in self.states:  # torchtitan flattens the model's keys into state_dict
                self.states[MODEL].load_state_dict(state_dict)
            for name, what in self.partial.items():
                missing = [key.removeprefix(f"{name}.") for key in planner.left_out if key.startswith(f"{name}.")]
                if missing:
                    self.announce(f"{checkpoint_id} has no {name} {', '.join(missing)} at this job's shapes: {what}")

    return PartialLoadingCheckpointer


def checkpoint_due(checkpointer, step: int, last_step: bool) -> bool:
    """Whether ``checkpointer.save(step, last_step)`` will write a checkpoint (torchtitan's
    own interval rule, a private method of 0.2.2's ``CheckpointManager``)."""
    return checkpointer._should_save(step, last_step=last_step)


def load_tokenizer(path: str):
    """torchtitan's Hugging Face tokenizer for a folder with ``tokenizer.json``
    (``encode(text, add_bos=, add_eos=)``, ``decode(ids)``, ``bos_id``, ``eos_id``)."""
    init_torchtitan()
    from torchtitan.components.tokenizer import HuggingFaceTokenizer

    return HuggingFaceTokenizer(path)


def encode_without_special_tokens(tokenizer, text: str) -> list[int]:
    """Token ids of ``text`` with no special token added by the tokenizer (its post-processor's
    BOS included): how Hugging Face tokenizes a rendered chat template."""
    return tokenizer.tokenizer.encode(text, add_special_tokens=False).ids
