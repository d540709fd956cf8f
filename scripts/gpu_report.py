"""The JSON report of ``scripts/gpu_check.sh`` and ``scripts/smoke_8gpu.sh``.

The shell scripts run each stage under its own timeout and append one line per stage to
``<run folder>/stages.tsv`` (name, status, seconds, note, command); each stage leaves its outputs in
the run folder (benchmark JSONs, the jobs' ``metrics.jsonl`` and ``scale_check.json``, pytest's
JUnit XML). This assembles them: the machine (device, torch, CUDA, date) and, per stage, its
status (``ok``, ``failed``, ``timeout``, or ``skipped: needs CUDA`` in ``--cpu`` mode), its
seconds, its command, a note where the script left one (how ``--cpu`` mode differs), and its
key numbers, read from those files (none when a stage left none).

    python scripts/gpu_report.py name              # the default report name: the GPU's, slugified (h200)
    python scripts/gpu_report.py write --run DIR --out FILE --script gpu_check [--cpu]
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import re
import sys
import xml.etree.ElementTree as ElementTree
from pathlib import Path

import torch

# The main job's metrics kept per phase (the phase's last step), where the job logged them.
JOB_METRICS = ("loss/policy", "loss/draft", "draft/acc_pass1", "reward/mean", "rollout/tokens_per_s",
               "rollout/acceptance_length", "grad_norm/policy", "grad_norm/draft", "time/step_s",
               "time/rollout_s", "time/train_s", "memory/max_active_gib", "memory/max_reserved_gib",
               "memory/max_rss_gib")


def device_name() -> str:
    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else platform.processor() or "cpu"


def default_name() -> str:
    """The GPU's name without the vendor, slugified: ``NVIDIA H200`` -> ``h200``; ``cpu`` without one."""
    if not torch.cuda.is_available():
        return "cpu"
    name = torch.cuda.get_device_name(0).lower().removeprefix("nvidia").strip()
    return re.sub(r"[^a-z0-9]+", "_", name).strip("_")


# ---- key numbers, per stage ---------------------------------------------------------------------

def _json(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.is_file() else None


def pytest_numbers(run: Path, stage: str) -> dict | None:
    """Counts from pytest's ``--junitxml``."""
    path = run / f"{stage}.xml"
    if not path.is_file():
        return None
    suite = ElementTree.parse(path).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    counts = {key: int(suite.get(key, 0)) for key in ("tests", "failures", "errors", "skipped")}
    return counts | {"passed": counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]}


def job_numbers(run: Path, stage: str) -> dict | None:
    """A training job's steps and each phase's last logged metrics (``metrics.jsonl``), and the
    scale simulator's per-rank peaks when it checked the job at start (``scale_check.json``)."""
    folder = run / stage
    numbers = {}
    metrics = folder / "metrics.jsonl"
    if metrics.is_file():
        steps = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
        numbers["steps"] = {phase: sum(s["phase"] == phase for s in steps) for phase in dict.fromkeys(
            s["phase"] for s in steps)}
        numbers["last"] = {phase: {k: s[k] for k in JOB_METRICS if k in s}
                           for phase, s in {s["phase"]: s for s in steps}.items()}
    check = _json(folder / "scale_check.json")
    if check:
        numbers["scale_check"] = {"gpu_memory_gib": check["gpu_memory_gib"],
                                  "peak_gib": {str(r["rank"]): round(r["peak_gib"], 3) for r in check["ranks"]}}
    return numbers or None


def rollout_numbers(run: Path, stage: str) -> dict | None:
    """``bench_rollout.py``: per batch, plain and the best speculative (trained draft, greedy)
    tokens/s; the sampled (T = 1) speedups; the batch-1 summary."""
    result = _json(run / f"{stage}.json")
    if not result:
        return None
    greedy = [r for r in result["records"] if r["temperature"] == 0]
    per_batch = {}
    for batch in sorted({r["batch"] for r in greedy}):
        plain = next(r for r in greedy if r["batch"] == batch and r["draft"] == "none")
        spec = [r for r in greedy if r["batch"] == batch and r["draft"] == "trained"]
        best = max(spec, key=lambda r: r["tokens_per_s"])
        per_batch[str(batch)] = {"plain_tokens_per_s": round(plain["tokens_per_s"], 1),
                                 "speculative_tokens_per_s": round(best["tokens_per_s"], 1), "k": best["k"],
                                 "speedup": round(best["speedup"], 3),
                                 "acceptance_length": round(best["acceptance_length"], 3)}
    sampled = {str(r["batch"]): round(r["speedup"], 3)
               for r in result["records"] if r["temperature"] == 1 and r["draft"] == "trained"}
    summary = result["summary"]
    return {"device": greedy[0]["device"], "model": greedy[0]["model"], "greedy": per_batch,
            "sampled_speedup": sampled, "best_speedup_batch1": summary["best_speedup_batch1_trained"],
            "paged_over_static": result["mixed"]["paged_over_static"]}


