"""The main job runs end to end on 2 CPU processes, and a bad config stops it cleanly."""

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _run(*args: str, nproc: int | None = 2) -> subprocess.CompletedProcess:
    """The main job under torchrun with ``nproc`` ranks, or as a plain process (None)."""
    launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"] if nproc else []
    cmd = [sys.executable, *launcher, "-m", "titan_cotrain.train", *args]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)


def test_main_job_runs_and_logs(tmp_path):
    result = _run("--training.steps", "3", "--job.dump_folder", str(tmp_path))
    assert result.returncode == 0, result.stdout + result.stderr
    steps = [line for line in result.stdout.splitlines() if line.startswith("step ")]
    assert len(steps) == 3, result.stdout
    assert all("loss" in line for line in steps)
    events = list((tmp_path / "tb").glob("events.out.tfevents.*"))
    assert events, "no TensorBoard event file written"


def test_bad_config_fails_with_one_message(tmp_path):
    result = _run("--draft.tap_layers", "1", "2", "40", "--job.dump_folder", str(tmp_path), nproc=None)
    assert result.returncode == 2
    assert "config error" in result.stderr and "draft.tap_layers" in result.stderr
    assert "Traceback" not in result.stderr
