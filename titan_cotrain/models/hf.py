"""Hugging Face checkpoint folders (``config.json`` + ``*.safetensors``) in and out of ``Transformer``.

Our parameter names are HF's minus the ``model.`` prefix (``lm_head`` sits outside it), so
weights map one to one and mostly only ``config.json`` needs translating. The exception is the
sparse layers of a Qwen3-MoE (``Qwen3MoeForCausalLM``), whose feed-forward is torchtitan's MoE:

    ours (layer i)                     the hub's
    mlp.router.gate.weight  [E, H]     mlp.gate.weight
    mlp.experts.w1  [E, I, H]          mlp.experts.{e}.gate_proj.weight  [I, H], e = 0 .. E-1
    mlp.experts.w3  [E, I, H]          mlp.experts.{e}.up_proj.weight    [I, H]
    mlp.experts.w2  [E, H, I]          mlp.experts.{e}.down_proj.weight  [H, I]

each of our expert stacks being the hub's ``E`` tensors stacked along a new first dimension
(transformers v5 fuses them differently in memory but reads and writes this layout). Weights
are read by our tensors, the experts of a stack one by one. Two config layouts exist:
transformers v4 keeps ``rope_theta`` / ``rope_scaling`` at the top level, v5 nests them in
``rope_parameters``. Both are read, and both are written, so transformers of either major
version (and the inference engines pinned to one) load what ``save_hf`` writes.

Whatever is wrong with a folder surfaces as one ``HFCheckpointError`` naming the file and
the problem; every missing, unexpected and mis-shaped tensor is listed in the same error.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from huggingface_hub import split_torch_state_dict_into_shards
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from titan_cotrain.models.args import ModelArgs, RopeScaling
from titan_cotrain.models.transformer import Transformer, rope_inv_freq

__all__ = [
    "HFCheckpointError",
    "hf_config_from_model_args",
    "load_hf",
    "load_hf_weights_",
    "model_args_from_hf_config",
    "save_hf",
]

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"

# (our architecture, mixture of experts) -> (HF ``architectures[0]``, HF ``model_type``).
_HF_NAMES = {
    ("llama3", False): ("LlamaForCausalLM", "llama"),
    ("qwen3", False): ("Qwen3ForCausalLM", "qwen3"),
    ("qwen3", True): ("Qwen3MoeForCausalLM", "qwen3_moe"),
}
# The hub's projection in each expert for a stack of torchtitan's ``GroupedExperts``.
_EXPERT_PROJECTIONS = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
# What transformers assumes when a config names no RoPE base.
_HF_DEFAULT_ROPE_THETA = 10000.0
# Longest list of tensor names one error message spells out.
_MAX_LISTED = 8

PathLike = str | os.PathLike


class HFCheckpointError(ValueError):
    """A Hugging Face checkpoint folder that cannot be loaded; the message names the file and why."""


def model_args_from_hf_config(hf_config: Mapping[str, Any]) -> ModelArgs:
    """``ModelArgs`` for a parsed HF ``config.json`` of a Llama-3, Qwen-3 or Qwen3-MoE causal LM.

    Features our decoder does not implement (biases, sliding windows, partial rotary, RoPE
    types other than ``default`` and ``llama3``) are rejected with ``HFCheckpointError``
    rather than loaded into a model that would compute something else.
    """
    architecture, moe = _architecture(hf_config)
    for key in ("attention_bias", "mlp_bias"):
        if hf_config.get(key):
            raise HFCheckpointError(f"{key}=true is not supported: the decoder's projections have no bias")
    if hf_config.get("hidden_act", "silu") != "silu":
        raise HFCheckpointError(f"hidden_act={hf_config['hidden_act']!r} is not supported (only 'silu')")
    if hf_config.get("use_sliding_window") or any(t != "full_attention" for t in hf_config.get("layer_types") or ()):
        raise HFCheckpointError("sliding-window attention is not supported (only full attention)")

    dim = _positive(hf_config, "hidden_size", int)
    n_heads = _positive(hf_config, "num_attention_heads", int)
    max_seq_len = _positive(hf_config, "max_position_embeddings", int)
    rope_theta, rope_scaling = _rope(hf_config, max_seq_len)
    try:
        return ModelArgs(
            architecture=architecture,
            dim=dim,
            n_layers=_positive(hf_config, "num_hidden_layers", int),
            n_heads=n_heads,
            n_kv_heads=_positive(hf_config, "num_key_value_heads", int, default=n_heads),
            head_dim=_positive(hf_config, "head_dim", int, default=dim // n_heads),
            ffn_dim=_positive(hf_config, "intermediate_size", int),
            vocab_size=_positive(hf_config, "vocab_size", int),
            norm_eps=_positive(hf_config, "rms_norm_eps", float),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            qk_norm=architecture == "qwen3",
            tie_embeddings=bool(hf_config.get("tie_word_embeddings", False)),
            max_seq_len=max_seq_len,
            **(_moe_args(hf_config) if moe else {}),
        )
    except ValueError as e:
        raise HFCheckpointError(str(e)) from None


def _moe_args(hf_config: Mapping[str, Any]) -> dict[str, Any]:
    """The ``ModelArgs`` mixture-of-experts fields of a Qwen3-MoE config (transformers v5 writes
    ``num_experts`` as ``num_local_experts``), with transformers' defaults where it has them."""
    mlp_only_layers = hf_config.get("mlp_only_layers") or []
    if not (isinstance(mlp_only_layers, list) and all(isinstance(i, int) for i in mlp_only_layers)):
        raise HFCheckpointError(f"mlp_only_layers must be a list of layer indices, got {mlp_only_layers!r}")
    return dict(
        n_experts=_positive(hf_config, "num_experts", int, default=hf_config.get("num_local_experts")),
        top_k=_positive(hf_config, "num_experts_per_tok", int),
        moe_inter_dim=_positive(hf_config, "moe_intermediate_size", int),
        norm_topk_prob=bool(hf_config.get("norm_topk_prob", False)),
        decoder_sparse_step=_positive(hf_config, "decoder_sparse_step", int, default=1),
        mlp_only_layers=tuple(mlp_only_layers),
    )


