"""The main job end to end on 2 CPU processes: warm start, RL with co-training, metrics,
checkpoints, and resumes that continue bit-identically (from the phase boundary and from an RL
step). A bad config stops it cleanly.
Context- and pipeline-parallel runs of the same job, and PP combined with CP, match a
one-process run; PP combined with data parallelism matches the FSDP run of the same job."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
SHORT = ("--task.sft_steps", "2", "--training.steps", "2", "--task.sft_batch_size", "8",
         "--rl.prompts_per_step", "2", "--rl.group_size", "2", "--rollout.max_new_tokens", "12",
         "--training.seq_len", "64", "--checkpoint.interval", "2", "--checkpoint.keep_latest_k", "0",
         "--lr_scheduler.warmup_steps", "1", "--task.sft_warmup_steps", "1")

# Parity with one process: the first of the CP / PP peers generates all their rollouts (the
# one-process job's) and sends them, instead of each generating a share.
LEADER_GENERATES = ("--rollout.no-split_prompts",)


def _run(*args: str, nproc: int | None = 2, module: str = "titan_cotrain.train") -> subprocess.CompletedProcess:
    """The main job (or another entry point) under torchrun with ``nproc`` ranks, or as a plain process (None)."""
    launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"] if nproc else []
    cmd = [sys.executable, *launcher, "-m", module, *args]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)


def _metrics(folder: Path) -> list[dict]:
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]


def _assert_repeated_exactly(uninterrupted: list[dict], resumed: list[dict]) -> None:
    """A resumed run's steps log what the uninterrupted run's did, bit for bit (but timings)."""
    volatile = ("time/", "memory/", "rollout/tokens_per_s", "rollout/tail_share", "prefit/tokens_per_s")
    assert [m["step"] for m in resumed] == [m["step"] for m in uninterrupted]
    for a, b in zip(uninterrupted, resumed, strict=True):
        for key, value in a.items():
            # Wall times: the rollout's per live-rows bucket too (rollout/live_le<n>_s).
            if not key.startswith(volatile) and not (key.startswith("rollout/live_le") and key.endswith("_s")):
                assert b[key] == value, (a["step"], key, value, b[key])


@pytest.mark.slow
def test_main_job_trains_logs_checkpoints_and_resumes_exactly(tmp_path):
    full = tmp_path / "full"
    result = _run(*SHORT, "--job.dump_folder", str(full))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    metrics = _metrics(full)
    assert [m["step"] for m in metrics] == [1, 2, 3, 4]
    assert [m["phase"] for m in metrics] == ["sft", "sft", "rl", "rl"]
    for m in metrics[2:]:
        assert {"reward/mean", "reward/std", "rollout/acceptance_length", "rollout/tokens_per_s", "loss/draft",
                "draft/acc_pass1", "draft/tau", "grad_norm/policy", "grad_norm/draft", "time/rollout_s",
                "rl/clip_fraction", "task/answer_correct", "task/steps_preferred"} <= m.keys()
        # The task's details are means over the step's samples, like the reward they make up.
        assert abs(m["reward/mean"] - (0.4 * m["task/answer_correct"] + 0.2 * m["task/steps_correct"]
                                       + 0.4 * m["task/steps_preferred"] - 0.05 * m["task/fillers"])) < 1e-5
    assert list((full / "tb").glob("events.out.tfevents.*"))
    assert sorted(p.name for p in (full / "checkpoint").iterdir()) == ["step-2", "step-4"]
    from titan_cotrain.models import load_eagle3, load_hf

    assert load_hf(full / "export" / "policy").args.n_layers == 8
    assert load_eagle3(full / "export" / "draft")[1] == (1, 3, 4)

    # A second run that finds only the step-2 checkpoint resumes there and repeats steps 3-4.
    _assert_repeated_exactly(metrics[2:], _resume(full, 2, SHORT, tmp_path / "resumed"))


def _resume(full: Path, step: int, args, dump: Path) -> list[dict]:
    """Run ``args`` in a new ``dump`` folder holding only ``full``'s step-``step``
    checkpoint; the resumed run's metrics."""
    shutil.copytree(full / "checkpoint" / f"step-{step}", dump / "checkpoint" / f"step-{step}")
    result = _run(*args, "--job.dump_folder", str(dump))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert f"resumed from step {step}" in result.stdout
    return _metrics(dump)


