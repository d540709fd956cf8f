"""A mixture-of-experts policy under pipeline parallelism reproduces the single-device step.

The load-balancing loss pools the routers of every sparse layer (``models.moe``), which the
stages hold apart: each stage passes its routers' load on to the next, the last stage adds
``moe_aux_loss_weight x n_policy x aux`` to the policy sum, and the backward brings every
stage's routers their share. On 2 gloo ranks, ``qwen3 debugmoe`` (sparse layers 1, 3, 7;
layer 5 dense by ``mlp_only_layers``) with the draft: the metrics (``loss/moe_aux`` among
them) and every gradient equal ``forward_backward`` on one device with the same weight, in
microbatches of one row, within 1e-5 (fp32; the pipeline sums the routers' records stage by
stage where the one device stacks them, and scales the loss sum after the step). Splits:
a first stage with no sparse layer, looped and V-shaped stages, a checkpointed stage
forward (its rerun must not count the routers twice). On 4 ranks (slow): the job's own
path (``parallelize``) with pp 2 x dp_shard 2 x expert parallelism 2, each data-parallel
rank training half the rows.
"""

import functools

import pytest
import torch

from tests.multiprocess import one_thread, run_on_ranks
from tests.parallel.test_pipeline import _models as pipeline_models
from tests.parallel.test_pipeline import (
    POLICY_LOSS,
    STEP,
    _batch,
    _bounded_step,
    _reference_name,
    _settings,
    _stage_parameters,
    _whole,
)
from titan_cotrain.cotrain.step import forward_backward
from titan_cotrain.models.args import model_args_for
from titan_cotrain.parallel.pipeline import plan_pipeline

ARGS = model_args_for("qwen3", "debugmoe").replace(tie_embeddings=False)  # V schedules refuse tied weights
AUX_WEIGHT = 0.25  # large, so the routers' share of the gradient is well above fp32 noise
ROWS, SEQ = 4, 16
TOL = dict(rtol=1e-5, atol=1e-6)
SCHEDULES = [  # (schedule, layers per stage, stage forward checkpointed)
    ("1F1B", [1, 7], False),  # stage 0 (layer 0) has no router: it starts the load, adds nothing
    ("Interleaved1F1B", [2, 2, 2, 2], False),
    ("ZBVZeroBubble", [2, 2, 2, 2], False),  # the stages holding layers 0-1 and 6-7 on rank 0
    ("GPipe", [4, 4], False),
    # The rerun inside the backward recomputes the load and the head, and records nothing twice.
    ("1F1B", [4, 4], True),
]


def _models():
    return pipeline_models(ARGS, std=0.2)  # routers far from uniform


def _reference(policy, draft, batch, weight: float):
    metrics = forward_backward(policy, draft, batch, POLICY_LOSS, microbatch_rows=1, moe_aux_loss_weight=weight,
                               **STEP)
    grads = {f"{prefix}.{n}": p.grad.clone() for prefix, m in (("policy", policy), ("draft", draft))
             for n, p in m.named_parameters()}
    policy.zero_grad()
    draft.zero_grad()
    return metrics, grads


def _check(metrics, pipe, ref_metrics, ref_grads, what: str, tied: bool = False) -> None:
    assert list(metrics) == list(ref_metrics), what
    for key, value in ref_metrics.items():
        torch.testing.assert_close(metrics[key], value, **TOL, msg=lambda m: f"{what} {key}: {m}")
    for name, param in _stage_parameters(pipe):
        torch.testing.assert_close(_whole(param.grad), ref_grads[_reference_name(name, tied)], **TOL,
                                   msg=lambda m: f"{what} {name}: {m}")


