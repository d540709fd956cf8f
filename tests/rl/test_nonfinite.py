"""Nothing lost to a NaN: a non-finite loss (on one rank) or gradient skips that model's
update on every rank, the job stops after ``training.max_nonfinite_steps`` such steps in a
row or when its last step was skipped, and weights that are not finite, or whose forward on
a probe is not, are never checkpointed or exported."""

import json

import pytest
import torch

from tests.multiprocess import run_on_ranks

# Warm-start steps only (no rollouts), a tiny batch, a checkpoint every step.
ARGS = ("--task.sft_steps", "3", "--training.steps", "1", "--task.sft_batch_size", "4", "--training.seq_len", "64",
        "--rl.prompts_per_step", "2", "--rl.group_size", "2", "--rollout.max_new_tokens", "8",
        "--checkpoint.enable", "--checkpoint.interval", "1", "--checkpoint.keep_latest_k", "0",
        "--training.max_nonfinite_steps", "2", "--metrics.no-enable_tensorboard")


def _trainer(world_size: int, rank: int, folder: str, *overrides: str):
    from titan_cotrain.config import load_job_config
    from titan_cotrain.rl.trainer import Trainer

    config = load_job_config([*ARGS, *overrides, "--job.dump_folder", folder], world_size=world_size)
    return Trainer(config, world_size, rank)


def _local_copies(module) -> dict[str, torch.Tensor]:
    return {name: (p.to_local() if hasattr(p, "to_local") else p).detach().clone()
            for name, p in module.named_parameters()}


def _unchanged(before: dict[str, torch.Tensor], module) -> bool:
    return all(torch.equal(before[name], now) for name, now in _local_copies(module).items())


def _run_until_stopped(trainer) -> str:
    with pytest.raises(RuntimeError, match="2 consecutive steps had a non-finite") as stopped:
        trainer.run()
    return str(stopped.value)


def _nan_loss_on_rank_1(rank: int, world_size: int, folder: str) -> None:
    import titan_cotrain.rl.trainer as trainer_module

    trainer = _trainer(world_size, rank, folder)
    if rank == 1:
        real = trainer_module.next_token_loss

        def poisoned(logits, rows):
            loss = real(logits, rows)
            return loss._replace(loss_sum=loss.loss_sum * float("nan"))

        trainer_module.next_token_loss = poisoned
    policy, draft = _local_copies(trainer.policy), _local_copies(trainer.draft)
    message = _run_until_stopped(trainer)
    assert "training.max_nonfinite_steps = 2" in message
    assert trainer.state.step == 2 and trainer.state.nonfinite_steps == 2
    # The policy's updates were skipped on every rank; the draft (finite) trained on.
    assert _unchanged(policy, trainer.policy)
    assert not _unchanged(draft, trainer.draft)


def test_nan_loss_on_one_rank_skips_the_policy_update_on_every_rank_then_stops(tmp_path):
    run_on_ranks(_nan_loss_on_rank_1, 2, str(tmp_path))
    metrics = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(m["step"], m["nonfinite/policy"], m["nonfinite/draft"]) for m in metrics] == [(1, 1.0, 0.0),
                                                                                            (2, 1.0, 0.0)]
    # A skipped step's checkpoint holds the untouched (finite) weights; the step that stops
    # the job writes none.
    assert sorted(p.name for p in (tmp_path / "checkpoint").iterdir()) == ["step-1"]
    assert not (tmp_path / "export").exists()


def _nan_gradient_on_rank_1(rank: int, world_size: int, folder: str) -> None:
    import titan_cotrain.rl.update_step as update_module

    trainer = _trainer(world_size, rank, folder)
    if rank == 1:
        real = update_module.clip_grad_norms

        def poisoned(policy_params, draft_params, *args):
            draft_params = list(draft_params)
            grad = next(p.grad for p in draft_params if p.grad is not None)
            (grad.to_local() if hasattr(grad, "to_local") else grad).view(-1)[0] = float("nan")
            return real(policy_params, draft_params, *args)

        update_module.clip_grad_norms = poisoned
    policy, draft = _local_copies(trainer.policy), _local_copies(trainer.draft)
    _run_until_stopped(trainer)
    assert _unchanged(draft, trainer.draft)
    assert not _unchanged(policy, trainer.policy)


