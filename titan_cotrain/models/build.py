"""Build the policy (target) and the draft a job config asks for.

Two ways: ``build_target`` / ``build_draft`` make whole, initialised models on one device
(tests, references, the pipeline split); the trainer instead builds them on the meta device
(``device="meta"``), shards them, and fills each rank's shards with ``init_target_`` /
``init_draft_``, one whole tensor at a time on the host, so no rank ever holds a whole model.
"""

import warnings
from collections.abc import Callable

import torch

from titan_cotrain.models.args import ARCHITECTURES, ModelArgs, model_args_for
from titan_cotrain.models.block_draft import BlockDraftArgs, BlockDrafter, block_target_layers
from titan_cotrain.models.draft import Draft, DraftArgs
from titan_cotrain.models.draft_vocab import draft_vocab_from_counts
from titan_cotrain.models.taps import default_tap_layers, validate_tap_layers
from titan_cotrain.models.transformer import Transformer, rope_inv_freq

__all__ = [
    "build_draft", "build_target", "draft_vocab_maps", "init_draft_", "init_target_", "job_seed", "resolve_model_args",
    "resolve_tap_layers",
]

# fill(param, whole): copy a whole host tensor (or a reader of its slices) into ``param``.
Fill = Callable[[torch.Tensor, object], None]


def resolve_model_args(config) -> ModelArgs:
    """The target's shape: from ``[model] hf_path``'s ``config.json`` or the named flavor
    (with ``[model] n_layers`` decoder layers when set). Raises ``ValueError`` naming the key;
    ``config.validate`` lists it among the config's problems."""
    m = config.model
    if m.n_layers < 0 or (m.n_layers and m.hf_path):
        raise ValueError(f"model.n_layers ({m.n_layers}) must be 0 (the flavor's), or >= 1 without model.hf_path")
    if m.hf_path:
        from titan_cotrain.models.hf import HFCheckpointError, read_hf_model_args

        try:
            return read_hf_model_args(m.hf_path)
        except HFCheckpointError as e:
            raise ValueError(f"model.hf_path: {e}") from None
    if m.name not in ARCHITECTURES:
        raise ValueError(f"model.name: unknown architecture {m.name!r}; known: {', '.join(ARCHITECTURES)}")
    try:
        args = model_args_for(m.name, m.flavor)
    except ValueError as e:
        raise ValueError(f"model.flavor: {e}") from None
    return args.replace(n_layers=m.n_layers) if m.n_layers else args


def resolve_tap_layers(config, n_layers: int) -> tuple[int, ...]:
    """``[draft] tap_layers``, or EAGLE-3's default for an ``n_layers`` target."""
    try:
        if config.draft.tap_layers:
            return validate_tap_layers(config.draft.tap_layers, n_layers)
        if config.draft.kind == "dflash":
            return block_target_layers(n_layers, config.draft.block_layers)
        return default_tap_layers(n_layers)
    except ValueError as e:
        raise ValueError(f"draft.tap_layers: {e}") from None


def job_seed(config) -> int:
    """``[debug] seed``, 0 when unset: the root of every random choice of a job."""
    return config.debug.seed if config.debug.seed is not None else 0


