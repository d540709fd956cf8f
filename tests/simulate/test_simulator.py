"""The scale simulator: it runs the real job on the fake accelerator, counts what the code
allocates (checked against the analytic count of sharded parameters and AdamW state),
refuses a rank over budget naming its biggest category, and flags a collective handed a
host tensor with its file and line."""

import json

import pytest
import torch
import torch.distributed as dist

from titan_cotrain.config import load_job_config
from titan_cotrain.models.build import build_draft, build_target
from titan_cotrain.simulate.run import SimulationFailed, simulate

WORLD = 8


def _config(tmp_path, *extra):
    args = ["--job.config_file", "train_configs/debug_cpu.toml", "--job.dump_folder", str(tmp_path / "out"),
            "--parallelism.data_parallel_shard_degree", str(WORLD), "--training.mixed_precision_param", "bfloat16",
            "--simulate.enable", "--simulate.output", str(tmp_path / "report.json"), "--simulate.decode_rounds", "1",
            "--simulate.microbatches", "1", *extra]
    return load_job_config(args, world_size="config")


def test_parameter_and_optimizer_bytes_match_the_analytic_count(tmp_path):
    # A real shape (Qwen3-0.6B), so that allocator rounding of the debug model's tiny norms
    # does not dominate; on fake tensors it costs nothing.
    config = _config(tmp_path, "--model.name", "qwen3", "--model.flavor", "0.6B")
    result = simulate(config, "debug_cpu.toml")
    assert json.loads((tmp_path / "report.json").read_text()) == json.loads(json.dumps(result))
    rank = result["ranks"][0]
    policy = build_target(config, device="meta")
    draft = build_draft(config, policy, device="meta")
    n_params = sum(p.numel() for m in (policy, draft) for p in m.parameters())
    shard_gib = n_params * 4 / WORLD / 2**30  # fp32 masters, sharded 8 ways
    after = rank["after_step_gib"]
    assert after["parameters"] == pytest.approx(shard_gib, rel=0.05)
    assert after["optimizer state"] == pytest.approx(2 * shard_gib, rel=0.05)  # AdamW: exp_avg, exp_avg_sq
    assert after["KV cache"] > 0 and after["engine weights"] > 0
    assert rank["peak_gib"] >= sum(after.values()) * 0.99
    assert result["host_collectives"] == []
    rollout = result["rollout"]  # the engine's schedule over this rank's share
    assert rollout["requested_rows"] == config.rl.prompts_per_step // WORLD * config.rl.group_size
    assert 1 <= rollout["concurrent_min"] <= rollout["concurrent_median"] <= rollout["requested_rows"]
    assert rollout["kv_pool_gib"] == pytest.approx(rank["kv_pool_gib"]) and rollout["tp_group_nodes"] == 1
    assert rollout["rounds"] > 0 and rollout["modeled_rollout_s"] > 0


def test_the_simulator_measures_the_phases_the_trainer_takes(tmp_path):
    """The simulated step is ``Trainer.rl_step`` itself: the phases the report measures between
    the optimizers' state and the checkpoint are, in order, those a real one-process RL step
    of the same job enters (``RealRun.phase``)."""
    from titan_cotrain.rl.run_mode import RealRun
    from titan_cotrain.rl.trainer import Trainer

    seen: list[str] = []
    args = ["--job.config_file", "train_configs/debug_cpu.toml", "--job.dump_folder", str(tmp_path / "real"),
            "--task.sft_steps", "0", "--checkpoint.no-enable", "--metrics.no-enable_tensorboard",
            "--rollout.max_new_tokens", "8"]
    Trainer(load_job_config(args, world_size=1), 1, 0, mode=RealRun(on_phase=seen.append)).rl_step(1)
    assert seen == ["offload", "refresh", "rollout", "release", "restore", "pack", "update"]
    simulated = simulate(_config(tmp_path), "debug_cpu.toml")["ranks"][0]["phase_peak_gib"]
    assert list(simulated) == ["construction", "optimizer state", *seen, "checkpoint"]


