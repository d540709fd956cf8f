"""The HF adapter against transformers itself: tiny random checkpoints built in ``tmp_path``.

Logits are compared in fp32 with ``atol = rtol = 1e-5`` (the same kernels run on both
sides; observed differences are 0). Weights are initialised with std 0.1, not HF's 0.02, so
attention is peaked enough that a RoPE error moves logits by ~1, far above the tolerance.
Qwen3-MoE logits are compared at ``1e-4``: the experts' outputs are mixed in another order
(torchtitan: a batched matmul of the top-k scores; transformers: ``index_add_`` per expert);
observed differences are 0 on CPU.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from titan_cotrain.models import (
    HFCheckpointError,
    ModelArgs,
    RopeScaling,
    Transformer,
    hf_config_from_model_args,
    load_hf,
    model_args_for,
    model_args_from_hf_config,
    save_hf,
)
from titan_cotrain.models.args import ARCHITECTURES, flavors
from titan_cotrain.models.hf import load_hf_weights_
from tests.models.errors import assert_one_clear_error

os.environ["HF_HUB_OFFLINE"] = "1"  # nothing here may reach the Hub
transformers = pytest.importorskip("transformers")

TOL = dict(atol=1e-5, rtol=1e-5)
MOE_TOL = dict(atol=1e-4, rtol=1e-4)
VOCAB = 128
# Llama-3.1 scaling with a pretraining context of 32, so positions up to 160 reach well
# past it and every band (kept, interpolated, divided) of frequencies is in play.
LLAMA31_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}


def _llama_config(**overrides):
    return transformers.LlamaConfig(
        hidden_size=64, intermediate_size=96, num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=VOCAB, max_position_embeddings=256, rms_norm_eps=1e-5, initializer_range=0.1,
        rope_parameters=dict(LLAMA31_ROPE), **overrides,
    )


def _qwen3_config(tied: bool):
    # head_dim 32 != hidden / heads: Qwen3 names it explicitly.
    return transformers.Qwen3Config(
        hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        head_dim=32, vocab_size=VOCAB, max_position_embeddings=256, rms_norm_eps=1e-6, initializer_range=0.1,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6}, tie_word_embeddings=tied,
    )


def _qwen3_moe_config(tied: bool, norm_topk_prob: bool = True):
    # decoder_sparse_step 2 makes layers 1, 3, 5 sparse; mlp_only_layers takes 3 back: layers
    # 0, 2, 3, 4 keep the dense intermediate_size MLP, so both of HF's rules are in play.
    return transformers.Qwen3MoeConfig(
        hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=6, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, vocab_size=VOCAB, max_position_embeddings=256, rms_norm_eps=1e-6,
        initializer_range=0.1, rope_parameters={"rope_type": "default", "rope_theta": 1e6}, tie_word_embeddings=tied,
        num_experts=8, num_experts_per_tok=2, norm_topk_prob=norm_topk_prob, decoder_sparse_step=2,
        mlp_only_layers=[3],
    )


def _save_transformers_model(config, folder, sharded: bool):
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    model.save_pretrained(folder, safe_serialization=True, **({"max_shard_size": 40_000} if sharded else {}))
    return model


def _tokens(seq_len: int = 160) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, seq_len), generator=torch.Generator().manual_seed(1))


@torch.no_grad()
def _logits(model, tokens: torch.Tensor) -> torch.Tensor:
    out = model(tokens)
    return out.logits if hasattr(out, "logits") else out


def _assert_materialised(model: Transformer) -> None:
    assert not any(t.is_meta for t in (*model.parameters(), *model.buffers()))
    assert all(p.requires_grad for p in model.parameters())
    assert model.rope_inv_freq.dtype == torch.float32


@pytest.mark.parametrize("sharded", [False, True], ids=["single", "sharded"])
def test_llama31_gqa_matches_transformers(tmp_path, sharded):
    hf = _save_transformers_model(_llama_config(), tmp_path, sharded)
    assert (tmp_path / "model.safetensors.index.json").exists() == sharded

    model = load_hf(tmp_path)

    assert model.args.rope_scaling == RopeScaling(8.0, 1.0, 4.0, 32)
    assert (model.args.n_heads, model.args.n_kv_heads, model.tap_layers) == (4, 2, (1, 3, 4))
    _assert_materialised(model)
    tokens = _tokens()
    expected = _logits(hf, tokens)
    torch.testing.assert_close(_logits(model, tokens), expected, **TOL)
    # The comparison has teeth: without the Llama-3.1 scaling the logits are far off.
    unscaled = Transformer(model.args.replace(rope_scaling=None))
    unscaled.load_state_dict(model.state_dict())
    assert (_logits(unscaled, tokens) - expected).abs().max() > 0.1


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_qwen3_qk_norm_matches_transformers(tmp_path, tied):
    hf = _save_transformers_model(_qwen3_config(tied), tmp_path, sharded=False)
    assert ("lm_head.weight" in load_file(tmp_path / "model.safetensors")) != tied

    model = load_hf(tmp_path, tap_layers=(0, 2))

    assert model.args.qk_norm and model.args.head_dim == 32 and model.args.tie_embeddings == tied
    assert (model.lm_head.weight is model.embed_tokens.weight) == tied
    _assert_materialised(model)
    tokens = _tokens()
    torch.testing.assert_close(_logits(model, tokens), _logits(hf, tokens), **TOL)


@pytest.mark.parametrize(
    "tied, norm_topk_prob, sharded", [(True, True, True), (False, True, False), (False, False, True)],
    ids=["tied-sharded", "untied", "unnormalised-sharded"],
)
def test_qwen3_moe_matches_transformers(tmp_path, tied, norm_topk_prob, sharded):
    hf = _save_transformers_model(_qwen3_moe_config(tied, norm_topk_prob), tmp_path, sharded)

    model = load_hf(tmp_path, tap_layers=(0, 2))

    a = model.args
    assert (a.n_experts, a.top_k, a.moe_inter_dim, a.norm_topk_prob) == (8, 2, 32, norm_topk_prob)
    assert (a.decoder_sparse_step, a.mlp_only_layers, a.ffn_dim, a.tie_embeddings) == (2, (3,), 96, tied)
    assert [layer.sparse for layer in model.layers] == [False, True, False, False, False, True]
    _assert_materialised(model)
    tokens = _tokens()
    expected = _logits(hf, tokens)
    torch.testing.assert_close(_logits(model, tokens), expected, **MOE_TOL)
    # The comparison has teeth: the other renormalisation of the top-k scores is far off.
    other = Transformer(a.replace(norm_topk_prob=not norm_topk_prob), tap_layers=(0, 2))
    other.load_state_dict(model.state_dict())
    assert (_logits(other, tokens) - expected).abs().max() > 0.1


@pytest.mark.parametrize(
    "make_config, sharded",
    [(_llama_config, True), (lambda: _qwen3_config(tied=True), True), (lambda: _qwen3_config(tied=False), False),
     (lambda: _qwen3_moe_config(tied=True), True), (lambda: _qwen3_moe_config(tied=False), False)],
    ids=["llama31-sharded", "qwen3-tied-sharded", "qwen3-untied", "qwen3-moe-tied-sharded", "qwen3-moe-untied"],
)
def test_save_hf_round_trip_and_loads_in_transformers(tmp_path, make_config, sharded):
    _save_transformers_model(make_config(), tmp_path / "hf", sharded=False)
    model = load_hf(tmp_path / "hf", tap_layers=(0,))

    save_hf(model, tmp_path / "ours", max_shard_bytes=40_000 if sharded else None)

    written = sorted(p.name for p in (tmp_path / "ours").iterdir())
    if sharded:
        index = json.loads((tmp_path / "ours" / "model.safetensors.index.json").read_text())
        assert len(set(index["weight_map"].values())) > 1
        assert set(index["weight_map"].values()) | {"config.json", "model.safetensors.index.json"} == set(written)
    else:
        assert written == ["config.json", "model.safetensors"]
    reloaded = load_hf(tmp_path / "ours", tap_layers=(0,))
    assert reloaded.args == model.args
    assert reloaded.state_dict().keys() == model.state_dict().keys()
    for name, t in model.state_dict().items():
        assert torch.equal(reloaded.state_dict()[name], t), name
    tokens = _tokens()
    ours = _logits(model, tokens)
    torch.testing.assert_close(_logits(reloaded, tokens), ours, atol=0, rtol=0)
    from_ours = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ours").eval()
    torch.testing.assert_close(_logits(from_ours, tokens), ours, **MOE_TOL if model.args.n_experts else TOL)


def test_bf16_load_and_save_keep_dtype(tmp_path):
    model = Transformer(ModelArgs(architecture="qwen3", qk_norm=True, tie_embeddings=True))
    model.init_weights(generator=torch.Generator().manual_seed(0))
    save_hf(model, tmp_path / "fp32")

    bf16 = load_hf(tmp_path / "fp32", dtype=torch.bfloat16)
    save_hf(bf16, tmp_path / "bf16")

    assert {p.dtype for p in bf16.parameters()} == {torch.bfloat16}
    _assert_materialised(bf16)
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    again = load_hf(tmp_path / "bf16", dtype=torch.bfloat16)
    for name, t in bf16.state_dict().items():
        assert torch.equal(again.state_dict()[name], t), name


def test_moe_weights_read_slice_by_slice(tmp_path):
    """``load_hf_weights_`` hands each parameter a reader of any part of it: the part of an
    expert stack is read from just the experts and rows it covers, as a sharded rank asks,
    across the shard files its experts lie in."""
    _save_transformers_model(_qwen3_moe_config(tied=False), tmp_path / "hf", sharded=False)
    whole = load_hf(tmp_path / "hf", tap_layers=(0,))
    save_hf(whole, tmp_path, max_shard_bytes=20_000)  # experts: 8 KiB each
    weight_map = json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]
    assert len({weight_map[f"model.layers.1.mlp.experts.{e}.down_proj.weight"] for e in range(2, 5)}) > 1
    with torch.device("meta"):
        shell = Transformer(whole.args, tap_layers=(0,))
    parts = {}

    def fill(param, read):  # a rank holding experts 2..4, rows 5..19, columns 1.. of each tensor
        index = tuple(slice(lo, None if hi is None else min(hi, n)) for (lo, hi), n in
                      zip([(2, 5), (5, 20), (1, None)], param.shape))
        parts[param] = (index, read(index))

    load_hf_weights_(shell, tmp_path, fill)

    assert len(parts) == len(list(whole.parameters()))
    named = dict(shell.named_parameters())
    for name, param in whole.named_parameters():
        index, part = parts[named[name]]
        assert torch.equal(part, param.detach()[index]), name
    assert parts[named["layers.1.mlp.experts.w2"]][1].shape == (3, 15, 31)  # experts 2..4 of [8, 64, 32]


def test_moe_folder_missing_an_expert_is_one_clear_error(tmp_path):
    model = Transformer(model_args_for("qwen3", "debugmoe"))
    model.init_weights(generator=torch.Generator().manual_seed(0))
    save_hf(model, tmp_path)
    _edit_weights(tmp_path, lambda tensors: tensors.pop("model.layers.3.mlp.experts.6.up_proj.weight"))

    with pytest.raises(HFCheckpointError) as info:
        load_hf(tmp_path)

    assert_one_clear_error(info.value, tmp_path, ["missing tensors (1): model.layers.3.mlp.experts.6.up_proj.weight"])


def test_save_hf_replaces_an_earlier_sharded_save(tmp_path):
    model = Transformer(ModelArgs())
    model.init_weights(generator=torch.Generator().manual_seed(0))
    save_hf(model, tmp_path, max_shard_bytes=40_000)
    model.init_weights(generator=torch.Generator().manual_seed(1))

    save_hf(model, tmp_path)

    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors"]
    assert torch.equal(load_hf(tmp_path).embed_tokens.weight, model.embed_tokens.weight)


@pytest.mark.parametrize("arch, flavor", [(arch, flavor) for arch in ARCHITECTURES for flavor in flavors(arch)])
def test_config_round_trip(arch, flavor):
    args = model_args_for(arch, flavor)
    assert model_args_from_hf_config(hf_config_from_model_args(args)) == args


def test_config_v4_layout_and_defaults():
    v5 = hf_config_from_model_args(model_args_for("llama3", "8B"))
    v4 = {k: v for k, v in v5.items() if k not in ("rope_parameters", "head_dim")}
    v4["rope_scaling"] = {("type" if k == "rope_type" else k): v for k, v in v4["rope_scaling"].items()}
    v4["num_key_value_heads"] = None
    v4["model_type"], v4["architectures"] = "llama", None

    args = model_args_from_hf_config(v4)

    assert args == model_args_for("llama3", "8B").replace(n_kv_heads=32)  # head_dim 4096 / 32 = 128


def test_qk_norm_must_match_architecture():
    with pytest.raises(ValueError, match="qk_norm"):
        hf_config_from_model_args(ModelArgs(architecture="qwen3", qk_norm=False))


# ---- errors: each one a single HFCheckpointError naming the file and the problem ----


@pytest.fixture
def good_folder(tmp_path):
    model = Transformer(ModelArgs(dim=32, n_heads=2, n_kv_heads=1, ffn_dim=64, vocab_size=64))
    model.init_weights(generator=torch.Generator().manual_seed(0))
    save_hf(model, tmp_path / "ckpt")
    return tmp_path / "ckpt"


def _edit_config(folder, **changes):
    config = json.loads((folder / "config.json").read_text())
    config.update(changes)
    (folder / "config.json").write_text(json.dumps(config))


def _edit_weights(folder, edit):
    tensors = load_file(folder / "model.safetensors")
    edit(tensors)
    save_file(tensors, folder / "model.safetensors")


def _shard_with_missing_file(folder):
    weights = load_file(folder / "model.safetensors")
    (folder / "model.safetensors").unlink()
    save_file(weights, folder / "model-00001-of-00002.safetensors")
    weight_map = dict.fromkeys(weights, "model-00001-of-00002.safetensors")
    weight_map["model.norm.weight"] = "model-00002-of-00002.safetensors"
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))


def _break_tensors(tensors):
    del tensors["model.norm.weight"], tensors["model.layers.3.mlp.up_proj.weight"]
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)
    tensors["model.embed_tokens.weight"] = torch.zeros(65, 32)


@pytest.mark.parametrize(
    "break_folder, where, expected",
    [
        (lambda f: f.rename(f.with_name("elsewhere")), "", ["no such directory"]),
        (lambda f: (f / "config.json").unlink(), "config.json", ["no such file"]),
        (lambda f: (f / "config.json").write_text('{"hidden_size": 64,'), "config.json", ["malformed JSON"]),
        (lambda f: (f / "config.json").write_text("[1, 2]"), "config.json", ["expected a JSON object"]),
        (
            lambda f: _edit_config(f, architectures=["MistralForCausalLM"]),
            "config.json",
            ["'MistralForCausalLM'", "LlamaForCausalLM, Qwen3ForCausalLM"],
        ),
        (lambda f: _edit_config(f, architectures=None, model_type="gpt2"), "config.json", ["model_type 'gpt2'"]),
        (lambda f: _edit_config(f, attention_bias=True), "config.json", ["attention_bias=true"]),
        (lambda f: _edit_config(f, mlp_bias=True), "config.json", ["mlp_bias=true"]),
        (
            lambda f: _edit_config(f, rope_scaling=None, rope_parameters={"rope_type": "yarn", "factor": 4.0}),
            "config.json",
            ["rope_type 'yarn'", "'default' and 'llama3'"],
        ),
        (
            lambda f: _edit_config(f, rope_scaling={"rope_type": "llama3", "factor": 8.0}),
            "config.json",
            ["llama3 rope scaling", "'low_freq_factor'"],
        ),
        (lambda f: _edit_config(f, hidden_size=None), "config.json", ["missing required key 'hidden_size'"]),
        (lambda f: _edit_config(f, num_key_value_heads=3), "config.json", ["multiple of n_kv_heads"]),
        (lambda f: (f / "model.safetensors").unlink(), "", ["no safetensors weights"]),
        (_shard_with_missing_file, "model.safetensors.index.json", ["model-00002-of-00002.safetensors"]),
        (
            lambda f: (f / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}"),
            "model.safetensors",
            ["not a readable safetensors file"],
        ),
        (
            lambda f: _edit_weights(f, _break_tensors),
            "",
            [
                "missing tensors (2): model.layers.3.mlp.up_proj.weight, model.norm.weight",
                "unexpected tensors (1): model.layers.0.self_attn.rotary_emb.inv_freq",
                "model.embed_tokens.weight is [65, 32] in the file, config.json implies [64, 32]",
            ],
        ),
    ],
    ids=[
        "no-folder", "no-config", "bad-json", "json-not-object", "unknown-architecture", "unknown-model-type",
        "attention-bias", "mlp-bias", "rope-yarn", "rope-llama3-incomplete", "missing-key", "bad-heads",
        "no-weights", "missing-shard", "corrupt-safetensors", "tensor-mismatch",
    ],
)
def test_bad_checkpoint_is_one_clear_error(good_folder, break_folder, where, expected):
    break_folder(good_folder)

    with pytest.raises(HFCheckpointError) as info:
        load_hf(good_folder)

    assert_one_clear_error(info.value, good_folder / where, expected)
