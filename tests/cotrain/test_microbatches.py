"""An update in microbatches equals one big batch: the co-training objective backpropagates
loss sums per microbatch and scales the gradients by the global counts once all are done
(the draft's count is only known after every forward). Also: the chunked policy head and
soft CE inside the forwards give the whole-logits values."""

import pytest
import torch

from tests.batches import synthetic_packed_batch
from titan_cotrain.cotrain.step import forward_backward
from titan_cotrain.data.batch import PackedBatch
from titan_cotrain.models.args import model_args_for
from titan_cotrain.models.draft import Draft, DraftArgs
from titan_cotrain.models.draft_vocab import draft_vocab_from_counts
from titan_cotrain.models.transformer import Transformer
from titan_cotrain.rl.grpo import ppo_loss

STEP = dict(ttt_steps=3, pass_decay=0.8, draft_loss_weight=0.5)


def _models():
    target = Transformer(model_args_for("llama3", "debugmodel"))
    target.init_weights(std=0.2, generator=torch.Generator().manual_seed(0))
    maps = draft_vocab_from_counts(torch.arange(target.args.vocab_size).flip(0).float(), 96)
    draft = Draft(DraftArgs.from_target(target.args, n_taps=3, draft_vocab_size=96), *maps)
    draft.init_weights(std=0.1, generator=torch.Generator().manual_seed(1))
    return target, draft


def _batch(rows=4, seq=24) -> PackedBatch:
    g = torch.Generator().manual_seed(3)
    b = synthetic_packed_batch(rows, seq, 256, g)
    response = (torch.arange(seq) >= seq // 4).expand(rows, seq).clone()
    return PackedBatch(b.tokens, b.document_ids, response, advantages=torch.randn(rows, seq, generator=g),
                       old_logprobs=-5 - torch.rand(rows, seq, generator=g))


def _grads(microbatch_rows: int, chunk_tokens: int = 2048):
    target, draft = _models()
    metrics = forward_backward(target, draft, _batch(), ppo_loss(0.2, 0.2), microbatch_rows=microbatch_rows,
                               chunk_tokens=chunk_tokens, **STEP)
    grads = {f"{p}.{n}": q.grad.clone() for p, m in (("policy", target), ("draft", draft))
             for n, q in m.named_parameters()}
    return metrics, grads


@pytest.mark.parametrize("microbatch_rows,chunk_tokens", [(1, 2048), (1, 7)])
def test_four_microbatches_equal_one_batch(microbatch_rows, chunk_tokens):
    """4 microbatches of one row (and, separately, vocabulary chunks of 7 tokens) against one
    forward of the 4-row batch: losses, metrics and every gradient within 1e-6 (fp32)."""
    whole_metrics, whole_grads = _grads(0)
    metrics, grads = _grads(microbatch_rows, chunk_tokens)
    assert metrics.keys() == whole_metrics.keys()
    for key in metrics:
        torch.testing.assert_close(metrics[key], whole_metrics[key], rtol=1e-6, atol=1e-6, msg=key)
    for name in grads:
        torch.testing.assert_close(grads[name], whole_grads[name], rtol=1e-6, atol=1e-6, msg=name)


def test_policy_loss_is_the_whole_logits_one():
    """The reported policy loss and PPO metrics, with microbatches and 5-token vocabulary
    chunks, against ``ppo_loss`` on whole logits (float64). (The draft's chunked soft CE is
    checked against boolean-indexed anchors in ``test_vocab_chunks.py``.)"""
    target, draft = _models()
    target, draft = target.double(), draft.double()
    batch = _batch()
    metrics = forward_backward(target, draft, batch, ppo_loss(0.2, 0.2), microbatch_rows=1, chunk_tokens=5, **STEP)
    with torch.no_grad():
        from titan_cotrain.data.batch import labels_of

        labels = labels_of(batch)
        logits = target(batch.tokens, document_ids=batch.document_ids)
        reference = ppo_loss(0.2, 0.2)(logits, labels)
    torch.testing.assert_close(metrics["loss/policy"].double(), (reference.loss_sum / reference.count).double(),
                               rtol=1e-6, atol=1e-9)
    for name, total in reference.metric_sums.items():
        torch.testing.assert_close(metrics[name].double(), (total / reference.count).double(), rtol=1e-6, atol=1e-9)


def test_reference_logprobs_in_chunks_equal_whole_logits():
    """The KL reference's per-token log-probs, the head in 7-token chunks inside the forward,
    equal ``log_softmax`` of whole logits at the rollout temperature (fp32, 1e-5)."""
    from titan_cotrain.cotrain.vocab import chunked_token_logprobs
    from titan_cotrain.rl.grpo import next_token_logprobs

    target, _ = _models()
    tokens = torch.randint(0, 256, (1, 40), generator=torch.Generator().manual_seed(4))
    following = torch.roll(tokens, -1, dims=1).reshape(-1)
    with torch.no_grad():
        whole = next_token_logprobs(target(tokens)[:, :-1] / 0.7, tokens[:, 1:])[0]
        chunked = target(tokens, head=lambda h, w: chunked_token_logprobs(h, w, following, scale=1 / 0.7,
                                                                          chunk_tokens=7)).head[:-1]
    torch.testing.assert_close(chunked, whole, rtol=1e-5, atol=1e-5)