def draft_vocab_maps(config, token_counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(d2t, t2d)`` of the ``[draft] vocab_size`` most frequent tokens of ``token_counts [V]``;
    a corpus too small for that size (``draft_vocab_from_counts``) is refused naming the keys."""
    try:
        return draft_vocab_from_counts(token_counts, config.draft.vocab_size)
    except ValueError as e:
        raise ValueError(f"[draft] vocab_size = {config.draft.vocab_size}: {e}. Count more text "
                         "([draft] vocab_samples: task samples; [draft] vocab_generations: the policy's own "
                         "responses, with [model] hf_path), lower [draft] vocab_size, or set it to 0 (the "
                         "target's vocabulary)") from None


def _plain_fill(param: torch.Tensor, whole) -> None:
    with torch.no_grad():
        param.copy_(whole(tuple(slice(None) for _ in param.shape)) if callable(whole) else whole)


def build_target(config, device: torch.device | str = "cpu") -> Transformer:
    """The policy: loaded from ``[model] hf_path``, or ``flavor`` with a seeded random init.
    On ``device="meta"`` it is left uninitialised (fill it with ``init_target_``)."""
    args = resolve_model_args(config)
    taps = resolve_tap_layers(config, args.n_layers)
    if str(device) != "meta" and config.model.hf_path:
        from titan_cotrain.models.hf import load_hf

        return load_hf(config.model.hf_path, dtype=torch.float32, tap_layers=taps, device=device)
    with torch.device(device):
        model = Transformer(args, tap_layers=taps)
    if str(device) != "meta":
        init_target_(model, config)
    return model


def init_target_(model: Transformer, config, fill: Fill = _plain_fill) -> None:
    """Fill ``model``'s parameters (plain or sharded, see ``fill``) from ``[model] hf_path``
    (each rank reads only its slices) or the job's seeded random init."""
    if config.model.hf_path:
        from titan_cotrain.models.hf import load_hf_weights_

        load_hf_weights_(model, config.model.hf_path, fill)
        return
    model.init_weights(generator=torch.Generator().manual_seed(job_seed(config)), fill=fill)


def check_mask_token_id(mask_token_id: int, target_args) -> None:
    """``[draft] mask_token_id`` (a block drafter's) names a row of the policy's embedding that
    the exports overwrite, so it must exist, and the embedding must not be the head too."""
    if mask_token_id == -1:
        return
    if not 0 <= mask_token_id < target_args.vocab_size:
        raise ValueError(f"draft.mask_token_id = {mask_token_id} is not a row of the policy's embedding "
                          f"[0, {target_args.vocab_size}): choose a row no text uses, or -1")
    if target_args.tie_embeddings:
        raise ValueError(f"draft.mask_token_id = {mask_token_id}: the policy ties its embedding to its head, so "
                          "the exported mask row would also be a logit; set draft.mask_token_id = -1")


def build_draft(config, target: Transformer, token_counts: torch.Tensor | None = None,
                device: torch.device | str = "cpu") -> Draft | None:
    """The EAGLE-3 draft for ``target`` (None when ``[draft] enable = false``), loaded from
    ``[draft] init_path`` (an EAGLE-3 folder) or freshly initialised; on ``device="meta"``
    left uninitialised (its vocabulary maps are host buffers; fill it with ``init_draft_``).

    A reduced vocabulary (``[draft] vocab_size`` below the target's) keeps the most
    frequent tokens of ``token_counts [V]``, which the caller counts on its corpus
    (``draft_vocab_maps``); a folder brings its own.
    """
    d = config.draft
    if not d.enable:
        return None
    if d.kind == "dflash":
        check_mask_token_id(d.mask_token_id, target.args)
        args = BlockDraftArgs.from_target(target.args, n_layers=d.block_layers, block_size=d.block_size,
                                          target_layer_ids=target.tap_layers, ffn_dim=d.intermediate_size)
        with torch.device(device):
            drafter = BlockDrafter(args)
        if str(device) != "meta":
            init_draft_(drafter, config, target)
        return drafter
    if d.init_path:
        draft = _load_init_draft(config, target)
        if str(device) == "meta":
            with torch.device("meta"):
                shell = Draft(draft.args, draft.d2t, draft.t2d)
            return shell
        return draft.to(device)
    args = DraftArgs.from_target(
        target.args, n_taps=len(target.tap_layers), draft_vocab_size=d.vocab_size, dim=d.hidden_size,
        n_heads=d.num_heads, n_kv_heads=d.num_kv_heads, ffn_dim=d.intermediate_size,
    )
    maps = None
    if args.draft_vocab_size != args.vocab_size:
        if token_counts is None:
            raise ValueError("a reduced draft vocabulary ([draft] vocab_size) needs token counts of a corpus")
        maps = draft_vocab_maps(config, token_counts)
    with torch.device(device):
        draft = Draft(args, *(maps or (None, None)))
    if str(device) != "meta":
        init_draft_(draft, config, target)
    return draft



def init_draft_(draft: Draft | BlockDrafter, config, target: Transformer, fill: Fill = _plain_fill) -> None:
    """Fill ``draft``'s parameters from ``[draft] init_path`` (an EAGLE-3 folder, or a DFlash
    folder for a block drafter) or the job's seeded random init."""
    if config.draft.init_path:
        load = _load_init_block_drafter if isinstance(draft, BlockDrafter) else _load_init_draft
        state = load(config, target).state_dict()
        for name, param in draft.named_parameters():
            fill(param, state[name])
        with torch.no_grad():
            draft.rope_inv_freq.copy_(rope_inv_freq(draft.args.head_dim, draft.args.rope_theta, draft.args.rope_scaling))
        return
    draft.init_weights(generator=torch.Generator().manual_seed(job_seed(config) + 1), fill=fill)


def _load_init_block_drafter(config, target: Transformer) -> BlockDrafter:
    """The DFlash folder ``[draft] init_path``, which must fit the job's drafter: the policy's
    width, the target layers it taps, the block size and depth. A folder without its own mask
    embedding takes the policy's row ``dflash_config.mask_token_id`` (as SGLang does)."""
    from titan_cotrain.models.dflash import load_dflash

    d, path = config.draft, config.draft.init_path
    embedding = target.embed_tokens.weight
    drafter = load_dflash(path, target_embedding=None if embedding.is_meta else embedding.detach().float())
    a = drafter.args
    mismatched = [f"{name} {theirs} (the job's: {ours})" for name, theirs, ours in (
        ("target_layer_ids", list(a.target_layer_ids), list(target.tap_layers)),
        ("block_size", a.block_size, d.block_size), ("num_hidden_layers", a.n_layers, d.block_layers),
        ("hidden_size", a.dim, target.args.dim)) if theirs != ours]
    if mismatched:
        raise ValueError(f"draft.init_path {path!r} does not fit this job's block drafter: {'; '.join(mismatched)}. "
                         "Set draft.tap_layers, draft.block_size and draft.block_layers to the folder's")
    return drafter


def _load_init_draft(config, target: Transformer) -> Draft:
    from titan_cotrain.models.eagle3 import load_eagle3

    path = config.draft.init_path
    draft, taps = load_eagle3(path, device="cpu", tap_layers=target.tap_layers)
    if tuple(taps) != tuple(target.tap_layers) or draft.args.target_dim != target.args.dim:
        raise ValueError(f"draft.init_path {path!r} taps layers {list(taps)} of a width-"
                         f"{draft.args.target_dim} target; the policy taps {list(target.tap_layers)} at width "
                         f"{target.args.dim}")
    if config.draft.vocab_size not in (0, draft.args.draft_vocab_size):
        raise ValueError(f"draft.vocab_size = {config.draft.vocab_size}, but draft.init_path {path!r} has a "
                         f"{draft.args.draft_vocab_size}-token vocabulary (with its d2t / t2d maps): set "
                         f"draft.vocab_size to 0 or {draft.args.draft_vocab_size}")
    if draft.args.vocab_size != target.args.vocab_size:
        raise ValueError(f"draft.init_path {path!r} was trained for a {draft.args.vocab_size}-token "
                         f"vocabulary; the policy has {target.args.vocab_size}")
    ours = (draft.args.rope_theta, draft.args.rope_scaling)
    if ours != (target.args.rope_theta, target.args.rope_scaling):
        # The draft keeps the RoPE it was trained with (and exports it); a mismatch usually
        # means a folder whose config lost the target's RoPE keys.
        warnings.warn(f"draft.init_path {path!r} places positions with rope_theta {ours[0]} and rope_scaling "
                      f"{ours[1]}, the policy with {target.args.rope_theta} and {target.args.rope_scaling}: the "
                      "draft keeps its own, as trained; check its config.json if it was meant for this policy",
                      stacklevel=2)
    return draft
