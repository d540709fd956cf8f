"""The mixture-of-experts target (Qwen3-MoE): published sizes, and the load-balancing loss
against transformers' own, its gradient confined to the routers, under activation
checkpointing too. Logits against transformers are in ``test_hf.py``; packing and the KV-cache
forward in ``test_transformer.py``."""

import functools
import os

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from titan_cotrain.models import load_hf, model_args_for
from titan_cotrain.models.transformer import Transformer


def _moe(seed: int = 0) -> Transformer:
    model = Transformer(model_args_for("qwen3", "debugmoe"))
    model.init_weights(std=0.2, generator=torch.Generator().manual_seed(seed))
    return model


def _tokens(batch: int = 2, seq: int = 24, vocab: int = 256) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(1))


def _policy_loss(logits: torch.Tensor) -> torch.Tensor:  # any loss of the logits will do
    return logits.logsumexp(-1).mean()


def _records(model: Transformer) -> list:
    return [layer.mlp.router.router_load for layer in model.layers if layer.sparse]


def _routers(model: Transformer) -> set[str]:
    return {f"layers.{i}.mlp.router.gate.weight" for i, layer in enumerate(model.layers) if layer.sparse}


@pytest.mark.parametrize("flavor, total, active", [("30B-A3B", 30.5e9, 3.3e9), ("235B-A22B", 235e9, 22e9)])
def test_named_moe_sizes_match_published_counts(flavor, total, active):
    args = model_args_for("qwen3", flavor)
    with torch.device("meta"):
        model = Transformer(args)
    counts = {name: p.numel() for name, p in model.named_parameters()}
    experts = sum(n for name, n in counts.items() if ".mlp.experts." in name)
    assert all(layer.sparse for layer in model.layers)
    assert sum(counts.values()) == pytest.approx(total, rel=0.01)
    assert sum(counts.values()) - experts * (1 - args.top_k / args.n_experts) == pytest.approx(active, rel=0.03)


def test_debugmoe_has_sparse_and_dense_layers():
    args = model_args_for("qwen3", "debugmoe")
    sparse = [i for i in range(args.n_layers) if args.is_sparse_layer(i)]
    assert sparse == [1, 3, 7]  # every second layer but 5, which mlp_only_layers keeps dense
    model = _moe()
    assert model.layers[1].mlp.experts.w1.shape == (8, 32, 64) and model.layers[5].mlp.gate_proj.out_features == 128


def test_aux_loss_equals_transformers(tmp_path):
    """HF's ``aux_loss`` (``output_router_logits=True``) on the same weights and tokens: the
    Switch loss with counts and probabilities pooled over the sparse layers."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    transformers = pytest.importorskip("transformers")
    config = transformers.Qwen3MoeConfig(
        hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, vocab_size=128, initializer_range=0.1, num_experts=8,
        num_experts_per_tok=3, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[2],
    )
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(config).eval()
    hf.save_pretrained(tmp_path)
    ours = load_hf(tmp_path, tap_layers=(0,))
    tokens = _tokens(vocab=128)

    ours(tokens)
    expected = hf(tokens, output_router_logits=True).aux_loss

    torch.testing.assert_close(ours.moe_aux_loss(), expected, atol=1e-6, rtol=1e-6)
    assert 3.0 < expected < 8 * 3  # top_k when balanced, top_k x E at worst: not a trivial value


def test_aux_loss_gradient_reaches_only_the_routers():
    """Adding the weighted aux loss leaves every gradient but the routers' bitwise the same."""
    policy_only, with_aux = _moe(), _moe()
    tokens = _tokens()

    _policy_loss(policy_only(tokens)).backward()
    loss = _policy_loss(with_aux(tokens))
    (loss + 0.5 * with_aux.moe_aux_loss()).backward()

    routers = _routers(with_aux)
    grads = {name: p.grad for name, p in policy_only.named_parameters()}
    for name, p in with_aux.named_parameters():
        if name in routers:
            assert (p.grad - grads[name]).abs().max() > 1e-4, name
        else:
            assert torch.equal(p.grad, grads[name]), name
    aux_only = _moe()
    aux_only(tokens)
    aux_only.moe_aux_loss().backward()
    assert {name for name, p in aux_only.named_parameters() if p.grad is not None} == routers


def test_aux_loss_under_activation_checkpointing():
    """Checkpointing reruns each layer in the backward; the records stay the forward's and the
    gradients of policy + aux loss are the same as without it."""
    plain, checkpointed = _moe(), _moe()
    for layer in checkpointed.layers:  # as parallel.activation_checkpoint wraps them
        layer.forward = functools.partial(checkpoint, layer.forward, use_reentrant=False)
    tokens = _tokens()
    for model in (plain, checkpointed):
        logits = model(tokens)
        aux = model.moe_aux_loss()
        records = _records(model)
        (_policy_loss(logits) + 0.5 * aux).backward()
        assert all(after is before for after, before in zip(_records(model), records, strict=True))
    torch.testing.assert_close(checkpointed.moe_aux_loss(), plain.moe_aux_loss(), atol=0, rtol=0)
    for (name, p), q in zip(plain.named_parameters(), checkpointed.parameters()):
        torch.testing.assert_close(q.grad, p.grad, atol=0, rtol=0, msg=name)


def test_no_aux_loss_without_gradients_or_experts():
    model = _moe()
    model(_tokens())
    assert model.moe_aux_loss() is not None
    with torch.no_grad():
        model(_tokens())
    assert model.moe_aux_loss() is None
    dense = Transformer(model_args_for("qwen3", "debugmodel"))
    dense(_tokens())
    assert dense.moe_aux_loss() is None
