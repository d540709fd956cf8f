"""Cross-field checks of a parsed job config (types were checked when the TOML was read).

The checks that need a package above ``config`` (the task registry of ``rl``, the compile
components and engine tensor parallelism of ``parallel``) live in that package and are
registered here with ``@config_check`` (``rl/config_checks.py``,
``parallel/config_checks.py``); importing ``titan_cotrain`` registers them, so ``config``
imports nothing above it.
"""

from collections.abc import Callable

from titan_cotrain.config.torchtitan_keys import unhonoured_key_errors
from titan_cotrain.models.build import resolve_model_args, resolve_tap_layers

__all__ = ["config_check", "validate_job_config"]

# (config, world_size) -> problems; see config_check.
_CHECKS: list[Callable[..., list[str]]] = []


def config_check(check: Callable[..., list[str]]) -> Callable[..., list[str]]:
    """Register ``check(config, world_size) -> list of problems`` with ``validate_job_config``
    (a decorator). A check that needs the model's shape resolves it itself and returns
    nothing when the model keys are wrong (that error is reported once, here)."""
    if check not in _CHECKS:
        _CHECKS.append(check)
    return check


def _config_error(message: str):
    from titan_cotrain.config.loader import ConfigError

    return ConfigError(message)


def _parallel_errors(p, world_size: int) -> list[str]:
    errors = []
    if p.tensor_parallel_degree != 1:
        errors.append("parallelism.tensor_parallel_degree: tensor parallelism is not supported (use 1)")
    degrees = {
        "data_parallel_replicate_degree": p.data_parallel_replicate_degree,
        "context_parallel_degree": p.context_parallel_degree,
        "pipeline_parallel_degree": p.pipeline_parallel_degree,
        "expert_parallel_degree": p.expert_parallel_degree,
    }
    for key, value in degrees.items():
        if value < 1:
            errors.append(f"parallelism.{key} must be >= 1, got {value}")
    if errors:
        return errors
    others = p.data_parallel_replicate_degree * p.context_parallel_degree * p.pipeline_parallel_degree
    shard = p.data_parallel_shard_degree
    if shard == -1:
        if world_size % others:
            errors.append(
                f"parallelism: world size {world_size} is not divisible by dp_replicate x cp x pp = {others}, "
                "so data_parallel_shard_degree = -1 cannot be inferred"
            )
    elif shard < 1:
        errors.append(f"parallelism.data_parallel_shard_degree must be >= 1 or -1 (infer), got {shard}")
    elif others * shard != world_size:
        errors.append(
            "parallelism: data_parallel_replicate_degree x data_parallel_shard_degree x "
            f"context_parallel_degree x pipeline_parallel_degree = {p.data_parallel_replicate_degree} x {shard} x "
            f"{p.context_parallel_degree} x {p.pipeline_parallel_degree} = {others * shard}, "
            f"but the world size is {world_size}"
        )
    return errors