@pytest.mark.slow
def test_a_resume_inside_the_rl_phase_repeats_the_run_exactly(tmp_path):
    """The run stops after the checkpoint of an RL step and a new process resumes from it
    (a kill -9 leaves it no more): the next RL steps repeat the uninterrupted run's bit for
    bit. Their ``G = 4`` samples per prompt share the prompt's KV blocks; the new process's
    engine starts with zeroed pools, the uninterrupted one's hold the last rollout's keys,
    which nothing may read.

    The uninterrupted run moves its training state off the device during every rollout
    (``[rollout] offload_training_state``); a resume without the offload repeats its steps
    (the state came back bitwise, the checkpoint is the same), and so does one with it."""
    args = (*SHORT, "--task.sft_steps", "1", "--training.steps", "3", "--rl.group_size", "4",
            "--metrics.no-enable_tensorboard")
    offload = ("--rollout.offload_training_state",)
    full = tmp_path / "full"
    result = _run(*args, *offload, "--job.dump_folder", str(full))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    metrics = _metrics(full)
    assert [m["phase"] for m in metrics] == ["sft", "rl", "rl", "rl"]
    assert all(m["rollout/draft_tokens"] > 0 for m in metrics[1:])  # speculative rollouts
    assert all(m["memory/offloaded_gib"] > 0 for m in metrics[1:])

    _assert_repeated_exactly(metrics[2:], _resume(full, 2, args, tmp_path / "resumed"))
    _assert_repeated_exactly(metrics[2:], _resume(full, 2, (*args, *offload), tmp_path / "resumed_offload"))


@pytest.mark.slow
def test_the_mixture_of_experts_job_trains_resumes_exactly_and_exports(tmp_path):
    """``debug_cpu_moe.toml`` (Qwen3-MoE's debugmoe, FSDP 2 x expert parallel 2): warm start,
    GRPO with speculative rollouts of the MoE policy and its load-balancing loss logged, a
    resume at an RL step that repeats the run bit for bit, and exports the loaders read back
    (the policy whole, every expert in it)."""
    args = ("--job.config_file", "train_configs/debug_cpu_moe.toml", *SHORT, "--task.sft_steps", "1",
            "--training.steps", "3", "--rl.group_size", "4", "--metrics.no-enable_tensorboard")
    full = tmp_path / "full"
    result = _run(*args, "--job.dump_folder", str(full))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    metrics = _metrics(full)
    assert [m["phase"] for m in metrics] == ["sft", "rl", "rl", "rl"]
    assert all(m["loss/moe_aux"] > 0 for m in metrics)
    assert all(m["rollout/draft_tokens"] > 0 for m in metrics[1:])  # speculative rollouts
    from titan_cotrain.models import load_eagle3, load_hf

    policy = load_hf(full / "export" / "policy")
    assert (policy.args.n_experts, policy.args.top_k) == (8, 2)
    assert policy.layers[1].mlp.experts.w1.shape[0] == 8
    assert load_eagle3(full / "export" / "draft")[1] == (1, 3, 4)

    _assert_repeated_exactly(metrics[2:], _resume(full, 2, args, tmp_path / "resumed"))


def test_bad_config_fails_with_one_message(tmp_path):
    result = _run("--draft.tap_layers", "1", "2", "40", "--job.dump_folder", str(tmp_path), nproc=None)
    assert result.returncode == 2
    assert "config error" in result.stderr and "draft.tap_layers" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.slow
