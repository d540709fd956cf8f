"""The corpus a reduced draft vocabulary is chosen from: ``[draft] vocab_samples`` task samples
and, optionally, the initial policy's own responses to ``[draft] vocab_generations`` prompts.
Counting and choosing are ``models.draft_vocab``'s; this module draws the corpus from the
job's task and its rollout engine, the same on every rank."""


import torch
import torch.distributed as dist

from titan_cotrain.engine.rollout import RolloutEngine
from titan_cotrain.engine.sampling import SamplingParams
from titan_cotrain.models.build import draft_vocab_maps, resolve_model_args
from titan_cotrain.models.draft import Draft
from titan_cotrain.models.draft_vocab import count_tokens, set_vocab_maps_
from titan_cotrain.rl.problems import ProblemStream

__all__ = ["draft_vocab_from_generations", "task_token_counts"]


def task_token_counts(problems: ProblemStream, samples: int, vocab_size: int) -> torch.Tensor:
    """``int64 [vocab_size]``: tokens of the prompt stream's first ``samples`` problems (prompt +
    demonstration), the same on every rank: the corpus of a reduced draft vocabulary."""
    return count_tokens((sum(problems.demonstration(position), []) for position in range(samples)), vocab_size)


def draft_vocab_from_generations(config, problems: ProblemStream, engine: RolloutEngine, params: SamplingParams,
                                 draft: Draft | None, refresh_engine=None,
                                 responses: list[list[int]] | None = None) -> None:
    """The reduced draft vocabulary from the task samples' tokens plus the initial policy's own
    responses (``engine`` sampling with ``params``) to the prompt stream's first ``[draft]
    vocab_generations`` prompts (each data-parallel rank answers its part of them, rounded up;
    counts are summed over all ranks, so every rank chooses the same), written into the trained ``draft`` (None off a pipeline's last stage)
    and the engine's copy. ``refresh_engine``: fills the engine first (a pipeline's engine gets
    its weights streamed from the stages). ``responses``: this rank's share of generations made
    already (the draft prefit's first step, ``rl.prefit``: each counted by one rank), counted
    instead of generating. A collective: every rank calls it."""
    vocab_size = resolve_model_args(config).vocab_size
    device = engine.device
    if responses is None:
        per_rank = -(-config.draft.vocab_generations // problems.dp_degree)
        prompts = [problems.encode_prompt(problems.problem(position).prompt)
                   for position in problems.positions(0, per_rank)]
        if refresh_engine is not None:
            refresh_engine()
        generator = torch.Generator(device=device).manual_seed(problems.generator_seed(0))
        out = engine.generate(prompts, params, generator=generator, draft_tokens=0)
        responses = [out.tokens[i, :n].tolist() for i, n in enumerate(out.response_lens.tolist())]
    counts = count_tokens(responses, vocab_size).to(device)
    if dist.is_initialized():
        dist.all_reduce(counts)
    corpus = counts.cpu() + task_token_counts(problems, config.draft.vocab_samples, vocab_size)
    d2t, t2d = draft_vocab_maps(config, corpus)
    for model in (draft, engine.draft):
        if model is not None:
            set_vocab_maps_(model, d2t.to(model.d2t.device), t2d.to(model.t2d.device))
