"""Build the policy (target) and the draft a job config asks for."""

import torch

from titan_cotrain.config import resolve_model_args, resolve_tap_layers
from titan_cotrain.models.draft import Draft, DraftArgs, draft_vocab_from_counts
from titan_cotrain.models.transformer import Transformer

__all__ = ["build_draft", "build_target", "job_seed"]


def job_seed(config) -> int:
    """``[debug] seed``, 0 when unset: the root of every random choice of a job."""
    return config.debug.seed if config.debug.seed is not None else 0


def build_target(config, device: torch.device | str = "cpu") -> Transformer:
    """The policy: loaded from ``[model] hf_path``, or ``flavor`` with a seeded random init."""
    args = resolve_model_args(config)
    taps = resolve_tap_layers(config, args.n_layers)
    if config.model.hf_path:
        from titan_cotrain.models.hf import load_hf

        return load_hf(config.model.hf_path, dtype=torch.float32, tap_layers=taps, device=device)
    seed = job_seed(config)
    with torch.device(device):
        model = Transformer(args, tap_layers=taps)
    model.init_weights(generator=torch.Generator(device=device).manual_seed(seed))
    return model


def build_draft(config, target: Transformer, token_counts: torch.Tensor | None = None,
                device: torch.device | str = "cpu") -> Draft | None:
    """The EAGLE-3 draft for ``target`` (None when ``[draft] enable = false``), loaded from
    ``[draft] init_path`` (an EAGLE-3 folder) or freshly initialised.

    A reduced vocabulary (``[draft] vocab_size`` below the target's) keeps the most
    frequent tokens of ``token_counts [V]``, which the caller counts on its corpus.
    """
    d = config.draft
    if not d.enable:
        return None
    if d.init_path:
        from titan_cotrain.models.eagle3 import load_eagle3

        draft, taps = load_eagle3(d.init_path, device=device, tap_layers=target.tap_layers)
        if tuple(taps) != tuple(target.tap_layers) or draft.args.target_dim != target.args.dim:
            raise ValueError(f"draft.init_path {d.init_path!r} taps layers {list(taps)} of a width-"
                             f"{draft.args.target_dim} target; the policy taps {list(target.tap_layers)} at width "
                             f"{target.args.dim}")
        if draft.args.vocab_size != target.args.vocab_size:
            raise ValueError(f"draft.init_path {d.init_path!r} was trained for a {draft.args.vocab_size}-token "
                             f"vocabulary; the policy has {target.args.vocab_size}")
        return draft
    args = DraftArgs.from_target(
        target.args, n_taps=len(target.tap_layers), draft_vocab_size=d.vocab_size, dim=d.hidden_size,
        n_heads=d.num_heads, n_kv_heads=d.num_kv_heads, ffn_dim=d.intermediate_size,
    )
    maps = None
    if args.draft_vocab_size != args.vocab_size:
        if token_counts is None:
            raise ValueError("a reduced draft vocabulary ([draft] vocab_size) needs token counts of a corpus")
        maps = draft_vocab_from_counts(token_counts, args.draft_vocab_size)
    seed = job_seed(config)
    with torch.device(device):
        draft = Draft(args, *(maps or (None, None)))
    draft.init_weights(generator=torch.Generator(device=device).manual_seed(seed + 1))
    return draft
