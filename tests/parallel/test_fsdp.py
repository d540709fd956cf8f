"""FSDP2 over 2 gloo ranks reproduces the single-device step (gradients are summed on CPU,
losses divide by the global token count)."""

import copy

import torch
import torch.distributed as dist

from tests.multiprocess import run_on_ranks
from titan_cotrain.models.args import model_args_for
from titan_cotrain.models.transformer import Transformer
from titan_cotrain.train import next_token_loss_sum, synthetic_packed_batch


def _model() -> Transformer:
    model = Transformer(model_args_for("qwen3", "debugmodel"))
    model.init_weights(std=0.1, generator=torch.Generator().manual_seed(0))
    return model


def _batches(world_size: int):
    g = torch.Generator().manual_seed(1)
    return [synthetic_packed_batch(2, 24, 256, g) for _ in range(world_size)]


def _sgd_step(model, batches, world_size):
    """One SGD step on ``batches``; returns the loss normalised by the global token count."""
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    total = sum(int((d[:, 1:] == d[:, :-1]).sum()) for _, d in batches)
    loss = sum(next_token_loss_sum(model(t, document_ids=d), t, d)[0] for t, d in batches) / total
    loss.backward()
    opt.step()
    return loss.detach()


def _fsdp_rank(rank, world_size, reference_state, reference_loss):
    from titan_cotrain.components.titan import init_torchtitan
    from torch.distributed.device_mesh import init_device_mesh

    from titan_cotrain.parallel.fsdp import apply_fsdp

    init_torchtitan()
    model = _model()
    apply_fsdp(model, init_device_mesh("cpu", (world_size,)))
    batches = _batches(world_size)
    tokens, doc = batches[rank]
    count = (doc[:, 1:] == doc[:, :-1]).sum()
    global_count = count.clone()
    dist.all_reduce(global_count)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    loss_sum, _ = next_token_loss_sum(model(tokens, document_ids=doc), tokens, doc)
    (loss_sum / global_count).backward()
    opt.step()
    loss = (loss_sum / global_count).detach()
    dist.all_reduce(loss)
    torch.testing.assert_close(loss, reference_loss, rtol=1e-5, atol=1e-6)
    for name, param in model.named_parameters():
        full = param.full_tensor()
        torch.testing.assert_close(full, reference_state[name], rtol=1e-5, atol=1e-6, msg=name)


def test_fsdp_step_matches_single_device():
    world_size = 2
    model = _model()
    loss = _sgd_step(model, _batches(world_size), world_size)
    state = {k: v.detach().clone() for k, v in model.named_parameters()}
    run_on_ranks(_fsdp_rank, world_size, state, loss)
