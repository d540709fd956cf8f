"""The EAGLE-3 export: round trips, every rule of docs/DESIGN.md section 9 read back from a written
folder, folders written by other trainers, and one clear error per broken folder.

Every weight (the norms included) is random, so a tensor saved under the wrong name changes
the outputs; round trips compare state dicts and outputs exactly.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from titan_cotrain.models import HFCheckpointError, ModelArgs, RopeScaling, load_eagle3, save_eagle3
from titan_cotrain.models.draft import Draft, DraftArgs
from titan_cotrain.models.draft_vocab import draft_vocab_from_counts
from titan_cotrain.models.taps import default_tap_layers
from tests.models.errors import assert_one_clear_error

# Llama-3.1 RoPE scaling, so the rope_scaling round trip is exercised.
TARGET = ModelArgs(
    dim=32, n_layers=8, n_heads=4, n_kv_heads=2, head_dim=8, ffn_dim=48, vocab_size=96, rope_theta=5e5,
    rope_scaling=RopeScaling(8.0, 1.0, 4.0, 64), max_seq_len=4096,
)
TAPS = default_tap_layers(TARGET.n_layers)  # (1, 3, 4)
DRAFT_VOCAB = 40
OWN_DIM = 48  # != TARGET.dim: the draft then has an embed_tokens of its own
CU_SEQLENS = torch.tensor([0, 5, 12], dtype=torch.int32)


def make_draft(reduced_vocab: bool = True, own_dim: bool = False, seed: int = 0) -> Draft:
    g = torch.Generator().manual_seed(seed)
    args = DraftArgs.from_target(
        TARGET, n_taps=len(TAPS), draft_vocab_size=DRAFT_VOCAB if reduced_vocab else 0, dim=OWN_DIM if own_dim else 0
    )
    maps = draft_vocab_from_counts(torch.randint(0, 1000, (TARGET.vocab_size,), generator=g), DRAFT_VOCAB)
    draft = Draft(args, *(maps if reduced_vocab else (None, None)))
    with torch.no_grad():
        for p in draft.parameters():
            p.normal_(0.0, 0.3, generator=g)
    return draft


def two_ttt_passes(draft: Draft) -> torch.Tensor:
    """Logits ``[2 * T, V_d]`` of TTT passes 1 and 2 (pass 2 reads pass 1's keys as trunk and its own as branch)."""
    g = torch.Generator().manual_seed(1)
    args, t = draft.args, int(CU_SEQLENS[-1])
    tokens = torch.randint(0, args.vocab_size, (t + 1,), generator=g)
    target_embeddings = torch.randn(t + 1, args.target_dim, generator=g)
    embeds = draft.embed(tokens, target_embeddings)
    positions = torch.cat([torch.arange(5), torch.arange(7)])
    taps = torch.randn(t, args.n_taps * args.target_dim, generator=g)
    h1, kv1 = draft.forward_pass(embeds[:t], draft.fuse(taps), positions, CU_SEQLENS, None, [])
    h2, _ = draft.forward_pass(embeds[1:], h1, positions + 1, CU_SEQLENS, kv1, [])
    return torch.cat([draft.logits(h1), draft.logits(h2)])


def assert_same_state(got: Draft, want: Draft) -> None:
    got_state, want_state = got.state_dict(), want.state_dict()
    assert got_state.keys() == want_state.keys()
    for name, t in want_state.items():
        assert got_state[name].dtype == t.dtype and torch.equal(got_state[name], t), name


@pytest.mark.parametrize("own_dim", [False, True], ids=["target-dim", "own-dim"])
@pytest.mark.parametrize("reduced_vocab", [True, False], ids=["reduced-vocab", "full-vocab"])
def test_round_trip(tmp_path, reduced_vocab, own_dim):
    draft = make_draft(reduced_vocab, own_dim)

    save_eagle3(draft, tmp_path, TAPS)
    loaded, taps = load_eagle3(tmp_path)

    assert taps == TAPS and loaded.args == draft.args
    assert_same_state(loaded, draft)
    assert not loaded.rope_inv_freq.is_meta and torch.equal(loaded.rope_inv_freq, draft.rope_inv_freq)
    assert torch.equal(two_ttt_passes(loaded), two_ttt_passes(draft))


@pytest.mark.parametrize("own_dim", [False, True], ids=["target-dim", "own-dim"])
def test_folder_follows_design_section_9(tmp_path, own_dim):
    draft = make_draft(own_dim=own_dim)
    h, ht, v, vd = draft.args.dim, TARGET.dim, TARGET.vocab_size, DRAFT_VOCAB

    save_eagle3(draft, tmp_path, TAPS, target_max_position_embeddings=8192)

    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors"]
    config = json.loads((tmp_path / "config.json").read_text())
    # 1. config.json: architecture, the draft's own shape, both vocab sizes, explicit flags.
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["model_type"] == "llama"
    assert {k: config[k] for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                                   "head_dim", "intermediate_size", "rms_norm_eps", "hidden_act")} == {
        "hidden_size": h, "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": draft.args.head_dim, "intermediate_size": 48, "rms_norm_eps": 1e-5, "hidden_act": "silu",
    }
    assert (config["vocab_size"], config["draft_vocab_size"], config["target_hidden_size"]) == (v, vd, ht)
    assert config["tie_word_embeddings"] is False and config["norm_before_residual"] is False
    assert config["max_position_embeddings"] == 8192  # the target's, above the draft's own 4096
    assert config["rope_theta"] == 5e5
    llama3_rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": 64}
    assert config["rope_scaling"] == llama3_rope
    assert config["rope_parameters"] == {**llama3_rope, "rope_theta": 5e5}
    assert config["torch_dtype"] == "float32"
    # 2. Taps: vLLM's ids name the stream entering layer k (ours + 1), SGLang's the output of layer k.
    sglang_ids = config["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    assert sglang_ids == list(TAPS)
    assert config["eagle_aux_hidden_state_layer_ids"] == [x + 1 for x in sglang_ids]
    n = TARGET.n_layers
    assert config["eagle_aux_hidden_state_layer_ids"] == [2, n // 2, n - 3]  # vLLM's own default for these taps
    # 3. Tensors: exact names, shapes and dtypes; no fc.bias; midlayer.*, not layers.0.*.
    with safe_open(tmp_path / "model.safetensors", framework="pt") as f:
        tensors = {name: f.get_tensor(name) for name in f.keys()}
    layer = "midlayer."
    expected = {
        "fc.weight": [h, 3 * ht],
        **{f"{layer}{norm}.weight": [h] for norm in ("input_layernorm", "hidden_norm", "post_attention_layernorm")},
        f"{layer}self_attn.q_proj.weight": [4 * draft.args.head_dim, 2 * h],
        f"{layer}self_attn.k_proj.weight": [2 * draft.args.head_dim, 2 * h],
        f"{layer}self_attn.v_proj.weight": [2 * draft.args.head_dim, 2 * h],
        f"{layer}self_attn.o_proj.weight": [h, 4 * draft.args.head_dim],
        f"{layer}mlp.gate_proj.weight": [48, h],
        f"{layer}mlp.up_proj.weight": [48, h],
        f"{layer}mlp.down_proj.weight": [h, 48],
        "norm.weight": [h],
        "lm_head.weight": [vd, h],
        "d2t": [vd],
        "t2d": [v],
    }
    # 4. embed_tokens only when the draft's width differs from the target's.
    if own_dim:
        expected["embed_tokens.weight"] = [v, h]
    assert {name: list(t.shape) for name, t in tensors.items()} == expected
    assert tensors["d2t"].dtype == torch.int64 and tensors["t2d"].dtype == torch.bool
    assert {t.dtype for name, t in tensors.items() if name not in ("d2t", "t2d")} == {torch.float32}
    target_ids = torch.arange(vd) + tensors["d2t"]
    assert target_ids.unique().numel() == vd and 0 <= target_ids.min() and target_ids.max() < v
    assert torch.equal(tensors["t2d"].nonzero().flatten(), target_ids.sort().values)


def test_config_reads_as_a_transformers_llama_config(tmp_path):
    """Both engines parse config.json with transformers: the draft's shape and the EAGLE-3 keys must survive."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    transformers = pytest.importorskip("transformers")
    save_eagle3(make_draft(own_dim=True), tmp_path, TAPS)

    config = transformers.AutoConfig.from_pretrained(tmp_path)

    assert type(config).__name__ == "LlamaConfig"
    assert (config.hidden_size, config.head_dim, config.num_hidden_layers) == (OWN_DIM, OWN_DIM // 4, 1)
    assert (config.vocab_size, config.draft_vocab_size, config.target_hidden_size) == (96, DRAFT_VOCAB, 32)
    assert config.tie_word_embeddings is False and config.norm_before_residual is False
    assert config.rope_parameters["rope_type"] == "llama3" and config.rope_parameters["factor"] == 8.0
    assert config.eagle_aux_hidden_state_layer_ids == [2, 4, 5]
    assert config.eagle_config["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]


def test_bfloat16_export_keeps_the_vocab_maps_exact(tmp_path):
    draft = make_draft()

    save_eagle3(draft, tmp_path, TAPS, dtype=torch.bfloat16)
    loaded, _ = load_eagle3(tmp_path, dtype=torch.bfloat16)

    assert json.loads((tmp_path / "config.json").read_text())["torch_dtype"] == "bfloat16"
    stored = load_file(tmp_path / "model.safetensors")
    assert (stored["d2t"].dtype, stored["t2d"].dtype, stored["fc.weight"].dtype) == (torch.int64, torch.bool, torch.bfloat16)
    assert {p.dtype for p in loaded.parameters()} == {torch.bfloat16}
    assert torch.equal(loaded.d2t, draft.d2t) and torch.equal(loaded.t2d, draft.t2d)
    assert torch.equal(loaded.lm_head.weight, draft.lm_head.weight.bfloat16())


def test_save_replaces_an_earlier_save(tmp_path):
    save_eagle3(make_draft(seed=0), tmp_path, TAPS)
    draft = make_draft(seed=1)

    save_eagle3(draft, tmp_path, TAPS)

    assert_same_state(load_eagle3(tmp_path)[0], draft)


def _edit_config(folder, **changes):
    config = json.loads((folder / "config.json").read_text())
    config.update(changes)
    (folder / "config.json").write_text(json.dumps(config))


def _drop_config_keys(folder, *keys):
    config = json.loads((folder / "config.json").read_text())
    for key in keys:
        if key.startswith("eagle_config."):
            del config["eagle_config"][key.removeprefix("eagle_config.")]
        else:
            del config[key]
    (folder / "config.json").write_text(json.dumps(config))


def _edit_weights(folder, edit):
    tensors = load_file(folder / "model.safetensors")
    edit(tensors)
    save_file(tensors, folder / "model.safetensors")


def test_loads_layer_list_names_and_rebuilds_t2d(tmp_path):
    """Other trainers write ``layers.0.*`` and may leave ``t2d`` out (the engines ignore it)."""
    draft = make_draft()
    save_eagle3(draft, tmp_path, TAPS)

    def rewrite(tensors):
        del tensors["t2d"]
        for name in [n for n in tensors if n.startswith("midlayer.")]:
            tensors["layers.0." + name.removeprefix("midlayer.")] = tensors.pop(name)

    _edit_weights(tmp_path, rewrite)
    loaded, _ = load_eagle3(tmp_path)

    assert_same_state(loaded, draft)


def test_loads_a_full_vocab_without_maps(tmp_path):
    draft = make_draft(reduced_vocab=False)
    save_eagle3(draft, tmp_path, TAPS)
    _edit_weights(tmp_path, lambda t: (t.pop("d2t"), t.pop("t2d")))
    _drop_config_keys(tmp_path, "draft_vocab_size")  # both engines then take the target's vocab

    loaded, _ = load_eagle3(tmp_path)

    assert_same_state(loaded, draft)


@pytest.mark.parametrize(
    "dropped", ["eagle_config.eagle_aux_hidden_state_layer_ids", "eagle_aux_hidden_state_layer_ids"],
    ids=["vllm-ids-only", "sglang-ids-only"],
)
def test_tap_ids_in_either_convention(tmp_path, dropped):
    save_eagle3(make_draft(), tmp_path, TAPS)
    _drop_config_keys(tmp_path, dropped)

    assert load_eagle3(tmp_path)[1] == TAPS
    assert load_eagle3(tmp_path, tap_layers=TAPS)[1] == TAPS


def test_tap_ids_from_the_caller_when_the_config_has_none(tmp_path):
    save_eagle3(make_draft(), tmp_path, TAPS)
    _drop_config_keys(tmp_path, "eagle_aux_hidden_state_layer_ids", "eagle_config.eagle_aux_hidden_state_layer_ids")

    assert load_eagle3(tmp_path, tap_layers=[2, 5, 6])[1] == (2, 5, 6)
    with pytest.raises(HFCheckpointError, match="names no tap layers.*pass tap_layers"):
        load_eagle3(tmp_path)


def test_caller_taps_must_agree_with_the_config(tmp_path):
    save_eagle3(make_draft(), tmp_path, TAPS)

    with pytest.raises(HFCheckpointError, match=r"names tap layers \[1, 3, 4\], but tap_layers=\[2, 3, 4\]"):
        load_eagle3(tmp_path, tap_layers=(2, 3, 4))


def test_save_rejects_what_the_engines_cannot_load(tmp_path):
    with pytest.raises(ValueError, match="exactly 3"):
        save_eagle3(Draft(DraftArgs.from_target(TARGET, n_taps=2)), tmp_path, TAPS[:2])
    with pytest.raises(ValueError, match=r"fc fuses 3 taps, but the tap layers are \[1, 3\]"):
        save_eagle3(make_draft(), tmp_path, (1, 3))
    with pytest.raises(ValueError, match="increasing"):
        save_eagle3(make_draft(), tmp_path, (3, 1, 4))
    bad = make_draft()
    bad.d2t[1] = bad.d2t[0] - 1  # draft ids 0 and 1 both map to the same target id
    with pytest.raises(ValueError, match="more than one draft id"):
        save_eagle3(bad, tmp_path, TAPS)
    assert not (tmp_path / "config.json").exists()


def _out_of_range(tensors):
    tensors["d2t"][-1] += TARGET.vocab_size


def _duplicate(tensors):
    tensors["d2t"][1] = tensors["d2t"][0] - 1


def _flip_t2d(tensors):
    tensors["t2d"][tensors["t2d"].logical_not().nonzero()[0]] = True


def _break_tensors(tensors):
    del tensors["midlayer.mlp.up_proj.weight"]
    tensors["midlayer.self_attn.rotary_emb.inv_freq"] = torch.ones(4)
    tensors["lm_head.weight"] = torch.zeros(DRAFT_VOCAB + 1, TARGET.dim)


@pytest.mark.parametrize(
    "break_folder, where, expected",
    [
        (lambda f: f.rename(f.with_name("elsewhere")), "", ["no such directory"]),
        (lambda f: (f / "config.json").unlink(), "config.json", ["no such file"]),
        (lambda f: (f / "config.json").write_text('{"hidden_size": 64,'), "config.json", ["malformed JSON"]),
        (
            lambda f: _edit_config(f, architectures=["LlamaForCausalLM"]),
            "config.json",
            ["['LlamaForCausalLM']", "LlamaForCausalLMEagle3"],
        ),
        (
            lambda f: _edit_config(f, eagle_aux_hidden_state_layer_ids=[1, 3, 4]),
            "config.json",
            ["inconsistent tap layers", "outputs of layers [0, 2, 3]", "[1, 3, 4]"],
        ),
        (
            lambda f: _edit_config(
                f, eagle_aux_hidden_state_layer_ids=[4, 2, 5],
                eagle_config={"eagle_aux_hidden_state_layer_ids": [3, 1, 4]},
            ),
            "config.json",
            ["[3, 1, 4] must be distinct, increasing"],
        ),
        (lambda f: _edit_config(f, num_hidden_layers=2), "config.json", ["only single-layer"]),
        (lambda f: _edit_config(f, norm_before_residual=True), "config.json", ["norm_before_residual=true"]),
        (lambda f: _edit_config(f, tie_word_embeddings=True), "config.json", ["tie_word_embeddings=true"]),
        (lambda f: _edit_config(f, draft_vocab_size=200), "config.json", ["draft vocab (200)"]),
        (lambda f: _edit_config(f, hidden_size=None), "config.json", ["missing required key 'hidden_size'"]),
        (
            lambda f: _edit_weights(f, _break_tensors),
            "",
            [
                "missing tensors (1): midlayer.mlp.up_proj.weight",
                "unexpected tensors (1): midlayer.self_attn.rotary_emb.inv_freq",
                "lm_head.weight is [41, 32] in the file, config.json implies [40, 32]",
            ],
        ),
        (lambda f: _edit_weights(f, lambda t: t.pop("d2t")), "", ["missing tensors (1): d2t"]),
        (
            lambda f: _edit_weights(f, lambda t: t.update({"fc.bias": torch.zeros(TARGET.dim)})),
            "",
            ["fc.bias is not supported"],
        ),
        (
            lambda f: _edit_weights(f, lambda t: t.update({"layers.0.hidden_norm.weight": t["midlayer.hidden_norm.weight"].clone()})),
            "",
            ["midlayer.hidden_norm.weight", "layers.0.hidden_norm.weight", "are the same tensor"],
        ),
        (lambda f: _edit_weights(f, _out_of_range), "", ["d2t maps draft ids [39]", "outside [0, 96)"]),
        (lambda f: _edit_weights(f, _duplicate), "", ["more than one draft id"]),
        (lambda f: _edit_weights(f, _flip_t2d), "", ["t2d does not mark exactly"]),
        (lambda f: _edit_weights(f, lambda t: t.update(d2t=t["d2t"].float())), "", ["integer offsets", "float32"]),
    ],
    ids=[
        "no-folder", "no-config", "bad-json", "wrong-architecture", "inconsistent-taps", "unordered-taps",
        "two-layers", "norm-before-residual", "tied-head", "draft-vocab-too-big", "missing-key", "tensor-mismatch",
        "no-d2t", "fc-bias", "both-layer-names", "d2t-out-of-range", "d2t-duplicates", "t2d-disagrees", "float-d2t",
    ],
)
def test_bad_folder_is_one_clear_error(tmp_path, break_folder, where, expected):
    folder = tmp_path / "draft"
    save_eagle3(make_draft(), folder, TAPS)
    break_folder(folder)

    with pytest.raises(HFCheckpointError) as info:
        load_eagle3(folder)

    assert_one_clear_error(info.value, folder / where, expected)
