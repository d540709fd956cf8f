"""``python -m titan_cotrain.export`` on the checkpoints of 2-process FSDP, CP, PP and
expert-parallel (the MoE job's FSDP 2 x EP 2) jobs: the folders it writes are, byte for byte,
the ones each job's end wrote; transformers loads the policy with the checkpoint's logits; the
draft loads as a job's ``[draft] init_path``; a checkpoint without the draft exports the policy
alone. One job per layout serves every assertion (module-scoped fixtures); what cannot be
exported is tested on a checkpoint saved here, without a job."""

import contextlib
import io
import json
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file

from tests.test_train import SHORT, _run
from titan_cotrain.config import load_job_config
from titan_cotrain.export import DRAFT_PREFIX, ONE_RANK, CheckpointTensors
from titan_cotrain.export import main as export_main
from titan_cotrain.models.build import build_draft, build_target

# One warm-start and one RL step, checkpointed at the last.
JOB = (*SHORT, "--task.sft_steps", "1", "--training.steps", "1", "--training.local_batch_size", "2",
       "--checkpoint.interval", "100", "--metrics.no-enable_tensorboard")
LAYOUTS = {"fsdp": (), "cp": ("--parallelism.context_parallel_degree", "2"),
           "pp": ("--parallelism.pipeline_parallel_degree", "2"),
           "ep": ("--job.config_file", "train_configs/debug_cpu_moe.toml")}  # FSDP 2 x EP 2
POLICY_MODULES = ("embed_tokens", "layers", "norm", "lm_head")


@dataclass(frozen=True)
class Job:
    args: tuple[str, ...]  # the job's, which the export is given too
    dump: Path
    export: Path  # the CLI's export of the last checkpoint

    @property
    def step(self) -> Path:
        return self.dump / "checkpoint" / "step-2"


def _files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module", params=list(LAYOUTS))
def job(request, tmp_path_factory) -> Job:
    """A finished 2-process job of the layout, and the export of its checkpoint folder (the
    latest step; in this process: ``test_the_command_line_...`` runs it as a command)."""
    root = tmp_path_factory.mktemp(request.param)
    done = Job((*JOB, *LAYOUTS[request.param]), root / "job", root / "cli")
    result = _run(*done.args, "--job.dump_folder", str(done.dump))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert sorted(p.name for p in (done.dump / "checkpoint").iterdir()) == ["step-2"]
    with contextlib.redirect_stdout(io.StringIO()) as printed:
        assert export_main([*done.args, "--checkpoint", str(done.dump / "checkpoint"), "--out", str(done.export)]) == 0
    assert printed.getvalue() == (f"exported the policy and the draft of step 2 ({done.step}) to {done.export} "
                                  "in float32\n")
    return done


@pytest.mark.slow
def test_the_export_is_the_jobs_own_byte_for_byte(job):
    ours, the_jobs = _files(job.export), _files(job.dump / "export")
    assert sorted(ours) == sorted(the_jobs) == ["draft/config.json", "draft/model.safetensors", "policy/config.json",
                                                "policy/model.safetensors", "policy/tokenizer.json",
                                                "policy/tokenizer_config.json"]
    for name, data in the_jobs.items():
        assert ours[name] == data, name


@pytest.mark.slow
def test_transformers_loads_the_policy_with_the_checkpoints_logits(job):
    from tests.models.test_hf import MOE_TOL, TOL, _logits, transformers

    ours = build_target(load_job_config([*job.args, *ONE_RANK], world_size=1))
    saved = CheckpointTensors(str(job.step))
    ours.load_state_dict({name: saved[name] for name in ours.state_dict()})
    theirs = transformers.AutoModelForCausalLM.from_pretrained(job.export / "policy").eval()
    tokens = torch.randint(0, ours.args.vocab_size, (2, 48), generator=torch.Generator().manual_seed(0))
    tolerance = MOE_TOL if ours.args.n_experts else TOL
    torch.testing.assert_close(_logits(theirs, tokens), _logits(ours, tokens), **tolerance)


@pytest.mark.slow
def test_the_draft_loads_as_a_jobs_init_path(job):
    config = load_job_config([*job.args, "--draft.init_path", str(job.export / "draft"), *ONE_RANK], world_size=1)
    draft = build_draft(config, build_target(config, device="meta"))
    saved = CheckpointTensors(str(job.step), DRAFT_PREFIX)
    assert draft.state_dict().keys() == saved.keys()
    for name, t in draft.state_dict().items():
        assert torch.equal(t, saved[name]), name


