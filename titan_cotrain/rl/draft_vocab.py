"""The reduced draft vocabulary's corpus: task samples' tokens, and optionally the initial
policy's own generations (``[draft] vocab_samples``, ``vocab_generations``)."""

import random

import torch
import torch.distributed as dist

from titan_cotrain.config import resolve_model_args
from titan_cotrain.models.build import draft_vocab_maps
from titan_cotrain.models.draft import count_tokens, set_vocab_maps_

__all__ = ["draft_vocab_from_generations", "task_token_counts"]


def task_token_counts(trainer) -> torch.Tensor:
    """``int64 [V]``: tokens of ``[draft] vocab_samples`` task samples (prompt + demonstration),
    the same on every rank: the corpus of a reduced draft vocabulary."""
    rng = random.Random(f"{trainer.seed}/vocab")
    return count_tokens((sum(trainer.demonstration(rng), []) for _ in range(trainer.config.draft.vocab_samples)),
                        resolve_model_args(trainer.config).vocab_size)


def draft_vocab_from_generations(trainer) -> None:
    """The reduced draft vocabulary from the task samples' tokens plus the initial policy's own
    responses to ``[draft] vocab_generations`` prompts (each data-parallel rank answers its
    share, counts are summed over all ranks, so every rank chooses the same), written into
    the trained draft and the engine's copy. A collective: every rank calls it."""
    cfg = trainer.config
    rng = trainer.rng(0, "vocab")
    per_rank = -(-cfg.draft.vocab_generations // trainer.dp_degree)
    prompts = [trainer.encode_prompt(trainer.task.sample(rng).prompt) for _ in range(per_rank)]
    if trainer.pipeline is not None:
        trainer.refresh_engine()  # a pipeline's engine gets its weights streamed from the stages
    generator = torch.Generator(device=trainer.device).manual_seed(trainer.seed * 1_000_003 + trainer.dp_rank)
    out = trainer.engine.generate(prompts, trainer.sampling_params(), generator=generator, draft_tokens=0)
    counts = count_tokens((out.tokens[i, :n].tolist() for i, n in enumerate(out.response_lens.tolist())),
                          resolve_model_args(cfg).vocab_size).to(trainer.device)
    if dist.is_initialized():
        dist.all_reduce(counts)
    d2t, t2d = draft_vocab_maps(cfg, counts.cpu() + task_token_counts(trainer))
    for draft in (trainer.draft, trainer.engine.draft):
        if draft is not None:
            set_vocab_maps_(draft, d2t.to(draft.d2t.device), t2d.to(draft.t2d.device))
