"""Scoring responses: every task's reward called through one path, its failures counted or
stopping the step.

A task's ``score(problem, prompt, response)`` (``rl.tasks.Task``) returns what a user's
reward function returns (``[task] reward``, imported by ``load_reward``): a float, or a dict
of floats with one named ``reward``, the others its parts (logged as ``task/<name>`` means by
``rl.rollout_metrics``). ``RewardScorer`` makes a step's calls:

* ``[task] reward_workers = 0``: in this process, one after another, without a timeout;
* ``reward_workers = n``: spread over ``n`` worker processes of this rank. Each worker takes
  one call at a time over its own pipe, so a call that runs past ``reward_timeout_s`` is
  pinned to its worker, which is killed and replaced; the call scores 0 and is counted
  (``reward_timeouts``). The workers are forked from a forkserver, never from the trainer,
  whose threads (torch's, the process group's) a fork would copy mid-lock.

A call that raises, dies with its worker, or returns anything but finite numbers stops the
step (``RewardError``: the record or prompt, the response and the traceback), or under
``reward_on_error = "zero"`` scores 0 and is counted (``reward_errors``), until more than
``reward_max_error_fraction`` of the rank's calls of a step have failed.
"""

import importlib
import inspect
import math
import multiprocessing
import os
import signal
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import wait

__all__ = ["COUNTS", "RewardError", "RewardScorer", "RewardSettings", "load_reward"]

COUNTS = ("reward_errors", "reward_timeouts")
"""The parts the scorer adds to a response's details (1.0 when its call failed / timed out):
the metrics log their sums over the step's calls, counts rather than means."""

_SHOWN = 400  # characters of a record, prompt or response quoted in an error


class RewardError(RuntimeError):
    """A reward call failed or returned something other than finite numbers, or more of a
    step's calls failed than ``[task] reward_max_error_fraction`` allows."""


def load_reward(path: str) -> Callable:
    """The function ``"package.module:function"`` names (``[task] reward``), imported from
    ``sys.path`` (``PYTHONPATH``) and checked to take ``(record, prompt, response)``. A
    ``ValueError`` naming the key says what is wrong."""
    where = f"task.reward = {path!r}"
    module_name, _, name = path.partition(":")
    if not module_name or not name:
        raise ValueError(f"{where}: expected 'package.module:function'")
    try:
        function = importlib.import_module(module_name)
    except Exception as e:  # the module's own import errors as well as a missing module
        raise ValueError(f"{where}: cannot import {module_name} ({type(e).__name__}: {e}); is its folder on "
                         "PYTHONPATH?") from None
    for attribute in name.split("."):
        if not hasattr(function, attribute):
            raise ValueError(f"{where}: {module_name} has no {name!r}")
        function = getattr(function, attribute)
    if not callable(function):
        raise ValueError(f"{where}: {module_name}.{name} is not callable")
    try:
        inspect.signature(function).bind(None, None, None)
    except TypeError as e:
        raise ValueError(f"{where}: {module_name}.{name} cannot be called as function(record, prompt, response): "
                         f"{e}") from None
    except ValueError:  # no signature to read (a builtin): its first call will tell
        pass
    return function


@dataclass(frozen=True)
class RewardSettings:
    """What scoring reads of ``[task]`` (``from_config``); the defaults score in this process
    and stop the step at the first failure."""

    workers: int = 0
    timeout_s: float = 60.0
    on_error: str = "raise"
    max_error_fraction: float = 0.1

    @classmethod
    def from_config(cls, task) -> "RewardSettings":
        return cls(task.reward_workers, task.reward_timeout_s, task.reward_on_error, task.reward_max_error_fraction)


@dataclass(frozen=True)
class _Outcome:
    """One call's: what the reward returned, or why it did not (``error``, one line, and its
    ``trace``), or that it ran out of time."""

    value: object = None
    error: str = ""
    trace: str = ""
    timed_out: bool = False


def _call(reward: Callable, args: tuple) -> _Outcome:
    try:
        return _Outcome(value=reward(*args))
    except Exception as e:
        return _Outcome(error=repr(e), trace=traceback.format_exc())