def compile_numbers(run: Path, stage: str) -> dict | None:
    """``bench_compile.py``: eager and compiled medians, their ratio and the first (compiling) call."""
    result = _json(run / f"{stage}.json")
    if not result:
        return None
    records = result["records"]
    calls = ([("cotrain_step", records["cotrain_step"])] if "cotrain_step" in records else []) + [
        (f"decode_{k}", r) for k, r in records.get("decode", {}).items()]
    return {"hardware": result["hardware"], **{name: {
        "eager_s": round(r["eager_median_s"], 5), "compiled_s": round(r["compiled_median_s"], 5),
        "ratio": round(r["ratio"], 3), "first_compiled_s": round(r["first_s"]["compiled"], 2)} for name, r in calls}}


def branch_memory_numbers(run: Path, stage: str) -> dict | None:
    """``bench_branch_memory.py``: per layout and implementation, peak MiB and seconds at each S;
    the log-log slopes and whether the growth checks passed."""
    result = _json(run / f"{stage}.json")
    if not result:
        return None
    points = {}
    for r in result["records"]:
        points.setdefault(r["layout"], {}).setdefault(r["impl"], {})[str(r["seq_len"])] = {
            "peak_mib": round(r["peak_bytes"] / 2**20, 2), "seconds": r["seconds"]}
    slopes = {layout: {name: n[name]["loglog_slope"] for name in ("branch", "trunk", "added") if name in n}
              for layout, n in result["checks"]["layouts"].items()}
    return {"device": result["config"].get("device", "CPU"), "dtype": result["config"]["dtype"], "points": points,
            "loglog_slopes": slopes, "checks_passed": result["checks"]["passed"]}


def ring_numbers(run: Path, stage: str) -> dict | None:
    """``ring_check.py``: the world, and per tensor the worst error of the ring and of one device."""
    result = _json(run / f"{stage}.json")
    if not result:
        return None
    return {key: result[key] for key in ("world", "backend", "dtype", "seq_len", "passed")} | {
        "max_abs_error": {key: {name: float(f"{value:.3g}") for name, value in e.items()}
                          for key, e in result["max_abs_error"].items()}}


NUMBERS = {
    "gpu_check": {"pytest_gpu": pytest_numbers, "main_job": job_numbers, "bench_rollout_eager": rollout_numbers,
                  "bench_rollout_compiled": rollout_numbers, "bench_compile": compile_numbers,
                  "branch_memory": branch_memory_numbers},
    "smoke_8gpu": {"fsdp_cp": job_numbers, "pp_cp_dp": job_numbers, "tp_engine": job_numbers, "ring": ring_numbers},
}


# ---- the report ---------------------------------------------------------------------------------

def report(run: Path, script: str, cpu: bool) -> dict:
    stages = {}
    for line in (run / "stages.tsv").read_text().splitlines():
        name, status, seconds, note, command = line.split("\t", 4)
        stage = {"status": status, "seconds": float(seconds), "command": command} | ({"note": note} if note else {})
        try:
            numbers = NUMBERS[script][name](run, name)
        except (KeyError, ValueError, StopIteration) as e:  # a stage's file in an unexpected shape
            numbers = {"unreadable": f"{type(e).__name__}: {e}"}
        if numbers:
            stage["numbers"] = numbers
        stages[name] = stage
    missing = sorted(set(NUMBERS[script]) - set(stages))
    return {
        "script": f"scripts/{script}.sh", "mode": "cpu" if cpu else "gpu", "device": device_name(),
        "device_count": torch.cuda.device_count(), "torch": torch.__version__, "cuda": torch.version.cuda,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "passed": not missing and all(s["status"] in ("ok", "skipped: needs CUDA") for s in stages.values()),
        "missing_stages": missing, "stages": stages,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("name", help="print the default report name")
    write = sub.add_parser("write", help="assemble the report of a run folder")
    write.add_argument("--run", type=Path, required=True, help="the run folder (stages.tsv and the stages' outputs)")
    write.add_argument("--out", type=Path, required=True, help="the report's path")
    write.add_argument("--script", choices=sorted(NUMBERS), required=True)
    write.add_argument("--cpu", action="store_true", help="the --cpu mode's run")
    args = parser.parse_args()
    if args.command == "name":
        print(default_name())
        return 0
    result = report(args.run, args.script, args.cpu)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    width = max(map(len, result["stages"]), default=0)
    for name, stage in result["stages"].items():
        print(f"  {name:<{width}}  {stage['status']:<20} {stage['seconds']:7.1f} s")
    print(f"wrote {args.out}: {'passed' if result['passed'] else 'FAILED'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
