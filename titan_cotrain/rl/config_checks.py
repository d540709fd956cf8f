"""The job-config checks that need the task registry or the update step, registered with
``config.validate``."""

import os

from titan_cotrain.config.validate import config_check
from titan_cotrain.data.prompts import PromptDatasetError, dataset_format
from titan_cotrain.models.build import resolve_model_args
from titan_cotrain.rl.tasks import DATASET_TASKS, TASKS

__all__ = ["dataset_errors", "task_errors"]


@config_check
def task_errors(config, world_size: int) -> list[str]:
    if config.task.name not in TASKS:
        return [f"task.name: unknown task {config.task.name!r}; known: {', '.join(sorted(TASKS))}"]
    return []


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
