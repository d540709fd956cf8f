"""A mixture-of-experts policy's load-balancing loss in the update (``cotrain.step``): each
microbatch adds ``moe_aux_loss_weight x n_policy x aux`` to its loss sum, so the update's
gradient is the weight times the policy-token-weighted mean of the microbatches' losses,
reaching the routers only, and ``loss/moe_aux`` logs that mean."""

import torch

from tests.batches import synthetic_packed_batch
from titan_cotrain.cotrain.step import forward_backward, microbatches
from titan_cotrain.data.batch import PackedBatch, labels_of
from titan_cotrain.models.args import model_args_for
from titan_cotrain.models.transformer import Transformer
from titan_cotrain.rl.grpo import ppo_loss

WEIGHT = 0.25  # large, so the routers' gradients move well above fp32 noise
STEP = dict(ttt_steps=3, pass_decay=0.8, draft_loss_weight=0.5, microbatch_rows=1)


def _policy(flavor: str = "debugmoe") -> Transformer:
    target = Transformer(model_args_for("qwen3", flavor))
    target.init_weights(std=0.2, generator=torch.Generator().manual_seed(0))
    return target


def _batch(rows=3, seq=20) -> PackedBatch:
    g = torch.Generator().manual_seed(3)
    b = synthetic_packed_batch(rows, seq, 256, g)
    response = torch.arange(seq).expand(rows, seq) >= torch.tensor([[4], [9], [13]])  # ragged token counts
    return PackedBatch(b.tokens, b.document_ids, response, advantages=torch.randn(rows, seq, generator=g),
                       old_logprobs=-5 - torch.rand(rows, seq, generator=g))


def _update(policy: Transformer, weight: float):
    metrics = forward_backward(policy, None, _batch(), ppo_loss(0.2, 0.2), moe_aux_loss_weight=weight, **STEP)
    grads = {name: p.grad.clone() for name, p in policy.named_parameters()}
    policy.zero_grad()
    return metrics, grads


def _token_weighted_aux(policy: Transformer) -> torch.Tensor:
    """``sum_mb n_mb aux_mb / sum_mb n_mb`` over the one-row microbatches, written out."""
    weighted, tokens = [], []
    for rows in microbatches(_batch(), 1):
        logits = policy(rows.tokens, document_ids=rows.document_ids)
        count = ppo_loss(0.2, 0.2)(logits, labels_of(rows)).count
        weighted.append(count * policy.moe_aux_loss())
        tokens.append(count)
    return torch.stack(weighted).sum() / torch.stack(tokens).sum()


def test_the_update_adds_the_token_weighted_aux_loss_to_the_routers_only():
    policy = _policy()
    off_metrics, off = _update(policy, 0.0)
    on_metrics, on = _update(policy, WEIGHT)
    expected = _token_weighted_aux(policy)
    expected.backward()
    routers = {name for name in on if name.endswith("router.gate.weight")}
    assert len(routers) == 3  # debugmoe's sparse layers: 1, 3, 7
    for name in on:
        if name in routers:
            torch.testing.assert_close(on[name] - off[name], WEIGHT * dict(policy.named_parameters())[name].grad,
                                       rtol=1e-4, atol=1e-7, msg=name)
            assert not torch.equal(on[name], off[name]), name
        else:
            assert torch.equal(on[name], off[name]), name
    for metrics in (off_metrics, on_metrics):  # logged whether or not it is added
        torch.testing.assert_close(metrics["loss/moe_aux"], expected.detach(), rtol=1e-6, atol=0)
        assert list(metrics)[:2] == ["loss/policy", "loss/moe_aux"]
    assert torch.equal(on_metrics["loss/policy"], off_metrics["loss/policy"])
    assert 1.0 < float(expected.detach()) < 8.0  # about top_k when balanced; n_experts at most


def test_a_dense_policy_logs_no_aux_loss():
    metrics, _ = _update(_policy("debugmodel"), WEIGHT)
    assert "loss/moe_aux" not in metrics
