"""FSDP2 over 2 gloo ranks reproduces the single-device co-training step: gradients are
summed across ranks and every loss divides by the global token count."""

import pytest
import torch

from tests.multiprocess import run_on_ranks
from titan_cotrain.cotrain.step import forward_backward
from titan_cotrain.data.batch import PackedBatch
from titan_cotrain.models.args import model_args_for
from titan_cotrain.models.draft import Draft, DraftArgs
from titan_cotrain.models.transformer import Transformer
from tests.batches import synthetic_packed_batch
from titan_cotrain.rl.grpo import next_token_loss

STEP = dict(ttt_steps=3, pass_decay=0.8, draft_loss_weight=0.5)


def _models() -> tuple[Transformer, Draft]:
    policy = Transformer(model_args_for("qwen3", "debugmodel"))
    policy.init_weights(std=0.1, generator=torch.Generator().manual_seed(0))
    draft = Draft(DraftArgs.from_target(policy.args, n_taps=3))
    draft.init_weights(std=0.1, generator=torch.Generator().manual_seed(1))
    return policy, draft


def _batches(world_size: int) -> list[PackedBatch]:
    g = torch.Generator().manual_seed(1)
    return [synthetic_packed_batch(2, 24, 256, g) for _ in range(world_size)]


def _grads(*models) -> dict[str, torch.Tensor]:
    return {f"{i}.{n}": p.grad for i, m in enumerate(models) for n, p in m.named_parameters()}


def _fsdp_rank(rank, world_size, reference_grads, reference_metrics, mesh_shape):
    from torch.distributed.device_mesh import init_device_mesh

    from titan_cotrain.components.titan import init_torchtitan
    from titan_cotrain.parallel.fsdp import apply_fsdp

    init_torchtitan()
    policy, draft = _models()
    # (world,): FSDP; (replicas, shards): HSDP, as the trainer builds it from dp_replicate x fsdp.
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=("dp_replicate", "fsdp")[-len(mesh_shape):])
    apply_fsdp(policy, mesh)
    apply_fsdp(draft, mesh)
    metrics = forward_backward(policy, draft, _batches(world_size)[rank], next_token_loss, **STEP)
    for key in ("loss/policy", "loss/draft", "draft/tau"):
        torch.testing.assert_close(metrics[key], reference_metrics[key], rtol=1e-5, atol=1e-6, msg=key)
    for name, grad in _grads(policy, draft).items():
        torch.testing.assert_close(grad.full_tensor(), reference_grads[name], rtol=1e-5, atol=1e-6,
                                   msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("mesh_shape", [(2,), (2, 1)], ids=["fsdp", "hsdp_replicated"])
def test_fsdp_cotrain_step_matches_single_device(mesh_shape):
    world_size = 2
    policy, draft = _models()
    batches = _batches(world_size)
    whole = PackedBatch(*(torch.cat(parts) for parts in zip(*((b.tokens, b.document_ids, b.loss_mask)
                                                                for b in batches))))
    metrics = forward_backward(policy, draft, whole, next_token_loss, **STEP)
    grads = {k: v.clone() for k, v in _grads(policy, draft).items()}
    assert all(g.abs().sum() > 0 for g in grads.values())
    run_on_ranks(_fsdp_rank, world_size, grads, metrics, mesh_shape)


def _local_slices_rank(rank, world_size):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from titan_cotrain.parallel.fsdp import copy_whole_into_, local_slices

    mesh = init_device_mesh("cpu", (world_size,))
    # torch.chunk over 3 ranks: 4 rows -> 2, 2, nothing; 5 columns -> 2, 2, 1.
    expected = {
        (4, 3, 0): [(slice(0, 2), slice(0, 3)), (slice(2, 4), slice(0, 3)), None],
        (3, 5, 1): [(slice(0, 3), slice(0, 2)), (slice(0, 3), slice(2, 4)), (slice(0, 3), slice(4, 5))],
    }
    for (rows, cols, dim), per_rank in expected.items():
        whole = torch.arange(rows * cols, dtype=torch.float32).view(rows, cols)
        param = distribute_tensor(whole, mesh, [Shard(dim)])
        assert local_slices(param) == per_rank[rank], (rows, cols, dim, local_slices(param))
        param.to_local().zero_()
        copy_whole_into_(param, whole)
        assert torch.equal(param.full_tensor(), whole)
    assert local_slices(torch.zeros(2, 3)) == (slice(None), slice(None))


def test_local_slices_follow_uneven_chunks():
    run_on_ranks(_local_slices_rank, 3)