def _range_errors(config) -> list[str]:
    d, rl, ro, t = config.draft, config.rl, config.rollout, config.training
    checks = [
        ("model.moe_aux_loss_weight", config.model.moe_aux_loss_weight, config.model.moe_aux_loss_weight >= 0,
         ">= 0"),
        ("training.seq_len", t.seq_len, t.seq_len >= 1, ">= 1"),
        ("training.local_batch_size", t.local_batch_size, t.local_batch_size >= 1, ">= 1"),
        ("training.steps", t.steps, t.steps >= 1, ">= 1"),
        ("training.max_nonfinite_steps", t.max_nonfinite_steps, t.max_nonfinite_steps >= 1, ">= 1"),
        ("draft.ttt_steps", d.ttt_steps, d.ttt_steps >= 1, ">= 1"),
        ("draft.loss_weight", d.loss_weight, d.loss_weight >= 0, ">= 0"),
        ("draft.pass_decay", d.pass_decay, 0 < d.pass_decay <= 1, "in (0, 1]"),
        ("draft.vocab_size", d.vocab_size, d.vocab_size >= 0, ">= 0 (0 = the target's)"),
        ("draft.vocab_samples", d.vocab_samples, d.vocab_samples >= 0, ">= 0"),
        ("draft.vocab_generations", d.vocab_generations, d.vocab_generations >= 0, ">= 0 (0 = off)"),
        ("draft.lr", d.lr, d.lr > 0, "> 0"),
        ("draft.sft_lr", d.sft_lr, d.sft_lr >= 0, ">= 0 (0 = draft.lr)"),
        ("draft.grad_clip", d.grad_clip, d.grad_clip > 0, "> 0"),
        ("rl.group_size", rl.group_size, rl.group_size >= 2, ">= 2 (advantages are normalised within a group)"),
        ("rl.prompts_per_step", rl.prompts_per_step, rl.prompts_per_step >= 1, ">= 1"),
        ("rl.clip_eps_low", rl.clip_eps_low, 0 <= rl.clip_eps_low < 1, "in [0, 1)"),
        ("rl.clip_eps_high", rl.clip_eps_high, rl.clip_eps_high >= 0, ">= 0"),
        ("rl.kl_coef", rl.kl_coef, rl.kl_coef >= 0, ">= 0"),
        ("rl.updates_per_step", rl.updates_per_step, rl.updates_per_step >= 1, ">= 1"),
        ("rl.tis_cap", rl.tis_cap, rl.tis_cap == 0 or rl.tis_cap >= 1, "0 (off) or >= 1"),
        ("rollout.max_new_tokens", ro.max_new_tokens, ro.max_new_tokens >= 1, ">= 1"),
        ("rollout.temperature", ro.temperature, ro.temperature >= 0, ">= 0 (0 = greedy)"),
        ("rollout.top_p", ro.top_p, 0 < ro.top_p <= 1, "in (0, 1]"),
        ("rollout.top_k", ro.top_k, ro.top_k >= 0, ">= 0 (0 = off)"),
        ("rollout.draft_tokens", ro.draft_tokens, ro.draft_tokens >= 0, ">= 0"),
        ("rollout.speculation_granularity", ro.speculation_granularity,
         ro.speculation_granularity in ("round", "call"), "'round' or 'call'"),
        ("rollout.kv_block_size", ro.kv_block_size, ro.kv_block_size >= 1, ">= 1"),
        ("rollout.kv_cache_gib", ro.kv_cache_gib, ro.kv_cache_gib == "auto" or ro.kv_cache_gib >= 0,
         '>= 0 (0 = the whole batch) or "auto"'),
        ("rollout.acceptance_warning_fraction", ro.acceptance_warning_fraction,
         0 <= ro.acceptance_warning_fraction <= 1, "in [0, 1] (0 = off)"),
        ("rollout.acceptance_warning_steps", ro.acceptance_warning_steps, ro.acceptance_warning_steps >= 1, ">= 1"),
        ("rollout.collapse_fraction", ro.collapse_fraction, 0 <= ro.collapse_fraction < 1, "in [0, 1) (0 = off)"),
        ("rollout.collapse_position_rate", ro.collapse_position_rate, 0 <= ro.collapse_position_rate < 1,
         "in [0, 1) (0 = off)"),
        ("rollout.collapse_steps", ro.collapse_steps, ro.collapse_steps >= 1, ">= 1"),
        ("task.sft_steps", config.task.sft_steps, config.task.sft_steps >= 0, ">= 0"),
        ("task.sft_batch_size", config.task.sft_batch_size, config.task.sft_batch_size >= 1, ">= 1"),
        ("task.eval_size", config.task.eval_size, config.task.eval_size >= 0, ">= 0"),
        ("task.eval_fraction", config.task.eval_fraction, 0 <= config.task.eval_fraction < 1, "in [0, 1)"),
        ("simulate.prompt_tokens", config.simulate.prompt_tokens, config.simulate.prompt_tokens >= 1, ">= 1"),
        ("simulate.gpus_per_node", config.simulate.gpus_per_node, config.simulate.gpus_per_node >= 1, ">= 1"),
        ("task.sft_lr", config.task.sft_lr, config.task.sft_lr >= 0, ">= 0 (0 = [optimizer] lr)"),
        ("task.sft_warmup_steps", config.task.sft_warmup_steps, config.task.sft_warmup_steps >= 0, ">= 0"),
        ("task.sft_min_lr_factor", config.task.sft_min_lr_factor, 0 <= config.task.sft_min_lr_factor <= 1,
         "in [0, 1]"),
    ]
    return [f"{key} must be {rule}, got {value!r}" for key, value, ok, rule in checks if not ok]


