"""The main job: ``torchrun ... -m titan_cotrain.train --job.config_file F [--section.key value]``.

What runs today: the policy built from the config (or an HF folder), the EAGLE-3 draft
co-trained on the policy's own forward (TTT passes with branch attention, separate
optimizer, LR and grad-norm clip), FSDP2 over the data-parallel ranks, a one-line
console log and TensorBoard scalars per step. The policy's objective is next-token
prediction on synthetic packed documents (random tokens, random document lengths): it
stands in for the RL loop (rollouts, rewards, the clipped policy loss), which replaces
it when it lands.
"""

import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from titan_cotrain.components import titan
from titan_cotrain.config import ConfigError, load_job_config
from titan_cotrain.cotrain.step import PackedBatch, PolicyLoss, clip_and_step, forward_backward
from titan_cotrain.models.build import build_draft, build_target
from titan_cotrain.parallel.fsdp import apply_fsdp


def synthetic_packed_batch(batch: int, seq_len: int, vocab: int, generator: torch.Generator) -> PackedBatch:
    """Random tokens ``[B, S]`` packed from documents of random lengths; every token is a
    training target. Stands in for rollout data until the RL loop lands."""
    tokens = torch.randint(0, vocab, (batch, seq_len), generator=generator)
    doc_lengths = torch.randint(1, seq_len + 1, (batch, seq_len), generator=generator)
    document_ids = torch.empty(batch, seq_len, dtype=torch.long)
    for row in range(batch):
        starts = doc_lengths[row].cumsum(0)
        document_ids[row] = torch.bucketize(torch.arange(seq_len), starts[starts < seq_len], right=True)
    return PackedBatch(tokens, document_ids, torch.ones(batch, seq_len, dtype=torch.bool))


def next_token_loss_sum(logits: torch.Tensor, batch: PackedBatch) -> PolicyLoss:
    """Summed CE of predicting token t+1 from t inside a document, over targets in the loss mask."""
    tokens, doc = batch.tokens, batch.document_ids
    keep = (doc[:, 1:] == doc[:, :-1]) & batch.loss_mask[:, 1:]
    ce = F.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten(), reduction="none")
    return PolicyLoss((ce * keep.flatten()).sum(), keep.sum())


def _init_distributed(config) -> int:
    if "WORLD_SIZE" not in os.environ:
        return 1
    titan.init_torchtitan()
    from torchtitan.distributed.utils import init_distributed

    return init_distributed(config.comm)


def _log_line(step: int, metrics: dict[str, float]) -> str:
    line = f"step {step:4d}  loss {metrics['loss/policy']:.4f}"
    if "loss/draft" in metrics:
        line += f"  draft {metrics['loss/draft']:.4f}  acc1 {metrics['draft/acc_pass1']:.3f}  tau {metrics['draft/tau']:.2f}"
    line += f"  gnorm {metrics['grad_norm/policy']:.3f}  lr {metrics['lr/policy']:.2e}  {metrics['time/step_s']:.2f}s"
    return line


def main(argv: list[str] | None = None) -> int:
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
    if world_size > 1:
        parallel_dims.build_mesh()

    seed = config.debug.seed if config.debug.seed is not None else 0
    generator = torch.Generator().manual_seed(seed + 1000 * rank)
    policy = build_target(config, device=device)
    vocab = policy.args.vocab_size
    corpus_counts = torch.bincount(
        synthetic_packed_batch(8, config.training.seq_len, vocab, torch.Generator().manual_seed(seed)).tokens.flatten(),
        minlength=vocab,
    )
    draft = build_draft(config, policy, token_counts=corpus_counts, device=device)
    if world_size > 1 and parallel_dims.fsdp_enabled:
        for module in (policy, draft):
            if module is not None:
                apply_fsdp(module, parallel_dims.get_mesh("fsdp"), config.training.mixed_precision_param,
                           config.training.mixed_precision_reduce)
    policy_opt = titan.build_optimizers([policy], config.optimizer, parallel_dims)
    policy_lr = titan.build_lr_schedulers(policy_opt, config.lr_scheduler, config.training.steps)
    draft_opt = draft_lr = None
    if draft is not None:
        draft_opt = titan.build_optimizers([draft], config.optimizer, parallel_dims, lr=config.draft.lr)
        draft_lr = titan.build_lr_schedulers(draft_opt, config.lr_scheduler, config.training.steps)
    tb = None
    if config.metrics.enable_tensorboard and rank == 0:
        tb = titan.tensorboard_logger(os.path.join(config.job.dump_folder, config.metrics.save_tb_folder))

    if rank == 0:
        n_policy = sum(p.numel() for p in policy.parameters())
        n_draft = sum(p.numel() for p in draft.parameters()) if draft is not None else 0
        print(f"titan_cotrain: {config.model.name}/{config.model.flavor} policy {n_policy / 1e6:.2f}M + draft "
              f"{n_draft / 1e6:.2f}M params (local shards), world {world_size}; {config.training.steps} steps of "
              "next-token training on synthetic packed documents with the draft co-trained (the RL loop is not "
              "built yet)")
    for step in range(1, config.training.steps + 1):
        t0 = time.perf_counter()
        batch = synthetic_packed_batch(config.training.local_batch_size, config.training.seq_len, vocab, generator)
        batch = PackedBatch(*(t.to(device) for t in (batch.tokens, batch.document_ids, batch.loss_mask)))
        metrics = forward_backward(
            policy, draft, batch, next_token_loss_sum, ttt_steps=config.draft.ttt_steps,
            pass_decay=config.draft.pass_decay, draft_loss_weight=config.draft.loss_weight,
            draft_loss_on=config.draft.loss_on,
        )
        metrics |= clip_and_step(policy, draft, policy_opt, draft_opt, config.training.max_norm,
                                 config.draft.grad_clip)
        metrics["lr/policy"] = policy_lr.schedulers[0].get_last_lr()[0]
        policy_lr.step()
        if draft_lr is not None:
            metrics["lr/draft"] = draft_lr.schedulers[0].get_last_lr()[0]
            draft_lr.step()
        metrics = {k: float(v) for k, v in metrics.items()}
        metrics["time/step_s"] = time.perf_counter() - t0
        metrics |= titan.device_memory_stats()
        if rank == 0:
            print(_log_line(step, metrics), flush=True)
            if tb is not None:
                tb.log(metrics, step)
    if tb is not None:
        tb.close()
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
