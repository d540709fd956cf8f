"""The GPU scripts, as CI runs them on CPU: ``scripts/gpu_check.sh --cpu`` and
``scripts/smoke_8gpu.sh --cpu`` (the same entry points at tiny shapes, gloo) exit 0 and
report every stage, each ok or skipped because it needs CUDA, with its key numbers; and the
stage runner both share records a failure and a timeout and goes on to the next stage."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
SKIPPED = "skipped: needs CUDA"


def _run(script: str, out: Path) -> dict:
    """``bash scripts/<script> --cpu --out <out>``; its report."""
    result = subprocess.run(["bash", f"scripts/{script}", "--cpu", "--out", str(out)], cwd=REPO,
                            capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-5000:] + result.stderr[-3000:]
    reports = list(out.glob("*.json"))
    assert len(reports) == 1, reports
    report = json.loads(reports[0].read_text())
    assert report["mode"] == "cpu" and report["device"] and report["date"]
    assert report["torch"] == torch.__version__ and report["cuda"] == torch.version.cuda
    assert report["passed"] and not report["missing_stages"]
    return report


@pytest.mark.slow
def test_gpu_check_runs_on_cpu_and_reports_every_stage(tmp_path):
    """About 2 minutes on 2 cores."""
    report = _run("gpu_check.sh", tmp_path)
    stages = report["stages"]
    assert {name: stage["status"] for name, stage in stages.items()} == {
        "pytest_gpu": SKIPPED, "main_job": "ok", "bench_rollout_eager": "ok", "bench_rollout_compiled": SKIPPED,
        "bench_compile": "ok", "branch_memory": "ok"}
    for name, stage in stages.items():
        assert stage["command"] and stage["seconds"] >= 0
        if stage["status"] == "ok":
            assert stage["note"].startswith("--cpu: ") and stage["numbers"], name
    job = stages["main_job"]["numbers"]
    assert job["steps"] == {"sft": 2, "rl": 2}
    assert job["last"]["rl"]["rollout/tokens_per_s"] > 0
    rollout = stages["bench_rollout_eager"]["numbers"]
    assert set(rollout["greedy"]) == {"1", "8", "64"}
    assert all(b["plain_tokens_per_s"] > 0 and b["speculative_tokens_per_s"] > 0 for b in rollout["greedy"].values())
    assert stages["bench_compile"]["numbers"]["cotrain_step"]["ratio"] > 0
    memory = stages["branch_memory"]["numbers"]
    assert memory["checks_passed"] and set(memory["points"]["packed"]["branch"]) == {"1024", "2048", "4096"}
    # The benchmarks wrote where they were told, not over the committed CPU results.
    assert {p.name for p in (tmp_path / "cpu").glob("*.json")} == {
        "bench_rollout_eager.json", "bench_compile.json", "branch_memory.json"}


@pytest.mark.slow
def test_smoke_8gpu_runs_on_cpu_and_reports_every_stage(tmp_path):
    """About 3 minutes on 2 cores, a third of it the scale simulator's check at start."""
    report = _run("smoke_8gpu.sh", tmp_path)
    stages = report["stages"]
    assert {name: stage["status"] for name, stage in stages.items()} == dict.fromkeys(
        ("fsdp_cp", "pp_cp_dp", "tp_engine", "ring"), "ok")
    for name in ("fsdp_cp", "pp_cp_dp", "tp_engine"):
        job = stages[name]["numbers"]
        assert job["steps"] == {"sft": 1, "rl": 2}, name
        assert job["last"]["sft"]["grad_norm/policy"] > 0, name
    assert "--simulate.check_at_start" in stages["fsdp_cp"]["command"]
    assert stages["fsdp_cp"]["numbers"]["scale_check"]["peak_gib"]
    assert "--rollout.tensor_parallel_degree 2" in stages["tp_engine"]["command"]
    ring = stages["ring"]["numbers"]
    assert ring["passed"] and ring["world"] == 4 and "ring W=4 dq" in ring["max_abs_error"]


def test_a_failing_or_timed_out_stage_is_recorded_and_the_next_one_runs(tmp_path):
    """The stage runner of both scripts (scripts/gpu_stages.sh) and the report."""
    script = f"""
        RUN={tmp_path} FAILED=()
        mkdir -p "$RUN/logs"
        source scripts/gpu_stages.sh
        run_stage main_job 5 false
        run_stage bench_compile 1 sleep 10
        STAGE_NOTE="--cpu: a note" run_stage branch_memory 5 true
        skip_stage pytest_gpu pytest tests/gpu
        echo "failed: ${{FAILED[*]}}"
    """
    result = subprocess.run(["bash", "-c", script], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().endswith("failed: main_job bench_compile")
    write = subprocess.run([sys.executable, "scripts/gpu_report.py", "write", "--run",
                            str(tmp_path), "--out", str(tmp_path / "report.json"), "--script", "gpu_check", "--cpu"],
                           cwd=REPO, capture_output=True, text=True, timeout=120)
    assert write.returncode == 0, write.stderr
    report = json.loads((tmp_path / "report.json").read_text())
    stages = report["stages"]
    assert {name: s["status"] for name, s in stages.items()} == {
        "main_job": "failed", "bench_compile": "timeout", "branch_memory": "ok", "pytest_gpu": SKIPPED}
    assert 1 <= stages["bench_compile"]["seconds"] < 5 and stages["main_job"]["command"] == "false"
    assert stages["branch_memory"]["note"] == "--cpu: a note" and "note" not in stages["main_job"]
    assert not report["passed"] and report["missing_stages"] == ["bench_rollout_compiled", "bench_rollout_eager"]
