"""``python -m titan_cotrain.export`` on the checkpoints of 2-process FSDP, CP and PP jobs: the
folders it writes are, byte for byte, the ones each job's end wrote; transformers loads the
policy with the checkpoint's logits, and the draft loads as a job's ``[draft] init_path``.
One job per layout serves every assertion (module-scoped fixtures)."""

from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from tests.test_train import SHORT, _run
from titan_cotrain.config import load_job_config
from titan_cotrain.eval import ONE_PROCESS
from titan_cotrain.export import DRAFT_PREFIX, CheckpointTensors
from titan_cotrain.export import main as export_main
from titan_cotrain.models.build import build_draft, build_target

# One warm-start and one RL step, checkpointed at the last.
JOB = (*SHORT, "--task.sft_steps", "1", "--training.steps", "1", "--training.local_batch_size", "2",
       "--checkpoint.interval", "100", "--metrics.no-enable_tensorboard")
LAYOUTS = {"fsdp": (), "cp": ("--parallelism.context_parallel_degree", "2"),
           "pp": ("--parallelism.pipeline_parallel_degree", "2")}


def _files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module", params=list(LAYOUTS))
def job(request, tmp_path_factory) -> Path:
    """The dump folder of a finished 2-process job of the layout, and the CLI's export of its
    last checkpoint beside it (``cli_export``)."""
    dump = tmp_path_factory.mktemp(request.param)
    result = _run(*JOB, *LAYOUTS[request.param], "--job.dump_folder", str(dump / "job"))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert sorted(p.name for p in (dump / "job" / "checkpoint").iterdir()) == ["step-2"]
    return dump


@pytest.fixture(scope="module")
def cli_export(job) -> Path:
    """``python -m titan_cotrain.export`` (a process of its own, as documented) on the job's
    checkpoint folder: its latest step."""
    out = job / "cli"
    result = _run(*JOB, "--checkpoint", str(job / "job" / "checkpoint"), "--out", str(out), nproc=None,
                  module="titan_cotrain.export")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    step = job / "job" / "checkpoint" / "step-2"
    assert result.stdout.strip() == f"exported the policy and the draft of step 2 ({step}) to {out} in float32"
    return out


@pytest.mark.slow
def test_the_export_is_the_jobs_own_byte_for_byte(job, cli_export):
    ours, the_jobs = _files(cli_export), _files(job / "job" / "export")
    assert sorted(ours) == sorted(the_jobs) == ["draft/config.json", "draft/model.safetensors", "policy/config.json",
                                                "policy/model.safetensors", "policy/tokenizer.json",
                                                "policy/tokenizer_config.json"]
    for name, data in the_jobs.items():
        assert ours[name] == data, name


@pytest.mark.slow
def test_transformers_loads_the_policy_with_the_checkpoints_logits(job, cli_export):
    from tests.models.test_hf import TOL, _logits, transformers

    config = load_job_config([*JOB, *ONE_PROCESS], world_size=1)
    ours = build_target(config)
    saved = CheckpointTensors(str(job / "job" / "checkpoint" / "step-2"))
    ours.load_state_dict({name: saved[name] for name in ours.state_dict()})
    theirs = transformers.AutoModelForCausalLM.from_pretrained(cli_export / "policy").eval()
    tokens = torch.randint(0, ours.args.vocab_size, (2, 48), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(_logits(theirs, tokens), _logits(ours, tokens), **TOL)


@pytest.mark.slow
def test_the_draft_loads_as_a_jobs_init_path(job, cli_export):
    config = load_job_config([*JOB, "--draft.init_path", str(cli_export / "draft"), *ONE_PROCESS], world_size=1)
    draft = build_draft(config, build_target(config, device="meta"))
    saved = CheckpointTensors(str(job / "job" / "checkpoint" / "step-2"), DRAFT_PREFIX)
    assert draft.state_dict().keys() == saved.keys()
    for name, t in draft.state_dict().items():
        assert torch.equal(t, saved[name]), name


def _export(capsys, *args: str) -> tuple[int, str, str]:
    status = export_main([*JOB, *args])
    out, err = capsys.readouterr()
    return status, out, err


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # the model-only save, in this process
def test_a_checkpoint_without_the_draft_exports_the_policy_and_says_so(job, tmp_path, capsys):
    """A model-only save (the policy's tensors alone, as ``last_save_model_only`` writes)."""
    saved = CheckpointTensors(str(job / "job" / "checkpoint" / "step-2"))
    policy = {name: saved[name] for name in saved
              if name.split(".")[0] in ("embed_tokens", "layers", "norm", "lm_head")}
    dcp.save(policy, checkpoint_id=str(tmp_path / "step-2"), no_dist=True)
    status, out, err = _export(capsys, "--checkpoint", str(tmp_path / "step-2"), "--out", str(tmp_path / "out"))
    assert status == 0, err
    assert "holds no draft" in out and "exported the policy of step 2" in out
    assert _files(tmp_path / "out") == {f"policy/{name}": data
                                        for name, data in _files(job / "job" / "export" / "policy").items()}


@pytest.mark.slow
@pytest.mark.parametrize("args, message", [
    (("--checkpoint", "{job}/nowhere"), "no checkpoint: {job}/nowhere is not a folder"),
    (("--checkpoint", "{job}/export"), "no checkpoint in {job}/export: no step-N folder"),
    (("--checkpoint", "{job}/checkpoint", "--step", "1"), "no checkpoint of step 1 in {job}/checkpoint; its steps: 2"),
    (("--checkpoint", "{job}/checkpoint/step-2", "--step", "1"), "--step 1, but {job}/checkpoint/step-2 is the "
                                                                 "checkpoint of step 2"),
    (("--checkpoint", "{job}/checkpoint", "--model.n_layers", "7"), "does not hold the config's policy (layers.7."),
    (("--checkpoint", "{job}/checkpoint", "--model.flavor", "debugdeep"), "layers.8.input_layernorm.weight missing"),
    (("--checkpoint", "{job}/checkpoint", "--job.config_file", "{job}/missing.toml"), "missing.toml"),
], ids=["no-folder", "no-step", "wrong-step", "step-folder-and-other-step", "shallower-model", "deeper-model",
         "missing-config"])
def test_what_cannot_be_exported_is_one_clear_error(job, tmp_path, capsys, args, message):
    status, out, err = _export(capsys, *(a.format(job=job / "job") for a in args), "--out", str(tmp_path / "out"))
    assert status == 2 and message.format(job=job / "job") in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()
