"""The streamed writers write what ``safetensors.torch.save_file`` and ``save_hf`` write, byte
for byte, reading each tensor once, as it is written."""

import pytest
import torch
from safetensors.torch import save_file

from titan_cotrain.models import Transformer, model_args_for, save_hf
from titan_cotrain.models.hf_stream import save_hf_streamed, write_safetensors


def _files(folder):
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


@pytest.mark.parametrize("metadata", [None, {"format": "pt"}])
def test_write_safetensors_is_save_file(tmp_path, metadata):
    g = torch.Generator().manual_seed(0)
    tensors = {
        "b.weight": torch.randn(3, 5, generator=g), "a.weight": torch.randn(7, generator=g).bfloat16(),
        "d2t": torch.arange(6), "t2d": torch.rand(9, generator=g) > 0.5, "scalar": torch.tensor(1.5),
        "empty": torch.zeros(0, 4), "half": torch.randn(2, 2, generator=g).half(), "ids": torch.arange(3).int(),
    }
    save_file(tensors, tmp_path / "reference.safetensors", metadata=metadata)
    reads = []

    def read(name):
        reads.append(name)
        return tensors[name]

    write_safetensors(tmp_path / "streamed.safetensors", {n: (t.shape, t.dtype) for n, t in tensors.items()}, read,
                      metadata)
    assert (tmp_path / "streamed.safetensors").read_bytes() == (tmp_path / "reference.safetensors").read_bytes()
    assert sorted(reads) == sorted(tensors)  # each once


@pytest.mark.parametrize("architecture, flavor, dtype", [
    ("llama3", "debugmodel", torch.float32), ("llama3", "debugmodel", torch.bfloat16),
    ("qwen3", "debugmodel", torch.float32), ("qwen3", "debugmoe", torch.bfloat16)],
    ids=["llama3", "llama3-bf16", "qwen3-tied", "qwen3-moe-bf16"])
def test_save_hf_streamed_is_save_hf(tmp_path, architecture, flavor, dtype):
    model = Transformer(model_args_for(architecture, flavor).replace(n_layers=4), tap_layers=(0, 1, 2))
    model.init_weights(std=0.1, generator=torch.Generator().manual_seed(0))
    model.to(dtype)
    save_hf(model, tmp_path / "reference")
    state = model.state_dict()
    reads = []

    def read(name):
        reads.append(name)
        return state[name].float()  # cast back by the writer

    with torch.device("meta"):
        shapes_only = Transformer(model.args, tap_layers=(0, 1, 2)).to(dtype)
    save_hf_streamed(shapes_only, tmp_path / "streamed", read)
    assert _files(tmp_path / "streamed") == _files(tmp_path / "reference")
    assert len(reads) == len(set(reads))  # every tensor, an expert stack too, read once