def hf_config_from_model_args(args: ModelArgs) -> dict[str, Any]:
    """The HF ``config.json`` contents for ``args`` (all but ``torch_dtype``, which belongs to
    the weights); ``model_args_from_hf_config`` inverts it exactly.

    RoPE is written twice, as v4's top-level ``rope_theta`` / ``rope_scaling`` and as v5's
    ``rope_parameters``; v5 gives ``rope_scaling`` precedence, and the two agree.
    """
    hf_architecture, model_type = _HF_NAMES[args.architecture, args.n_experts > 0]
    if args.qk_norm != (args.architecture == "qwen3"):
        raise ValueError(
            f"{args.architecture} with qk_norm={args.qk_norm} has no Hugging Face equivalent "
            "(Qwen3 always normalises q and k, Llama never does)"
        )
    if args.rope_scaling is None:
        rope_scaling = None
        rope_parameters = {"rope_type": "default", "rope_theta": args.rope_theta}
    else:
        rope_scaling = {"rope_type": "llama3", **dataclasses.asdict(args.rope_scaling)}
        rope_parameters = {**rope_scaling, "rope_theta": args.rope_theta}
    config = {
        "architectures": [hf_architecture],
        "model_type": model_type,
        "hidden_size": args.dim,
        "intermediate_size": args.ffn_dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_kv_heads,
        "head_dim": args.head_dim,
        "vocab_size": args.vocab_size,
        "rms_norm_eps": args.norm_eps,
        "max_position_embeddings": args.max_seq_len,
        "tie_word_embeddings": args.tie_embeddings,
        "hidden_act": "silu",
        "attention_bias": False,
        "rope_theta": args.rope_theta,
        "rope_scaling": rope_scaling,
        "rope_parameters": rope_parameters,
    }
    if args.architecture == "llama3":
        config["mlp_bias"] = False
    if args.n_experts:
        config.update(
            num_experts=args.n_experts, num_experts_per_tok=args.top_k, moe_intermediate_size=args.moe_inter_dim,
            norm_topk_prob=args.norm_topk_prob, decoder_sparse_step=args.decoder_sparse_step,
            mlp_only_layers=list(args.mlp_only_layers),
        )
    return config


