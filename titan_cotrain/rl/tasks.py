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

Dataset tasks read their problems from a local file (``[task] dataset_path``, see
``titan_cotrain.data.prompts``); ``get_task`` builds them from its ``PromptSplits``:

* ``math``: MATH-style answers (``\\frac{1}{2}``, ``(1, 2)``, ``\\sqrt{3}``): the response's final
  answer (``titan_cotrain.rl.answers.final_answer``) must equal the reference by ``math_verify``.
* ``gsm8k``: integer answers (the reference after GSM8K's ``####``, or a plain number); the
  response's ``#### N``, boxed or stated answer must be the same integer.
* ``custom``: any records, scored by the user's ``function(record, prompt, response)``
  (``[task] reward``, ``"package.module:function"``; ``docs/recipes.md``).

Every task is scored through ``score(problem, prompt, response)``, which returns what a user's
reward returns: a float, or a dict of floats with one named ``reward`` (the built-in tasks:
their ``reward`` and, as its other parts, their ``details``). ``rl.rewards.RewardScorer``
makes the calls, in the rank's process or in worker processes.
"""

import random
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from titan_cotrain.data.prompts import PromptDatasetError, PromptRecord, PromptSplits
from titan_cotrain.rl.answers import final_answer, gsm8k_answer, integer_answer, last_boxed, math_equivalent
from titan_cotrain.rl.rewards import load_reward

__all__ = ["DATASET_TASKS", "TASKS", "Problem", "Task", "get_task"]


@dataclass(frozen=True)
class Problem:
    """``prompt``: the question, or a dataset's chat messages (the trainer encodes it, chat
    template and all); ``answer``: the reference; ``numbers``: a synthetic task's operands;
    ``solution``: a dataset task's demonstration; ``record``: a dataset task's record, every
    field of the file (what a ``custom`` reward reads)."""

    prompt: str | list[dict[str, str]]
    answer: str
    numbers: tuple[int, ...] = ()
    solution: str = ""
    record: dict = field(default_factory=dict)


class Task(Protocol):
    name: str

    def sample(self, rng: random.Random, position: int | None = None) -> Problem:
        """A problem. ``position``: its place in the job's stream of draws (a dataset task goes
        through its training split in epochs by it); a synthetic task draws with ``rng`` alone
        (``rl.problems.ProblemStream`` hands it a random stream keyed by the position)."""
        ...

    def demonstration(self, problem: Problem, rng: random.Random) -> str: ...

    def score(self, problem: Problem, prompt: str, response: str) -> float | dict[str, float]:
        """The reward of ``response`` to ``problem`` (whose ``prompt`` is as the policy saw it,
        the chat template rendered): a float, or a dict of floats with one named ``reward``
        and the parts it is made of (the trainer logs their batch means as ``task/<name>``:
        they show where RL moves the policy, not only how far)."""
        ...


class _RewardAndDetails:
    """A built-in task's ``score``: its ``reward``, with its ``details`` as the parts."""

    def score(self, problem: Problem, prompt: str, response: str) -> dict[str, float]:
        return {"reward": self.reward(problem, response), **self.details(problem, response)}


def _final_answer(response: str) -> str | None:
    """The text after the last ``#`` up to the end of the line, or None."""
    if "#" not in response:
        return None
    return response.rsplit("#", 1)[1].split("\n", 1)[0].strip()


class Arithmetic(_RewardAndDetails):
    name = "arithmetic"

    filler = " "
    filler_cost = 0.05

    def __init__(self, min_terms: int = 3, max_terms: int = 5, max_value: int = 5, filler_rate: float = 0.3) -> None:
        self.min_terms, self.max_terms, self.max_value = min_terms, max_terms, max_value
        self.filler_rate = filler_rate

    def sample(self, rng: random.Random, position: int | None = None) -> Problem:
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


