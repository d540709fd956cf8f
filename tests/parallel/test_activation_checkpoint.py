"""Full activation checkpointing recomputes the policy's layers without changing anything."""

import functools

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from tests.batches import synthetic_packed_batch
from titan_cotrain.cotrain.step import forward_backward
from titan_cotrain.models.args import model_args_for
from titan_cotrain.models.draft import Draft, DraftArgs
from titan_cotrain.models.transformer import Transformer
from titan_cotrain.parallel.activation_checkpoint import apply_activation_checkpointing
from titan_cotrain.rl.grpo import next_token_loss


def _grads(mode: str):
    policy = Transformer(model_args_for("qwen3", "debugmodel"))
    policy.init_weights(std=0.1, generator=torch.Generator().manual_seed(0))
    draft = Draft(DraftArgs.from_target(policy.args, n_taps=3))
    draft.init_weights(std=0.1, generator=torch.Generator().manual_seed(1))
    apply_activation_checkpointing(policy, mode, draft)
    batch = synthetic_packed_batch(2, 32, 256, torch.Generator().manual_seed(2))
    metrics = forward_backward(policy, draft, batch, next_token_loss, ttt_steps=2, pass_decay=0.8,
                               draft_loss_weight=1.0)
    return metrics, {n: p.grad for m in (policy, draft) for n, p in m.named_parameters()}, policy, draft


def test_full_checkpointing_recomputes_and_matches():
    plain_metrics, plain, _, _ = _grads("none")
    ac_metrics, ac, policy, draft = _grads("full")
    # Wrapped in place: every layer's forward is torch's checkpoint around the layer's own forward.
    for layer in policy.layers:
        assert isinstance(layer.forward, functools.partial) and layer.forward.func is checkpoint
        assert layer.forward.args[0].__func__ is type(layer).forward
    assert isinstance(draft.forward_pass, functools.partial) and draft.forward_pass.func is checkpoint
    assert [n for n, _ in policy.named_parameters()][:2] == ["embed_tokens.weight", "layers.0.input_layernorm.weight"]
    for key in ("loss/policy", "loss/draft"):
        torch.testing.assert_close(ac_metrics[key], plain_metrics[key], rtol=0, atol=0)
    for name in plain:
        torch.testing.assert_close(ac[name], plain[name], rtol=1e-6, atol=1e-7, msg=name)


def test_recompute_really_happens():
    policy = Transformer(model_args_for("llama3", "debugmodel"))
    draft = Draft(DraftArgs.from_target(policy.args, n_taps=3))
    calls, draft_calls = [], []
    policy.layers[0].mlp.register_forward_pre_hook(lambda *_: calls.append(1))
    draft.midlayer.mlp.register_forward_pre_hook(lambda *_: draft_calls.append(1))
    apply_activation_checkpointing(policy, "full", draft)
    policy(torch.randint(0, 256, (1, 8))).sum().backward()
    assert len(calls) == 2  # forward, then the recompute in backward
    batch = synthetic_packed_batch(1, 16, 256, torch.Generator().manual_seed(3))
    forward_backward(policy, draft, batch, next_token_loss, ttt_steps=3, pass_decay=0.8, draft_loss_weight=1.0)
    assert len(draft_calls) == 2 * 3  # each of the 3 passes, forward and recompute


def test_unknown_mode_is_refused():
    with pytest.raises(ValueError, match="'selective' is not supported"):
        apply_activation_checkpointing(Transformer(model_args_for("llama3", "debugmodel")), "selective")