def test_the_evaluation_phase_is_simulated_and_adds_nothing_to_the_update(tmp_path):
    """With ``[eval]`` on, the first RL step evaluates the policy RL starts from (an ``eval``
    phase between the refresh and the rollout, on the refreshed engine): the simulator measures
    it as the trainer takes it, below the rollout's peak (the same engine, fewer rows), and the
    update's peak is the one without it."""
    from titan_cotrain.rl.run_mode import RealRun
    from titan_cotrain.rl.trainer import Trainer

    seen: list[str] = []
    args = ["--job.config_file", "train_configs/debug_cpu.toml", "--job.dump_folder", str(tmp_path / "real"),
            "--task.sft_steps", "0", "--checkpoint.no-enable", "--metrics.no-enable_tensorboard",
            "--rollout.max_new_tokens", "8", "--eval.enable", "--eval.prompts", "2"]
    Trainer(load_job_config(args, world_size=1), 1, 0, mode=RealRun(on_phase=seen.append)).rl_step(1)
    assert seen == ["offload", "refresh", "eval", "rollout", "release", "restore", "pack", "update"]
    assert (tmp_path / "real" / "eval" / "eval_step0.json").is_file()
    plain = simulate(_config(tmp_path), "debug_cpu.toml")["ranks"][0]["phase_peak_gib"]
    evaluated = simulate(_config(tmp_path, "--eval.enable", "--eval.prompts", "2"),
                         "debug_cpu.toml")["ranks"][0]["phase_peak_gib"]
    assert list(evaluated) == ["construction", "optimizer state", *seen, "checkpoint"]
    assert evaluated["eval"] <= evaluated["rollout"] and evaluated["update"] == plain["update"]


def test_the_draft_prefit_is_simulated_before_the_rl_steps(tmp_path):
    """With ``[draft] prefit_steps``, the simulator runs one prefit step (the last before RL)
    as the trainer writes it, then the two RL steps; the prefit's update (the draft's alone, the
    policy's forward and zero-weight backward) peaks no higher than RL's, whose peaks the
    prefit leaves as they were."""
    plain = simulate(_config(tmp_path), "debug_cpu.toml")["ranks"][0]["phase_peak_gib"]
    prefit = simulate(_config(tmp_path, "--draft.prefit_steps", "3"), "debug_cpu.toml")["ranks"][0]["phase_peak_gib"]
    # Dictionary order: each phase where it first came (the RL steps' offload and restore are the prefit's keys).
    assert list(prefit) == ["construction", "optimizer state", "offload", "prefit refresh", "prefit generate",
                            "prefit release", "restore", "prefit pack", "prefit update", "refresh", "rollout",
                            "release", "pack", "update", "checkpoint"]
    assert prefit["prefit update"] <= prefit["update"]
    assert all(prefit[name] == plain[name] for name in ("rollout", "update", "checkpoint"))


def test_a_dataset_task_simulates_without_its_file(tmp_path, monkeypatch):
    """The simulator never reads ``[task] dataset_path``: its prompts are synthetic, of
    ``[simulate] prompt_tokens`` (here capped by the 128 - 64 = 64-token prompt budget)."""
    from titan_cotrain.engine.rollout import RolloutEngine

    lengths = []
    start = RolloutEngine.start

    def recording_start(self, prompts, *args, **kwargs):
        lengths.extend(len(p) for p in prompts for _ in range(kwargs["samples_per_prompt"]))
        return start(self, prompts, *args, **kwargs)

    monkeypatch.setattr(RolloutEngine, "start", recording_start)
    config = _config(tmp_path, "--task.name", "gsm8k", "--task.dataset_path", str(tmp_path / "none.jsonl"),
                     "--simulate.prompt_tokens", "100")
    result = simulate(config, "debug_cpu.toml")
    assert result["ranks"][0]["peak_gib"] > 0 and result["host_collectives"] == []
    # Two simulated RL steps, each generating this rank's share.
    assert set(lengths) == {64} and len(lengths) == 2 * config.rl.prompts_per_step // WORLD * config.rl.group_size


