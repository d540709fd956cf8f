"""The job-config checks that need the parallel layer (compile components, engine tensor
parallelism and the node it must stay in), registered with ``config.validate``."""

from titan_cotrain.config.validate import config_check
from titan_cotrain.models.build import resolve_model_args
from titan_cotrain.parallel.compile import COMPILE_COMPONENTS
from titan_cotrain.parallel.rank_layout import gpus_per_node

__all__ = ["compile_errors", "engine_tp_config_errors"]


@config_check
def compile_errors(config, world_size: int) -> list[str]:
    unknown = sorted(set(config.compile.components) - set(COMPILE_COMPONENTS))
    if unknown:
        return [f"compile.components: unknown {unknown}; known: {', '.join(COMPILE_COMPONENTS)} (the "
                "rollout engine's key is rollout.compile)"]
    return []


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
