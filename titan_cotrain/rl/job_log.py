"""The job's outputs on its logging rank (rank 0; under PP the last stage's rank of rank 0's
column): TensorBoard and one JSON line per step in ``<dump_folder>/metrics.jsonl``, a console
line every ``[metrics] log_freq`` steps of a phase (and at its first and last step), and the
warnings. Other ranks' calls do nothing."""

import json
import os

from titan_cotrain.components import titan
from titan_cotrain.rl.progress import step_line

__all__ = ["JobLog"]


class JobLog:
    """``active``: this is the logging rank; ``writes``: it writes files (the dump folder and
    TensorBoard; not on a simulated device)."""

    def __init__(self, config, active: bool, writes: bool) -> None:
        self.config, self.active = config, active
        self.tb = None
        if active and writes:
            os.makedirs(config.job.dump_folder, exist_ok=True)
            if config.metrics.enable_tensorboard:
                self.tb = titan.tensorboard_logger(os.path.join(config.job.dump_folder, config.metrics.save_tb_folder))

    def say(self, line: str) -> None:
        if self.active:
            print(line, flush=True)

    def step(self, step: int, phase: str, metrics: dict[str, float]) -> None:
        """Step ``step``'s metrics; ``phase``: ``"sft"``, ``"prefit"`` (the draft's) or ``"rl"``."""
        if not self.active:
            return
        if self.tb is not None:
            self.tb.log(metrics, step)
        with open(os.path.join(self.config.job.dump_folder, "metrics.jsonl"), "a") as f:
            f.write(json.dumps({"step": step, "phase": phase, **metrics}) + "\n")
        sft_steps, prefit_steps = self.config.task.sft_steps, self.config.draft.prefit_steps
        done, total = {"sft": (step, sft_steps), "prefit": (step - sft_steps, prefit_steps)}.get(
            phase, (step - sft_steps - prefit_steps, self.config.training.steps))
        if done in (1, total) or done % max(self.config.metrics.log_freq, 1) == 0:
            print(step_line("rl " if phase == "rl" else phase, done, total, metrics), flush=True)

    def eval(self, step: int, metrics: dict[str, float], line: str) -> None:
        """An evaluation of the policy after step ``step`` (``rl.evaluation``): its ``eval/``
        ``metrics`` to TensorBoard at that step and as a ``"phase": "eval"`` line of
        ``metrics.jsonl``, and its console ``line``."""
        if not self.active:
            return
        if self.tb is not None:
            self.tb.log(metrics, step)
        with open(os.path.join(self.config.job.dump_folder, "metrics.jsonl"), "a") as f:
            f.write(json.dumps({"step": step, "phase": "eval", **metrics}) + "\n")
        print(line, flush=True)

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
