"""Expert parallelism on gloo reproduces the single-device mixture of experts.

Every rank runs ``parallelize`` on ``qwen3 debugmoe`` (8 experts, top-2, sparse layers 1, 3
and 7) over its own rows (under CP, its zigzag chunks of the shared rows); the one device
runs all the rows. A rank's logits must equal the single device's for its tokens, and each
parameter's gradient (summed over the ranks, as FSDP and the all-to-all's backward sum them)
the single device's, within fp32 tolerances: the experts see their tokens in another order
and grouping, with zero rows of padding, so sums round differently (observed: logits within
3e-7 and gradients within 1e-6 of their largest entry). The routers' top-k choices must be
identical, and no assignment is dropped (torchtitan's token-choice MoE has no capacity
factor: dropless, so there is no drop count to log).
"""

import pytest
import torch

from tests.multiprocess import run_on_ranks
from titan_cotrain.components import titan
from titan_cotrain.config import load_job_config
from titan_cotrain.models.build import build_target, init_target_
from titan_cotrain.parallel.parallelize import parallelize
from titan_cotrain.rl.grpo import next_token_loss

ROWS_PER_RANK, SEQ, VOCAB = 2, 16, 256
LOGITS_TOL = dict(rtol=1e-5, atol=1e-6)
GRAD_TOL = dict(rtol=1e-5, atol=1e-6)


def _config(world_size: int, ep: int, *overrides: str):
    return load_job_config(
        ["--model.name", "qwen3", "--model.flavor", "debugmoe", "--training.seq_len", "64",
         "--rollout.max_new_tokens", "8", "--checkpoint.no-enable", "--metrics.no-enable_tensorboard",
         "--training.mixed_precision_param", "float32", "--training.mixed_precision_reduce", "float32",
         "--parallelism.expert_parallel_degree", str(ep), *overrides],
        world_size=world_size)


