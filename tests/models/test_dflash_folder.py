"""Block drafter folders in the DFlash layout: what SGLang's loader reads (architecture,
dflash_config, weight names without embedding or head), read back into the same function,
the mask token taken from the target's embedding for folders trained elsewhere, and clear
errors for bad folders."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from titan_cotrain.models.args import model_args_for
from titan_cotrain.models.block_draft import BlockDraftArgs, BlockDrafter
from titan_cotrain.models.dflash import load_dflash, save_dflash
from titan_cotrain.models.hf import HFCheckpointError


def _drafter():
    target = model_args_for("qwen3", "debugmodel").replace(vocab_size=64)
    drafter = BlockDrafter(BlockDraftArgs.from_target(target, n_layers=2, block_size=4))
    drafter.init_weights(std=0.2, generator=torch.Generator().manual_seed(0))
    return drafter, target


def _blocks(drafter, seed=1):
    g = torch.Generator().manual_seed(seed)
    t, args = 12, drafter.args
    features = torch.randn(t, args.n_ctx * args.dim, generator=g)
    embeddings = torch.randn(2, args.dim, generator=g)
    with torch.no_grad():
        return drafter(features, torch.arange(t), embeddings, torch.tensor([5, 11]), torch.tensor([0, 6]),
                       torch.tensor([5, 11]))


def test_a_saved_folder_is_what_sglang_reads_and_loads_back_to_the_same_function(tmp_path):
    drafter, target = _drafter()
    save_dflash(drafter, tmp_path, n_target_layers=target.n_layers, mask_token_id=63)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"]
    assert config["dflash_config"] == {"block_size": 4, "target_layer_ids": list(drafter.args.target_layer_ids),
                                       "num_target_layers": target.n_layers, "mask_token_id": 63}
    assert (config["num_hidden_layers"], config["hidden_size"], config["block_size"]) == (2, target.dim, 4)
    names = set(load_file(tmp_path / "model.safetensors"))
    assert {"fc.weight", "hidden_norm.weight", "norm.weight", "layers.1.self_attn.k_norm.weight",
            "layers.0.mlp.gate_proj.weight", "mask_embedding"} <= names
    assert not any("embed_tokens" in n or "lm_head" in n for n in names)
    loaded = load_dflash(tmp_path)
    assert loaded.args == drafter.args
    assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), drafter.state_dict().values()))
    assert torch.equal(_blocks(loaded), _blocks(drafter))


def test_a_folder_without_the_mask_embedding_takes_the_targets_row(tmp_path):
    drafter, target = _drafter()
    save_dflash(drafter, tmp_path, n_target_layers=target.n_layers, mask_token_id=7)
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["mask_embedding"]
    save_file(tensors | {"layers.0.self_attn.rotary_emb.inv_freq": torch.ones(4)}, tmp_path / "model.safetensors")
    embedding = torch.randn(64, target.dim)
    loaded = load_dflash(tmp_path, target_embedding=embedding)
    assert torch.equal(loaded.mask_embedding, embedding[7])
    with pytest.raises(HFCheckpointError, match="no mask_embedding tensor"):
        load_dflash(tmp_path)


def test_bad_folders_are_refused_naming_the_file(tmp_path):
    drafter, target = _drafter()
    with pytest.raises(ValueError, match="do not fit a 2-layer target"):
        save_dflash(drafter, tmp_path, n_target_layers=2)
    save_dflash(drafter, tmp_path, n_target_layers=target.n_layers)
    config_path = tmp_path / "config.json"
    config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps(config | {"architectures": ["LlamaForCausalLMEagle3"]}))
    with pytest.raises(HFCheckpointError, match="config.json: architectures must include 'DFlashDraftModel'"):
        load_dflash(tmp_path)
    config["dflash_config"].pop("target_layer_ids")
    config_path.write_text(json.dumps(config))
    with pytest.raises(HFCheckpointError, match="target_layer_ids must be a non-empty list"):
        load_dflash(tmp_path)