def read_hf_model_args(path: PathLike) -> ModelArgs:
    """The ``ModelArgs`` of an HF folder, from its ``config.json`` alone (no weights read)."""
    folder = Path(path)
    if not folder.is_dir():
        raise HFCheckpointError(f"{folder}: no such directory")
    config_path = folder / CONFIG_NAME
    try:
        return model_args_from_hf_config(_read_json(config_path))
    except HFCheckpointError as e:
        if str(e).startswith(str(config_path)):
            raise
        raise HFCheckpointError(f"{config_path}: {e}") from None


def load_hf(
    path: PathLike,
    dtype: torch.dtype = torch.float32,
    tap_layers: Sequence[int] | None = None,
    device: str | torch.device = "cpu",
) -> Transformer:
    """Load an HF folder (``model.safetensors``, or shards + ``model.safetensors.index.json``).

    The model is built on the meta device and never initialised; each of its tensors is
    read, cast to ``dtype`` and moved to ``device`` on its own, so peak host memory is one
    tensor (with a stack of experts, twice one) beyond what ``device`` ends up holding. All
    tensor names and shapes are checked against ``config.json`` before any weight is read.
    ``tap_layers`` as in ``Transformer``.
    """
    folder = Path(path)
    args = read_hf_model_args(folder)
    device = torch.device(device)
    with torch.device("meta"):
        model = Transformer(args, tap_layers)
    state = {}
    with _open_weights(folder, model) as readers:
        for name, read in readers.items():
            whole = tuple(slice(None) for _ in model.get_parameter(name).shape)
            state[name] = read(whole).to(device=device, dtype=dtype)
    if args.tie_embeddings:
        state["lm_head.weight"] = state["embed_tokens.weight"]
    model.load_state_dict(state, strict=True, assign=True)
    if args.tie_embeddings:
        # assign=True wraps each entry in a Parameter of its own; share one again.
        model.lm_head.weight = model.embed_tokens.weight
    # Non-persistent, so still on meta: compute RoPE (fp32, like HF) where the weights
    # landed; start a mixture of experts' per-expert token tallies (torchtitan's) at zero.
    model.rope_inv_freq = rope_inv_freq(args.head_dim, args.rope_theta, args.rope_scaling).to(device)
    for module in model.modules():
        for name, buffer in module.named_buffers(recurse=False):
            if buffer.is_meta:
                setattr(module, name, torch.zeros_like(buffer, device=device))
    return model


def load_hf_weights_(model: Transformer, path: PathLike, fill) -> None:
    """Fill ``model``'s (possibly sharded) parameters from the HF folder ``path``, reading
    only what each parameter needs: ``fill(param, read)`` calls ``read(index)`` with the
    index of this rank's slice, which is read from the safetensors file as a slice (of each
    expert it covers, for a stack of experts: a rank holding rows of ``w1`` reads only those
    experts' ``gate_proj``). Names and shapes are checked against the model before any
    weight is read."""
    with _open_weights(Path(path), model) as readers:
        for name, read in readers.items():
            fill(model.get_parameter(name), read)
    model.rope_inv_freq.copy_(rope_inv_freq(model.args.head_dim, model.args.rope_theta, model.args.rope_scaling))