def validate_job_config(config, world_size: int, source: str = "<config>") -> None:
    """Raise one ``ConfigError`` listing every problem of ``config`` for ``world_size`` ranks."""
    errors = _parallel_errors(config.parallelism, world_size) + _range_errors(config)
    ro = config.rollout
    p = config.parallelism
    dp_world = max(p.context_parallel_degree * p.pipeline_parallel_degree, 1)
    if not errors and world_size % dp_world == 0 and config.rl.prompts_per_step % (world_size // dp_world):
        errors.append(f"rl.prompts_per_step ({config.rl.prompts_per_step}) must split evenly over the "
                      f"{world_size // dp_world} data-parallel ranks")
    cp = config.parallelism.context_parallel_degree
    if cp > 1 and config.training.seq_len % (2 * cp):
        errors.append(
            f"training.seq_len ({config.training.seq_len}) must be divisible by 2 x context_parallel_degree "
            f"= {2 * cp} (the zigzag layout cuts every row into 2 x cp chunks)"
        )
    if ro.max_prompt_tokens < 0 or ro.max_prompt_tokens + ro.max_new_tokens > config.training.seq_len:
        errors.append(f"rollout.max_prompt_tokens ({ro.max_prompt_tokens}) must be >= 0, and with "
                      f"rollout.max_new_tokens ({ro.max_new_tokens}) fit in training.seq_len "
                      f"({config.training.seq_len})")
    if ro.max_new_tokens >= config.training.seq_len:
        errors.append(f"rollout.max_new_tokens ({ro.max_new_tokens}) must leave room for the prompt within "
                      f"training.seq_len ({config.training.seq_len})")
    tp, peers = ro.tensor_parallel_degree, p.context_parallel_degree * p.pipeline_parallel_degree
    if tp < 1 or peers % tp:
        errors.append(f"rollout.tensor_parallel_degree ({tp}) must divide context_parallel_degree x "
                      f"pipeline_parallel_degree = {peers}: an engine group is made of ranks that train the same rows")
    if ro.kv_cache_gib == "auto" and not ro.release_between_rollouts:
        errors.append('rollout.kv_cache_gib = "auto" needs rollout.release_between_rollouts = true: the pool takes '
                      "what the rollout leaves, and gives it back to the update, whose activations and gradients "
                      "no count at start knows")
    if config.rl.tis_cap > 0 and config.rl.updates_per_step != 1:
        errors.append(f"rl.tis_cap needs rl.updates_per_step = 1 (got {config.rl.updates_per_step}): the trainer's "
                      "log-probs it weights by are the single update's own")
    pp, mb = config.parallelism.pipeline_parallel_degree, config.parallelism.pipeline_parallel_microbatch_size
    if pp > 1 and config.rl.kl_coef > 0:
        errors.append("rl.kl_coef > 0 is not supported with pipeline parallelism yet (the KL reference is "
                      "not split into stages); set it to 0 or pipeline_parallel_degree to 1")
    if pp > 1 and (mb < 1 or config.training.local_batch_size % mb):
        errors.append(
            f"parallelism.pipeline_parallel_microbatch_size ({mb}) must divide "
            f"training.local_batch_size ({config.training.local_batch_size})"
        )
    try:
        args = resolve_model_args(config)
        if config.draft.enable:
            resolve_tap_layers(config, args.n_layers)
        if config.draft.vocab_size > args.vocab_size:
            errors.append(
                f"draft.vocab_size ({config.draft.vocab_size}) exceeds the target vocabulary ({args.vocab_size})"
            )
    except ValueError as e:  # the model keys (models.build.resolve_*)
        errors.append(str(e))
    errors += _draft_errors(config) + _recipe_errors(config)
    errors += unhonoured_key_errors(config, type(config)())
    for check in _CHECKS:
        errors += check(config, world_size)
    if errors:
        raise _config_error(f"{source}: invalid config:\n  " + "\n  ".join(errors))


def _draft_errors(config) -> list[str]:
    """Combinations of the draft's keys that cannot do what they say."""
    d, errors = config.draft, []
    if config.rollout.speculative and d.enable and config.rollout.draft_tokens == 0:
        errors.append("rollout.draft_tokens = 0 drafts nothing: speculative decoding needs >= 1 (for plain "
                      "decoding set --rollout.no-speculative)")
    if d.freeze_after_sft and not d.enable:
        errors.append("draft.freeze_after_sft freezes the draft, but draft.enable is false: there is none "
                      "(drop --draft.freeze_after_sft or enable the draft)")
    if d.enable and d.kind == "dflash":
        errors += _block_drafter_errors(config)
    if d.vocab_generations:
        missing = [need for need, ok in (
            ("draft.enable", d.enable), ("a reduced draft.vocab_size (> 0)", d.vocab_size),
            ("no draft.init_path (its folder brings its vocabulary)", not d.init_path),
            ("model.hf_path (a random policy writes noise)", config.model.hf_path)) if not ok]
        if missing:
            errors.append("draft.vocab_generations counts the policy's responses for a reduced draft vocabulary; "
                          f"it needs {', '.join(missing)}: set it to 0 otherwise")
    return errors


def _block_drafter_errors(config) -> list[str]:
    """What ``[draft] kind = "dflash"`` does not do yet, and its own keys' ranges."""
    d, p, ro, errors = config.draft, config.parallelism, config.rollout, []
    if d.block_size < 2 or d.block_layers < 1 or d.blocks_per_doc < 1:
        errors.append(f"draft.block_size ({d.block_size}) must be >= 2, draft.block_layers ({d.block_layers}) and "
                      f"draft.blocks_per_doc ({d.blocks_per_doc}) >= 1")
    if d.mask_token_id < -1:
        errors.append(f"draft.mask_token_id ({d.mask_token_id}) must be -1 (off) or a row of the policy's embedding")
    if ro.speculative and ro.draft_tokens > d.block_size - 1:
        errors.append(f"rollout.draft_tokens ({ro.draft_tokens}) must be at most draft.block_size - 1 "
                      f"({d.block_size - 1}): a block drafts that many")
    unsupported = [(f"draft.vocab_size = {d.vocab_size} (the drafter reads the target's head: 0)", d.vocab_size),
                   ("draft.hidden_size / num_heads / num_kv_heads (the drafter has the target's)",
                    d.hidden_size or d.num_heads or d.num_kv_heads),
                   ("rollout.compile", ro.compile),
                   ('compile.components with "draft"', config.compile.enable and "draft" in config.compile.components)]
    if names := [name for name, on in unsupported if on]:
        errors.append(f'draft.kind = "dflash" is not built yet with {", ".join(names)}: use draft.kind = "eagle3" '
                      "there (docs/DESIGN.md section 16)")
    return errors


def _recipe_errors(config) -> list[str]:
    """The RL recipe's settings that cannot go together (``docs/recipes.md``)."""
    rl, ro, errors = config.rl, config.rollout, []
    if rl.ratio_level == "sequence":
        if rl.loss_aggregation != "seq_mean_token_mean":
            errors.append(f'rl.ratio_level = "sequence" (GSPO) averages each response over its tokens: it needs '
                          f'rl.loss_aggregation = "seq_mean_token_mean", got {rl.loss_aggregation!r}')
        if rl.tis_cap:
            errors.append('rl.ratio_level = "sequence" (GSPO) takes the ratio against the behaviour log-probs: '
                          "set rl.tis_cap = 0")
        if rl.updates_per_step != 1:
            errors.append('rl.ratio_level = "sequence" (GSPO) measures each response\'s ratio once, before the '
                          f"step's update: it needs rl.updates_per_step = 1, got {rl.updates_per_step}")
        if config.parallelism.pipeline_parallel_degree > 1 or config.parallelism.context_parallel_degree > 1:
            errors.append('rl.ratio_level = "sequence" (GSPO) is not supported with pipeline or context '
                          "parallelism yet (its forward before the update runs on whole rows of the unsplit policy)")
    if rl.overlong == "soft" and not 1 <= rl.overlong_buffer <= ro.max_new_tokens:
        errors.append(f'rl.overlong = "soft" penalises the last rl.overlong_buffer tokens of the budget: it must be '
                      f"in [1, rollout.max_new_tokens = {ro.max_new_tokens}], got {rl.overlong_buffer}")
    if rl.overlong != "soft" and rl.overlong_buffer:
        errors.append(f'rl.overlong_buffer = {rl.overlong_buffer} is read only with rl.overlong = "soft" '
                      f"(got {rl.overlong!r})")
    if rl.dynamic_sampling_max_rounds < 0:
        errors.append(f"rl.dynamic_sampling_max_rounds must be >= 0, got {rl.dynamic_sampling_max_rounds}")
    if any(i < 0 for i in ro.stop_token_ids):
        errors.append(f"rollout.stop_token_ids must be token ids (>= 0), got {ro.stop_token_ids}")
    return errors