class LongTailArithmetic(Arithmetic):
    """``arithmetic`` whose response lengths are heavy-tailed, as reasoning rollouts' are: the
    number of working steps (terms - 1) is ``floor(X)`` for a Pareto ``X`` with scale
    ``min_steps`` and shape ``alpha``, ``P(steps >= s) = (min_steps / s) ** alpha`` for
    ``s >= min_steps``, capped at ``max_steps`` (the mass beyond lands there). With the defaults
    (2, 1.0, 48) half the problems have 3 steps or fewer (responses of about 33 tokens), one in
    ten has 20 or more (about 220 tokens), and one in 24 the full 48 (about 540): most of a
    batch finishes early and a few long responses decode alone, the long tail of RL rollouts."""

    name = "arithmetic_longtail"

    def __init__(self, min_steps: int = 2, alpha: float = 1.0, max_steps: int = 48, max_value: int = 5,
                 filler_rate: float = 0.3) -> None:
        super().__init__(min_steps + 1, max_steps + 1, max_value, filler_rate)
        self.min_steps, self.alpha, self.max_steps = min_steps, alpha, max_steps

    def steps(self, rng: random.Random) -> int:
        """A draw of the law above (``1 - random()`` lies in (0, 1])."""
        return min(int(self.min_steps * (1.0 - rng.random()) ** (-1.0 / self.alpha)), self.max_steps)

    def sample(self, rng: random.Random, position: int | None = None) -> Problem:
        numbers = tuple(rng.randint(1, self.max_value) for _ in range(self.steps(rng) + 1))
        return Problem(prompt="+".join(map(str, numbers)) + "=", answer=str(sum(numbers)), numbers=numbers)


class Sort(_RewardAndDetails):
    name = "sort"

    def __init__(self, min_len: int = 3, max_len: int = 6, max_value: int = 20) -> None:
        self.min_len, self.max_len, self.max_value = min_len, max_len, max_value

    def sample(self, rng: random.Random, position: int | None = None) -> Problem:
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


class _DatasetTask:
    """Problems from a ``PromptSplits``; ``held_out`` is the evaluation split. ``sample`` at a
    ``position`` goes through the training split in epochs: positions ``e N .. e N + N - 1``
    are epoch ``e``, a permutation of the ``N`` problems seeded by ``order_seed`` and ``e``,
    so every problem is drawn once per epoch and a resumed run (whose positions derive from
    the step) draws the same ones. Without a position it draws uniformly with ``rng``."""

    name: str

    def __init__(self, prompts: PromptSplits, order_seed: int = 0) -> None:
        self.order_seed = order_seed
        self.train = [self.problem(r) for r in prompts.train]
        self.held_out = [self.problem(r) for r in prompts.held_out]
        self._epoch: tuple[int, list[int]] | None = None  # the last epoch's order

    def __getstate__(self) -> dict:
        # What a reward worker process receives (rl.rewards): it only scores, and a dataset
        # may be large, so the problems stay here.
        return {**self.__dict__, "train": [], "held_out": [], "_epoch": None}

    def problem(self, record: PromptRecord) -> Problem:
        """The record as this task's problem: its reference answer and demonstration."""
        raise NotImplementedError

    def sample(self, rng: random.Random, position: int | None = None) -> Problem:
        if position is None:
            return self.train[rng.randrange(len(self.train))]
        if position < 0:
            raise ValueError(f"task {self.name!r}: position {position} must be >= 0")
        epoch, index = divmod(position, len(self.train))
        if self._epoch is None or self._epoch[0] != epoch:
            order = list(range(len(self.train)))
            random.Random(f"{self.order_seed}/epoch/{epoch}").shuffle(order)
            self._epoch = (epoch, order)
        return self.train[self._epoch[1][index]]

    def demonstration(self, problem: Problem, rng: random.Random) -> str:
        return problem.solution


class _AnswerTask(_RewardAndDetails, _DatasetTask):
    """A dataset task that checks the response's final answer against the record's reference.
    The reward is ``correct + format_reward x format``, where ``format`` is 1 when the final
    answer is written in the task's ``form``."""

    form: str

    def __init__(self, prompts: PromptSplits, format_reward: float = 0.0, order_seed: int = 0) -> None:
        self.format_reward = format_reward
        super().__init__(prompts, order_seed)

    def reward(self, problem: Problem, response: str) -> float:
        d = self.details(problem, response)
        return d["correct"] + self.format_reward * d["format"]


