"""The main job: ``torchrun ... -m titan_cotrain.train --job.config_file F [--section.key value]``.

What runs today: the policy (target) built from the config, FSDP2 over the
data-parallel ranks, and packed-row next-token training steps on synthetic documents
(random tokens, random document lengths) with torchtitan's optimizer and LR containers,
a one-line console log and TensorBoard scalars per step. The RL loop with rollouts and
draft co-training replaces the synthetic batches as it lands.
"""

import logging
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from titan_cotrain.components import titan
from titan_cotrain.config import ConfigError, load_job_config
from titan_cotrain.models.build import build_target
from titan_cotrain.parallel.fsdp import apply_fsdp

logger = logging.getLogger("titan_cotrain")


def synthetic_packed_batch(batch: int, seq_len: int, vocab: int, generator: torch.Generator):
    """Random tokens ``[B, S]`` packed from documents of random lengths, with their
    ``document_ids [B, S]``: stands in for rollout data until the RL loop lands."""
    tokens = torch.randint(0, vocab, (batch, seq_len), generator=generator)
    doc_lengths = torch.randint(1, seq_len + 1, (batch, seq_len), generator=generator)
    document_ids = torch.empty(batch, seq_len, dtype=torch.long)
    for row in range(batch):
        starts = doc_lengths[row].cumsum(0)
        document_ids[row] = torch.bucketize(torch.arange(seq_len), starts[starts < seq_len], right=True)
    return tokens, document_ids


def next_token_loss_sum(logits: torch.Tensor, tokens: torch.Tensor, document_ids: torch.Tensor):
    """Summed CE of predicting token t+1 from t within a document; returns (sum, count)."""
    same_doc = document_ids[:, 1:] == document_ids[:, :-1]
    ce = F.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten(), reduction="none")
    return (ce * same_doc.flatten()).sum(), same_doc.sum()


def _init_distributed(config) -> int:
    if "WORLD_SIZE" not in os.environ:
        return 1
    titan.init_torchtitan()
    from torchtitan.distributed.utils import init_distributed

    return init_distributed(config.comm)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        config = load_job_config(sys.argv[1:] if argv is None else argv)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    world_size = _init_distributed(config)
    rank = dist.get_rank() if dist.is_initialized() else 0
    parallel_dims = titan.build_parallel_dims(config.parallelism, world_size)
    if parallel_dims.cp_enabled or parallel_dims.pp_enabled:
        raise NotImplementedError("context and pipeline parallelism are not wired into the main job yet")
    device = titan.device_type()
    mesh = parallel_dims.build_mesh() if world_size > 1 else None

    model = build_target(config, device=device)
    if world_size > 1 and parallel_dims.fsdp_enabled:
        apply_fsdp(model, parallel_dims.get_mesh("fsdp"), config.training.mixed_precision_param,
                   config.training.mixed_precision_reduce)
    optimizers = titan.build_optimizers([model], config.optimizer, parallel_dims)
    lr_schedulers = titan.build_lr_schedulers(optimizers, config.lr_scheduler, config.training.steps)
    tb = None
    if config.metrics.enable_tensorboard and rank == 0:
        tb = titan.tensorboard_logger(os.path.join(config.job.dump_folder, config.metrics.save_tb_folder))

    seed = config.debug.seed if config.debug.seed is not None else 0
    generator = torch.Generator().manual_seed(seed + 1000 * rank)
    n_params = sum(p.numel() for p in model.parameters())
    if rank == 0:
        print(f"titan_cotrain: {config.model.name}/{config.model.flavor}, {n_params / 1e6:.2f}M params (local shard), "
              f"world {world_size}, {config.training.steps} steps of packed next-token training on synthetic data")
    for step in range(1, config.training.steps + 1):
        t0 = time.perf_counter()
        tokens, document_ids = synthetic_packed_batch(
            config.training.local_batch_size, config.training.seq_len, model.args.vocab_size, generator)
        tokens, document_ids = tokens.to(device), document_ids.to(device)
        optimizers.zero_grad()
        logits = model(tokens, document_ids=document_ids)
        loss_sum, count = next_token_loss_sum(logits, tokens, document_ids)
        global_count = count.clone()
        if dist.is_initialized():
            dist.all_reduce(global_count)
        (loss_sum / global_count).backward()
        grad_norm = titan.clip_grad_norm_(model.parameters(), config.training.max_norm)
        optimizers.step()
        lr_schedulers.step()
        loss = (loss_sum / global_count).detach()
        if dist.is_initialized():
            dist.all_reduce(loss)
        metrics = {"loss/policy": loss.item(), "grad_norm/policy": grad_norm.item(),
                   "lr/policy": lr_schedulers.schedulers[0].get_last_lr()[0],
                   "time/step_s": time.perf_counter() - t0, **titan.device_memory_stats()}
        if rank == 0:
            print(f"step {step:4d}  loss {metrics['loss/policy']:.4f}  grad_norm {metrics['grad_norm/policy']:.3f}  "
                  f"lr {metrics['lr/policy']:.2e}  {metrics['time/step_s']:.2f}s")
            if tb is not None:
                tb.log(metrics, step)
    if tb is not None:
        tb.close()
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
