"""``[draft] kind = "dflash"``: a job co-trains a block drafter inside the policy step and
speculates with it. The warm start and RL train it (its per-position accuracies logged under
the draft's names), the rollouts draft blocks and report the acceptance the training accuracy
predicts, the export writes a DFlash folder that loads back, a resumed job repeats the
uninterrupted one, and what is not built yet is refused naming the keys."""

import shutil

import pytest
import torch

from tests.test_train import (
    LEADER_GENERATES,
    ONE_EACH,
    REPO,
    SHORT,
    _assert_match,
    _assert_repeated_exactly,
    _metrics,
    _run,
)
from titan_cotrain.config import ConfigError, load_job_config

CONFIG = ("--job.config_file", str(REPO / "train_configs" / "debug_cpu.toml"))
BLOCK = ("--draft.kind", "dflash", "--draft.block_size", "4", "--draft.block_layers", "2",
         "--draft.blocks_per_doc", "4", "--rollout.draft_tokens", "3", "--rollout.no-adaptive_speculation")
# What a parallel run of a block-drafter job must log as one process does (1e-4, _assert_match).
MATCHED = ("loss/policy", "loss/draft", "grad_norm/policy", "grad_norm/draft",
           *(f"draft/{kind}_pass{j}" for kind in ("acc", "accept") for j in (1, 2, 3)))


def test_a_job_co_trains_a_block_drafter_and_speculates_with_it(tmp_path):
    from titan_cotrain.models.block_draft import BlockDrafter
    from titan_cotrain.models.dflash import load_dflash
    from titan_cotrain.rl.trainer import Trainer

    config = load_job_config([*CONFIG, *SHORT, *BLOCK, "--job.dump_folder", str(tmp_path), "--checkpoint.no-enable",
                              "--metrics.no-enable_tensorboard"], world_size=1)
    trainer = Trainer(config, world_size=1, rank=0)
    assert isinstance(trainer.draft, BlockDrafter) and trainer.policy.tap_layers == trainer.draft.args.target_layer_ids
    before = {k: v.clone() for k, v in trainer.draft.state_dict().items()}
    trainer.run()
    metrics = _metrics(tmp_path)
    rl = [m for m in metrics if m["phase"] == "rl"]
    assert [m["phase"] for m in metrics].count("sft") == 2 and len(rl) == 2
    for m in metrics:
        assert all(f"draft/{kind}_pass{j}" in m for kind in ("loss", "acc", "accept") for j in (1, 2, 3)), m.keys()
        assert "draft/acc_pass4" not in m
    for m in rl:
        assert m["rollout/draft_tokens"] == 3.0 and m["rollout/acceptance_length"] >= 1.0
        assert "rollout/acceptance_over_tau" in m
    after = trainer.draft.state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before), "the drafter did not train"
    loaded = load_dflash(tmp_path / "export" / "draft")
    assert loaded.args == trainer.draft.args
    assert all(torch.equal(loaded.state_dict()[k], after[k].float()) for k in after)


def test_a_resumed_block_drafter_job_repeats_the_uninterrupted_one(tmp_path):
    """The anchors are drawn from the job's seed, the step and the rank: a job resumed from the
    uninterrupted one's checkpoint of its last warm-start step repeats its RL steps exactly."""
    common = [*CONFIG, *SHORT, *BLOCK, "--metrics.no-enable_tensorboard"]
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    result = _run(*common, "--job.dump_folder", str(whole), nproc=None)
    assert result.returncode == 0, result.stderr[-3000:]
    shutil.copytree(whole / "checkpoint" / "step-2", resumed / "checkpoint" / "step-2")
    result = _run(*common, "--job.dump_folder", str(resumed), nproc=None)
    assert result.returncode == 0, result.stderr[-3000:]
    again = _metrics(resumed)
    assert [m["step"] for m in again] == [3, 4]
    _assert_repeated_exactly([m for m in _metrics(whole) if m["step"] > 2], again)