def test_nan_gradient_on_one_rank_skips_the_draft_update_on_every_rank(tmp_path):
    run_on_ranks(_nan_gradient_on_rank_1, 2, str(tmp_path))
    metrics = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(m["nonfinite/policy"], m["nonfinite/draft"]) for m in metrics] == [(0.0, 1.0), (0.0, 1.0)]
    # The draft's metrics of a finite forward are still reported; its update is what was skipped.
    assert all(0.0 <= m["draft/acc_pass1"] <= 1.0 for m in metrics)


def _nan_weights(rank: int, world_size: int, folder: str) -> None:
    from titan_cotrain.rl.nonfinite import NonfiniteWeights

    trainer = _trainer(world_size, rank, folder)
    with torch.no_grad():
        next(trainer.policy.parameters()).view(-1)[0] = float("nan")
    with pytest.raises(NonfiniteWeights, match="the checkpoint of step 1 is not written"):
        trainer.run()
    with pytest.raises(NonfiniteWeights, match="the export is not written"):
        trainer.export()


def test_nonfinite_weights_are_never_checkpointed_or_exported_and_their_metrics_are_not_perfect(tmp_path):
    run_on_ranks(_nan_weights, 1, str(tmp_path))
    assert not any((tmp_path / "checkpoint").glob("step-*"))
    assert not (tmp_path / "export").exists()
    (step1,) = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert step1["nonfinite/policy"] == 1.0 and step1["nonfinite/draft"] == 1.0
    # NaN logits: argmaxes of NaN rows agree, but they must not count as correct.
    assert step1["draft/acc_pass1"] == 0.0 and step1["draft/tau"] == 1.0


def _last_update_skipped(rank: int, world_size: int, folder: str) -> None:
    """Step 1 warm-starts normally; the gradient of the last step's (RL) update is NaN."""
    import titan_cotrain.rl.update_step as update_module

    trainer = _trainer(world_size, rank, folder, "--task.sft_steps", "1")
    real = update_module.clip_grad_norms

    def poisoned(policy_params, draft_params, *args):
        policy_params = list(policy_params)
        if trainer.state.step == trainer.total_steps - 1:
            grad = next(p.grad for p in policy_params if p.grad is not None)
            (grad.to_local() if hasattr(grad, "to_local") else grad).view(-1)[0] = float("nan")
        return real(policy_params, draft_params, *args)

    update_module.clip_grad_norms = poisoned
    with pytest.raises(RuntimeError, match="at step 2, the job's last: the update of the policy was skipped") as err:
        trainer.run()
    assert "nothing is exported" in str(err.value)


def test_a_job_whose_last_update_was_skipped_stops_without_exporting(tmp_path):
    """One skipped step, under ``max_nonfinite_steps``, but the last: the job must not end as
    if it had trained (``train.py`` exits 1 with the message)."""
    run_on_ranks(_last_update_skipped, 1, str(tmp_path))
    metrics = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [m["nonfinite/policy"] for m in metrics] == [0.0, 1.0]
    assert sorted(p.name for p in (tmp_path / "checkpoint").iterdir()) == ["step-1"]
    assert not (tmp_path / "export").exists()


def _useless_weights(rank: int, world_size: int, folder: str) -> None:
    from titan_cotrain.rl.nonfinite import NonfiniteWeights

    trainer = _trainer(world_size, rank, folder)
    head = dict(trainer.policy.named_parameters())["lm_head.weight"]
    with torch.no_grad():  # finite, but every logit overflows
        (head.to_local() if hasattr(head, "to_local") else head).fill_(3e38)
    probe = "the weights are finite, but a forward of the policy and the draft on a probe of"
    with pytest.raises(NonfiniteWeights, match=f"the checkpoint of step 1 is not written: {probe}"):
        trainer.run()
    with pytest.raises(NonfiniteWeights, match=f"the export is not written: {probe}"):
        trainer.export()


def test_finite_weights_whose_forward_is_not_are_never_checkpointed_or_exported(tmp_path):
    run_on_ranks(_useless_weights, 1, str(tmp_path))
    assert not any((tmp_path / "checkpoint").glob("step-*"))
    assert not (tmp_path / "export").exists()
