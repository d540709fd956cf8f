"""Reward functions as a user writes them, outside the package, imported by path
(``[task] reward = "tests.rl.reward_fixtures:<name>"``) by the reward tests and the custom-task
job (``tests/test_custom_task.py``)."""

import os
import time

PROMPT_END = "assistant (no thinking): "
"""How the job test's chat template ends a prompt when ``enable_thinking`` is false."""


def graded(record, prompt, response):
    """The job's reward, reading the record's own fields: ``behaviour`` ``"slow"`` sleeps past
    any short timeout and ``"raise"`` fails; otherwise the reward is ``bonus`` plus a little
    per character. Its parts: ``bonus``, and ``templated``, 1 when the prompt came rendered by
    the test's chat template with ``enable_thinking = false``."""
    if record["behaviour"] == "slow":
        time.sleep(600)
    if record["behaviour"] == "raise":
        raise ZeroDivisionError(f"record {record['id']} divides by zero")
    templated = prompt.startswith("<bos>user: ") and prompt.endswith(PROMPT_END)
    return {"reward": record["bonus"] + 0.01 * len(response), "bonus": record["bonus"], "templated": float(templated)}


def length(record, prompt, response):
    """A plain float."""
    return float(len(response))


def sleeps(record, prompt, response):
    """1, after ``record["sleep_s"]`` seconds."""
    time.sleep(record["sleep_s"])
    return 1.0


def fails_on_x(record, prompt, response):
    """Raises for the response ``"x"``, else 1."""
    if response == "x":
        raise KeyError("boom")
    return 1.0


def dies_on_x(record, prompt, response):
    """Its process exits, with no Python exception, for the response ``"x"``, else 1."""
    if response == "x":
        os._exit(3)
    return 1.0


def not_finite(record, prompt, response):
    return {"reward": 1.0, "margin": float("nan")}


def without_reward(record, prompt, response):
    return {"score": 1.0}


def a_string(record, prompt, response):
    return "1.0"


def two_arguments(record, prompt):
    return 0.0


not_callable = 3.0
