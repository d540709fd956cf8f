"""DAPO's dynamic sampling on 2 data-parallel ranks: groups whose rewards are all equal never
reach the update, further rounds refill the batch from the next blocks of the prompt stream,
and the stream's position is part of the trainer's state (a resumed run draws the same)."""

import torch
import torch.distributed as dist

from tests.multiprocess import run_on_ranks

ARGS = ("--task.sft_steps", "0", "--training.steps", "2", "--training.seq_len", "64", "--rl.prompts_per_step", "4",
        "--rl.group_size", "2", "--rollout.max_new_tokens", "8", "--checkpoint.no-enable",
        "--metrics.no-enable_tensorboard", "--rl.dynamic_sampling", "--rl.dynamic_sampling_max_rounds", "6")


def _constant_unless_a_multiple_of_3(trainer):
    """Rewards that vary within a group only for problems whose answer is a multiple of 3;
    the others score 1 for every response (about two thirds of the groups: dropped)."""
    def score(problems, responses):
        rewards = [float(len(r) % 2) + 0.5 if int(p.answer) % 3 == 0 else 1.0 for p, r in zip(problems, responses)]
        # Such a group must vary: its second response scores more than its first.
        for i in range(0, len(rewards), 2):
            if int(problems[i].answer) % 3 == 0:
                rewards[i + 1] = rewards[i] + 1.0
        return rewards, [{} for _ in rewards]
    trainer.problems.score = score


def _dynamic(rank: int, world_size: int, folder: str) -> None:
    from titan_cotrain.config import load_job_config
    from titan_cotrain.rl.trainer import Trainer

    trainer = Trainer(load_job_config([*ARGS, "--job.dump_folder", folder], world_size=world_size),
                      world_size, rank)
    _constant_unless_a_multiple_of_3(trainer)
    trainer.refresh_engine()
    drawn = []
    real_prompts = trainer.rollouts.prompts

    def recording(step, round_=0):
        problems, prompts = real_prompts(step, round_)
        drawn.append((step, round_, [p.answer for p in problems]))
        return problems, prompts

    trainer.rollouts.prompts = recording
    samples, metrics = trainer.rollouts(1)
    # Only groups whose rewards differ are trained, at most this rank's 2 groups.
    groups = [samples[i:i + 2] for i in range(0, len(samples), 2)]
    assert 1 <= len(groups) <= 2
    assert all(len({s.reward for s in g}) == 2 for g in groups), [[s.reward for s in g] for g in groups]
    rounds = int(metrics["rl/sampling_rounds"])
    assert rounds >= 2 and metrics["rl/dropped_groups"] > 0  # this seed's first round held constant groups
    assert [r for s, r, _ in drawn] == list(range(rounds))
    everyone = [None] * world_size
    dist.all_gather_object(everyone, (drawn, len(groups), trainer.state.extra_prompt_rounds))
    # Every rank ran the same rounds, and the stream moved on by them.
    assert len({len(d) for d, _, _ in everyone}) == 1 and trainer.state.extra_prompt_rounds == rounds - 1
    kept = sum(n for _, n, _ in everyone)
    assert metrics["rl/kept_groups"] >= kept and metrics["rl/dropped_groups"] >= 0
    assert metrics["rl/kept_shortfall"] == max(4 - kept, 0)
    if rounds < 7:  # stopped because the batch is full, not because the rounds ran out
        assert kept == 4
    # The update trains on the kept groups only.
    update = trainer.update.step(trainer.pack(samples, 1), trainer.rl_loss, train_draft=True, warm_start=False)
    assert torch.isfinite(torch.tensor(update["loss/policy"]))
    # Every round drew the stream's next block (2 positions per rank, 4 per block), and step 2
    # starts from the block after step 1's last round: no problem is drawn twice.
    stream = trainer.problems
    assert [a for _, _, answers in drawn for a in answers] == [
        stream.problem(p).answer for r in range(rounds) for p in stream.positions(4 * r, 2)]
    step2, _ = trainer.rollouts.prompts(2)
    assert [p.answer for p in step2] == [stream.problem(p).answer for p in stream.positions(4 * rounds, 2)]


def test_dynamic_sampling_keeps_varied_groups_and_refills_the_batch(tmp_path):
    run_on_ranks(_dynamic, 2, str(tmp_path))


def test_rl_prompts_continue_the_stream_after_the_warm_start():
    """RL's first block starts where the warm start's draws ended (all ranks' of them)."""
    from titan_cotrain.rl.problems import ProblemStream
    from titan_cotrain.rl.trainer_setup import TrainerState

    streams = [ProblemStream(None, None, None, seed=0, dp_rank=r, dp_degree=2, scorer=object()) for r in range(2)]
    state = TrainerState(warm_start_batch=2 * 8, sft_steps=3)  # 2 ranks x 8 demonstrations
    sft = [p for _ in range(3) for start in [state.warm_start_block()] for s in streams for p in s.positions(start, 8)]
    assert sorted(sft) == list(range(48)) and state.warm_start_positions == 48
    rl = [p for s in streams for p in s.positions(state.warm_start_positions, 4)]
    assert sorted(rl) == list(range(48, 56))
    # A checkpoint from before the position was saved: the warm start's draws follow from the step.
    old = TrainerState(warm_start_batch=2 * 8, sft_steps=3)
    old.load_state_dict({"step": torch.tensor(5), "nonfinite_steps": torch.tensor(0),
                         "extra_prompt_rounds": torch.tensor(0)})
    assert old.warm_start_positions == 48
