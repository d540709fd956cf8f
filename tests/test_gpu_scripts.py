"""The GPU scripts, as CI runs them on CPU: ``scripts/gpu_check.sh --cpu`` and
``scripts/smoke_8gpu.sh --cpu`` (the same entry points at tiny shapes, gloo) exit 0 and
report every stage, each ok or skipped because it needs CUDA, with its key numbers, in two
files; the stage runner both share (``scripts/gpu_stages.sh``) records a failure, a timeout
and what the budget leaves out and goes on, rewrites the report after every stage, stops the
running stage and reports it on a TERM, and installs offline wheels behind the interpreter's
own packages; the offline wheels' list (``scripts/gpu_closure.py``) is pinned to the project's
versions and holds what the main module imports."""

import base64
import hashlib
import importlib.metadata
import json
import signal
import subprocess
import sys
import tarfile
import time
import tomllib
import zipfile
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
SKIPPED = "skipped: needs CUDA"
BUDGET = "not run: budget"
GPU_CHECK_STAGES = ("pytest_gpu", "bench_rollout_eager", "main_job", "bench_rollout_compiled", "draft_overhead",
                    "bench_compile", "branch_memory")
CPU_SKIPPED = ("pytest_gpu", "bench_rollout_compiled")


def _load(path: Path) -> dict:
    return json.loads(path.read_text())


def _outputs(out: Path, name: str) -> dict:
    """What a run left in ``out``: exactly its report and its archive, nothing in a folder."""
    assert sorted(p.name for p in out.iterdir()) == [f"{name}.json", f"{name}.tar.gz"]
    return _load(out / f"{name}.json")


def _run(script: str, out: Path, *flags: str) -> dict:
    """``bash scripts/<script> --cpu --out <out>``; its report."""
    result = subprocess.run(["bash", f"scripts/{script}", "--cpu", "--out", str(out), *flags], cwd=REPO,
                            capture_output=True, text=True, timeout=1800)
    assert result.returncode == 0, result.stdout[-5000:] + result.stderr[-3000:]
    report = _outputs(out, "cpu" + ("_smoke_8gpu" if script == "smoke_8gpu.sh" else ""))
    assert report["mode"] == "cpu" and report["device"] and report["date"]
    assert report["torch"]["version"] == torch.__version__ and report["torch"]["cuda"] == torch.version.cuda
    assert Path(report["torch"]["path"]) == Path(torch.__file__).parent and report["triton"]["version"]
    assert report["finished"] and report["passed"] and not report["missing_stages"] and report["budget_s"] == 1800
    return report


@pytest.mark.slow
def test_gpu_check_runs_on_cpu_and_reports_every_stage(tmp_path):
    """About 3 minutes on 2 cores."""
    report = _run("gpu_check.sh", tmp_path)
    stages = report["stages"]
    assert list(stages) == list(GPU_CHECK_STAGES)
    assert {name: stage["status"] for name, stage in stages.items()} == {
        name: SKIPPED if name in CPU_SKIPPED else "ok" for name in GPU_CHECK_STAGES}
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
    assert "--batches 1 64" in stages["bench_rollout_compiled"]["command"]
    overhead = stages["draft_overhead"]["numbers"]
    assert overhead["with_draft_s"] > 0 and overhead["policy_only_s"] > 0 and overhead["overhead"] > -1
    assert stages["bench_compile"]["numbers"]["cotrain_step"]["ratio"] > 0
    memory = stages["branch_memory"]["numbers"]
    assert memory["checks_passed"] and set(memory["points"]["packed"]["branch"]) == {"1024", "2048", "4096", "8192"}
    # Everything else is in the archive: the logs, the benchmarks' outputs, the job's metrics.
    with tarfile.open(tmp_path / "cpu.tar.gz") as archive:
        names = set(archive.getnames())
    ran = [name for name in GPU_CHECK_STAGES if name not in CPU_SKIPPED]
    assert {f"cpu/logs/{name}.log" for name in ran} <= names
    assert {"cpu/stages.tsv", "cpu/machine.json", "cpu/main_job/metrics.jsonl", "cpu/bench_rollout_eager.json",
            "cpu/bench_rollout_eager.png", "cpu/draft_overhead.json", "cpu/bench_compile.json",
            "cpu/branch_memory.json", "cpu/branch_memory.png"} <= names