def test_context_parallel_job_matches_one_process(tmp_path):
    """``[parallelism] context_parallel_degree = 2``: two ranks train zigzag shards of the
    same rows; losses and gradient norms match a one-process run of the same job."""
    args = (*SHORT, "--training.steps", "1", "--checkpoint.no-enable", *LEADER_GENERATES)
    single = _run(*args, "--job.dump_folder", str(tmp_path / "single"), nproc=None)
    assert single.returncode == 0, single.stderr[-3000:]
    cp = _run(*args, "--parallelism.context_parallel_degree", "2", "--job.dump_folder", str(tmp_path / "cp"))
    assert cp.returncode == 0, cp.stdout[-3000:] + cp.stderr[-3000:]
    for a, b in zip(_metrics(tmp_path / "single"), _metrics(tmp_path / "cp"), strict=True):
        for key in ("loss/policy", "loss/draft", "grad_norm/policy", "grad_norm/draft", "draft/acc_pass1"):
            assert abs(a[key] - b[key]) <= 1e-4 * max(1.0, abs(a[key])), (a["step"], key, a[key], b[key])


@pytest.mark.slow
def test_a_compiled_job_with_fsdp_and_context_parallelism_matches_the_eager_one(tmp_path):
    """``[compile] enable`` (inductor, per block, before FSDP2) on two CP ranks: the warm-start
    and RL losses and gradient norms are the eager one-process job's."""
    args = (*SHORT, "--task.sft_steps", "1", "--training.steps", "1", "--checkpoint.no-enable", *LEADER_GENERATES)
    eager = _run(*args, "--job.dump_folder", str(tmp_path / "eager"), nproc=None)
    assert eager.returncode == 0, eager.stderr[-3000:]
    compiled = _run(*args, "--compile.enable", "--parallelism.context_parallel_degree", "2",
                    "--job.dump_folder", str(tmp_path / "compiled"))
    assert compiled.returncode == 0, compiled.stdout[-3000:] + compiled.stderr[-3000:]
    _assert_match(tmp_path / "eager", tmp_path / "compiled")