@pytest.mark.parametrize("flags, message", [
    (("--rollout.compile",), "rollout.compile"),
    (("--draft.vocab_size", "100"), "draft.vocab_size = 100"),
    (("--rollout.draft_tokens", "4"), "at most draft.block_size - 1 (3)"),
    (("--draft.block_size", "1"), "draft.block_size (1) must be >= 2"),
])
def test_what_the_block_drafter_does_not_do_yet_is_refused_with_the_key(flags, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_job_config([*CONFIG, *BLOCK, *flags], world_size=2)


def test_a_block_drafter_job_runs_under_fsdp_on_two_processes(tmp_path):
    """FSDP 2: the drafter sharded beside the policy, its loss inside the policy step (the head's
    weight copied from the gathered one), the engine refreshed from the shards; the export
    loads back."""
    from titan_cotrain.models.dflash import load_dflash

    result = _run(*CONFIG, *SHORT, *BLOCK, "--metrics.no-enable_tensorboard", "--checkpoint.no-enable",
                  "--job.dump_folder", str(tmp_path), nproc=2)
    assert result.returncode == 0, result.stderr[-3000:]
    rl = [m for m in _metrics(tmp_path) if m["phase"] == "rl"]
    assert len(rl) == 2 and all(m["rollout/draft_tokens"] == 3.0 and "draft/acc_pass3" in m for m in rl)
    assert load_dflash(tmp_path / "export" / "draft").args.block_size == 4


@pytest.mark.slow
def test_a_block_drafter_job_under_context_parallelism_matches_one_process(tmp_path):
    """CP 2: the two ranks train zigzag shards of the one-process job's rows; the drafter's
    anchors, context (every rank's, ``BlockContextRing``) and halo rows make its loss, gradient
    norm and per-position accuracies the one-process run's."""
    args = (*CONFIG, *SHORT, *BLOCK, "--training.steps", "1", "--checkpoint.no-enable",
            "--metrics.no-enable_tensorboard", *LEADER_GENERATES)
    single = _run(*args, "--job.dump_folder", str(tmp_path / "single"), nproc=None)
    assert single.returncode == 0, single.stderr[-3000:]
    cp = _run(*args, "--parallelism.context_parallel_degree", "2", "--job.dump_folder", str(tmp_path / "cp"))
    assert cp.returncode == 0, cp.stdout[-3000:] + cp.stderr[-3000:]
    assert all(key in m for m in _metrics(tmp_path / "single") for key in MATCHED)
    _assert_match(tmp_path / "single", tmp_path / "cp", MATCHED)


@pytest.mark.slow
def test_a_block_drafter_job_with_a_tensor_parallel_engine_matches_one_process(tmp_path):
    """``[rollout] tensor_parallel_degree = 2`` over the two CP ranks: the engine group splits
    the policy's copy, the drafter whole on both ranks; the rollouts (rewards, acceptance) and
    the training they feed are the one-process job's."""
    args = (*CONFIG, *SHORT, *BLOCK, "--training.steps", "1", "--checkpoint.no-enable",
            "--metrics.no-enable_tensorboard")
    single = _run(*args, "--job.dump_folder", str(tmp_path / "single"), nproc=None)
    assert single.returncode == 0, single.stderr[-3000:]
    tp = _run(*args, "--parallelism.context_parallel_degree", "2", "--rollout.tensor_parallel_degree", "2",
              "--job.dump_folder", str(tmp_path / "tp"))
    assert tp.returncode == 0, tp.stdout[-3000:] + tp.stderr[-3000:]
    rl = [m for m in _metrics(tmp_path / "tp") if m["phase"] == "rl"]
    assert rl and all(m["rollout/draft_tokens"] == 3.0 for m in rl)
    _assert_match(tmp_path / "single", tmp_path / "tp", (*MATCHED, "reward/mean", "rollout/acceptance_length"))


@pytest.mark.slow
def test_a_block_drafter_job_under_pipeline_parallelism_matches_one_process(tmp_path):
    """PP 2 (1F1B, microbatches of one row): the drafter on the last stage trains on the taps
    and embeddings the TapChannel brings and the head's input and weight its stage kept; the
    warm-start and RL losses, gradient norms, per-position accuracies and the rollouts'
    acceptance match one process, and the export gathers a DFlash folder that loads back."""
    from titan_cotrain.models.dflash import load_dflash

    args = (*CONFIG, *SHORT, *BLOCK, "--rl.updates_per_step", "2", "--training.local_batch_size", "2",
            "--training.steps", "1", "--checkpoint.no-enable", "--metrics.no-enable_tensorboard", *LEADER_GENERATES)
    single = _run(*args, "--job.dump_folder", str(tmp_path / "single"), nproc=None)
    assert single.returncode == 0, single.stderr[-3000:]
    pp = _run(*args, "--parallelism.pipeline_parallel_degree", "2", "--job.dump_folder", str(tmp_path / "pp"))
    assert pp.returncode == 0, pp.stdout[-3000:] + pp.stderr[-3000:]
    _assert_match(tmp_path / "single", tmp_path / "pp", (*MATCHED, "rollout/acceptance_length"))
    loaded, single_loaded = (load_dflash(tmp_path / run / "export" / "draft") for run in ("pp", "single"))
    assert loaded.args == single_loaded.args
    for name, value in single_loaded.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[name], value, rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.slow
def test_a_block_drafter_job_under_pipeline_and_context_parallelism_matches_one_process(tmp_path):
    """PP 2 x CP 2 on 4 ranks: the TapChannel brings each CP rank's shard of the taps to its
    last stage, where the drafter's context spans the CP pair; losses, gradient norms and the
    rollouts' acceptance match one process."""
    args = (*CONFIG, *ONE_EACH, *BLOCK, "--checkpoint.no-enable", "--metrics.no-enable_tensorboard")
    single = _run(*args, "--job.dump_folder", str(tmp_path / "single"), nproc=None)
    assert single.returncode == 0, single.stderr[-3000:]
    run = _run(*args, "--parallelism.pipeline_parallel_degree", "2", "--parallelism.context_parallel_degree", "2",
               "--job.dump_folder", str(tmp_path / "ppcp"), nproc=4)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    _assert_match(tmp_path / "single", tmp_path / "ppcp", (*MATCHED, "rollout/acceptance_length"))


@pytest.mark.slow
def test_the_exports_carry_the_mask_row_sglang_embeds_the_mask_token_with(tmp_path):
    """``[draft] mask_token_id``: the job's export writes the drafter's mask embedding into that
    row of the policy's embedding (the rest unchanged) and names it in the DFlash config, so a
    drafter folder without its own mask tensor, read with the exported policy's embedding (as
    SGLang reads it), is the same drafter; the export command writes the job's bytes from its
    last checkpoint."""
    from safetensors.torch import load_file

    from titan_cotrain.export import main as export_main
    from titan_cotrain.models.dflash import load_dflash

    mask_row = 255  # the debug policy's embedding has 256 rows, its tokenizer fewer ids
    args = (*CONFIG, *SHORT, *BLOCK, "--metrics.no-enable_tensorboard", "--draft.mask_token_id", str(mask_row))
    result = _run(*args, "--job.dump_folder", str(tmp_path / "job"), nproc=None)
    assert result.returncode == 0, result.stderr[-3000:]
    export = tmp_path / "job" / "export"
    policy = load_file(export / "policy" / "model.safetensors")["model.embed_tokens.weight"]
    draft = load_file(export / "draft" / "model.safetensors")
    assert torch.equal(policy[mask_row], draft["mask_embedding"].to(policy))
    assert (export / "draft" / "config.json").read_text().count(f'"mask_token_id": {mask_row}') == 1

    checkpoint = str(tmp_path / "job" / "checkpoint")
    assert export_main([*args, "--checkpoint", checkpoint, "--out", str(tmp_path / "cli")]) == 0
    for part in ("policy", "draft"):
        assert (tmp_path / "cli" / part / "model.safetensors").read_bytes() == \
            (export / part / "model.safetensors").read_bytes(), part
    assert export_main([*args, "--draft.mask_token_id", "-1", "--checkpoint", checkpoint,
                        "--out", str(tmp_path / "plain")]) == 0
    plain = load_file(tmp_path / "plain" / "policy" / "model.safetensors")["model.embed_tokens.weight"]
    others = torch.arange(plain.shape[0]) != mask_row
    assert torch.equal(plain[others], policy[others]) and not torch.equal(plain[mask_row], policy[mask_row])

    as_sglang = tmp_path / "as_sglang"
    shutil.copytree(export / "draft", as_sglang)
    from safetensors.torch import save_file
    save_file({k: v for k, v in draft.items() if k != "mask_embedding"}, as_sglang / "model.safetensors")
    loaded = load_dflash(as_sglang, target_embedding=policy.float())
    mine = load_dflash(export / "draft")
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in mine.state_dict().items())