def test_a_rank_over_budget_is_refused_naming_its_biggest_category(tmp_path):
    config = _config(tmp_path, "--simulate.gpu_memory_gib", "0.001")
    with pytest.raises(SimulationFailed, match=r"rank 0 .* over the 0\.001 GiB budget; the biggest category is "):
        simulate(config, "debug_cpu.toml")
    assert json.loads((tmp_path / "report.json").read_text())["ranks"][0]["peak_gib"] > 0.001


def test_a_collective_on_a_host_tensor_is_flagged_with_its_caller(tmp_path, monkeypatch):
    from titan_cotrain.rl.host_sync import HostSync

    def host_all_reduce(self, values, op=dist.ReduceOp.SUM):
        t = torch.tensor(values, dtype=torch.float64)  # stays on the host: what NCCL rejects
        dist.all_reduce(t, op=op)
        return values

    monkeypatch.setattr(HostSync, "all_reduce", host_all_reduce)
    with pytest.raises(SimulationFailed, match=r"collective on a host tensor: rank 0: c10d\.allreduce_.* at rl/host_sync\.py:\d+ \(most_or_stop\)"):
        simulate(_config(tmp_path), "debug_cpu.toml")


def test_check_at_start_refuses_a_job_that_does_not_fit(tmp_path, capsys):
    from titan_cotrain.train import main

    rc = main(["--job.config_file", "train_configs/debug_cpu.toml", "--job.dump_folder", str(tmp_path / "out"),
               "--simulate.check_at_start", "--simulate.gpu_memory_gib", "0.001", "--simulate.decode_rounds", "1",
               "--simulate.microbatches", "1"])
    assert rc == 1
    assert "does not fit: rank 0 (single) needs" in capsys.readouterr().err
    report = json.loads((tmp_path / "out" / "scale_check.json").read_text())
    assert report["world_size"] == 1 and report["ranks"][0]["peak_gib"] > 0.001
    assert not (tmp_path / "out" / "metrics.jsonl").exists()  # refused before training


@pytest.mark.slow
def test_pipeline_ranks_are_simulated_each_in_a_fresh_process(tmp_path):
    """PP 2 x FSDP 2 (world 4): rank 0 (first stage) and rank 2 (the last stage, with the
    draft) are both simulated, each in a process of its own, with every collective on the
    device (the last stage's clip and the stages' broadcasts included)."""
    args = ["--job.config_file", "train_configs/debug_cpu.toml", "--job.dump_folder", str(tmp_path / "out"),
            "--parallelism.pipeline_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "2",
            "--training.mixed_precision_param", "bfloat16", "--simulate.enable",
            "--simulate.output", str(tmp_path / "report.json"), "--simulate.decode_rounds", "1"]
    result = simulate(load_job_config(args, world_size="config"), "debug_cpu.toml", args=(args, "config"))
    assert [(r["rank"], r["role"]) for r in result["ranks"]] == [(0, "pp stages [0], dp 0/2"),
                                                                 (2, "pp stages [1], dp 0/2")]
    first, last = result["ranks"]
    assert last["after_step_gib"]["parameters"] > 0 and first["after_step_gib"]["KV cache"] > 0
    assert result["host_collectives"] == []


def test_offloaded_training_state_leaves_the_rollout_s_device_memory(tmp_path):
    """``[rollout] offload_training_state``: during the rollout the device holds neither the
    fp32 shards nor the optimizer state; the report counts them as host bytes, and the
    rollout phase's peak drops by them."""
    shape = ("--model.name", "qwen3", "--model.flavor", "0.6B")
    resident = simulate(_config(tmp_path, *shape), "debug_cpu.toml")["ranks"][0]
    moved = simulate(_config(tmp_path, *shape, "--rollout.offload_training_state"), "debug_cpu.toml")["ranks"][0]
    after = resident["after_step_gib"]
    state = after["parameters"] + after["optimizer state"] + after.get("reference", 0) + after.get("gradients", 0)
    assert resident["offloaded_gib"] == 0
    assert moved["offloaded_gib"] == pytest.approx(state, rel=0.02)
    drop = resident["phase_peak_gib"]["rollout"] - moved["phase_peak_gib"]["rollout"]
    assert drop == pytest.approx(moved["offloaded_gib"], rel=0.05)
    assert moved["after_step_gib"] == pytest.approx(after, rel=1e-6)  # all of it back for the update