def _parts(value) -> dict[str, float]:
    """A reward's return as ``{"reward": r, <part>: v, ...}`` of finite floats; a
    ``ValueError`` saying what it returned otherwise."""
    if isinstance(value, dict):
        if "reward" not in value:
            raise ValueError(f"returned a dict without 'reward' (its keys: {sorted(map(str, value))})")
        if kept := sorted(set(value) & set(COUNTS)):
            raise ValueError(f"returned {kept}: the trainer's own counts have these names")
        items = value.items()
    else:
        items = [("reward", value)]
    parts = {}
    for name, v in items:
        if not isinstance(name, str):
            raise ValueError(f"returned a part named {name!r}: names are strings")
        try:
            number = float(v)
        except (TypeError, ValueError):
            number = None
        if number is None or isinstance(v, (str, bytes)):
            raise ValueError(f"returned {name} = {_shown(v)}, not a number")
        if not math.isfinite(number):
            raise ValueError(f"returned {name} = {number}, not a finite number")
        parts[name] = number
    return parts


def _shown(value) -> str:
    text = repr(value)
    return text if len(text) <= _SHOWN else f"{text[:_SHOWN]}... ({len(text)} characters)"


class RewardScorer:
    """A step's reward calls of ``task`` (``__call__``), made as ``settings`` says (the module
    docstring). ``start()`` starts the workers (the trainer does, at build; else the first
    call does); ``close()`` ends them."""

    def __init__(self, task, settings: RewardSettings = RewardSettings()) -> None:
        self.task, self.settings = task, settings
        self.pool = _WorkerPool(task, settings.workers, settings.timeout_s) if settings.workers else None
        # The counts a response's details carry: those this job's settings can make nonzero.
        possible = {"reward_errors": settings.on_error == "zero", "reward_timeouts": settings.workers > 0}
        self.counts = [name for name in COUNTS if possible[name]]

    def start(self) -> None:
        if self.pool is not None:
            self.pool.start()

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()

    def __call__(self, problems: list, prompts: list[str], responses: list[str]
                 ) -> tuple[list[float], list[dict[str, float]]]:
        """The rewards of ``responses[i]`` to ``problems[i]`` (``prompts[i]``: its prompt as
        the policy saw it) and each response's details: the reward's parts, then the counts
        (``COUNTS``) this job can make nonzero. A call that timed out or failed scores 0 and
        has no parts."""
        calls = list(zip(problems, prompts, responses, strict=True))
        # In this process the calls are made lazily: the first failure stops the rest.
        outcomes = self.pool.run(calls) if self.pool is not None else (_call(self.task.score, c) for c in calls)
        rewards, details, failures = [], [], []
        for call, outcome in zip(calls, outcomes):
            parts, failure = {}, None
            if outcome.error:
                failure = f"failed: {outcome.error}\n{outcome.trace}".rstrip()
            elif not outcome.timed_out:
                try:
                    parts = _parts(outcome.value)
                except ValueError as e:
                    failure = str(e)
            if failure is not None:
                failures.append(f"{self._context(*call)} {failure}")
                if self.settings.on_error == "raise":
                    raise RewardError(failures[0])
            rewards.append(parts.pop("reward", 0.0))
            flags = {"reward_errors": float(failure is not None), "reward_timeouts": float(outcome.timed_out)}
            details.append(parts | {name: flags[name] for name in self.counts})
        if len(failures) > self.settings.max_error_fraction * len(calls):
            raise RewardError(f"task {self.task.name!r}: {len(failures)} of this rank's {len(calls)} reward calls of "
                              f"the step failed, more than task.reward_max_error_fraction = "
                              f"{self.settings.max_error_fraction}; the first:\n{failures[0]}")
        return rewards, details

    def _context(self, problem, prompt: str, response: str) -> str:
        """Which call: the record (a dataset's, every field) or the prompt, and the response."""
        record = problem.record  # empty for a synthetic task's problem
        where = f"record {_shown(record)}, prompt {_shown(prompt)}" if record else f"prompt {_shown(prompt)}"
        return f"task {self.task.name!r}: the reward of {where}, response {_shown(response)}"


