"""``torch.compile`` of the training models, block by block (``[compile] enable``), with inductor on CPU:
a co-training step compiled equals the eager one, no block breaks its graph, and batches of
other document layouts reuse the graphs instead of recompiling."""

import copy

import pytest
import torch
from torch._dynamo.utils import counters

from tests.batches import synthetic_packed_batch
from tests.multiprocess import one_thread
from titan_cotrain.cotrain.step import forward_backward
from titan_cotrain.models.args import model_args_for
from titan_cotrain.models.draft import Draft, DraftArgs
from titan_cotrain.models.transformer import Transformer
from titan_cotrain.parallel.activation_checkpoint import apply_activation_checkpointing
from titan_cotrain.parallel.compile import apply_compile
from titan_cotrain.rl.grpo import next_token_loss

STEP = dict(ttt_steps=3, pass_decay=0.8, draft_loss_weight=0.1)


def _models():
    args = model_args_for("llama3", "debugmodel").replace(n_layers=8, vocab_size=64)
    policy = Transformer(args)
    policy.init_weights(generator=torch.Generator().manual_seed(0))
    draft = Draft(DraftArgs.from_target(args, n_taps=3))
    draft.init_weights(generator=torch.Generator().manual_seed(1))
    return policy, draft


def _step(policy, draft, batch):
    metrics = forward_backward(policy, draft, batch, next_token_loss, **STEP)
    grads = {f"{tag}.{name}": p.grad.clone() for tag, model in (("policy", policy), ("draft", draft))
             for name, p in model.named_parameters()}
    for model in (policy, draft):
        model.zero_grad(set_to_none=True)
    return metrics, grads


@pytest.mark.slow
@pytest.mark.parametrize("checkpointing", ["none", "full"])
def test_compiled_blocks_match_eager_without_graph_breaks_or_recompiles(checkpointing):
    torch._dynamo.reset()
    counters.clear()
    eager = _models()
    compiled = copy.deepcopy(eager)
    for models in (eager, compiled):
        apply_activation_checkpointing(models[0], checkpointing, models[1])
    apply_compile(*compiled, ["model", "draft"], backend="inductor")
    layouts = [synthetic_packed_batch(2, 48, 64, torch.Generator().manual_seed(seed)) for seed in (2, 3, 4)]
    assert len({int(b.document_ids.max()) for b in layouts}) > 1  # the document counts differ
    graphs = []
    with one_thread():
        for batch in layouts:
            expected_metrics, expected_grads = _step(*eager, batch)
            metrics, grads = _step(*compiled, batch)
            for key, value in expected_metrics.items():
                torch.testing.assert_close(metrics[key], value, rtol=1e-5, atol=1e-6, msg=key)
            for name, grad in expected_grads.items():
                torch.testing.assert_close(grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)
            graphs.append(counters["stats"]["unique_graphs"])
    assert not counters["graph_break"], dict(counters["graph_break"])
    # Every graph is made at the first batch (the blocks share theirs; the draft's passes
    # settle on one graph for the later depths); the other layouts compile nothing new.
    assert graphs[0] > 0 and graphs[1] == graphs[2] == graphs[0], graphs


def test_unknown_components_are_refused():
    with pytest.raises(ValueError, match="unknown \\['engine'\\]"):
        apply_compile(*_models(), ["model", "engine"])