@pytest.mark.parametrize("name, world, ranks", [("qwen3_32b_pp_cp", 16, [0, 4, 12]),
                                                ("llama3_70b_pp_cp", 32, [0, 2, 6])])
def test_every_pipeline_role_is_simulated(name, world, ranks):
    """The real-scale PP configs' default simulated ranks: the embedding's PP rank, the head's
    (with the draft), and the middle rank holding the most decoder layers (17 of 64 at 32B,
    21 of 80 at 70B: one more than the embedding's rank, two more than the head's). At 70B the
    data-parallel coordinate is outermost (its engine TP 8 in a node): PP rank ``r`` starts at
    rank ``2r``, not ``8r``."""
    from titan_cotrain.models.build import resolve_model_args
    from titan_cotrain.parallel.pipeline.build import plan_from_config
    from titan_cotrain.parallel.rank_layout import rank_layout
    from titan_cotrain.simulate.run import _default_ranks, world_size_of

    config = load_job_config(["--job.config_file", f"train_configs/{name}.toml", "--simulate.enable"],
                             world_size="config")
    assert world_size_of(config) == world and _default_ranks(config, world) == ranks
    plan = plan_from_config(config, resolve_model_args(config).n_layers)
    layers = [sum(len(plan.layer_ranges[s]) for s in plan.stages_of(r)) for r in range(4)]
    pp_ranks = [rank_layout(config, world).rank(p, 0, 0) for p in range(4)]
    assert layers[pp_ranks.index(ranks[1])] == max(layers) == layers[0] + 1 == layers[-1] + 2


def test_an_auto_kv_pool_keeps_the_margin_in_the_phases_that_hold_it(tmp_path):
    """``[rollout] kv_cache_gib = "auto"`` on a 4.3 GiB simulated GPU: the pool is smaller than the
    whole batch at its longest (what 0 would give), it is reported, and the phases that hold
    it (the rollout, and the refresh that re-allocates it after the update) peak within 90% of
    the GPU. The update, with the pool released, is not the pool's: at this toy shape its
    draft logits alone exceed the GPU, so the job is refused there."""
    shape = ("--model.name", "qwen3", "--model.flavor", "0.6B", "--rollout.release_between_rollouts")
    whole = simulate(_config(tmp_path, *shape), "debug_cpu.toml")["ranks"][0]["kv_pool_gib"]
    with pytest.raises(SimulationFailed, match=r"over the 4.3 GiB budget; the biggest category is activations"):
        simulate(_config(tmp_path, *shape, "--rollout.kv_cache_gib", "auto", "--simulate.gpu_memory_gib", "4.3"),
                 "debug_cpu.toml")
    rank = json.loads((tmp_path / "report.json").read_text())["ranks"][0]
    assert 0 < rank["kv_pool_gib"] < whole
    for phase in ("construction", "optimizer state", "rollout", "refresh", "checkpoint"):
        assert rank["phase_peak_gib"][phase] <= 0.9 * 4.3, phase
    assert rank["peak_phase"] == "update"


