"""The console's progress bars: a phase's, and a long rollout's live line."""

import sys
import time

__all__ = ["RolloutProgress", "progress_bar", "step_line"]


def progress_bar(done: int, total: int, width: int = 20) -> str:
    """``[#####...............]   40/200``: the phase's progress bar of the console line."""
    filled = round(width * done / max(total, 1))
    return f"[{'#' * filled}{'.' * (width - filled)}] {done:>4}/{total}"


class RolloutProgress:
    """The console progress bar of a long rollout: after ``delay_s`` it redraws one line
    (``rollout [####....]  300/768 responses``) at most every ``interval_s`` and clears it
    when the rollout ends, so short rollouts print nothing."""

    def __init__(self, delay_s: float = 2.0, interval_s: float = 1.0, stream=None) -> None:
        self.delay_s, self.interval_s, self.stream = delay_s, interval_s, stream or sys.stdout
        self.start = time.monotonic()
        self.last_draw = None

    def __call__(self, finished: int, total: int) -> None:
        now = time.monotonic()
        if now - self.start < self.delay_s or (self.last_draw is not None and now - self.last_draw < self.interval_s):
            return
        self.last_draw = now
        print(f"\rrollout {progress_bar(finished, total)} responses  {now - self.start:.0f}s", end="",
              file=self.stream, flush=True)

    def close(self) -> None:
        if self.last_draw is not None:
            print("\r\033[K", end="", file=self.stream, flush=True)


def step_line(phase: str, done: int, total: int, metrics: dict[str, float]) -> str:
    """The console line of a finished step: its phase's progress, the losses, the rollouts'
    reward and speed, their measured acceptance length beside the draft's training ``tau``
    (``accept_len 3.10 / tau 3.02``: the gap between the two is how a draft fed the wrong
    inputs shows), the draft's accuracy, the step time."""
    line = f"{phase} {progress_bar(done, total)}  loss {metrics['loss/policy']:.4f}"
    speculating = metrics.get("rollout/draft_tokens", 0.0) > 0
    if "reward/mean" in metrics:
        line += f"  reward {metrics['reward/mean']:.3f}  tok/s {metrics['rollout/tokens_per_s']:.0f}"
        line += f"  accept_len {metrics['rollout/acceptance_length']:.2f}" if speculating else "  plain decoding"
        if speculating and "draft/tau" in metrics:
            line += f" / tau {metrics['draft/tau']:.2f}"
    if "draft/tau" in metrics:
        line += f"  draft {metrics['loss/draft']:.3f}  acc1 {metrics['draft/acc_pass1']:.2f}"
        if not speculating:
            line += f"  tau {metrics['draft/tau']:.2f}"
    return line + f"  {metrics['time/step_s']:.2f}s"