def _two_ranks(rank, world_size, reference):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.utils.checkpoint import checkpoint

    from titan_cotrain.parallel.pipeline import make_pipeline

    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("pp",))
    ref_metrics, ref_grads = reference
    for schedule, split, checkpointed in SCHEDULES:
        policy, draft = _models()
        plan = plan_pipeline(ARGS.n_layers, world_size, schedule, layers_per_stage=split)
        pipe = make_pipeline(policy, draft, mesh, plan, _settings(moe_aux_loss_weight=AUX_WEIGHT),
                             policy_loss_fn=POLICY_LOSS)
        if checkpointed:
            for part in pipe.model_parts:
                part.forward = functools.partial(checkpoint, part.forward, use_reentrant=False)
        metrics = _bounded_step(pipe, _batch(vocab=ARGS.vocab_size))
        _check(metrics, pipe, ref_metrics, ref_grads, schedule)


def test_a_mixture_of_experts_pipeline_matches_single_device():
    policy, draft = _models()
    with one_thread():
        batch = _batch(vocab=ARGS.vocab_size)
        _, without_aux = _reference(policy, draft, batch, 0.0)
        reference = _reference(policy, draft, batch, AUX_WEIGHT)
    routers = [name for name in without_aux if name.endswith("router.gate.weight")]
    assert len(routers) == ARGS.n_sparse_layers == 3
    for name in without_aux:  # the aux loss moves every router and nothing else
        assert torch.equal(without_aux[name], reference[1][name]) != (name in routers), name
    assert 1.0 < float(reference[0]["loss/moe_aux"]) < ARGS.n_experts
    run_on_ranks(_two_ranks, 2, reference)


def _config(world_size: int, *degrees: str):
    from titan_cotrain.config import load_job_config

    return load_job_config([
        "--model.name", "qwen3", "--model.flavor", "debugmoe", "--model.moe_aux_loss_weight", str(AUX_WEIGHT),
        "--training.seq_len", str(SEQ), "--training.local_batch_size", str(ROWS * 2 // world_size),
        "--training.mixed_precision_param", "float32", "--training.mixed_precision_reduce", "float32",
        "--rollout.max_new_tokens", "4", "--checkpoint.no-enable", "--metrics.no-enable_tensorboard",
        "--draft.ttt_steps", str(STEP["ttt_steps"]), "--draft.pass_decay", str(STEP["pass_decay"]),
        "--draft.loss_weight", str(STEP["draft_loss_weight"]), *degrees,
    ], world_size=world_size)


PP_EP = ("--parallelism.pipeline_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "2",
         "--parallelism.expert_parallel_degree", "2", "--parallelism.pipeline_parallel_microbatch_size", "1",
         "--parallelism.pipeline_parallel_schedule", "1F1B")


def _pp_ep_ranks(rank, world_size, reference):
    from torch.distributed.tensor import DTensor

    from titan_cotrain.components import titan
    from titan_cotrain.parallel.parallelize import parallelize

    torch.set_num_threads(1)
    config = _config(world_size, *PP_EP)
    dims = titan.build_parallel_dims(config.parallelism, world_size)
    dims.build_mesh()
    models = parallelize(config, dims, world_size, torch.device("cpu"), policy_loss_fn=POLICY_LOSS)
    pipe = models.pipeline
    experts = [layer.mlp.experts.w1 for part in pipe.model_parts for layer in part.layers.values() if layer.sparse]
    assert experts and all(isinstance(w, DTensor) and w.device_mesh.mesh_dim_names[-2:] == ("efsdp", "ep")
                           for w in experts)
    half = config.training.local_batch_size
    dp_rank = dims.get_mesh("batch").get_local_rank()
    batch = _batch(vocab=ARGS.vocab_size, rows=2 * half).map(lambda t: t[dp_rank * half:(dp_rank + 1) * half])
    metrics = _bounded_step(pipe, batch)
    _check(metrics, pipe, *reference, "pp x dp x ep", tied=True)


@pytest.mark.slow
def test_expert_parallelism_composes_with_the_pipeline():
    from titan_cotrain.models.build import build_draft, build_target, init_draft_, init_target_

    config = _config(1)
    with one_thread():
        policy = build_target(config)
        init_target_(policy, config)
        draft = build_draft(config, policy)
        init_draft_(draft, config, policy)
        reference = _reference(policy, draft, _batch(vocab=policy.args.vocab_size), AUX_WEIGHT)
    run_on_ranks(_pp_ep_ranks, 4, reference)