@pytest.mark.slow
def test_a_released_tensor_parallel_engine_leaves_the_update(tmp_path):
    """With ``release_between_rollouts`` a tensor-parallel engine's weights (DTensor slices)
    and its pool (sized by ``"auto"``) are freed after the rollout: after the step only the engine's buffers remain,
    as with an engine of one rank, and the update peaks lower than with the engine kept.
    Reading a released DTensor's storage through a view would allocate it again on the
    fake device; the simulator reads the local shard itself."""
    shape = ["--model.name", "qwen3", "--model.flavor", "0.6B", "--parallelism.data_parallel_shard_degree", "4",
             "--parallelism.context_parallel_degree", "2", "--rollout.tensor_parallel_degree", "2"]
    def rank_0(*extra):  # each in a process of its own: a second fake world with TP groups trips in one
        args = ["--job.config_file", "train_configs/debug_cpu.toml", "--job.dump_folder", str(tmp_path / "out"),
                "--training.mixed_precision_param", "bfloat16", "--simulate.enable", "--simulate.output",
                str(tmp_path / "report.json"), "--simulate.decode_rounds", "1", "--simulate.microbatches", "1",
                *shape, *extra]
        return simulate(load_job_config(args, world_size="config"), "debug_cpu.toml",
                        args=(args, "config"))["ranks"][0]

    # The released engine's pool is "auto": a tensor-parallel group's agreement on it is one
    # more collective the fake group answers without values (the rank's own budget stands).
    # On the default 80 GiB it reaches the whole batch at its longest, the fixed pool's size.
    kept, released = rank_0(), rank_0("--rollout.release_between_rollouts", "--rollout.kv_cache_gib", "auto")
    assert released["kv_pool_gib"] == kept["kv_pool_gib"] > 0
    buffers = released["after_step_gib"]["buffers"]
    assert released["after_step_gib"]["engine weights"] == pytest.approx(buffers, rel=0.01)
    assert released["after_step_gib"]["KV cache"] == 0
    engine = kept["after_step_gib"]["engine weights"] + kept["after_step_gib"]["KV cache"]
    assert engine > 0.4  # this rank's half of a 1.2 GiB bf16 copy, and its pool
    assert kept["phase_peak_gib"]["update"] - released["phase_peak_gib"]["update"] == pytest.approx(engine, rel=0.05)


@pytest.mark.parametrize("ep", [1, 2])
def test_a_mixture_of_experts_runs_grouped_matmuls_with_balanced_dispatch(tmp_path, monkeypatch, ep):
    """Qwen3 ``debugmoe`` on the simulated device, which stands for a GPU: every MoE call (the
    policy's update, the engine's rollout) runs torchtitan's grouped-matmul experts, whose
    counts stay on the device (its per-expert loop reads them on the host, which fake tensors
    cannot). Under expert parallelism the dispatch's split sizes are the balanced stand-in, a
    modelling assumption the report states: each rank's experts get their even share, the
    layer's ``N x top_k`` routed rows, padded by the dispatch as torchtitan pads them per local
    expert (``round_up(N top_k + local experts x 8, 8)`` rows; without EP the experts pad
    their ``N x top_k`` rows themselves)."""
    from torch.distributed.tensor import DTensor
    from torchtitan.models.moe import moe as titan_moe

    from titan_cotrain.models.args import model_args_for
    from titan_cotrain.simulate.run import BALANCED_DISPATCH

    tokens, calls = [], []
    moe_forward, experts_forward = titan_moe.MoE.forward, titan_moe.GroupedExperts.forward

    def moe(self, x):
        tokens.append(x.shape[0] * x.shape[1])
        return moe_forward(self, x)

    def experts(self, x, num_tokens_per_expert):
        local = self.w1.to_local().shape[0] if isinstance(self.w1, DTensor) else self.w1.shape[0]
        calls.append((self.use_grouped_mm, tokens[-1], local, x.shape[0]))
        return experts_forward(self, x, num_tokens_per_expert)

    monkeypatch.setattr(titan_moe.MoE, "forward", moe)
    monkeypatch.setattr(titan_moe.GroupedExperts, "forward", experts)
    result = simulate(_config(tmp_path, "--model.name", "qwen3", "--model.flavor", "debugmoe",
                              "--parallelism.expert_parallel_degree", str(ep)), "debug_cpu.toml")
    assert result["host_collectives"] == [] and result["ranks"][0]["peak_gib"] > 0
    assert result.get("expert_parallel_dispatch") == (BALANCED_DISPATCH if ep > 1 else None)
    args = model_args_for("qwen3", "debugmoe")
    assert {local for _, _, local, _ in calls} == {args.n_experts // ep, args.n_experts}  # the policy's, the engine's
    for grouped, n, local, rows in calls:
        dispatched = local < args.n_experts
        assert grouped and rows == (-(-(n * args.top_k + local * 8) // 8) * 8 if dispatched else n * args.top_k)
