"""What the trainer is built from: the device, the tokenizer's folder, the task and its prompts,
the two-phase LR schedules, the rollouts' draft length and the checkpointed step state."""

import dataclasses
import os

import torch

from titan_cotrain.components import titan
from titan_cotrain.data.prompts import PromptEncoder
from titan_cotrain.rl.tasks import DATASET_TASKS, get_task

__all__ = ["TrainerState", "build_task", "lr_phases", "rollout_draft_tokens", "tokenizer_folder", "training_device"]


def lr_phases(config, sft_peak: float, rl_peak: float) -> list[tuple[object, int, float]]:
    """The two phases of an LR schedule (``titan.build_lr_schedulers``): the warm start's
    (``[task] sft_*`` over ``task.sft_steps``), then RL's (``[lr_scheduler]`` over
    ``training.steps``), each from its own warm-up to its own peak."""
    sft = dataclasses.replace(config.lr_scheduler, warmup_steps=config.task.sft_warmup_steps,
                              decay_type=config.task.sft_decay_type, min_lr_factor=config.task.sft_min_lr_factor,
                              decay_ratio=None, total_steps=None)
    return [(sft, config.task.sft_steps, sft_peak), (config.lr_scheduler, config.training.steps, rl_peak)]


def rollout_draft_tokens(config) -> int:
    """k of the rollouts: ``[rollout] draft_tokens`` when decoding speculatively (``[rollout]
    speculative`` with ``[draft] enable``), else 0 (plain decoding)."""
    return config.rollout.draft_tokens if config.rollout.speculative and config.draft.enable else 0


class TrainerState:
    """The step counter, the number of consecutive steps that ended with a skipped update, and
    the prompt stream's position (``rl.problems``): the positions the warm start has drawn,
    every rank's (RL's blocks follow them), and the extra generation rounds dynamic sampling
    has run (each took the next RL block), as a DCP ``Stateful``. Nothing in it depends on the
    layout, so a job resumes at another.

    ``warm_start_batch``: the positions a warm-start step draws at this layout (``dp x [task]
    sft_batch_size``); with ``sft_steps``, what a checkpoint written before the warm start's
    position was saved had drawn: ``warm_start_batch`` per warm-start step taken (exact when it
    was written at this layout)."""

    def __init__(self, warm_start_batch: int = 0, sft_steps: int = 0) -> None:
        self.warm_start_batch, self.sft_steps = warm_start_batch, sft_steps
        self.step = 0
        self.nonfinite_steps = 0
        self.warm_start_positions = 0
        self.extra_prompt_rounds = 0

    def warm_start_block(self) -> int:
        """The first position of the next warm-start step's block; the stream moves past it."""
        start = self.warm_start_positions
        self.warm_start_positions += self.warm_start_batch
        return start

    def state_dict(self) -> dict:
        return {"step": torch.tensor(self.step), "nonfinite_steps": torch.tensor(self.nonfinite_steps),
                "warm_start_positions": torch.tensor(self.warm_start_positions),
                "extra_prompt_rounds": torch.tensor(self.extra_prompt_rounds)}

    def load_state_dict(self, state: dict) -> None:
        self.step = int(state["step"])
        self.nonfinite_steps = int(state["nonfinite_steps"])
        self.extra_prompt_rounds = int(state["extra_prompt_rounds"])
        self.warm_start_positions = (int(state["warm_start_positions"]) if "warm_start_positions" in state
                                     else min(self.step, self.sft_steps) * self.warm_start_batch)


def training_device() -> torch.device:
    """This rank's accelerator (``cuda:LOCAL_RANK``, made current), the simulator's, or the CPU."""
    kind = titan.device_type()
    if kind == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        return device
    return torch.device(kind, 0) if kind != "cpu" else torch.device("cpu")


def tokenizer_folder(config, fallback: str | None = None) -> str:
    """``[model] hf_path`` or ``hf_assets_path``, else ``fallback`` (``RealRun.tokenizer_fallback``)."""
    path = config.model.hf_path or config.model.hf_assets_path or fallback
    if not path:
        raise ValueError("no tokenizer: set [model] hf_path (a Hugging Face folder with tokenizer.json) "
                         "or [model] hf_assets_path")
    if not os.path.isfile(os.path.join(path, "tokenizer.json")):
        raise ValueError(f"[model] {'hf_path' if config.model.hf_path else 'hf_assets_path'} = {path!r} has no "
                         "tokenizer.json")
    return path


def build_task(config, encode: PromptEncoder, max_prompt_tokens: int, seed: int, run):
    """The ``[task]``; a dataset task's prompts from ``run.prompt_splits`` (``RealRun``: its
    file; the simulator's: synthetic), its epochs shuffled by the job's ``seed``; the
    ``custom`` task's reward imported from ``[task] reward``."""
    t = config.task
    prompts = run.prompt_splits(t, encode, max_prompt_tokens) if t.name in DATASET_TASKS else None
    return get_task(t.name, prompts, t.format_reward, seed, t.reward), prompts