def save_hf(model: Transformer, path: PathLike, max_shard_bytes: int | None = None,
            state: Mapping[str, torch.Tensor] | None = None) -> None:
    """Write ``model`` as an HF folder that ``load_hf`` and transformers both load.

    ``config.json`` plus ``model.safetensors``; with ``max_shard_bytes``, a model that does not
    fit is split into ``model-0000i-of-0000n.safetensors`` shards of at most that many bytes
    (a larger tensor gets a shard to itself) plus ``model.safetensors.index.json``, as
    ``huggingface_hub.split_torch_state_dict_into_shards`` lays them out. Tensors keep the
    model's dtype and are written contiguous from CPU, one shard's worth copied to CPU at a
    time; a tied ``lm_head`` is left out, as HF re-ties it from ``tie_word_embeddings``. Weight
    files of an earlier save in ``path`` are removed first, so a stale index can never shadow
    the new weights. ``state``: the whole tensors to write instead of ``model.state_dict()``
    (a tensor-parallel copy's, gathered).
    """
    if max_shard_bytes is not None and max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    args = model.args
    tensors = {}
    for name, t in (model.state_dict() if state is None else state).items():
        if args.tie_embeddings and name == "lm_head.weight":
            continue
        hf = _hf_names(name, t.shape)
        tensors.update(zip(hf, t.detach().unbind(0)) if isinstance(hf, list) else {hf: t.detach()})
    config = hf_config_from_model_args(args)
    config["torch_dtype"] = str(model.embed_tokens.weight.dtype).removeprefix("torch.")

    for stale in (*folder.glob("model-*-of-*.safetensors"), folder / WEIGHTS_NAME, folder / INDEX_NAME):
        stale.unlink(missing_ok=True)
    (folder / CONFIG_NAME).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    # The split reads only sizes: meta stand-ins give each tensor's own bytes (a view's
    # storage could be larger) and are never mistaken for tensors sharing a storage.
    shapes = {name: torch.empty(t.shape, dtype=t.dtype, device="meta") for name, t in tensors.items()}
    whole = sum(t.nbytes for t in shapes.values())  # without max_shard_bytes: one file
    split = split_torch_state_dict_into_shards(
        shapes, max_shard_size=whole if max_shard_bytes is None else max_shard_bytes)
    for file, names in split.filename_to_tensors.items():
        shard = {name: tensors[name].to("cpu").contiguous() for name in names}
        save_file(shard, folder / file, metadata={"format": "pt"})
        del shard  # before the next shard's copies: one shard on the host at a time
    if split.is_sharded:
        index = {"metadata": split.metadata, "weight_map": split.tensor_to_filename}
        (folder / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")


def _architecture(hf_config: Mapping[str, Any]) -> tuple[str, bool]:
    """``(our architecture name, mixture of experts)`` from ``architectures[0]``, else from
    ``model_type``."""
    by_class = {hf: ours for ours, (hf, _) in _HF_NAMES.items()}
    by_type = {model_type: ours for ours, (_, model_type) in _HF_NAMES.items()}
    classes = hf_config.get("architectures") or []
    if classes:
        found = by_class.get(classes[0])
    else:
        found = by_type.get(hf_config.get("model_type"))
    if found is None:
        name = f"architecture {classes[0]!r}" if classes else f"model_type {hf_config.get('model_type')!r}"
        raise HFCheckpointError(
            f"unsupported {name}; known architectures: {', '.join(by_class)} (model_type {', '.join(by_type)})"
        )
    return found


def _positive(hf_config: Mapping[str, Any], key: str, kind: type, default: Any = None) -> Any:
    """``hf_config[key]`` (``default`` when absent or null) as a positive ``kind``."""
    value = hf_config.get(key)
    if value is None:
        value = default
    if value is None:
        raise HFCheckpointError(f"missing required key {key!r}")
    allowed = (int,) if kind is int else (int, float)
    if isinstance(value, bool) or not isinstance(value, allowed) or value <= 0:
        raise HFCheckpointError(f"{key} must be a positive {kind.__name__}, got {value!r}")
    return kind(value)


def _rope(hf_config: Mapping[str, Any], max_seq_len: int) -> tuple[float, RopeScaling | None]:
    """``(rope_theta, rope_scaling)`` from either config layout, with v5's precedence:
    ``rope_scaling``, then ``rope_parameters``, then top-level keys, then HF's defaults."""
    params = hf_config.get("rope_scaling") or hf_config.get("rope_parameters") or {}
    if not isinstance(params, Mapping):
        raise HFCheckpointError(f"rope parameters must be an object, got {params!r}")
    merged = {"rope_theta": hf_config.get("rope_theta", _HF_DEFAULT_ROPE_THETA), **params}
    theta = _positive(merged, "rope_theta", float)
    if merged.get("partial_rotary_factor", hf_config.get("partial_rotary_factor", 1.0)) != 1.0:
        raise HFCheckpointError("partial_rotary_factor != 1 is not supported (RoPE covers the whole head)")
    rope_type = merged.get("rope_type", merged.get("type", "default"))
    if rope_type == "default":
        return theta, None
    if rope_type != "llama3":
        raise HFCheckpointError(f"rope_type {rope_type!r} is not supported (only 'default' and 'llama3')")
    try:
        scaling = RopeScaling(
            factor=_positive(merged, "factor", float),
            low_freq_factor=_positive(merged, "low_freq_factor", float),
            high_freq_factor=_positive(merged, "high_freq_factor", float),
            original_max_position_embeddings=_positive(
                merged, "original_max_position_embeddings", int, default=max_seq_len
            ),
        )
    except HFCheckpointError as e:
        raise HFCheckpointError(f"llama3 rope scaling: {e}") from None
    return theta, scaling


def _hf_name(name: str) -> str:
    """Our parameter name -> the checkpoint's: everything but ``lm_head`` lives under ``model.``."""
    return name if name.startswith("lm_head.") else f"model.{name}"


def _hf_names(name: str, shape: Sequence[int]) -> str | list[str]:
    """Our tensor ``name`` of ``shape`` -> the checkpoint's: one tensor of the same shape, or
    for a stack of experts ``[E, ...]`` the list of its ``E`` tensors ``[...]`` in expert order
    (module docstring)."""
    layer, _, in_mlp = name.partition(".mlp.")
    if in_mlp == "router.gate.weight":
        return f"model.{layer}.mlp.gate.weight"
    if in_mlp.startswith("experts."):
        projection = _EXPERT_PROJECTIONS[in_mlp.removeprefix("experts.")]
        return [f"model.{layer}.mlp.experts.{e}.{projection}.weight" for e in range(shape[0])]
    return _hf_name(name)


# read(index): the part ``index`` (a tuple of slices) of one of our whole tensors.
Reader = Callable[[tuple[slice, ...]], torch.Tensor]


@contextlib.contextmanager
def _open_weights(folder: Path, model: Transformer) -> Iterator[dict[str, Reader]]:
    """Check ``folder``'s tensors against ``model``'s, then open its weight files and yield a
    reader for each parameter of ``model`` (our names; a tied head is the embedding, not read):
    ``read(index)`` returns the part ``index`` (a tuple of slices) of the whole tensor, reading
    only that part from the files."""
    layout = {name: _hf_names(name, p.shape) for name, p in model.named_parameters()}
    expected, tolerated = {}, set()
    for name, hf in layout.items():
        shape = tuple(model.get_parameter(name).shape)
        expected.update(dict.fromkeys(hf, shape[1:]) if isinstance(hf, list) else {hf: shape})
    if model.args.tie_embeddings:
        # HF leaves lm_head.weight out, though some exporters write it anyway.
        tolerated = {"lm_head.weight"}
    files = _weight_files(folder)
    stored = _stored_shapes(files)
    _check_tensors(folder, {hf: shape for hf, (_, shape) in stored.items()}, expected, tolerated)
    with contextlib.ExitStack() as stack:
        handles = {file: stack.enter_context(_open(file)) for file in files}

        def part(hf: str, index: tuple[slice, ...]) -> torch.Tensor:
            return handles[stored[hf][0]].get_slice(hf)[index]

        def reader(hf: str | list[str]) -> Reader:
            if isinstance(hf, list):
                return lambda index: torch.stack([part(expert, index[1:]) for expert in hf[index[0]]])
            return lambda index: part(hf, index)

        yield {name: reader(hf) for name, hf in layout.items()}


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise HFCheckpointError(f"{path}: no such file")
    try:
        value = json.loads(path.read_bytes())
    except ValueError as e:  # JSONDecodeError and UnicodeDecodeError both
        raise HFCheckpointError(f"{path}: malformed JSON ({e})") from None
    if not isinstance(value, dict):
        raise HFCheckpointError(f"{path}: expected a JSON object, got {type(value).__name__}")
    return value


def write_single_file_folder(path: PathLike, hf_config: Mapping[str, Any], tensors: Mapping[str, torch.Tensor]) -> None:
    """A draft folder: ``config.json`` and every tensor in one ``model.safetensors``. The
    index and shards of an earlier save are removed first: a stale index would shadow the new
    weights for any Hugging Face style loader."""
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    for stale in (folder / INDEX_NAME, *folder.glob("model-*-of-*.safetensors")):
        stale.unlink(missing_ok=True)
    (folder / CONFIG_NAME).write_text(json.dumps(hf_config, indent=2, sort_keys=True) + "\n")
    save_file(dict(tensors), folder / WEIGHTS_NAME, metadata={"format": "pt"})


def _weight_files(folder: Path) -> list[Path]:
    """The safetensors files holding the weights: the index's shards, else the single file."""
    index_path = folder / INDEX_NAME
    if index_path.exists():
        weight_map = _read_json(index_path).get("weight_map")
        if not (isinstance(weight_map, dict) and weight_map and all(isinstance(f, str) for f in weight_map.values())):
            raise HFCheckpointError(f"{index_path}: needs a non-empty 'weight_map' of tensor name -> shard file")
        names = sorted(set(weight_map.values()))
        missing = [name for name in names if not (folder / name).is_file()]
        if missing:
            raise HFCheckpointError(f"{index_path}: names shard files missing from the folder: {', '.join(missing)}")
        return [folder / name for name in names]
    if (folder / WEIGHTS_NAME).is_file():
        return [folder / WEIGHTS_NAME]
    raise HFCheckpointError(
        f"{folder}: no safetensors weights (expected {WEIGHTS_NAME} or {INDEX_NAME}; "
        "only safetensors checkpoints are supported)"
    )


def _open(file: Path):
    try:
        return safe_open(file, framework="pt", device="cpu")
    except (SafetensorError, OSError) as e:
        raise HFCheckpointError(f"{file}: not a readable safetensors file ({e})") from None


def _stored_shapes(files: Sequence[Path]) -> dict[str, tuple[Path, tuple[int, ...]]]:
    """Tensor name -> (its file, its shape) across ``files``, read from the headers alone."""
    shapes = {}
    for file in files:
        with _open(file) as f:
            for name in f.keys():
                shapes[name] = (file, tuple(f.get_slice(name).get_shape()))
    return shapes


def _check_tensors(
    folder: Path, stored: dict[str, tuple[int, ...]], expected: dict[str, tuple[int, ...]], tolerated: set[str]
) -> None:
    """Raise one error listing every missing, unexpected (and not ``tolerated``) and mis-shaped tensor."""
    problems = [
        _listed("missing tensors", sorted(expected.keys() - stored.keys())),
        _listed("unexpected tensors", sorted(stored.keys() - expected.keys() - tolerated)),
        _listed(
            "wrong shapes",
            [
                f"{name} is {list(stored[name])} in the file, config.json implies {list(shape)}"
                for name, shape in expected.items()
                if name in stored and stored[name] != shape
            ],
        ),
    ]
    problems = [p for p in problems if p]
    if problems:
        raise HFCheckpointError(f"{folder}: weights do not match config.json:\n  " + "\n  ".join(problems))


def _listed(what: str, items: list[str]) -> str:
    if not items:
        return ""
    more = f", ... ({len(items) - _MAX_LISTED} more)" if len(items) > _MAX_LISTED else ""
    return f"{what} ({len(items)}): {', '.join(items[:_MAX_LISTED])}{more}"