class _Worker:
    """One worker process and the trainer's end of its pipe. ``started``: it has unpickled
    its task (imported the reward's module); ``call``: the index of the call it runs (None:
    idle), due by ``deadline`` (``time.monotonic``)."""

    def __init__(self, context, task) -> None:
        self.conn, theirs = context.Pipe()
        self.process = context.Process(target=_serve, args=(theirs, task), name="reward-worker", daemon=True)
        self.process.start()
        theirs.close()
        self.started, self.call, self.deadline = False, None, math.inf

    def give(self, index: int, args: tuple, timeout_s: float) -> None:
        self.conn.send(args)
        self.call, self.deadline = index, time.monotonic() + timeout_s

    def end(self) -> None:
        """Close the pipe (an idle worker returns) and make sure the process is gone."""
        self.conn.close()
        self.process.join(timeout=1.0 if self.call is None else 0.0)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()


def _serve(conn, task) -> None:
    """A worker's loop: a call's arguments in, its ``_Outcome`` out, until the pipe closes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the process group: the trainer ends workers
    # A trainer that dies (a failed job ends in os._exit) takes its workers along, busy ones too.
    threading.Thread(target=_exit_with, args=(multiprocessing.parent_process().sentinel,), daemon=True).start()
    conn.send(None)  # started
    while True:
        try:
            args = conn.recv()
        except EOFError:
            return
        outcome = _call(task.score, args)
        try:
            conn.send(outcome)
        except Exception as e:  # what the reward returned does not pickle (nothing was sent)
            conn.send(_Outcome(error=f"returned a {type(outcome.value).__name__} that cannot be sent back: {e!r}"))


def _exit_with(sentinel: int) -> None:
    wait([sentinel])
    os._exit(1)


class _WorkerPool:
    """``size`` worker processes scoring with ``task``, each call due within ``timeout_s``."""

    def __init__(self, task, size: int, timeout_s: float) -> None:
        self.task, self.size, self.timeout_s = task, size, timeout_s
        self.context = multiprocessing.get_context("forkserver")
        # Imported once by the forkserver, not by every worker it forks.
        self.context.set_forkserver_preload([__name__, type(task).__module__])
        self.workers: list[_Worker] = []

    def start(self) -> None:
        while len(self.workers) < self.size:
            self.workers.append(_Worker(self.context, self.task))

    def close(self) -> None:
        for worker in self.workers:
            worker.end()
        self.workers = []

    def _replace(self, worker: _Worker) -> None:
        worker.end()
        self.workers[self.workers.index(worker)] = _Worker(self.context, self.task)

    def run(self, calls: list[tuple]) -> list[_Outcome]:
        """Every call's outcome, in the order of ``calls``."""
        self.start()
        outcomes: list[_Outcome | None] = [None] * len(calls)
        waiting = deque(range(len(calls)))
        while waiting or any(w.call is not None for w in self.workers):
            for worker in self.workers:
                if waiting and worker.started and worker.call is None:
                    worker.give(waiting[0], calls[waiting[0]], self.timeout_s)
                    waiting.popleft()
            due = min((w.deadline for w in self.workers if w.call is not None), default=None)
            ready = wait([w.conn for w in self.workers], None if due is None else max(due - time.monotonic(), 0.0))
            for worker in [w for w in self.workers if w.conn in ready]:
                try:
                    message = worker.conn.recv()
                except EOFError:  # the process died
                    self._died(worker, outcomes)
                    continue
                if not worker.started:
                    worker.started = True
                else:
                    outcomes[worker.call], worker.call = message, None
            now = time.monotonic()
            for worker in [w for w in self.workers if w.call is not None and w.deadline <= now]:
                outcomes[worker.call] = _Outcome(timed_out=True)
                self._replace(worker)
        return outcomes

    def _died(self, worker: _Worker, outcomes: list) -> None:
        worker.process.join()
        code = worker.process.exitcode
        if not worker.started:
            raise RewardError(f"task {self.task.name!r}: a reward worker exited (code {code}) before it started; "
                              "its traceback is above")
        if worker.call is not None:
            outcomes[worker.call] = _Outcome(error=f"its worker process died (exit code {code})")
        self._replace(worker)
