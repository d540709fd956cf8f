"""A Hugging Face policy folder written one tensor at a time: ``save_hf``'s one-file layout,
byte for byte, for weights that are read as they are written (from a DCP checkpoint, or an
engine's copy on the device).

``save_hf`` hands ``safetensors.torch.save_file`` every tensor at once, so its caller holds
the whole model on the host. The safetensors header needs only names, dtypes and shapes, so
``save_hf_streamed`` writes the header first and then appends each tensor as it is read;
the host holds one tensor (a stack of experts: one layer's three) beyond the caller's. The
file, as ``save_file`` lays it out::

    [u64, little-endian: n]
    [n bytes: compact JSON {"__metadata__": {...}, name: {"dtype", "shape", "data_offsets": [begin, end]},
     ...}, padded with spaces to a multiple of 8]
    [the tensors' bytes back to back, in the header's order: by dtype, safetensors' ``Dtype``
     order descending (I64 before F32 before BF16 before BOOL), then by name]

``tests/models/test_hf_stream.py`` holds both writers to ``save_file``'s and ``save_hf``'s bytes.
"""

from __future__ import annotations

import functools
import json
import struct
from collections.abc import Callable, Mapping
from pathlib import Path

import torch

from titan_cotrain.models.hf import (
    CONFIG_NAME,
    INDEX_NAME,
    WEIGHTS_NAME,
    PathLike,
    _EXPERT_PROJECTIONS,
    _hf_names,
    hf_config_from_model_args,
)
from titan_cotrain.models.transformer import Transformer

__all__ = ["save_hf_streamed", "write_safetensors"]

# torch dtype -> (safetensors name, rank in safetensors' Dtype enum: the file orders by it, descending).
_DTYPES = {
    torch.bool: ("BOOL", 0), torch.uint8: ("U8", 1), torch.int8: ("I8", 2), torch.int16: ("I16", 5),
    torch.float16: ("F16", 7), torch.bfloat16: ("BF16", 8), torch.int32: ("I32", 9), torch.float32: ("F32", 11),
    torch.float64: ("F64", 13), torch.int64: ("I64", 14),
}

# read(name): the whole tensor ``name``, on any device, in any dtype (the writer casts it).
Read = Callable[[str], torch.Tensor]


def write_safetensors(path: PathLike, specs: Mapping[str, tuple[torch.Size, torch.dtype]], read: Read,
                      metadata: Mapping[str, str] | None = None) -> None:
    """Write ``path`` as ``safetensors.torch.save_file`` would write ``{name: read(name)}``,
    calling ``read`` once per name, in the file's order, as each tensor is written.

    ``specs``: ``name -> (shape, dtype)``; each tensor read is cast to its ``dtype`` and must
    have its ``shape``. The header is written before any tensor is read."""
    order = sorted(specs, key=lambda name: (-_DTYPES[specs[name][1]][1], name))
    header, offset = {}, 0
    if metadata is not None:
        header["__metadata__"] = dict(metadata)
    for name in order:
        shape, dtype = specs[name]
        nbytes = shape.numel() * dtype.itemsize
        header[name] = {"dtype": _DTYPES[dtype][0], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    encoded = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    encoded += b" " * (-len(encoded) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(encoded)))
        f.write(encoded)
        for name in order:
            shape, dtype = specs[name]
            t = read(name)
            if t.shape != shape:
                raise ValueError(f"{name}: read a tensor of shape {list(t.shape)}, the header says {list(shape)}")
            t = t.detach().to("cpu", dtype).contiguous()
            if t.numel():
                f.write(t.reshape(-1).view(torch.uint8).numpy())
            del t  # before the next read: one tensor on the host at a time


def save_hf_streamed(model: Transformer, path: PathLike, read: Read) -> None:
    """``save_hf(model, path)`` with each tensor read when it is written: ``read(name)`` gives
    ``model``'s state-dict entry ``name`` whole (any device and dtype; written in the dtype
    of ``model``'s embedding). ``model`` gives the config, the dtype and the tensors' names
    and shapes only, so it may live on the meta device.

    A stack of experts ``[E, ...]`` becomes the hub's ``E`` tensors (``hf`` module docstring),
    which the file interleaves by name with the layer's other two stacks: the three stacks of
    one layer are read once each and held while that layer's experts are written."""
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    args = model.args
    dtype = model.embed_tokens.weight.dtype
    stacked = functools.lru_cache(maxsize=len(_EXPERT_PROJECTIONS))(read)
    specs, sources = {}, {}
    for name, t in model.state_dict().items():
        if args.tie_embeddings and name == "lm_head.weight":
            continue
        hf = _hf_names(name, t.shape)
        if isinstance(hf, list):
            for expert, expert_name in enumerate(hf):
                specs[expert_name] = (t.shape[1:], dtype)
                sources[expert_name] = functools.partial(lambda n, e: stacked(n)[e], name, expert)
        else:
            specs[hf] = (t.shape, dtype)
            sources[hf] = functools.partial(read, name)
    config = hf_config_from_model_args(args)
    config["torch_dtype"] = str(dtype).removeprefix("torch.")

    for stale in (*folder.glob("model-*-of-*.safetensors"), folder / INDEX_NAME):
        stale.unlink(missing_ok=True)
    (folder / CONFIG_NAME).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    write_safetensors(folder / WEIGHTS_NAME, specs, lambda hf: sources[hf](), metadata={"format": "pt"})
