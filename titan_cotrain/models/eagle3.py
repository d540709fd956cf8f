"""EAGLE-3 draft folders that vLLM and SGLang both load, and back into ``Draft``.

A folder is ``config.json`` + ``model.safetensors`` of a ``LlamaForCausalLMEagle3``
(docs/DESIGN.md section 9). ``config.json`` is a one-layer Llama config (written by
``hf_config_from_model_args``, so RoPE is in both the transformers v4 and v5 layouts) plus
the EAGLE-3 keys; the weights are ``Draft``'s state dict under its own names. The facts
read from the two loaders that fix the format:

* both build ``fc`` as ``Linear(3 * target_hidden_size, hidden_size, bias=False)``: exactly
  three taps, and no ``fc.bias`` (vLLM fails on the unknown name, SGLang drops it);
* the tap layers go in twice. vLLM reads the top-level ``eagle_aux_hidden_state_layer_ids``
  as "the residual stream entering layer k", i.e. our output-of-layer index + 1; SGLang
  reads ``eagle_config.eagle_aux_hidden_state_layer_ids`` as the output-of-layer index
  (ours) and adds 1 itself;
* ``midlayer.*`` is the one layer name both accept (SGLang silently drops ``layers.0.*``);
* ``norm_before_residual`` is written explicitly (false, what ``Draft`` computes): the
  loaders do not agree on a default;
* ``tie_word_embeddings`` false (else SGLang uses the embedding as ``lm_head``), and
  ``draft_vocab_size`` always present (else SGLang takes the target's ``lm_head``);
* ``max_position_embeddings`` at least the target's context (the 2048 default would cap
  long rollouts);
* ``embed_tokens.weight`` only when the draft's hidden size differs from the target's:
  otherwise both engines hand the draft the target's embedding, which is what co-training
  wants.

``load_eagle3`` also reads what other EAGLE-3 trainers write: ``layers.0.*`` names, no
``t2d`` (rebuilt from ``d2t``), no vocab maps at all when ``draft_vocab_size == vocab_size``,
and tap ids in either convention alone. A folder with no tap ids at all needs the caller's
``tap_layers``: the EAGLE-3 default ``taps.default_tap_layers(n_layers)`` depends on the
target's depth, which a draft folder does not record.

Whatever is wrong with a folder surfaces as one ``HFCheckpointError`` naming the file.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from titan_cotrain.models.args import ModelArgs
from titan_cotrain.models.draft import Draft, DraftArgs
from titan_cotrain.models.draft_vocab import checked_vocab_maps, vocab_map_problem
from titan_cotrain.models.hf import (
    CONFIG_NAME,
    HFCheckpointError,
    PathLike,
    _check_tensors,
    _open,
    _read_json,
    _weight_files,
    hf_config_from_model_args,
    model_args_from_hf_config,
    write_single_file_folder,
)
from titan_cotrain.models.taps import vllm_aux_layer_ids
from titan_cotrain.models.transformer import rope_inv_freq

__all__ = ["ARCHITECTURE", "load_eagle3", "save_eagle3"]

ARCHITECTURE = "LlamaForCausalLMEagle3"
# Both engines size fc for exactly this many taps.
ENGINE_N_TAPS = 3
_TAP_IDS = "eagle_aux_hidden_state_layer_ids"
# Other trainers name the one layer like a Llama layer list; ours is the name both engines load.
_LAYER_LIST_PREFIX, _MIDLAYER_PREFIX = "layers.0.", "midlayer."


def save_eagle3(
    draft: Draft,
    path: PathLike,
    tap_layers: Sequence[int],
    target_max_position_embeddings: int | None = None,
    dtype: torch.dtype | None = None,
) -> None:
    """Write ``draft`` as an EAGLE-3 folder that vLLM, SGLang and ``load_eagle3`` load.

    ``tap_layers``: the target layers whose outputs ``fc`` fuses, as output-of-layer
    indices (our convention, ``taps.py``), increasing. ``target_max_position_embeddings``:
    the target's context length; the config gets the larger of it and
    ``draft.args.max_seq_len``. ``dtype``: of the floating-point tensors (default the
    draft's); ``d2t`` stays int64 and ``t2d`` bool. ``draft`` must be whole on this rank
    (gather an FSDP-sharded draft first). Weight files of an earlier save are replaced.
    """
    args = draft.args
    if args.n_taps != ENGINE_N_TAPS:
        raise ValueError(
            f"the draft fuses {args.n_taps} taps, but vLLM and SGLang build fc for exactly {ENGINE_N_TAPS}"
        )
    if target_max_position_embeddings is not None and target_max_position_embeddings <= 0:
        raise ValueError(f"target_max_position_embeddings must be positive, got {target_max_position_embeddings}")
    taps = tuple(int(x) for x in tap_layers)
    problem = _tap_problem(taps, args.n_taps) or vocab_map_problem(draft.d2t.cpu(), draft.t2d.cpu(), args.vocab_size)
    if problem:
        raise ValueError(problem)
    dtype = dtype or draft.fc.weight.dtype
    max_positions = max(args.max_seq_len, target_max_position_embeddings or 0)
    config = _eagle3_config(args, taps, max_positions)
    config["torch_dtype"] = str(dtype).removeprefix("torch.")
    tensors = {
        name: t.detach().to("cpu", dtype if t.is_floating_point() else t.dtype).contiguous()
        for name, t in draft.state_dict().items()
    }

    write_single_file_folder(path, config, tensors)


def load_eagle3(
    path: PathLike,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    tap_layers: Sequence[int] | None = None,
) -> tuple[Draft, tuple[int, ...]]:
    """Read an EAGLE-3 folder: returns the ``Draft`` and its tap layers (output-of-layer indices).

    Floating-point tensors are cast to ``dtype``; everything lands on ``device``. The draft is
    built on the meta device and only the stored tensors are materialised. ``tap_layers`` is
    needed only when ``config.json`` names none; when it does, the two must agree.
    """
    folder = Path(path)
    if not folder.is_dir():
        raise HFCheckpointError(f"{folder}: no such directory")
    config_path = folder / CONFIG_NAME
    config = _read_json(config_path)
    try:
        taps = _config_tap_layers(config, tap_layers)
        args = _draft_args(config, n_taps=len(taps))
    except HFCheckpointError as e:
        raise HFCheckpointError(f"{config_path}: {e}") from None

    files = _weight_files(folder)
    shapes = _stored_shapes(folder, files)
    if "fc.bias" in shapes:
        raise HFCheckpointError(
            f"{folder}: fc.bias is not supported: the draft's fc has no bias (and vLLM's EAGLE-3 loader rejects one)"
        )
    device = torch.device(device)
    with torch.device("meta"):
        draft = Draft(
            args, torch.empty(args.draft_vocab_size, dtype=torch.int64), torch.empty(args.vocab_size, dtype=torch.bool)
        )
    expected = {name: tuple(t.shape) for name, t in draft.state_dict().items()}
    # t2d is implied by d2t, and both by a full draft vocabulary.
    optional = {"t2d", "d2t"} if args.draft_vocab_size == args.vocab_size else {"t2d"}
    for name in optional - shapes.keys():
        del expected[name]
    _check_tensors(folder, shapes, expected, tolerated=set())

    state = {}
    for file in files:
        with _open(file) as f:
            for stored_name in f.keys():
                name, t = _our_name(stored_name), f.get_tensor(stored_name)
                # Cast one tensor at a time: host memory peaks at one tensor beyond the result.
                state[name] = t if name in ("d2t", "t2d") else t.to(device=device, dtype=dtype)
    try:
        d2t, t2d = checked_vocab_maps(state.pop("d2t", None), state.pop("t2d", None), args.draft_vocab_size,
                                      args.vocab_size)
    except ValueError as e:
        raise HFCheckpointError(f"{folder}: {e}") from None
    state["d2t"], state["t2d"] = d2t.to(device), t2d.to(device)
    draft.load_state_dict(state, strict=True, assign=True)
    # Non-persistent, so still on meta: compute it (fp32) where the weights landed.
    draft.rope_inv_freq = rope_inv_freq(args.head_dim, args.rope_theta, args.rope_scaling).to(device)
    return draft, taps


def _eagle3_config(args: DraftArgs, taps: tuple[int, ...], max_positions: int) -> dict[str, Any]:
    """``config.json`` (all but ``torch_dtype``): the draft as a one-layer Llama, plus the EAGLE-3 keys."""
    llama = ModelArgs(
        architecture="llama3", dim=args.dim, n_layers=1, n_heads=args.n_heads, n_kv_heads=args.n_kv_heads,
        head_dim=args.head_dim, ffn_dim=args.ffn_dim, vocab_size=args.vocab_size, norm_eps=args.norm_eps,
        rope_theta=args.rope_theta, rope_scaling=args.rope_scaling, max_seq_len=max_positions,
    )
    config = hf_config_from_model_args(llama)
    config.update(
        architectures=[ARCHITECTURE],
        draft_vocab_size=args.draft_vocab_size,
        target_hidden_size=args.target_dim,
        tie_word_embeddings=False,
        norm_before_residual=False,
        **{_TAP_IDS: vllm_aux_layer_ids(taps)},
        eagle_config={_TAP_IDS: list(taps), "use_aux_hidden_state": True},
    )
    return config


def _draft_args(hf_config: Mapping[str, Any], n_taps: int) -> DraftArgs:
    """``DraftArgs`` from an EAGLE-3 ``config.json``; unsupported variants are rejected."""
    classes = hf_config.get("architectures") or []
    if classes[:1] != [ARCHITECTURE]:
        raise HFCheckpointError(f"architectures is {classes!r}, expected [{ARCHITECTURE!r}] (an EAGLE-3 draft)")
    if hf_config.get("model_type", "llama") != "llama":
        raise HFCheckpointError(f"model_type {hf_config['model_type']!r} is not supported (only 'llama')")
    if hf_config.get("num_hidden_layers") != 1:
        raise HFCheckpointError(
            f"num_hidden_layers={hf_config.get('num_hidden_layers')!r}: only single-layer EAGLE-3 drafts are supported"
        )
    if hf_config.get("tie_word_embeddings"):
        raise HFCheckpointError("tie_word_embeddings=true is not supported: the draft's lm_head is its own")
    if hf_config.get("norm_before_residual"):
        raise HFCheckpointError(
            "norm_before_residual=true is not supported: the draft takes its residual before hidden_norm"
        )
    eagle_config = hf_config.get("eagle_config") or {}
    if not eagle_config.get("use_aux_hidden_state", True):
        raise HFCheckpointError("eagle_config.use_aux_hidden_state=false (a draft without fc) is not supported")

    # The shape keys are a Llama config's; its reader also rejects biases and unknown RoPE.
    llama = model_args_from_hf_config({**hf_config, "architectures": ["LlamaForCausalLM"]})
    # Both engines' defaults when absent: the target's vocab and the draft's own width.
    draft_vocab_size = hf_config.get("draft_vocab_size", llama.vocab_size)
    target_dim = hf_config.get("target_hidden_size", llama.dim)
    for key, value in (("draft_vocab_size", draft_vocab_size), ("target_hidden_size", target_dim)):
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise HFCheckpointError(f"{key} must be a positive int, got {value!r}")
    try:
        return DraftArgs(
            dim=llama.dim, target_dim=target_dim, n_taps=n_taps, n_heads=llama.n_heads, n_kv_heads=llama.n_kv_heads,
            head_dim=llama.head_dim, ffn_dim=llama.ffn_dim, vocab_size=llama.vocab_size,
            draft_vocab_size=draft_vocab_size, norm_eps=llama.norm_eps, rope_theta=llama.rope_theta,
            rope_scaling=llama.rope_scaling, max_seq_len=llama.max_seq_len,
        )
    except ValueError as e:
        raise HFCheckpointError(str(e)) from None


def _config_tap_layers(hf_config: Mapping[str, Any], given: Sequence[int] | None) -> tuple[int, ...]:
    """The tap layers (output-of-layer indices) from either convention in ``hf_config``, or ``given``."""
    eagle_config = hf_config.get("eagle_config") or {}
    if not isinstance(eagle_config, Mapping):
        raise HFCheckpointError(f"eagle_config must be an object, got {eagle_config!r}")
    sglang_ids = _int_list(eagle_config.get(_TAP_IDS), f"eagle_config.{_TAP_IDS}")
    vllm_ids = _int_list(hf_config.get(_TAP_IDS), _TAP_IDS)
    found = sglang_ids
    if vllm_ids is not None:
        # The inverse of vllm_aux_layer_ids.
        from_vllm = tuple(x - 1 for x in vllm_ids)
        if sglang_ids is not None and from_vllm != sglang_ids:
            raise HFCheckpointError(
                f"inconsistent tap layers: {_TAP_IDS}={list(vllm_ids)} (vLLM: the stream entering layer k) "
                f"names the outputs of layers {list(from_vllm)}, but eagle_config.{_TAP_IDS}={list(sglang_ids)} "
                "(SGLang: the output of layer k)"
            )
        found = from_vllm
    if given is not None:
        given = tuple(int(x) for x in given)
        if found is not None and given != found:
            raise HFCheckpointError(f"names tap layers {list(found)}, but tap_layers={list(given)} was passed")
        found = given
    if found is None:
        raise HFCheckpointError(
            f"names no tap layers ({_TAP_IDS} at the top level or in eagle_config): pass tap_layers; "
            "the EAGLE-3 default, taps.default_tap_layers(n_layers), depends on the target's depth"
        )
    problem = _tap_problem(found, len(found))
    if problem:
        raise HFCheckpointError(problem)
    return found


def _int_list(value: Any, key: str) -> tuple[int, ...] | None:
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(x, int) and not isinstance(x, bool) for x in value):
        raise HFCheckpointError(f"{key} must be a list of ints, got {value!r}")
    return tuple(value)


def _tap_problem(taps: tuple[int, ...], n_taps: int) -> str | None:
    """What is wrong with ``taps`` (output-of-layer indices) for a draft fusing ``n_taps``, if anything."""
    if len(taps) != n_taps or not taps:
        return f"fc fuses {n_taps} taps, but the tap layers are {list(taps)}"
    if taps[0] < 0 or list(taps) != sorted(set(taps)):
        return f"tap layers {list(taps)} must be distinct, increasing output-of-layer indices >= 0"
    return None


def _our_name(stored_name: str) -> str:
    if stored_name.startswith(_LAYER_LIST_PREFIX):
        return _MIDLAYER_PREFIX + stored_name.removeprefix(_LAYER_LIST_PREFIX)
    return stored_name


def _stored_shapes(folder: Path, files: Sequence[Path]) -> dict[str, tuple[int, ...]]:
    """Our tensor name -> stored shape across ``files``, from the headers alone."""
    shapes, stored_as = {}, {}
    for file in files:
        with _open(file) as f:
            for stored_name in f.keys():
                name = _our_name(stored_name)
                if name in shapes:
                    raise HFCheckpointError(f"{folder}: {stored_as[name]} and {stored_name} are the same tensor {name}")
                shapes[name], stored_as[name] = tuple(f.get_slice(stored_name).get_shape()), stored_name
    return shapes

