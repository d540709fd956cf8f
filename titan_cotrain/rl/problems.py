"""The job's streams of problems and of random numbers, per data-parallel rank, and the scoring
of their responses.

Everything random derives from ``(debug.seed, step, dp rank, salt)``, and every seed is made
here: host draws by ``rng`` (``job_rng`` for the job-wide ones), torch generators by
``generator_seed``, the same key folded into an integer. So a resumed run draws what the
uninterrupted one did, and context-parallel and pipeline peers (the same dp rank) draw the
same prompts and demonstrations.
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
        """Step ``step``'s host random numbers for ``salt`` on this data-parallel rank."""
        return random.Random(f"{self.seed}/{step}/{self.dp_rank}/{salt}")

    def job_rng(self, salt: str) -> random.Random:
        """The job's host random numbers for ``salt`` (the same on every rank)."""
        return random.Random(f"{self.seed}/{salt}")

    def generator_seed(self, step: int, unit: int = 0, round_: int = 0) -> int:
        """The integer seed of a torch generator for step ``step`` on this data-parallel rank,
        engine group ``unit`` and generation round ``round_`` of the step (dynamic sampling's
        extra rounds): ``rng``'s key folded into one integer by fixed primes, since a torch
        generator takes an integer. Step 0 is before the first step (the draft vocabulary's
        generations)."""
        if step == 0:
            return self.seed * 1_000_003 + self.dp_rank
        return (self.seed * 1_000_003 + step) * 1009 + self.dp_rank + 7919 * unit + 104_729 * round_

    def positions(self, block: int, per_rank: int) -> range:
        """This data-parallel rank's places in the job's stream of problems in its ``block``-th
        block of ``dp_degree x per_rank`` positions: consecutive blocks are consecutive slices of
        the stream, the DP ranks consecutive parts of each (so a dataset task's epoch goes to the
        ranks without repeats; CP and PP peers share theirs). The warm start's step ``s`` takes
        block ``s - 1`` of its batch size; RL continues the stream after it
        (``rl_positions``)."""
        first = (block * self.dp_degree + self.dp_rank) * per_rank
        return range(first, first + per_rank)

    def rl_positions(self, warm_start_positions: int, block: int, per_rank: int) -> range:
        """``positions`` of RL's ``block``-th block of the stream, which starts after the
        ``warm_start_positions`` the warm start drew (every rank's): RL does not re-draw the
        problems the warm start's last epoch trained on first."""
        within = self.positions(block, per_rank)
        return range(warm_start_positions + within.start, warm_start_positions + within.stop)

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