class Math(_AnswerTask):
    """The reference is the answer field's last ``\\boxed{}`` when it has one (MATH's
    ``solution``), else the field itself; a demonstration is the solution field (or the
    answer field) when it states a final answer, else ``\\boxed{reference}``."""

    name, form = "math", "boxed"

    def problem(self, record: PromptRecord) -> Problem:
        reference = last_boxed(record.answer) or record.answer
        solution = record.solution or record.answer
        demonstration = solution if final_answer(solution) else f"\\boxed{{{reference}}}"
        return Problem(record.prompt, reference, solution=demonstration)

    def details(self, problem: Problem, response: str) -> dict[str, float]:
        found = final_answer(response)
        correct = found is not None and math_equivalent(problem.answer, found[0])
        return {"answer_found": float(found is not None), "correct": float(correct),
                "format": float(found is not None and found[1] == self.form)}


class GSM8K(_AnswerTask):
    """The reference is the integer after the answer field's last ``####`` (or the field's
    number); a demonstration is the solution field (or the answer field) when it has a
    ``####`` answer, else ``#### reference``. A response's answer (``#### N``, boxed or
    stated) counts when its first number is the same integer."""

    name, form = "gsm8k", "####"

    def problem(self, record: PromptRecord) -> Problem:
        stated = gsm8k_answer(record.answer)
        reference = integer_answer(stated[0] if stated else record.answer)
        if reference is None:
            raise PromptDatasetError(f"task gsm8k: the answer {record.answer!r} of {record.prompt!r} is not an "
                                     "integer (task.answer_field)")
        solution = record.solution or record.answer
        demonstration = solution if "####" in solution else f"#### {reference}"
        return Problem(record.prompt, str(reference), solution=demonstration)

    def details(self, problem: Problem, response: str) -> dict[str, float]:
        found = gsm8k_answer(response)
        value = integer_answer(found[0]) if found is not None else None
        return {"answer_found": float(value is not None), "correct": float(value == int(problem.answer)),
                "format": float(found is not None and found[1] == self.form)}


class Custom(_DatasetTask):
    """Records scored by the user's ``function(record, prompt, response)`` (``[task]
    reward``): ``record`` is the file's record, every field, ``prompt`` the prompt as the
    policy saw it and ``response`` the response, as text. Demonstrations for the warm start
    are the ``[task] solution_field``'s."""

    name = "custom"

    def __init__(self, prompts: PromptSplits, function: Callable, order_seed: int = 0) -> None:
        self.function = function
        super().__init__(prompts, order_seed)

    def problem(self, record: PromptRecord) -> Problem:
        return Problem(record.prompt, record.answer, solution=record.solution, record=record.fields)

    def score(self, problem: Problem, prompt: str, response: str) -> float | dict[str, float]:
        return self.function(problem.record, prompt, response)


TASKS: dict[str, type] = {"arithmetic": Arithmetic, "arithmetic_longtail": LongTailArithmetic, "sort": Sort,
                          "math": Math, "gsm8k": GSM8K, "custom": Custom}
DATASET_TASKS = ("custom", "gsm8k", "math")


def get_task(name: str, prompts: PromptSplits | None = None, format_reward: float = 0.0, order_seed: int = 0,
             reward: str = "") -> Task:
    """The task ``name``; a dataset task (``DATASET_TASKS``) needs its ``prompts`` (and shuffles
    each epoch by ``order_seed``), ``custom`` its ``reward`` (``"package.module:function"``)."""
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; known: {', '.join(sorted(TASKS))}")
    if name in DATASET_TASKS and prompts is None:
        raise ValueError(f"task {name!r} reads its prompts from a dataset: set task.dataset_path")
    if name == "custom":
        return Custom(prompts, load_reward(reward), order_seed)
    if name in DATASET_TASKS:
        return TASKS[name](prompts, format_reward, order_seed)
    return TASKS[name]()
