"""The configured compute dtype holds on every layout: at world size 1 and under PP without
data parallelism the models are wrapped by FSDP2 over a one-rank mesh, so they compute in
bf16 from fp32 master weights exactly like a sharded job (before, bf16 came only with
sharding and such jobs trained in fp32)."""

import pytest
import torch
from torch.distributed.fsdp import FSDPModule

from tests.multiprocess import run_on_ranks
from titan_cotrain.components import titan
from titan_cotrain.config import load_job_config
from titan_cotrain.parallel.parallelize import parallelize
from titan_cotrain.rl.grpo import next_token_loss

TINY = ("--training.seq_len", "64", "--rollout.max_new_tokens", "8", "--checkpoint.no-enable",
        "--metrics.no-enable_tensorboard")


def _models(world_size: int, *overrides: str):
    config = load_job_config([*TINY, "--training.mixed_precision_param", "bfloat16", *overrides],
                             world_size=world_size)
    dims = titan.build_parallel_dims(config.parallelism, world_size)
    if world_size > 1:
        dims.build_mesh()
    return parallelize(config, dims, world_size, torch.device("cpu"), policy_loss_fn=next_token_loss)


def _check_bf16_compute(module: torch.nn.Module, inputs) -> None:
    """``module`` is an FSDP2 unit computing in bf16 from fp32 master weights."""
    assert isinstance(module, FSDPModule)
    assert {p.dtype for p in module.parameters()} == {torch.float32}
    seen = []
    hook = module.register_forward_hook(lambda m, args, out: seen.append(out.dtype))
    with torch.no_grad():
        module(*inputs)
    hook.remove()
    assert seen == [torch.bfloat16]


def _one_rank(rank, world_size):
    models = _models(1)
    policy = models.policy
    x = torch.randn(5, policy.args.dim)
    cos, sin = torch.ones(5, policy.args.head_dim), torch.zeros(5, policy.args.head_dim)
    cu = torch.tensor([0, 2, 5], dtype=torch.int32)
    _check_bf16_compute(policy.layers[0], (x, cos, sin, cu))
    assert isinstance(models.draft, FSDPModule)


def _pipeline_rank(rank, world_size):
    models = _models(2, "--parallelism.pipeline_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "1",
                     "--parallelism.pipeline_parallel_microbatch_size", "1")
    layers = [layer for part in models.pipeline.model_parts for layer in part.layers.values()]
    args = models.engine_policy.args
    x = torch.randn(5, args.dim)
    cos, sin = torch.ones(5, args.head_dim), torch.zeros(5, args.head_dim)
    _check_bf16_compute(layers[0], (x, cos, sin, torch.tensor([0, 5], dtype=torch.int32)))


@pytest.mark.parametrize("layout", ["one_rank", "pipeline_without_dp"])
def test_bf16_compute_without_sharding(layout):
    fn, world = {"one_rank": (_one_rank, 1), "pipeline_without_dp": (_pipeline_rank, 2)}[layout]
    run_on_ranks(fn, world)


def test_bf16_without_a_process_group_names_the_key():
    with pytest.raises(ValueError, match=r"mixed_precision_param = \"bfloat16\".*torchrun"):
        _models(1)


def test_fp32_compute_on_cuda_is_refused_at_start():
    """The flash kernels take bf16/fp16 only: a CUDA job configured for fp32 compute stops
    before building anything, naming the key (checked without a GPU: nothing is allocated)."""
    config = load_job_config([*TINY], world_size=1)
    dims = titan.build_parallel_dims(config.parallelism, 1)
    with pytest.raises(ValueError, match=r'\[training\] mixed_precision_param = "float32" on a CUDA device'):
        parallelize(config, dims, 1, torch.device("cuda"), policy_loss_fn=next_token_loss)