def _tokens(rows: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(3)
    return torch.randint(0, VOCAB, (rows, SEQ), generator=g)


def _loss(logits: torch.Tensor) -> torch.Tensor:  # a sum over tokens: the ranks' gradients add up
    return logits.logsumexp(-1).sum()


def _record_routing(policy) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """Per sparse layer, the routers' ``[tokens, top_k]`` choices (sorted: torchtitan's top-k
    is unsorted) and ``[E]`` assignment counts of the next forward."""
    records = []
    for layer in policy.layers:
        if layer.sparse:
            record = []
            layer.mlp.router.register_forward_hook(
                lambda mod, args, out, record=record: record.append((out[1].sort(-1).values, out[2])))
            records.append(record)
    return records


def _run(policy, tokens, valid: torch.Tensor | None = None, **layout):
    """Logits and routing (the forward's: a checkpointed layer's rerun records again) of one
    forward, and the backward of ``_loss`` over the ``valid`` tokens (default: all)."""
    routing = _record_routing(policy)
    logits = policy(tokens, **layout)
    _loss(logits if valid is None else logits[valid]).backward()
    return logits.detach(), [record[0] for record in routing]


def _ep_rank(rank, world_size, ep, reference, overrides, width_sharded=False):
    from torch.distributed.tensor import DTensor, Shard

    from titan_cotrain.data.batch import PackedBatch
    from titan_cotrain.parallel.context_parallel import shard_batch_for_cp

    config = _config(world_size, ep, *overrides)
    dims = titan.build_parallel_dims(config.parallelism, world_size)
    dims.build_mesh()
    models = parallelize(config, dims, world_size, torch.device("cpu"), policy_loss_fn=next_token_loss)
    policy = models.policy
    n_experts = policy.args.n_experts
    # torchtitan's per-expert tallies (in no state dict) start at zero, not as uninitialised memory
    assert all(layer.mlp.tokens_per_expert.dtype == torch.float32 and not layer.mlp.tokens_per_expert.any()
               for layer in policy.layers if layer.sparse)
    for model in (policy, models.reference):
        for layer in model.layers if model is not None else ():
            if layer.sparse:  # whole experts per ep rank, FSDP over efsdp on top
                w1 = layer.mlp.experts.w1
                assert isinstance(w1, DTensor) and w1.device_mesh.mesh_dim_names[-2:] == ("efsdp", "ep")
                assert w1.placements[-1] == Shard(0)
                # FSDP over efsdp on top: on the expert dimension (strided, under ep's split) or,
                # with more efsdp ranks than a rank's experts, on each expert's width.
                fsdp = w1.placements[-2]
                assert getattr(fsdp, "dim", None) == (1 if width_sharded else 0), fsdp  # Shard or _StridedShard
    batch_rank = dims.get_mesh("batch").get_local_rank() if dims.dp_enabled else 0
    rows = slice(batch_rank * ROWS_PER_RANK, (batch_rank + 1) * ROWS_PER_RANK)
    tokens, whole_logits = _tokens(reference["logits"].shape[0])[rows], reference["logits"][rows]
    whole_choices = [choices.view(-1, SEQ, choices.shape[-1])[rows] for choices, _ in reference["routing"]]
    if dims.cp_enabled:  # this rank's zigzag chunks of the rows: one document per row
        batch = PackedBatch(tokens, torch.zeros_like(tokens), torch.ones_like(tokens, dtype=torch.bool))
        cp_batch, shard = shard_batch_for_cp(batch, dims.get_mesh("cp"))
        with models.forward_scope():  # torch's CP dispatcher on, as for the update's forward-backward
            logits, routing = _run(policy, cp_batch.tokens, cu_seqlens=shard.cu_seqlens, positions=shard.positions,
                                   valid=shard.valid)
        logits = shard.unshard(logits)
        whole_choices = [shard.shard(choices) for choices in whole_choices]
    else:
        logits, routing = _run(policy, tokens)
        if models.reference is not None:  # the KL reference: the same weights, sharded alike, no gradients
            with torch.no_grad():
                torch.testing.assert_close(models.reference(tokens), whole_logits, **LOGITS_TOL)
    torch.testing.assert_close(logits, whole_logits, **LOGITS_TOL)
    for (choices, counts), whole in zip(routing, whole_choices, strict=True):
        assert torch.equal(choices, whole.flatten(0, 1))
        assert counts.sum() == choices.numel() and len(counts) == n_experts  # dropless
    for name, param in policy.named_parameters():
        torch.testing.assert_close(param.grad.full_tensor(), reference["grads"][name], **GRAD_TOL,
                                   msg=lambda m, name=name: f"{name}: {m}")
    # The experts' gradients live on another mesh than the rest's; the clip still sees one norm.
    whole_norm = torch.stack([grad.norm() for grad in reference["grads"].values()]).norm()
    torch.testing.assert_close(titan.clip_grad_norm_(list(policy.parameters()), 1e9), whole_norm, **GRAD_TOL)


def _single_device(rows: int, *overrides: str) -> dict:
    config = _config(1, 1, *overrides)
    policy = build_target(config)
    init_target_(policy, config)
    logits, routing = _run(policy, _tokens(rows))
    grads = {name: param.grad.clone() for name, param in policy.named_parameters()}
    assert all(grad.abs().sum() > 0 for grad in grads.values())
    return dict(logits=logits, routing=routing, grads=grads)


def _degrees(dp_replicate: int = 1, dp_shard: int = 1, cp: int = 1) -> tuple[str, ...]:
    return ("--parallelism.data_parallel_replicate_degree", str(dp_replicate),
            "--parallelism.data_parallel_shard_degree", str(dp_shard), "--parallelism.context_parallel_degree", str(cp))


@pytest.mark.parametrize("world_size, ep, degrees", [
    (2, 2, _degrees(dp_shard=2)),
    pytest.param(4, 4, _degrees(dp_shard=4), marks=pytest.mark.slow),
    # efsdp 2: each expert's shard is summed over the two ranks that hold it.
    pytest.param(4, 2, _degrees(dp_shard=4), marks=pytest.mark.slow),
    # HSDP: the experts replicated over dp_replicate, reduced over it.
    pytest.param(4, 2, _degrees(dp_replicate=2, dp_shard=2), marks=pytest.mark.slow),
    # The two CP ranks of the same rows hold 4 experts each and serve each other's chunks.
    (2, 2, _degrees(cp=2)),
    # Activation checkpointing reruns the dispatch in the backward; the KL reference gets EP too.
    (2, 2, (*_degrees(dp_shard=2), "--activation_checkpoint.mode", "full", "--rl.kl_coef", "0.1")),
], ids=["ep2", "ep4", "ep2_efsdp2", "ep2_hsdp", "ep2_cp2", "ep2_checkpointed_with_reference"])
def test_expert_parallel_matches_single_device(world_size, ep, degrees):
    config = _config(world_size, ep, *degrees)
    data_parallel = config.parallelism.data_parallel_replicate_degree * config.parallelism.data_parallel_shard_degree
    run_on_ranks(_ep_rank, world_size, ep, _single_device(data_parallel * ROWS_PER_RANK), degrees)


@pytest.mark.slow
def test_experts_fewer_than_their_fsdp_ranks_are_sharded_by_width(tmp_path):
    """8 ranks, ep 2 x efsdp 4, over a 4-expert policy read from a Hugging Face folder: a rank
    holds 2 experts, fewer than the 4 ranks that FSDP-shard them, so each expert is split on
    its width (dim 1) instead; the step still equals the single device's."""
    from titan_cotrain.models.args import model_args_for
    from titan_cotrain.models.hf import save_hf
    from titan_cotrain.models.transformer import Transformer

    policy = Transformer(model_args_for("qwen3", "debugmoe").replace(n_experts=4))
    policy.init_weights(std=0.2, generator=torch.Generator().manual_seed(4))
    save_hf(policy, tmp_path)
    folder = ("--model.hf_path", str(tmp_path))
    degrees = (*_degrees(dp_shard=8), *folder)
    run_on_ranks(_ep_rank, 8, 2, _single_device(8 * ROWS_PER_RANK, *folder), degrees, True)
