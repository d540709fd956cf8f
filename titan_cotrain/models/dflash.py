"""Block drafter folders in the DFlash layout SGLang serves (``--speculative-algorithm
DFLASH``), and back into ``BlockDrafter``.

A folder is ``config.json`` + ``model.safetensors``. The facts read from SGLang's
``python/sglang/srt/models/dflash.py`` (``DFlashDraftModel``) and
``python/sglang/srt/speculative/dflash_utils.py`` (``parse_dflash_draft_config``) at commits
003b23d and 00731f0 that fix the format:

* ``architectures: ["DFlashDraftModel"]``, a Qwen-3 style text config (``hidden_size``,
  ``num_hidden_layers``, ``num_attention_heads``, ``num_key_value_heads``, ``head_dim``,
  ``intermediate_size``, ``rms_norm_eps``, ``rope_theta`` / ``rope_scaling``,
  ``max_position_embeddings``, ``hidden_act = "silu"``, no attention bias);
* ``dflash_config``: ``block_size`` (also read at the top level), ``target_layer_ids`` (the
  hidden states *after* each listed target layer: our output-of-layer indices, as the
  taps), ``mask_token_id`` and ``num_target_layers``;
* the weights carry no embedding and no LM head (the target's are used): ``fc.weight``
  ``[H, n_ctx H]``, ``hidden_norm.weight``, ``norm.weight`` and ``layers.<i>.`` +
  ``input_layernorm``, ``post_attention_layernorm``, ``self_attn.{q,k,v,o}_proj``,
  ``self_attn.{q,k}_norm``, ``mlp.{gate,up,down}_proj`` (SGLang fuses q/k/v and gate/up
  itself when loading) -- ``BlockDrafter``'s own names;
* unknown tensor names are skipped by SGLang's loader. This project's drafter owns its mask
  embedding; it is written as ``mask_embedding``, which ``load_dflash`` reads back and
  SGLang skips: SGLang embeds the mask token with the *target's* embedding row
  ``mask_token_id``, so serving a co-trained drafter there needs that row of the policy's
  export to hold this vector: the job's export writes it there with ``[draft] mask_token_id``
  (``rl.export.write_export``).

Whatever is wrong with a folder surfaces as one ``HFCheckpointError`` naming the file.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from titan_cotrain.models.block_draft import BlockDraftArgs, BlockDrafter
from titan_cotrain.models.hf import (
    CONFIG_NAME,
    HFCheckpointError,
    PathLike,
    _check_tensors,
    _open,
    _positive,
    _read_json,
    _rope,
    _stored_shapes,
    _weight_files,
    write_single_file_folder,
)
from titan_cotrain.models.transformer import rope_inv_freq

__all__ = ["ARCHITECTURE", "MASK_EMBEDDING", "load_dflash", "save_dflash"]

ARCHITECTURE = "DFlashDraftModel"
MASK_EMBEDDING = "mask_embedding"


def save_dflash(drafter: BlockDrafter, path: PathLike, n_target_layers: int, mask_token_id: int | None = None,
                dtype: torch.dtype | None = None) -> None:
    """Write ``drafter`` as a DFlash folder (module docstring). ``n_target_layers``: the
    target's depth (``num_target_layers``); ``mask_token_id``: the target vocabulary's mask
    token, written when given; ``dtype`` of the tensors (default the drafter's). The drafter
    must be whole on this rank. Weight files of an earlier save are replaced."""
    args = drafter.args
    if any(not 0 <= layer < n_target_layers for layer in args.target_layer_ids):
        raise ValueError(f"target_layer_ids {list(args.target_layer_ids)} do not fit a {n_target_layers}-layer target")
    dtype = dtype or drafter.fc.weight.dtype
    hf_config = dflash_config(args, n_target_layers, mask_token_id)
    hf_config["torch_dtype"] = str(dtype).removeprefix("torch.")
    tensors = {name: t.detach().to("cpu", dtype).contiguous() for name, t in drafter.state_dict().items()}
    write_single_file_folder(path, hf_config, tensors)


def dflash_config(args: BlockDraftArgs, n_target_layers: int, mask_token_id: int | None) -> dict[str, Any]:
    """``config.json`` of a drafter (all but ``torch_dtype``)."""
    block = {"block_size": args.block_size, "target_layer_ids": list(args.target_layer_ids),
             "num_target_layers": n_target_layers}
    if mask_token_id is not None:
        block["mask_token_id"] = int(mask_token_id)
    hf_config = {
        "architectures": [ARCHITECTURE], "model_type": "qwen3", "hidden_size": args.dim,
        "num_hidden_layers": args.n_layers, "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_kv_heads, "head_dim": args.head_dim, "intermediate_size": args.ffn_dim,
        "rms_norm_eps": args.norm_eps, "hidden_act": "silu", "attention_bias": False,
        "rope_theta": args.rope_theta, "max_position_embeddings": args.max_seq_len, "vocab_size": args.vocab_size,
        "tie_word_embeddings": False, "block_size": args.block_size, "dflash_config": block,
    }
    if args.rope_scaling is not None:
        s = args.rope_scaling
        hf_config["rope_scaling"] = {"rope_type": "llama3", "factor": s.factor, "low_freq_factor": s.low_freq_factor,
                                  "high_freq_factor": s.high_freq_factor,
                                  "original_max_position_embeddings": s.original_max_position_embeddings}
    return hf_config


def load_dflash(path: PathLike, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                target_embedding: torch.Tensor | None = None) -> BlockDrafter:
    """Read a DFlash folder into a ``BlockDrafter``. Its mask embedding is the folder's
    ``mask_embedding`` tensor (this project's folders), else row ``dflash_config.mask_token_id``
    of ``target_embedding [V, H]`` (a folder trained elsewhere, whose mask token the target's
    embedding holds)."""
    folder = Path(path)
    if not folder.is_dir():
        raise HFCheckpointError(f"{folder}: no such directory")
    config_path = folder / CONFIG_NAME
    hf_config = _read_json(config_path)
    try:
        args, mask_token_id = _args(hf_config)
    except HFCheckpointError as e:
        raise HFCheckpointError(f"{config_path}: {e}") from None
    files = _weight_files(folder)
    shapes = {name: shape for name, (_, shape) in _stored_shapes(files).items()}
    with torch.device("meta"):
        drafter = BlockDrafter(args)
    expected = {name: tuple(t.shape) for name, t in drafter.state_dict().items()}
    if MASK_EMBEDDING not in shapes:
        if target_embedding is None or mask_token_id is None:
            raise HFCheckpointError(f"{folder}: no {MASK_EMBEDDING} tensor: give the target's embedding and a "
                                    f"dflash_config.mask_token_id in {config_path} to take the mask token's row")
        del expected[MASK_EMBEDDING]
    # Other trainers' folders may carry rotary caches and the like: SGLang skips what it does not know.
    _check_tensors(folder, shapes, expected, tolerated=set(shapes) - set(expected))
    state = {}
    device = torch.device(device)
    for file in files:
        with _open(file) as f:
            for name in f.keys():
                if name in expected:
                    state[name] = f.get_tensor(name).to(device=device, dtype=dtype)
    if MASK_EMBEDDING not in state:
        if not 0 <= mask_token_id < target_embedding.shape[0]:
            raise HFCheckpointError(f"{config_path}: mask_token_id {mask_token_id} is outside the target's "
                                    f"{target_embedding.shape[0]} embedding rows")
        state[MASK_EMBEDDING] = target_embedding[mask_token_id].detach().to(device=device, dtype=dtype)
    drafter.load_state_dict(state, strict=True, assign=True)
    drafter.rope_inv_freq = rope_inv_freq(args.head_dim, args.rope_theta, args.rope_scaling).to(device)
    return drafter


def _args(hf_config: Mapping[str, Any]) -> tuple[BlockDraftArgs, int | None]:
    """The drafter's args and mask token id from a DFlash ``config.json``."""
    if ARCHITECTURE not in (hf_config.get("architectures") or []):
        raise HFCheckpointError(f"architectures must include {ARCHITECTURE!r}, got {hf_config.get('architectures')!r}")
    if hf_config.get("hidden_act", "silu") != "silu" or hf_config.get("attention_bias", False):
        raise HFCheckpointError("only hidden_act 'silu' without attention bias is supported")
    block = hf_config.get("dflash_config") or {}
    if not isinstance(block, Mapping):
        raise HFCheckpointError(f"dflash_config must be an object, got {block!r}")
    layer_ids = block.get("target_layer_ids", hf_config.get("target_layer_ids"))
    if not isinstance(layer_ids, list) or not layer_ids or not all(isinstance(x, int) for x in layer_ids):
        raise HFCheckpointError(f"dflash_config.target_layer_ids must be a non-empty list of ints, got {layer_ids!r}")
    block_size = _positive({"block_size": block.get("block_size", hf_config.get("block_size"))}, "block_size", int)
    mask_token_id = block.get("mask_token_id", hf_config.get("mask_token_id"))
    if mask_token_id is not None and (isinstance(mask_token_id, bool) or not isinstance(mask_token_id, int)):
        raise HFCheckpointError(f"mask_token_id must be an int, got {mask_token_id!r}")
    hidden = _positive(hf_config, "hidden_size", int)
    heads = _positive(hf_config, "num_attention_heads", int)
    max_positions = _positive(hf_config, "max_position_embeddings", int, default=32768)
    theta, scaling = _rope(hf_config, max_positions)
    try:
        args = BlockDraftArgs(
            dim=hidden, n_layers=_positive(hf_config, "num_hidden_layers", int), n_heads=heads,
            n_kv_heads=_positive(hf_config, "num_key_value_heads", int, default=heads),
            head_dim=_positive(hf_config, "head_dim", int, default=hidden // heads),
            ffn_dim=_positive(hf_config, "intermediate_size", int), vocab_size=_positive(hf_config, "vocab_size", int),
            block_size=block_size, target_layer_ids=tuple(layer_ids),
            norm_eps=_positive(hf_config, "rms_norm_eps", float, default=1e-6), rope_theta=theta, rope_scaling=scaling,
            max_seq_len=max_positions)
    except ValueError as e:
        raise HFCheckpointError(str(e)) from None
    return args, mask_token_id