def test_a_mask_row_outside_the_embedding_or_on_a_tied_head_is_refused():
    from titan_cotrain.models.args import model_args_for
    from titan_cotrain.models.build import check_mask_token_id

    args = model_args_for("qwen3", "debugmodel").replace(vocab_size=64, tie_embeddings=False)
    check_mask_token_id(-1, args)
    check_mask_token_id(63, args)
    with pytest.raises(ValueError, match=r"not a row of the policy's embedding \[0, 64\)"):
        check_mask_token_id(64, args)
    with pytest.raises(ValueError, match="ties its embedding to its head"):
        check_mask_token_id(3, args.replace(tie_embeddings=True))
    with pytest.raises(ConfigError, match="draft.mask_token_id"):
        load_job_config([*CONFIG, *BLOCK, "--draft.mask_token_id", "-2"], world_size=1)


def test_a_block_drafter_starts_from_a_dflash_folder(tmp_path):
    """``[draft] init_path`` with ``kind = "dflash"``: the job's drafter starts as the folder's
    (its own mask tensor, or the policy's row ``mask_token_id`` without it); a folder of
    another shape is refused naming what differs."""
    from titan_cotrain.models.block_draft import BlockDraftArgs, BlockDrafter
    from titan_cotrain.models.dflash import save_dflash
    from titan_cotrain.rl.trainer import Trainer

    base = [*CONFIG, *SHORT, *BLOCK, "--job.dump_folder", str(tmp_path / "job"), "--checkpoint.no-enable",
            "--metrics.no-enable_tensorboard"]
    plain = Trainer(load_job_config(base, world_size=1), world_size=1, rank=0)
    args = plain.draft.args
    folder = tmp_path / "published"
    theirs = BlockDrafter(args)
    theirs.init_weights(std=0.05, generator=torch.Generator().manual_seed(7))
    save_dflash(theirs, folder, n_target_layers=plain.policy.args.n_layers, mask_token_id=255)
    started = Trainer(load_job_config([*base, "--draft.init_path", str(folder)], world_size=1), world_size=1, rank=0)
    for name, value in theirs.state_dict().items():
        assert torch.equal(started.draft.state_dict()[name], value), name

    other = tmp_path / "other"
    save_dflash(BlockDrafter(BlockDraftArgs.from_target(plain.policy.args, n_layers=1, block_size=4,
                                                        target_layer_ids=args.target_layer_ids)),
                other, n_target_layers=plain.policy.args.n_layers)
    with pytest.raises(ValueError, match=r"num_hidden_layers 1 \(the job's: 2\)"):
        Trainer(load_job_config([*base, "--draft.init_path", str(other)], world_size=1), world_size=1, rank=0)
