"""The job-config checks that need the parallel layer (compile components, expert
parallelism, engine tensor parallelism and the node it must stay in), registered with
``config.validate``."""

from titan_cotrain.config.validate import config_check
from titan_cotrain.models.build import resolve_model_args
from titan_cotrain.parallel.compile import COMPILE_COMPONENTS
from titan_cotrain.parallel.rank_layout import gpus_per_node

__all__ = ["compile_errors", "engine_tp_config_errors", "expert_parallel_errors"]


@config_check
def compile_errors(config, world_size: int) -> list[str]:
    unknown = sorted(set(config.compile.components) - set(COMPILE_COMPONENTS))
    if unknown:
        return [f"compile.components: unknown {unknown}; known: {', '.join(COMPILE_COMPONENTS)} (the "
                "rollout engine's key is rollout.compile)"]
    return []


@config_check
def expert_parallel_errors(config, world_size: int) -> list[str]:
    """``[parallelism] expert_parallel_degree`` (``parallel.expert_parallel``): a mixture of
    experts whose experts split evenly, over ranks that torchtitan's mesh cuts from the
    data-parallel x CP ones (of each PP coordinate); not under a compiled policy yet."""
    p = config.parallelism
    ep = p.expert_parallel_degree
    if ep <= 1:  # < 1: reported by validate_job_config
        return []
    try:
        args = resolve_model_args(config)
    except ValueError:  # the model keys: reported by validate_job_config itself
        return []
    key = f"parallelism.expert_parallel_degree ({ep})"
    if not args.n_experts:
        return [f"{key}: the policy ({config.model.name} {config.model.flavor}) is dense; expert parallelism "
                "shards a mixture of experts' experts (use 1, or a mixture of experts such as qwen3 debugmoe)"]
    errors = []
    if args.n_experts % ep:
        errors.append(f"{key} must divide the policy's {args.n_experts} experts")
    others = p.data_parallel_replicate_degree * p.context_parallel_degree * p.pipeline_parallel_degree
    shard = p.data_parallel_shard_degree if p.data_parallel_shard_degree != -1 else world_size // max(others, 1)
    fsdp = shard * p.context_parallel_degree
    if fsdp % ep:
        errors.append(f"{key} must divide data_parallel_shard_degree x context_parallel_degree = {shard} x "
                      f"{p.context_parallel_degree}: torchtitan's mesh cuts those ranks into efsdp x ep")
    if config.compile.enable and "model" in config.compile.components:
        errors.append(f"{key} with a compiled policy is not built yet: each block compiles fullgraph, and the "
                      "dispatch's all-to-all splits are read on the host (drop \"model\" from compile.components)")
    return errors


@config_check
def engine_tp_config_errors(config, world_size: int) -> list[str]:
    """An engine group stays in one node, and the policy splits evenly ``tp`` ways."""
    from titan_cotrain.parallel.engine_tp import engine_tp_errors

    tp, errors = config.rollout.tensor_parallel_degree, []
    node = gpus_per_node(config)
    if tp > node:
        errors.append(f"rollout.tensor_parallel_degree ({tp}) exceeds the {node} processes of a node "
                      "(LOCAL_WORLD_SIZE, else simulate.gpus_per_node): an engine group's all-reduces, two per layer "
                      "and step, would cross nodes")
    if tp > 1:
        try:
            errors += engine_tp_errors(resolve_model_args(config), tp)
        except ValueError:  # the model keys: reported by validate_job_config itself
            pass
    return errors