@pytest.mark.slow
def test_smoke_8gpu_runs_on_cpu_and_reports_every_stage(tmp_path):
    """About 4 minutes on 2 cores, half of it the scale simulator's check at start."""
    report = _run("smoke_8gpu.sh", tmp_path)
    stages = report["stages"]
    assert {name: stage["status"] for name, stage in stages.items()} == dict.fromkeys(
        ("ring", "fsdp_cp", "pp_cp_dp", "tp_engine"), "ok")
    for name in ("fsdp_cp", "pp_cp_dp", "tp_engine"):
        job = stages[name]["numbers"]
        assert job["steps"] == {"sft": 1, "prefit": 2, "rl": 2}, name  # the configs' prefit, cut to 2 steps
        assert job["last"]["sft"]["grad_norm/policy"] > 0, name
        assert job["last"]["prefit"]["grad_norm/draft"] > 0, name
    assert "--simulate.check_at_start" in stages["fsdp_cp"]["command"]
    assert stages["fsdp_cp"]["numbers"]["scale_check"]["peak_gib"]
    assert "--rollout.tensor_parallel_degree 2" in stages["tp_engine"]["command"]
    ring = stages["ring"]["numbers"]
    assert ring["passed"] and ring["world"] == 4 and "ring W=4 dq" in ring["max_abs_error"]