@pytest.mark.slow
def test_a_tensor_parallel_engine_job_matches_one_process_and_exports_whole_weights(tmp_path):
    """``[rollout] tensor_parallel_degree = 2`` over the two CP ranks: one engine group splits
    the policy's copy and generates the one-process job's rollouts; the export gathers it."""
    from safetensors.torch import load_file

    args = (*SHORT, "--training.steps", "1", "--checkpoint.no-enable")
    single = _run(*args, "--job.dump_folder", str(tmp_path / "single"), nproc=None)
    assert single.returncode == 0, single.stderr[-3000:]
    tp = _run(*args, "--parallelism.context_parallel_degree", "2", "--rollout.tensor_parallel_degree", "2",
              "--job.dump_folder", str(tmp_path / "tp"))
    assert tp.returncode == 0, tp.stdout[-3000:] + tp.stderr[-3000:]
    _assert_match(tmp_path / "single", tmp_path / "tp")
    ours, theirs = (load_file(tmp_path / run / "export" / "policy" / "model.safetensors") for run in ("tp", "single"))
    assert ours.keys() == theirs.keys()
    for name in ours:
        torch.testing.assert_close(ours[name], theirs[name], rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.slow
def test_pipeline_parallel_job_matches_one_process_and_resumes_exactly(tmp_path):
    """``[parallelism] pipeline_parallel_degree = 2``: two stages (1F1B, microbatches of one
    row, two per schedule step, so a minibatch runs several accumulated schedule steps)
    train the same job as one process: warm-start and RL losses and the global gradient
    norms match; a resume from the PP checkpoint continues bit-identically."""
    args = (*SHORT, "--rl.updates_per_step", "2", "--training.local_batch_size", "2", *LEADER_GENERATES)
    pp_args = ("--parallelism.pipeline_parallel_degree", "2")
    single = _run(*args, "--checkpoint.no-enable", "--job.dump_folder", str(tmp_path / "single"), nproc=None)
    assert single.returncode == 0, single.stderr[-3000:]
    pp = _run(*args, *pp_args, "--job.dump_folder", str(tmp_path / "pp"))
    assert pp.returncode == 0, pp.stdout[-3000:] + pp.stderr[-3000:]
    metrics = _metrics(tmp_path / "pp")
    for a, b in zip(_metrics(tmp_path / "single"), metrics, strict=True):
        for key in ("loss/policy", "loss/draft", "grad_norm/policy", "grad_norm/draft", "draft/acc_pass1",
                    "reward/mean", "rollout/acceptance_length"):
            if key in a:
                assert abs(a[key] - b[key]) <= 1e-4 * max(1.0, abs(a[key])), (a["step"], key, a[key], b[key])
    from titan_cotrain.models import load_eagle3, load_hf

    assert load_hf(tmp_path / "pp" / "export" / "policy").args.n_layers == 8  # gathered from both stages
    assert load_eagle3(tmp_path / "pp" / "export" / "draft")[1] == (1, 3, 4)

    resumed = tmp_path / "resumed"
    shutil.copytree(tmp_path / "pp" / "checkpoint" / "step-2", resumed / "checkpoint" / "step-2")
    again = _run(*args, *pp_args, "--job.dump_folder", str(resumed))
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert "resumed from step 2" in again.stdout
    _assert_repeated_exactly(metrics[2:], _metrics(resumed))


# One warm-start and one RL step: a 4-process job on 2 shared cores is slow.
ONE_EACH = (*SHORT, "--task.sft_steps", "1", "--training.steps", "1", "--training.local_batch_size", "2",
            *LEADER_GENERATES)
MATCHED = ("loss/policy", "loss/draft", "grad_norm/policy", "grad_norm/draft", "draft/acc_pass1", "reward/mean",
           "rollout/acceptance_length")


def _assert_match(reference: Path, run: Path, keys: tuple[str, ...] = MATCHED) -> None:
    for a, b in zip(_metrics(reference), _metrics(run), strict=True):
        for key in keys:
            if key in a:
                assert abs(a[key] - b[key]) <= 1e-4 * max(1.0, abs(a[key])), (a["step"], key, a[key], b[key])


@pytest.mark.slow
def test_pipeline_with_context_parallelism_matches_one_process(tmp_path):
    """pp=2 x cp=2 on 4 ranks: rows packed in the CP layout (each document padded to a
    multiple of 2 cp, so every row shards to ``seq_len``), every stage on the ring; the
    warm-start and RL losses and global gradient norms match a one-process run."""
    args = (*ONE_EACH, "--checkpoint.no-enable")
    single = _run(*args, "--job.dump_folder", str(tmp_path / "single"), nproc=None)
    assert single.returncode == 0, single.stderr[-3000:]
    run = _run(*args, "--parallelism.pipeline_parallel_degree", "2", "--parallelism.context_parallel_degree", "2",
               "--job.dump_folder", str(tmp_path / "pp_cp"), nproc=4)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    _assert_match(tmp_path / "single", tmp_path / "pp_cp")


@pytest.mark.slow
def test_a_mixture_of_experts_pipeline_job_matches_one_process(tmp_path):
    """``debug_cpu_moe.toml``'s policy in two stages (pp=2, no expert parallelism: 2 ranks
    leave no data-parallel ones to hold ep groups) and in one process: warm-start and RL
    losses, the load-balancing loss pooled over both stages' routers, the global gradient
    norms and the speculative rollouts match."""
    args = ("--job.config_file", "train_configs/debug_cpu_moe.toml", *ONE_EACH, "--checkpoint.no-enable",
            "--parallelism.expert_parallel_degree", "1", "--metrics.no-enable_tensorboard")
    # The load-balancing loss pools a forward's tokens: one process runs the pipeline's
    # microbatches of one row (the default pipeline_parallel_microbatch_size).
    single = _run(*args, "--training.local_batch_size", "1", "--job.dump_folder", str(tmp_path / "single"),
                  nproc=None)
    assert single.returncode == 0, single.stderr[-3000:]
    run = _run(*args, "--parallelism.pipeline_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "1",
               "--job.dump_folder", str(tmp_path / "pp"))
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    _assert_match(tmp_path / "single", tmp_path / "pp", (*MATCHED, "loss/moe_aux"))
    assert all(m["loss/moe_aux"] > 0 for m in _metrics(tmp_path / "pp"))


@pytest.mark.slow
def test_pipeline_with_data_parallelism_matches_fsdp_and_resumes_exactly(tmp_path):
    """pp=2 x dp=2 on 4 ranks: the stages are replicated over the data-parallel ranks, which
    generate and train their own rollouts and sum their gradients. Data-parallel ranks draw
    their own prompts and demonstrations, so the reference is the same job on 2 FSDP ranks
    (itself tested against one device): losses, rewards and global gradient norms match. A
    resume from the step-1 checkpoint repeats the RL step bit-identically."""
    args = (*ONE_EACH, "--checkpoint.interval", "1")
    fsdp = _run(*args, "--checkpoint.no-enable", "--job.dump_folder", str(tmp_path / "fsdp"))
    assert fsdp.returncode == 0, fsdp.stdout[-3000:] + fsdp.stderr[-3000:]
    pp_args = ("--parallelism.pipeline_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "2")
    run = _run(*args, *pp_args, "--job.dump_folder", str(tmp_path / "pp_dp"), nproc=4)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    _assert_match(tmp_path / "fsdp", tmp_path / "pp_dp")

    resumed = tmp_path / "resumed"
    shutil.copytree(tmp_path / "pp_dp" / "checkpoint" / "step-1", resumed / "checkpoint" / "step-1")
    again = _run(*args, *pp_args, "--job.dump_folder", str(resumed), nproc=4)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert "resumed from step 1" in again.stdout
    _assert_repeated_exactly(_metrics(tmp_path / "pp_dp")[1:], _metrics(resumed))


@pytest.mark.slow
def test_a_step_a_rank_cannot_run_stops_every_rank_with_one_message(tmp_path):
    """Nothing trainable after packing (every demonstration longer than the rows), or a
    prompt that leaves no room for the rollout: each rank raises the same error naming the
    failing ranks, instead of the healthy ones waiting at the next collective."""
    packing = _run(*SHORT, "--training.seq_len", "16", "--rollout.max_new_tokens", "8",
                   "--job.dump_folder", str(tmp_path / "packing"))
    assert packing.returncode != 0
    assert "step 1: rank 0: no trainable sample" in packing.stderr and "; rank 1: no trainable" in packing.stderr
    rollout = _run(*SHORT, "--task.sft_steps", "0", "--training.seq_len", "16", "--rollout.max_new_tokens", "12",
                   "--job.dump_folder", str(tmp_path / "rollout"))
    assert rollout.returncode != 0
    assert "plus rollout.max_new_tokens = 12 exceeds the engine's 16 positions" in rollout.stderr


def _fail_on_rank_one(rank, world_size):
    from titan_cotrain.rl.host_sync import HostSync
    from titan_cotrain.rl.run_mode import RealRun

    sync = HostSync(torch.device("cpu"), RealRun())
    sync.stop_if_any_rank_failed(None, 5)  # nobody failed: every rank goes on
    assert sync.most_or_stop(3 + rank, None, 5) == 4  # the packed rows every rank pads to
    with pytest.raises(ValueError) as err:
        sync.stop_if_any_rank_failed("boom" if rank == 1 else None, 5)
    assert str(err.value) == "step 5: rank 1: boom"


def test_every_rank_raises_what_one_rank_met():
    from tests.multiprocess import run_on_ranks

    run_on_ranks(_fail_on_rank_one, 2)
