"""The job-config checks that need the task registry, the reward's import or the update step,
registered with ``config.validate``."""

import os

from titan_cotrain.config.validate import config_check
from titan_cotrain.data.prompts import PromptDatasetError, dataset_format
from titan_cotrain.models.build import resolve_model_args
from titan_cotrain.rl.evaluation import settings_errors
from titan_cotrain.rl.prefit import prefit_errors
from titan_cotrain.rl.rewards import load_reward
from titan_cotrain.rl.tasks import DATASET_TASKS, TASKS

__all__ = ["dataset_errors", "eval_errors", "prefit_config_errors", "reward_config_errors", "task_errors"]


@config_check
def task_errors(config, world_size: int) -> list[str]:
    if config.task.name not in TASKS:
        return [f"task.name: unknown task {config.task.name!r}; known: {', '.join(sorted(TASKS))}"]
    return []


@config_check
def reward_config_errors(config, world_size: int) -> list[str]:
    """The ``custom`` task's reward (importable, callable as ``function(record, prompt,
    response)``, read by that task only) and the scoring keys' ranges."""
    t, errors = config.task, []
    if t.name == "custom" and not t.reward:
        errors.append("task.reward: task 'custom' scores responses with your function: set it to "
                      "'package.module:function' (the module on PYTHONPATH)")
    elif t.reward and t.name != "custom":
        errors.append(f"task.reward = {t.reward!r} is read by task.name = 'custom' only (task {t.name!r} scores "
                      "with its own reward)")
    elif t.reward:
        try:
            load_reward(t.reward)
        except ValueError as e:
            errors.append(str(e))
    if t.name == "custom" and t.sft_steps and not t.solution_field:
        errors.append(f"task.sft_steps = {t.sft_steps}: the custom task's warm start trains on the records' "
                      "solutions: set task.solution_field (or task.sft_steps = 0)")
    if t.reward_workers < 0:
        errors.append(f"task.reward_workers must be >= 0 (0 = score in the rank's process), got {t.reward_workers}")
    if not t.reward_timeout_s > 0:
        errors.append(f"task.reward_timeout_s must be > 0, got {t.reward_timeout_s}")
    if not 0 <= t.reward_max_error_fraction <= 1:
        errors.append(f"task.reward_max_error_fraction must be in [0, 1], got {t.reward_max_error_fraction}")
    return errors


@config_check
def dataset_errors(config, world_size: int) -> list[str]:
    """A dataset task's file (readable, of a known format) and split; the scale simulator
    never reads the file, so it need not exist there."""
    t = config.task
    if t.name not in DATASET_TASKS:
        return []
    if not t.dataset_path:
        return [f"task.dataset_path: task {t.name!r} reads its prompts from a local JSONL or Parquet file: set it"]
    errors = []
    if t.eval_size and t.eval_fraction:
        errors.append(f"task.eval_size ({t.eval_size}) and task.eval_fraction ({t.eval_fraction}): set one of them")
    try:
        dataset_format(t)
    except PromptDatasetError as e:
        errors.append(str(e))
    if not config.simulate.enable:
        if not os.path.isfile(t.dataset_path):
            errors.append(f"task.dataset_path = {t.dataset_path!r}: no such file")
        elif not os.access(t.dataset_path, os.R_OK):
            errors.append(f"task.dataset_path = {t.dataset_path!r}: not readable")
    return errors


@config_check
def eval_errors(config, world_size: int) -> list[str]:
    """``[eval]``'s settings (``rl.evaluation.settings_errors``), its file (as ``dataset_errors``
    checks the task's) and its custom reward's import."""
    e = config.eval
    errors = settings_errors(config)
    if e.path and not config.simulate.enable and not os.path.isfile(e.path):
        errors.append(f"eval.path = {e.path!r}: no such file")
    if e.path and e.reward:
        try:
            load_reward(e.reward)
        except ValueError as err:
            errors.append(str(err).replace("task.reward", "eval.reward"))
    return errors


@config_check
def prefit_config_errors(config, world_size: int) -> list[str]:
    """``[draft] prefit_*`` (``rl.prefit.prefit_errors``), and its prompts split evenly over
    the data-parallel ranks."""
    errors = prefit_errors(config)
    p = config.parallelism
    dp_world = max(p.context_parallel_degree * p.pipeline_parallel_degree, 1)
    prompts = config.draft.prefit_prompts
    if prompts and isinstance(world_size, int) and world_size % dp_world == 0 and prompts % (world_size // dp_world):
        errors.append(f"draft.prefit_prompts ({prompts}) must split evenly over the {world_size // dp_world} "
                      "data-parallel ranks")
    return errors
