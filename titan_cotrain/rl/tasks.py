"""Verifiable tasks: deterministic problems, demonstrations for the warm start, rewards.

A task turns a seeded ``random.Random`` into problems, writes a demonstration response for
each (the SFT warm start's data) and scores any response with code, never a model.

* ``arithmetic``: add three to five digits (1-5), e.g. ``4+3+5+2=``. The response shows its working
  one running sum at a time, ``4+3=7;7+5=12;12+2=14;#14`` (a few dozen tokens, so
  generation dominates a step, as in real RL). Each step may be written either way round
  (``7+5=12`` or ``5+7=12``); demonstrations pick each at random, and the reward pays
  for the correct answer and, on top, for writing the running sum first. RL therefore moves
  the policy away from its warm-start mixture towards one style: the drift that makes a
  frozen draft fall behind.
* ``sort``: sort a list of numbers, ``sort:5,12,3=`` -> ``3,5,12#``. Partial credit per
  position, so the reward has a different shape.
"""

import random
from dataclasses import dataclass
from typing import Protocol

__all__ = ["TASKS", "Problem", "Task", "get_task"]


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


def _final_answer(response: str) -> str | None:
    """The text after the last ``#`` up to the end of the line, or None."""
    if "#" not in response:
        return None
    return response.rsplit("#", 1)[1].split("\n", 1)[0].strip()


class Arithmetic:
    name = "arithmetic"

    def __init__(self, min_terms: int = 3, max_terms: int = 5, max_value: int = 5) -> None:
        self.min_terms, self.max_terms, self.max_value = min_terms, max_terms, max_value

    def sample(self, rng: random.Random) -> Problem:
        numbers = tuple(rng.randint(1, self.max_value) for _ in range(rng.randint(self.min_terms, self.max_terms)))
        return Problem(prompt="+".join(map(str, numbers)) + "=", answer=str(sum(numbers)), numbers=numbers)

    def demonstration(self, problem: Problem, rng: random.Random) -> str:
        total, steps = problem.numbers[0], []
        for x in problem.numbers[1:]:
            first, second = (total, x) if rng.random() < 0.5 else (x, total)
            total += x
            steps.append(f"{first}+{second}={total}")
        return ";".join(steps) + f";#{total}"

    def preferred_fraction(self, problem: Problem, response: str) -> float:
        """Share of the expected working steps written running-sum first, and correct."""
        steps = response.split(";")
        total, good = problem.numbers[0], 0
        for i, x in enumerate(problem.numbers[1:]):
            total_before, total = total, total + x
            if i < len(steps) and steps[i] == f"{total_before}+{x}={total}":
                good += 1
        return good / (len(problem.numbers) - 1)

    def reward(self, problem: Problem, response: str) -> float:
        if _final_answer(response) != problem.answer:
            return 0.0
        return 0.5 + 0.5 * self.preferred_fraction(problem, response)


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
        body = response.split("#", 1)[0].strip()
        got = body.split(",") if body else []
        want = problem.answer.split(",")
        hits = sum(g == w for g, w in zip(got, want))
        return hits / max(len(want), len(got))


TASKS: dict[str, type] = {"arithmetic": Arithmetic, "sort": Sort}


def get_task(name: str) -> Task:
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; known: {', '.join(sorted(TASKS))}")
    return TASKS[name]()
