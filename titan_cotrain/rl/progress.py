"""The console's progress bars: a phase's, and a long rollout's live line."""

import sys
import time

__all__ = ["RolloutProgress", "progress_bar"]


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
