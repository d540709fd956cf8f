"""The reduced draft vocabulary's corpus: task samples' tokens, and optionally the initial
policy's own generations (``[draft] vocab_samples``, ``vocab_generations``). The maps chosen
from it, and everything else about them, are ``titan_cotrain.models.draft_vocab``'s."""

import random

import torch
import torch.distributed as dist

from titan_cotrain.models.build import resolve_model_args
from titan_cotrain.models.draft_vocab import count_tokens, draft_vocab_maps, set_vocab_maps_

__all__ = ["draft_vocab_from_generations", "task_token_counts"]


def task_token_counts(problems, config) -> torch.Tensor:
    """``int64 [V]``: tokens of ``[draft] vocab_samples`` task samples (prompt + demonstration,
    from the ``ProblemStream`` ``problems``), the same on every rank: the corpus of a reduced
    draft vocabulary."""
    rng = random.Random(f"{problems.seed}/vocab")
    return count_tokens((sum(problems.demonstration(rng), []) for _ in range(config.draft.vocab_samples)),
                        resolve_model_args(config).vocab_size)


def draft_vocab_from_generations(config, problems, engine, params, draft, refresh_engine=None) -> None:
    """The reduced draft vocabulary from the task samples' tokens plus the initial policy's own
    responses (``engine`` sampling with ``params``) to ``[draft] vocab_generations`` prompts
    (each data-parallel rank answers its share, counts are summed over all ranks, so every rank
    chooses the same), written into the trained ``draft`` (None off a pipeline's last stage)
    and the engine's copy. ``refresh_engine``: fills the engine first (a pipeline's engine gets
    its weights streamed from the stages). A collective: every rank calls it."""
    rng = problems.rng(0, "vocab")
    per_rank = -(-config.draft.vocab_generations // problems.dp_degree)
    prompts = [problems.encode_prompt(problems.task.sample(rng).prompt) for _ in range(per_rank)]
    if refresh_engine is not None:
        refresh_engine()
    device = engine.device
    generator = torch.Generator(device=device).manual_seed(problems.seed * 1_000_003 + problems.dp_rank)
    out = engine.generate(prompts, params, generator=generator, draft_tokens=0)
    counts = count_tokens((out.tokens[i, :n].tolist() for i, n in enumerate(out.response_lens.tolist())),
                          resolve_model_args(config).vocab_size).to(device)
    if dist.is_initialized():
        dist.all_reduce(counts)
    d2t, t2d = draft_vocab_maps(config, counts.cpu() + task_token_counts(problems, config))
    for model in (draft, engine.draft):
        if model is not None:
            set_vocab_maps_(model, d2t.to(model.d2t.device), t2d.to(model.t2d.device))