def test_the_budget_leaves_out_what_does_not_fit(tmp_path):
    """``--budget-s`` under every stage's limit: the script runs nothing, reports each stage
    as not run (or skipped, in --cpu mode) and exits 1."""
    result = subprocess.run(["bash", "scripts/gpu_check.sh", "--cpu", "--out", str(tmp_path), "--budget-s", "30"],
                            cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 1, result.stdout + result.stderr
    report = _outputs(tmp_path, "cpu")
    assert {name: stage["status"] for name, stage in report["stages"].items()} == {
        name: SKIPPED if name in CPU_SKIPPED else BUDGET for name in GPU_CHECK_STAGES}
    assert report["finished"] and not report["passed"] and report["budget_s"] == 30


def test_a_killed_run_reports_the_stages_it_finished(tmp_path):
    """A TERM during the second stage: the report written after the first is there while the
    second runs; then the second is recorded as interrupted, its processes are gone, and the
    script exits 143 with its two files in place."""
    script = subprocess.Popen(["bash", "scripts/gpu_check.sh", "--cpu", "--out", str(tmp_path)], cwd=REPO,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    report = tmp_path / "cpu.json"
    deadline = time.monotonic() + 120
    while not (report.is_file() and "pytest_gpu" in _load(report)["stages"]):
        assert time.monotonic() < deadline and script.poll() is None, script.stdout.read()
        time.sleep(0.2)
    while not any("bench_rollout.py" in _cmdline(pid) for pid in _descendants(script.pid)):  # the second stage
        assert time.monotonic() < deadline and script.poll() is None, script.stdout.read()
        time.sleep(0.2)
    stage = _descendants(script.pid)
    script.send_signal(signal.SIGTERM)
    output = script.communicate(timeout=60)[0]
    assert script.returncode == 128 + signal.SIGTERM, output
    stages = _outputs(tmp_path, "cpu")["stages"]
    assert {name: s["status"] for name, s in stages.items()} == {"pytest_gpu": SKIPPED,
                                                                 "bench_rollout_eager": "interrupted"}
    assert not [pid for pid in stage if _cmdline(pid)], "the stage's processes outlived the script"
    with tarfile.open(tmp_path / "cpu.tar.gz") as archive:
        assert "cpu/logs/bench_rollout_eager.log" in archive.getnames()


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    except OSError:  # gone
        return ""


def _descendants(pid: int) -> set[int]:
    """The processes started by ``pid``, its children's children included."""
    parents = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parents[int(stat.parent.name)] = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):  # gone meanwhile
            pass
    found, new = set(), {pid}
    while new:
        new = {child for child, parent in parents.items() if parent in new} - found
        found |= new
    return found


def test_stages_that_fail_time_out_or_exceed_the_budget_are_recorded_and_the_next_one_runs(tmp_path):
    """The stage runner of both scripts (scripts/gpu_stages.sh) and the report, with stand-in commands."""
    out = tmp_path / "out"
    script = f"""
        CALLER=$PWD
        source scripts/gpu_stages.sh
        stages_begin gpu_check "" "" "" --cpu --out {out} --budget-s 120 --name run
        run_stage main_job 5 false
        run_stage bench_compile 1 sleep 10
        run_stage bench_rollout_eager 1000 true
        STAGE_NOTE="--cpu: a note" run_stage branch_memory 5 true
        skip_stage pytest_gpu pytest tests/gpu
        echo "failed: ${{FAILED[*]}}; not run: ${{NOT_RUN[*]}}"
        stages_end
    """
    result = subprocess.run(["bash", "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 1, result.stderr
    assert "failed: main_job bench_compile; not run: bench_rollout_eager" in result.stdout
    report = _outputs(out, "run")
    stages = report["stages"]
    assert {name: s["status"] for name, s in stages.items()} == {
        "main_job": "failed", "bench_compile": "timeout", "bench_rollout_eager": BUDGET, "branch_memory": "ok",
        "pytest_gpu": SKIPPED}
    assert 1 <= stages["bench_compile"]["seconds"] < 5 and stages["main_job"]["command"] == "false"
    assert stages["branch_memory"]["note"] == "--cpu: a note" and "note" not in stages["main_job"]
    assert report["finished"] and not report["passed"]
    assert report["missing_stages"] == ["bench_rollout_compiled", "draft_overhead"]


def _wheel(folder: Path, name: str, version: str, tag: str, files: dict[str, str]) -> None:
    """A minimal wheel of ``files`` (path: text), with its metadata and RECORD."""
    info = f"{name}-{version}.dist-info"
    files = files | {f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
                     f"{info}/WHEEL": f"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: {tag}\n"}
    record = [f"{path},sha256={base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b'=').decode()}"
              f",{len(text.encode())}" for path, text in files.items()]
    with zipfile.ZipFile(folder / f"{name}-{version}-{tag}.whl", "w") as wheel:
        for path, text in files.items():
            wheel.writestr(path, text)
        wheel.writestr(f"{info}/RECORD", "\n".join(record + [f"{info}/RECORD,,"]) + "\n")


def test_offline_wheels_are_installed_behind_the_interpreters_own_packages(tmp_path):
    """``--wheels``: the wheel of each name that fits this Python is installed without an index,
    and its packages are imported unless the interpreter has them (a fake numpy loses to the real)."""
    wheels, out = tmp_path / "wheels", tmp_path / "out"
    wheels.mkdir()
    _wheel(wheels, "titan_offline_probe", "1.0", "py3-none-any", {"titan_offline_probe/__init__.py": "WHO = 'wheel'\n"})
    _wheel(wheels, "titan_offline_probe", "2.0", "cp39-cp39-manylinux2014_x86_64",  # not this Python's
           {"titan_offline_probe/__init__.py": "WHO = 'wrong tag'\n"})
    _wheel(wheels, "numpy", "0.0.1", "py3-none-any", {"numpy/__init__.py": "raise ImportError('the fake numpy')\n"})
    check = ("import numpy, titan_offline_probe as p; assert p.WHO == 'wheel' and numpy.__version__ == "
             f"{importlib.metadata.version('numpy')!r}")
    script = f"""
        CALLER=$PWD
        source scripts/gpu_stages.sh
        stages_begin gpu_check "" "" "" --cpu --out {out} --wheels {wheels} --name run
        run_stage main_job 60 "$PYTHON" -c "{check}"
        stages_end
    """
    result = subprocess.run(["bash", "-c", script], cwd=REPO, capture_output=True, text=True, timeout=180)
    report = _load(out / "run.json")
    assert {name: s["status"] for name, s in report["stages"].items()} == {"wheels": "ok", "main_job": "ok"}, (
        result.stdout + result.stderr)
    assert "--no-index" in report["stages"]["wheels"]["command"]
    assert report["wheels"] == {"folder": str(wheels), "installed": {"numpy": "0.0.1", "titan_offline_probe": "1.0"},
                                "node_has": ["numpy"]}


def test_the_offline_wheels_list_is_pinned_to_the_project_and_holds_what_the_main_module_imports():
    """``scripts/gpu_closure.py``: every pin is the installed version (and pyproject's, where it
    pins), none is a package a torch node has, and the main module's import closure is inside."""
    sys.path.insert(0, str(REPO / "scripts"))
    try:
        import gpu_closure
    finally:
        sys.path.remove(str(REPO / "scripts"))
    pins = gpu_closure.CLOSURE | gpu_closure.PIPELINE_ONLY
    assert gpu_closure.CLOSURE and not set(gpu_closure.CLOSURE) & set(gpu_closure.PIPELINE_ONLY)
    assert not set(pins) & gpu_closure.NODE
    assert pins == {name: importlib.metadata.version(name) for name in pins}
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    for requirement in project["dependencies"] + project["optional-dependencies"]["test"]:
        name, _, version = requirement.partition("==")
        assert pins.get(gpu_closure.canonical(name), version) == version, name
    result = subprocess.run([sys.executable, "scripts/gpu_closure.py", "--measure", "--", sys.executable, "-c",
                             "import titan_cotrain.train"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
