"""The job's stream of problems, its random numbers, and the scoring of responses.

The job draws its problems from one stream, by global position: position ``p`` is a dataset
task's ``p``-th problem in its epoch order, or a synthetic task's problem drawn (with its
demonstration) from a host random stream keyed by ``(debug.seed, p)`` alone. A step's
positions are its block of the stream (``positions``): the warm start's steps take
consecutive blocks of ``dp x sft_batch_size``, RL continues after them with blocks of
``rl.prompts_per_step``, each data-parallel rank a consecutive part of the block. So a step's
problems depend on the step and their positions only, never on the data-parallel degree or
rank: a job resumed at another layout trains on the prompts the uninterrupted one would have.
CP and PP peers (the same dp rank) draw the same part.

The sampling streams are the rank's: torch generators seeded by ``generator_seed``, keyed by
``(debug.seed, step, dp rank, engine group, round)``. A resumed run at the same layout draws
what the uninterrupted one did; at another layout its sampled (not greedy) responses differ.
"""

import random

from titan_cotrain.rl.rewards import RewardScorer
from titan_cotrain.rl.tasks import Problem

__all__ = ["ProblemStream"]


class ProblemStream:
    """``task`` problems for data-parallel rank ``dp_rank`` of ``dp_degree``, as token ids
    (``encode_prompt``: a ``PromptEncoder``; ``tokenizer`` for demonstrations), scored by
    ``scorer`` (default: the task's reward in this process, stopping at a failure)."""

    def __init__(self, task, tokenizer, encode_prompt, seed: int, dp_rank: int, dp_degree: int,
                 scorer: RewardScorer | None = None) -> None:
        self.task, self.tokenizer, self.encode_prompt = task, tokenizer, encode_prompt
        self.seed, self.dp_rank, self.dp_degree = seed, dp_rank, dp_degree
        self.scorer = scorer or RewardScorer(task)

    def _draw(self, position: int) -> tuple[Problem, random.Random]:
        """The problem at ``position`` and the random stream it was drawn from, which goes on
        to draw its demonstration (the same on every rank, at any layout)."""
        rng = random.Random(f"{self.seed}/position/{position}")
        return self.task.sample(rng, position), rng

    def problem(self, position: int) -> Problem:
        """The stream's problem at ``position``."""
        return self._draw(position)[0]

    def demonstration(self, position: int) -> tuple[list[int], list[int]]:
        """The prompt and demonstration response of the problem at ``position``, as token ids."""
        problem, rng = self._draw(position)
        response = self.tokenizer.encode(self.task.demonstration(problem, rng), add_bos=False, add_eos=True)
        return self.encode_prompt(problem.prompt), response

    def positions(self, start: int, per_rank: int) -> range:
        """This data-parallel rank's part of the block of ``dp_degree x per_rank`` positions of the
        stream that starts at ``start``: the DP ranks take consecutive parts (so a dataset task's
        epoch goes to the ranks without repeats; CP and PP peers share theirs)."""
        first = start + self.dp_rank * per_rank
        return range(first, first + per_rank)

    def generator_seed(self, step: int, unit: int = 0, round_: int = 0) -> int:
        """The integer seed of a torch generator for step ``step`` on this data-parallel rank,
        engine group ``unit`` and generation round ``round_`` of the step (dynamic sampling's
        extra rounds), folded from the key by fixed primes. Step 0 is before the first step
        (the draft vocabulary's generations)."""
        if step == 0:
            return self.seed * 1_000_003 + self.dp_rank
        return (self.seed * 1_000_003 + step) * 1009 + self.dp_rank + 7919 * unit + 104_729 * round_

    def score(self, problems: list, responses: list[str]) -> tuple[list[float], list[dict[str, float]]]:
        """The rewards of ``responses[i]`` to ``problems[i]`` and their details
        (``RewardScorer``); the reward sees each prompt as the policy saw it, rendered by the
        chat template when there is one."""
        rendered = {id(p): self.encode_prompt.render(p.prompt) for p in problems}  # a group shares its problem
        return self.scorer(problems, [rendered[id(p)] for p in problems], responses)
