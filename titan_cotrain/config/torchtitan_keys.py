"""torchtitan's config keys that this job does not honour: set to anything but torchtitan's
default, each is refused at start with what to use instead, so that no key passes validation
and is then silently ignored.

The job honours the rest of torchtitan's sections through torchtitan's own builders or its own
code: ``[optimizer]`` (torchtitan's optimizer container), ``[lr_scheduler]`` (the RL phase's
schedule), ``[checkpoint]`` (torchtitan's ``CheckpointManager``, but for the Hugging Face and
fault-tolerance keys below), ``[comm]`` (torchtitan's ``init_distributed``), ``[compile]``,
``[metrics] enable_tensorboard / save_tb_folder / log_freq`` (console lines; metrics.jsonl
and TensorBoard get every step), ``[debug] deterministic / deterministic_warn_only`` (torch's
deterministic algorithms), ``[job] description`` (a label), ``[training]``'s and ``[parallelism]``'s
keys that the project reads, ``[debug] seed``. A test checks that
every key of torchtitan's ``JobConfig`` is either named here or read by the project.
"""

import dataclasses

__all__ = ["UNHONOURED", "unhonoured_key_errors"]

_TENSORBOARD = "the job logs to metrics.jsonl and TensorBoard ([metrics] enable_tensorboard)"
_SIMULATE = "the project's scale simulator, [simulate] enable (see the README's scale section)"

# "section.key" -> what to use instead.
UNHONOURED: dict[str, str] = {
    "job.print_config": "the job does not print its resolved config; drop the key",
    "job.save_config_file": "the job's config file is the TOML you pass; copy it beside the run",
    **{f"profiling.{key}": "profile with torch.profiler around python -m titan_cotrain.train, or the "
                           "benchmarks under scripts/ (bench_e2e.py, bench_rollout.py)"
       for key in ("enable_profiling", "save_traces_folder", "profile_freq", "profiler_active", "profiler_warmup",
                   "enable_memory_snapshot", "save_memory_snapshot_folder")},
    "metrics.disable_color_printing": "the job's log lines carry no colour",
    "metrics.save_for_all_ranks": "rank 0 logs the job's metrics, reduced over every rank",
    "metrics.enable_wandb": f"W&B is not carried: {_TENSORBOARD}; point a W&B TensorBoard sync at save_tb_folder",
    "model.tokenizer_path": "[model] hf_assets_path (the tokenizer folder)",
    "model.converters": "model converters (float8, MX) are not applied; drop the key",
    "model.print_after_conversion": "model converters are not applied; drop the key",
    "training.dataset": "[task] name (the task's prompts) and [task] dataset_path",
    "training.dataset_path": "[task] dataset_path",
    "training.global_batch_size": "[rl] prompts_per_step x [rl] group_size responses per step; "
                                  "[task] sft_batch_size for the warm start",
    "training.enable_cpu_offload": "[rollout] offload_training_state",
    "training.gc_freq": "Python's garbage collector runs as usual; drop the key",
    "training.gc_debug": "drop the key",
    "training.dataloader": "the prompts come from [task]; drop [training.dataloader]",
    "parallelism.fsdp_reshard_after_forward": "FSDP always reshards after the forward; drop the key",
    "parallelism.disable_loss_parallel": "tensor parallelism is not supported; drop the key",
    "parallelism.enable_async_tensor_parallel": "tensor parallelism is not supported; drop the key",
    "parallelism.pipeline_parallel_expert_parallel_overlap": "drop the key",
    "parallelism.context_parallel_load_balancer": "context parallelism always uses the zigzag layout",
    "parallelism.context_parallel_rotate_method": "the ring passes K/V blocks peer to peer; drop the key",
    "parallelism.expert_tensor_parallel_degree": "expert tensor parallelism is not supported; drop the key",
    "parallelism.expert_parallel_comm_backend": "expert parallelism uses all-to-all collectives; drop the key",
    "checkpoint.enable_ft_dataloader_checkpoints": "fault tolerance is not supported; drop the key",
    "checkpoint.initial_load_in_hf": "[model] hf_path (a Hugging Face folder the job loads itself)",
    "checkpoint.initial_load_in_hf_quantized": "[model] hf_path",
    "checkpoint.last_save_in_hf": "python -m titan_cotrain.export (Hugging Face folders of the policy and draft)",
    **{f"activation_checkpoint.{key}": "[activation_checkpoint] mode = \"full\" or \"none\""
       for key in ("selective_ac_option", "per_op_sac_force_recompute_mm_shapes_by_fqns", "early_stop",
                   "memory_budget", "visualize_memory_budget_pareto", "determinism_check", "preserve_rng_state")},
    "quantize.linear": "quantized training is not supported; drop [quantize]",
    "quantize.grouped_mm": "quantized training is not supported; drop [quantize]",
    "memory_estimation.enable": _SIMULATE,
    "memory_estimation.disable_fake_mode": _SIMULATE,
    **{f"fault_tolerance.{key}": "fault tolerance is not supported: a job resumes from its last checkpoint"
       for key in ("enable", "process_group", "process_group_timeout_ms", "replica_id", "group_size",
                   "min_replica_size", "semi_sync_method")},
    "experimental.custom_import": "[task] reward imports a reward function; models are the project's own",
    "experimental.custom_args_module": "the project's sections are fixed (titan_cotrain.config.job_config)",
    **{f"validation.{key}": ("evaluation during training is [eval] (enable, interval, path: "
                                 "docs/datasets.md); afterwards, python -m titan_cotrain.eval")
       for key in ("enable", "dataset", "dataset_path", "local_batch_size", "seq_len", "freq", "steps", "dataloader")},
    "debug.moe_force_load_balance": "drop the key",
}


def _value(config, dotted: str):
    section, key = dotted.split(".")
    return getattr(getattr(config, section), key)


def unhonoured_key_errors(config, defaults) -> list[str]:
    """One line per key of ``UNHONOURED`` whose value in ``config`` differs from ``defaults``'
    (torchtitan's ``JobConfig()``), naming it and what to use instead."""
    errors = []
    for dotted, instead in UNHONOURED.items():
        value, default = _value(config, dotted), _value(defaults, dotted)
        if value != default:
            shown = "{...}" if dataclasses.is_dataclass(value) else repr(value)
            errors.append(f"{dotted} = {shown} is a torchtitan key this job does not honour: {instead}")
    return errors
