"""The target model: packed rows, taps, and the KV-cache forward (dense and mixture of experts)."""

import pytest
import torch

from titan_cotrain.models.args import model_args_for
from titan_cotrain.models.transformer import Transformer

ARCHS = ["llama3", "qwen3", "qwen3-moe"]
# The debug size of each: (architecture, flavor).
_DEBUG = {"llama3": ("llama3", "debugmodel"), "qwen3": ("qwen3", "debugmodel"), "qwen3-moe": ("qwen3", "debugmoe")}


def _model(arch: str, seed: int = 0) -> Transformer:
    model = Transformer(model_args_for(*_DEBUG[arch]))
    model.init_weights(std=0.2, generator=torch.Generator().manual_seed(seed))
    return model


def _tokens(batch: int, seq: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 256, (batch, seq), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("arch", ARCHS)
def test_packed_rows_equal_documents_alone(arch):
    model = _model(arch)
    tokens = _tokens(2, 20)
    lengths = [[7, 1, 12], [20]]
    document_ids = torch.tensor([[d for d, n in enumerate(row) for _ in range(n)] for row in lengths])
    packed = model(tokens, document_ids=document_ids)
    for b, row in enumerate(lengths):
        start = 0
        for n in row:
            alone = model(tokens[b : b + 1, start : start + n])
            torch.testing.assert_close(packed[b, start : start + n], alone[0], rtol=1e-5, atol=1e-5)
            start += n
    # The same packing given as cu_seqlens over the flattened tokens.
    cu = torch.tensor([0, 7, 8, 20, 40], dtype=torch.int32)
    torch.testing.assert_close(model(tokens, cu_seqlens=cu), packed, rtol=0, atol=0)


def test_documents_do_not_see_each_other():
    model = _model("llama3")
    tokens = _tokens(1, 16)
    document_ids = torch.tensor([[0] * 8 + [1] * 8])
    changed = tokens.clone()
    changed[0, :8] = (changed[0, :8] + 1) % 256
    a = model(tokens, document_ids=document_ids)
    b = model(changed, document_ids=document_ids)
    torch.testing.assert_close(a[0, 8:], b[0, 8:], rtol=0, atol=0)
    assert (a[0, :8] - b[0, :8]).abs().max() > 1e-3


@pytest.mark.parametrize("arch", ARCHS)
def test_taps_are_the_named_layer_outputs(arch):
    model = _model(arch)
    assert model.tap_layers == (1, 3, 4)  # (1, L//2 - 1, L - 4) for L = 8
    seen = {}
    hooks = [layer.register_forward_hook(lambda m, i, o, k=k: seen.__setitem__(k, o)) for k, layer in
             enumerate(model.layers)]
    embeds = []
    hooks.append(model.embed_tokens.register_forward_hook(lambda m, i, o: embeds.append(o)))
    tokens = _tokens(2, 10)
    out = model(tokens, return_taps=True)
    for h in hooks:
        h.remove()
    assert len(out.taps) == 3
    for tap, layer in zip(out.taps, model.tap_layers):
        assert tap.shape == (2, 10, model.args.dim)
        assert not tap.requires_grad
        torch.testing.assert_close(tap, seen[layer].view(2, 10, -1), rtol=0, atol=0)
    torch.testing.assert_close(out.embeddings, embeds[0], rtol=0, atol=0)
    torch.testing.assert_close(out.logits, model(tokens), rtol=0, atol=0)


def test_custom_tap_layers_and_bad_ones():
    args = model_args_for("llama3", "debugmodel")
    assert Transformer(args, tap_layers=[0, 7]).tap_layers == (0, 7)
    with pytest.raises(ValueError, match="out of range"):
        Transformer(args, tap_layers=[1, 8])
    with pytest.raises(ValueError, match="distinct"):
        Transformer(args, tap_layers=[3, 1])


@pytest.mark.parametrize("arch", ARCHS)
def test_kv_cache_decode_equals_full_forward(arch):
    """Ragged prompts: each sequence prefilled to its own length, then decoded one and
    several tokens at a time at per-sequence offsets; logits equal the full forward."""
    model = _model(arch)
    tokens = _tokens(3, 18)
    full = model(tokens)
    prompt_lens = torch.tensor([5, 9, 2])
    # Paged: blocks of 4 positions, each sequence's out of order and interleaved with the others'.
    cache = model.new_kv_pool(n_blocks=19, block_size=4).view(torch.randperm(18).add(1).view(3, 6))
    # Prefill with right padding: positions past a prompt are written, never attended,
    # and overwritten by the decode steps below.
    padded = tokens[:, :9]
    logits = model.forward_cached(padded, cache, torch.zeros(3, dtype=torch.long))
    for b, n in enumerate(prompt_lens.tolist()):
        torch.testing.assert_close(logits[b, :n], full[b, :n], rtol=1e-5, atol=1e-5)
    pos = prompt_lens.clone()
    for step in (1, 3, 1, 2):
        chunk = torch.stack([tokens[b, p : p + step] for b, p in enumerate(pos.tolist())])
        logits = model.forward_cached(chunk, cache, pos)
        for b, p in enumerate(pos.tolist()):
            torch.testing.assert_close(logits[b], full[b, p : p + step], rtol=1e-5, atol=1e-5)
        pos += step
    with_taps = model.forward_cached(tokens[:, :1], model.new_kv_pool(4, 4).view(torch.tensor([[1], [2], [3]])), torch.zeros(3, dtype=torch.long),
                                     return_taps=True)
    ref = model(tokens[:, :1], return_taps=True)
    for a, b in zip(with_taps.taps, ref.taps):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_plain_tokens_give_float_logits():
    model = _model("qwen3")
    logits = model(_tokens(2, 6))
    assert logits.shape == (2, 6, 256) and logits.dtype == torch.float32


def test_tied_head_shares_the_embedding():
    model = _model("qwen3")
    assert model.lm_head.weight is model.embed_tokens.weight
    assert _model("llama3").lm_head.weight is not _model("llama3").embed_tokens.weight


def test_a_tied_head_and_its_embedding_are_filled_alike_when_held_apart():
    """Under PP the embedding (first stage) and the head (last stage) are two parameters on
    two ranks: the init fills both, by name, with the one draw a shared tensor ends up with."""
    shared = _model("qwen3")
    held_apart = _model("qwen3")
    held_apart.lm_head.weight = torch.nn.Parameter(torch.empty_like(held_apart.embed_tokens.weight))
    for model in (shared, held_apart):
        model.init_weights(generator=torch.Generator().manual_seed(5))
    assert torch.equal(held_apart.embed_tokens.weight, held_apart.lm_head.weight)
    for name, param in shared.named_parameters():
        assert torch.equal(param, dict(held_apart.named_parameters())[name]), name


def test_bad_packing_is_rejected():
    model = _model("llama3")
    tokens = _tokens(1, 6)
    with pytest.raises(ValueError, match="contiguous"):
        model(tokens, document_ids=torch.tensor([[0, 0, 1, 1, 0, 0]]))
    with pytest.raises(ValueError, match="crosses a row boundary"):
        model(_tokens(2, 6), cu_seqlens=torch.tensor([0, 4, 12], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"\[B, S\]"):
        model(tokens[0])


def test_named_sizes_match_published_shapes():
    q06 = model_args_for("qwen3", "0.6B")
    assert (q06.dim, q06.n_layers, q06.n_heads, q06.n_kv_heads, q06.head_dim, q06.ffn_dim) == (1024, 28, 16, 8, 128, 3072)
    assert q06.tie_embeddings and q06.qk_norm
    q8 = model_args_for("qwen3", "8B")
    assert (q8.dim, q8.n_layers, q8.n_heads, q8.ffn_dim, q8.tie_embeddings) == (4096, 36, 32, 12288, False)
    l8 = model_args_for("llama3", "8B")
    assert (l8.dim, l8.n_layers, l8.ffn_dim, l8.vocab_size, l8.rope_theta) == (4096, 32, 14336, 128256, 500000.0)
    assert l8.rope_scaling is not None and l8.rope_scaling.factor == 8.0
    with torch.device("meta"):
        n = sum(p.numel() for p in Transformer(model_args_for("qwen3", "1.7B")).parameters())
    assert 1.6e9 < n < 2.1e9
