"""Verifiable tasks: deterministic problems, demonstrations for the warm start, rewards.

A task turns a seeded ``random.Random`` into problems, writes a demonstration response for
each (the SFT warm start's data) and scores any response with code, never a model.

* ``arithmetic``: add three to five digits (1-5), e.g. ``4+3+5+2=``. The response shows its working
  one running sum at a time, ``4+3=7;7+5=12;12+2=14;#14`` (a few dozen tokens, so
  generation dominates a step, as in real RL). Demonstrations mix styles the way human
  data does: each step is written in one of four ways (``7+5=12``, ``5+7=12``, ``12=7+5``,
  ``12=5+7``) at random, and after any number or sign a filler space may follow
  (``7 +5= 12;``). The reward pays for the correct answer, for correct working steps and,
  on top, for the first way (running sum first, result last); each filler costs a little
  (compact working). RL therefore moves the policy away from its warm-start mixture at
  many positions of every response, where the warm-start policy (and a draft fitted to it)
  spreads its probability over the forms and the filler: the drift that makes a frozen
  draft fall behind.
* ``sort``: sort a list of numbers, ``sort:5,12,3=`` -> ``3,5,12#``. Partial credit per
  position, so the reward has a different shape.
"""

import math
import random
import re
from dataclasses import dataclass
from typing import Protocol

__all__ = ["TASKS", "Problem", "RewardError", "Task", "get_task", "score"]


@dataclass(frozen=True)
class Problem:
    prompt: str
    answer: str
    numbers: tuple[int, ...]


class Task(Protocol):
    name: str

    def sample(self, rng: random.Random) -> Problem: ...

    def demonstration(self, problem: Problem, rng: random.Random) -> str: ...

    def reward(self, problem: Problem, response: str) -> float: ...

    def details(self, problem: Problem, response: str) -> dict[str, float]:
        """What the reward is made of, per response (the trainer logs the batch means as
        ``task/<key>``): shows where RL moves the policy, not only how far."""
        ...


def _final_answer(response: str) -> str | None:
    """The text after the last ``#`` up to the end of the line, or None."""
    if "#" not in response:
        return None
    return response.rsplit("#", 1)[1].split("\n", 1)[0].strip()


class Arithmetic:
    name = "arithmetic"

    filler = " "
    filler_cost = 0.05

    def __init__(self, min_terms: int = 3, max_terms: int = 5, max_value: int = 5, filler_rate: float = 0.3) -> None:
        self.min_terms, self.max_terms, self.max_value = min_terms, max_terms, max_value
        self.filler_rate = filler_rate

    def sample(self, rng: random.Random) -> Problem:
        numbers = tuple(rng.randint(1, self.max_value) for _ in range(rng.randint(self.min_terms, self.max_terms)))
        return Problem(prompt="+".join(map(str, numbers)) + "=", answer=str(sum(numbers)), numbers=numbers)

    @staticmethod
    def step_forms(before: int, x: int) -> tuple[str, ...]:
        """The ways of writing the step that adds ``x`` to the running sum ``before``; the
        first is the one the reward prefers."""
        after = before + x
        return (f"{before}+{x}={after}", f"{x}+{before}={after}", f"{after}={before}+{x}", f"{after}={x}+{before}")

    def demonstration(self, problem: Problem, rng: random.Random) -> str:
        total, working = problem.numbers[0], []
        for x in problem.numbers[1:]:
            working += re.findall(r"\d+|\D", rng.choice(self.step_forms(total, x))) + [";"]
            total += x
        # A filler after each number or sign with probability filler_rate (never inside a number).
        return "".join(part + self.filler * (rng.random() < self.filler_rate) for part in working) + f"#{total}"

    def step_fractions(self, problem: Problem, response: str) -> tuple[float, float]:
        """Shares of the expected working steps that are correct in any form, and correct in
        the preferred form (step ``i`` is the ``i``-th ``;`` segment, fillers ignored)."""
        steps = response.replace(self.filler, "").split(";")
        total, correct, preferred = problem.numbers[0], 0, 0
        for i, x in enumerate(problem.numbers[1:]):
            forms = self.step_forms(total, x)
            total += x
            written = steps[i] if i < len(steps) else ""
            preferred += written == forms[0]
            correct += written in forms
        n = len(problem.numbers) - 1
        return correct / n, preferred / n

    def reward(self, problem: Problem, response: str) -> float:
        """``0.4`` for the right final answer, ``0.2`` x the share of correct working steps,
        ``0.4`` x the share written in the preferred form, ``- filler_cost`` per filler: dense
        enough that a weak policy still gets a signal; the style and filler terms are what
        RL moves."""
        d = self.details(problem, response)
        return (0.4 * d["answer_correct"] + 0.2 * d["steps_correct"] + 0.4 * d["steps_preferred"]
                - self.filler_cost * d["fillers"])

    def details(self, problem: Problem, response: str) -> dict[str, float]:
        correct, preferred = self.step_fractions(problem, response)
        return {"answer_correct": float(_final_answer(response) == problem.answer),
                "steps_correct": correct, "steps_preferred": preferred,
                "fillers": float(response.count(self.filler))}


class Sort:
    name = "sort"

    def __init__(self, min_len: int = 3, max_len: int = 6, max_value: int = 20) -> None:
        self.min_len, self.max_len, self.max_value = min_len, max_len, max_value

    def sample(self, rng: random.Random) -> Problem:
        numbers = tuple(rng.randint(0, self.max_value) for _ in range(rng.randint(self.min_len, self.max_len)))
        return Problem(prompt="sort:" + ",".join(map(str, numbers)) + "=",
                       answer=",".join(map(str, sorted(numbers))), numbers=numbers)

    def demonstration(self, problem: Problem, rng: random.Random) -> str:
        return problem.answer + "#"

    def reward(self, problem: Problem, response: str) -> float:
        return self.details(problem, response)["positions_correct"]

    def details(self, problem: Problem, response: str) -> dict[str, float]:
        body = response.split("#", 1)[0].strip()
        got = body.split(",") if body else []
        want = problem.answer.split(",")
        hits = sum(g == w for g, w in zip(got, want))
        return {"positions_correct": hits / max(len(want), len(got)), "exact": float(got == want)}


TASKS: dict[str, type] = {"arithmetic": Arithmetic, "sort": Sort}


def get_task(name: str) -> Task:
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; known: {', '.join(sorted(TASKS))}")
    return TASKS[name]()


class RewardError(RuntimeError):
    """A task's reward function failed or returned something that is not a finite number."""


def score(task: Task, problems: list[Problem], responses: list[str]) -> tuple[list[float], list[dict[str, float]]]:
    """Rewards of ``responses[i]`` to ``problems[i]``, and their ``details`` (empty for a
    task without that method). A reward that raises or is not a finite number stops the
    step with the task, prompt and response in the message: a silently wrong reward would
    train the policy on garbage."""
    rewards, details = [], []
    for problem, response in zip(problems, responses, strict=True):
        context = f"task {task.name!r}: reward {{}} for prompt {problem.prompt!r}, response {response!r}"
        try:
            reward = float(task.reward(problem, response))
        except Exception as e:
            raise RewardError(context.format("failed") + f": {e!r}") from e
        if not math.isfinite(reward):
            raise RewardError(context.format(reward) + " is not a finite number")
        try:
            detail = {key: float(v) for key, v in task.details(problem, response).items()} \
                if hasattr(task, "details") else {}
        except Exception as e:
            raise RewardError(context.format("details failed") + f": {e!r}") from e
        rewards.append(reward)
        details.append(detail)
    return rewards, details