def _export(capsys, *args: str) -> tuple[int, str, str]:
    status = export_main(list(args))
    out, err = capsys.readouterr()
    return status, out, err


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # the model-only save, in this process
def test_a_checkpoint_without_the_draft_exports_the_policy_and_says_so(job, tmp_path, capsys):
    """A model-only save (the policy's tensors alone, as ``last_save_model_only`` writes)."""
    saved = CheckpointTensors(str(job.step))
    dcp.save({name: saved[name] for name in saved if name.split(".")[0] in POLICY_MODULES},
             checkpoint_id=str(tmp_path / "step-2"), no_dist=True)
    status, out, err = _export(capsys, *job.args, "--checkpoint", str(tmp_path / "step-2"), "--out",
                               str(tmp_path / "out"))
    assert status == 0, err
    assert "holds no draft" in out and "exported the policy of step 2" in out
    policy_only = {f"policy/{name}": data for name, data in _files(job.dump / "export" / "policy").items()}
    assert _files(tmp_path / "out") == policy_only


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """``<dump>/checkpoint`` holding step 2 of the embedded job's models, as the trainer's
    checkpointer lays them out (the policy at the top level, the draft under ``draft``)."""
    config = load_job_config(list(ONE_RANK), world_size=1)
    policy = build_target(config)
    folder = tmp_path_factory.mktemp("dump") / "checkpoint"
    with pytest.warns(UserWarning, match="torch.distributed is disabled"):  # one process: the point
        dcp.save({**policy.state_dict(), "draft": build_draft(config, policy).state_dict()},
                 checkpoint_id=str(folder / "step-2"), no_dist=True)
    return folder


@pytest.mark.parametrize("args, message", [
    (("--checkpoint", "{dump}/nowhere"), "no checkpoint: {dump}/nowhere is not a folder"),
    (("--checkpoint", "{dump}"), "no checkpoint in {dump}: no step-N folder"),
    (("--checkpoint", "{dump}/checkpoint", "--step", "1"),
     "no checkpoint of step 1 in {dump}/checkpoint; its steps: 2"),
    (("--checkpoint", "{dump}/checkpoint/step-2", "--step", "1"), "--step 1, but {dump}/checkpoint/step-2 is the "
                                                                  "checkpoint of step 2"),
    (("--checkpoint", "{dump}/checkpoint", "--model.n_layers", "7"), "does not hold the config's policy (layers.7."),
    (("--checkpoint", "{dump}/checkpoint", "--model.n_layers", "9"), "layers.8.input_layernorm.weight missing"),
    (("--checkpoint", "{dump}/checkpoint", "--draft.hidden_size", "32"), "does not hold the config's draft"),
    (("--checkpoint", "{dump}/checkpoint", "--job.config_file", "{dump}/missing.toml"), "missing.toml"),
], ids=["no-folder", "no-step", "wrong-step", "step-folder-and-other-step", "shallower-policy", "deeper-policy",
        "other-draft", "missing-config"])
def test_what_cannot_be_exported_is_one_clear_error(checkpoint, tmp_path, capsys, args, message):
    dump = checkpoint.parent
    status, out, err = _export(capsys, *(a.format(dump=dump) for a in args), "--out", str(tmp_path / "out"))
    assert status == 2 and message.format(dump=dump) in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()


def test_the_command_line_prints_what_it_wrote(checkpoint, tmp_path):
    result = _run("--checkpoint", str(checkpoint), "--step", "2", "--out", str(tmp_path / "out"), "--dtype", "bfloat16",
                  nproc=None, module="titan_cotrain.export")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert result.stdout == (f"exported the policy and the draft of step 2 ({checkpoint / 'step-2'}) to "
                             f"{tmp_path / 'out'} in bfloat16\n")
    for model in ("policy", "draft"):
        config = json.loads((tmp_path / "out" / model / "config.json").read_text())
        weights = load_file(tmp_path / "out" / model / "model.safetensors")
        assert config["torch_dtype"] == "bfloat16" and weights["lm_head.weight"].dtype == torch.bfloat16
