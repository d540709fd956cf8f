"""The job's streams of problems and of random numbers, per data-parallel rank, and the scoring
of their responses.

Everything random derives from ``(debug.seed, step, dp rank, salt)``, so a resumed run draws
what the uninterrupted one did, and context-parallel and pipeline peers (the same dp rank)
draw the same prompts and demonstrations.
"""

import random

from titan_cotrain.rl.rewards import RewardScorer

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

    def rng(self, step: int, salt: str) -> random.Random:
        return random.Random(f"{self.seed}/{step}/{self.dp_rank}/{salt}")

    def positions(self, index: int, per_rank: int) -> range:
        """This data-parallel rank's places in the job's stream of problems at the ``index``-th
        step of a phase (warm start or RL): the phase's steps take consecutive slices of the
        stream, the DP ranks consecutive parts of each (so a dataset task's epoch goes to
        the ranks without repeats; CP and PP peers share theirs)."""
        first = (index * self.dp_degree + self.dp_rank) * per_rank
        return range(first, first + per_rank)

    def demonstration(self, rng: random.Random, position: int | None = None) -> tuple[list[int], list[int]]:
        """A task sample's prompt and demonstration response, as token ids (``position``: as
        in ``Task.sample``)."""
        problem = self.task.sample(rng, position)
        response = self.tokenizer.encode(self.task.demonstration(problem, rng), add_bos=False, add_eos=True)
        return self.encode_prompt(problem.prompt), response

    def score(self, problems: list, responses: list[str]) -> tuple[list[float], list[dict[str, float]]]:
        """The rewards of ``responses[i]`` to ``problems[i]`` and their details
        (``RewardScorer``); the reward sees each prompt as the policy saw it, rendered by the
        chat template when there is one."""
        rendered = {id(p): self.encode_prompt.render(p.prompt) for p in problems}  # a group shares its problem
        return self.scorer(problems, [rendered[id(p)] for p in problems], responses)
