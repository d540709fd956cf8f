"""The JSON report of ``scripts/gpu_check.sh`` and ``scripts/smoke_8gpu.sh``.

The stage runner (``scripts/gpu_stages.sh``) runs each stage under its own timeout and appends
one line per stage to ``<run folder>/stages.tsv`` (name, status, seconds, note, command); each
stage leaves its outputs in the run folder (benchmark JSONs, the jobs' ``metrics.jsonl`` and
``scale_check.json``, pytest's JUnit XML). ``write`` assembles them after every stage: the
machine (``machine.json``, written once at the start by ``machine``: the device, and the torch
and triton the stages import, version and path), the budget, the offline wheels (which came from
``--wheels`` and which the node's own copies hid), and per stage its status (``ok``, ``failed``,
``timeout``, ``interrupted``, ``not run: budget``, or ``skipped: needs CUDA`` in ``--cpu``
mode), its seconds, its command, a note where the script left one (how ``--cpu`` mode differs),
and its key numbers, read from those files (none when a stage left none). ``write`` imports
no torch, so a report comes back from a node whose torch does not import.

    python scripts/gpu_report.py machine --out FILE   # writes FILE; prints the default report name (h200)
    python scripts/gpu_report.py write --run DIR --out FILE --script gpu_check [--cpu] [--budget-s S]
        [--elapsed-s S] [--wheels DIR --wheels-site DIR] [--finished]
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import platform
import re
import sys
import xml.etree.ElementTree as ElementTree
from pathlib import Path

# The main job's metrics kept per phase (the phase's last step), where the job logged them.
JOB_METRICS = ("loss/policy", "loss/draft", "draft/acc_pass1", "reward/mean", "rollout/tokens_per_s",
               "rollout/acceptance_length", "grad_norm/policy", "grad_norm/draft", "time/step_s",
               "time/rollout_s", "time/train_s", "memory/max_active_gib", "memory/max_reserved_gib",
               "memory/max_rss_gib")
SKIPPED = "skipped: needs CUDA"  # what --cpu mode leaves out: counted as passed


# ---- the machine ---------------------------------------------------------------------------------

def machine() -> dict:
    """The device, and the torch and triton this Python imports (the node's own, even with
    ``--wheels``: the offline wheels come after its site-packages)."""
    import torch

    try:
        import triton
        found_triton = {"version": triton.__version__, "path": str(Path(triton.__file__).parent)}
    except ImportError as error:
        found_triton = {"error": f"{type(error).__name__}: {error}"}
    cuda = torch.cuda.is_available()
    device = torch.cuda.get_device_name(0) if cuda else platform.processor() or "cpu"
    # The GPU's name without the vendor, slugified: NVIDIA H200 -> h200; cpu without one.
    name = re.sub(r"[^a-z0-9]+", "_", device.lower().removeprefix("nvidia").strip()).strip("_") if cuda else "cpu"
    try:  # the attention kernels this torch gives the project (ops/flash.py), e.g. 2.11: no paged decode
        from titan_cotrain.ops import flash

        paths = flash.kernel_paths()
    except Exception as error:  # a report must come back whatever the project's import meets
        paths = {"error": f"{type(error).__name__}: {error}"}
    return {"name": name, "device": device, "device_count": torch.cuda.device_count(),
            "torch": {"version": torch.__version__, "path": str(Path(torch.__file__).parent),
                      "cuda": torch.version.cuda},
            "triton": found_triton, "python": {"version": platform.python_version(), "executable": sys.executable},
            "attention_paths": paths}


def wheels(folder: Path, site: Path) -> dict:
    """The distributions installed from the offline wheels' folder into ``site``, and which of
    them this Python imports from the node's own site-packages instead (found there first)."""
    site = site.resolve()
    installed = {_canonical(d.metadata["Name"]): d.version
                 for d in importlib.metadata.distributions(path=[str(site)])}
    hidden = [name for name in sorted(installed)
              if not Path(importlib.metadata.distribution(name).locate_file("")).resolve().is_relative_to(site)]
    return {"folder": str(folder), "installed": dict(sorted(installed.items())), "node_has": hidden}


def _canonical(name: str) -> str:
    """A distribution's name as pip compares them: ``Pygments``, ``absl-py`` -> ``pygments``, ``absl_py``."""
    return re.sub(r"[-_.]+", "_", name).lower()


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


def draft_overhead_numbers(run: Path, stage: str) -> dict | None:
    """``bench_compile.py --parts draft_overhead``: the policy step's median with the draft
    co-trained and without it, and the overhead."""
    result = _json(run / f"{stage}.json")
    if not result:
        return None
    r = result["records"]["draft_overhead"]
    return {"hardware": result["hardware"], "model": r["model"], "rows": r["rows"], "seq_len": r["seq_len"],
            "with_draft_s": round(r["with_draft_median_s"], 5), "policy_only_s": round(r["policy_only_median_s"], 5),
            "overhead": round(r["overhead"], 3)}


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
    "gpu_check": {"pytest_gpu": pytest_numbers, "bench_rollout_eager": rollout_numbers, "main_job": job_numbers,
                  "bench_rollout_compiled": rollout_numbers, "draft_overhead": draft_overhead_numbers,
                  "bench_compile": compile_numbers, "branch_memory": branch_memory_numbers},
    "smoke_8gpu": {"ring": ring_numbers, "fsdp_cp": job_numbers, "pp_cp_dp": job_numbers, "tp_engine": job_numbers},
}


# ---- the report ---------------------------------------------------------------------------------

def report(run: Path, script: str, cpu: bool, budget_s: float | None = None, elapsed_s: float | None = None,
           wheels_info: dict | None = None, finished: bool = False) -> dict:
    stages = {}
    table = run / "stages.tsv"
    for line in table.read_text().splitlines() if table.is_file() else []:
        name, status, seconds, note, command = line.split("\t", 4)
        stage = {"status": status, "seconds": float(seconds), "command": command} | ({"note": note} if note else {})
        try:
            numbers = NUMBERS[script][name](run, name) if name in NUMBERS[script] else None
        except (KeyError, ValueError, StopIteration) as e:  # a stage's file in an unexpected shape
            numbers = {"unreadable": f"{type(e).__name__}: {e}"}
        if numbers:
            stage["numbers"] = numbers
        stages[name] = stage
    missing = [name for name in NUMBERS[script] if name not in stages]
    found = _json(run / "machine.json") or {"error": "the machine probe (gpu_report.py machine) failed"}
    found.pop("name", None)
    return {
        "script": f"scripts/{script}.sh", "mode": "cpu" if cpu else "gpu", **found,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "finished": finished,
        "passed": finished and not missing and all(s["status"] in ("ok", SKIPPED) for s in stages.values()),
        "budget_s": budget_s, "elapsed_s": elapsed_s,
        **({"wheels": wheels_info} if wheels_info else {}),
        "missing_stages": missing, "stages": stages,
    }


def _write_beside_and_rename(path: Path, text: str) -> None:
    """``path`` replaced whole: a kill while writing leaves the previous file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    part = path.with_name(f".{path.name}.part")
    part.write_text(text)
    part.replace(path)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    probe = sub.add_parser("machine", help="write the machine's description; print the default report name")
    probe.add_argument("--out", type=Path, required=True)
    write = sub.add_parser("write", help="assemble the report of a run folder")
    write.add_argument("--run", type=Path, required=True, help="the run folder (stages.tsv and the stages' outputs)")
    write.add_argument("--out", type=Path, required=True, help="the report's path")
    write.add_argument("--script", choices=sorted(NUMBERS), required=True)
    write.add_argument("--cpu", action="store_true", help="the --cpu mode's run")
    write.add_argument("--budget-s", type=float, help="the run's budget")
    write.add_argument("--elapsed-s", type=float, help="the run's seconds so far (the script's start to now)")
    write.add_argument("--wheels", type=Path, help="the offline wheels' folder the run was given")
    write.add_argument("--wheels-site", type=Path, help="where the run installed them")
    write.add_argument("--finished", action="store_true", help="the script ran to its end (else: so far)")
    args = parser.parse_args()
    if args.command == "machine":
        found = machine()
        _write_beside_and_rename(args.out, json.dumps(found, indent=1) + "\n")
        print(found["name"])
        return 0
    wheels_info = wheels(args.wheels, args.wheels_site) if args.wheels else None
    result = report(args.run, args.script, args.cpu, args.budget_s, args.elapsed_s, wheels_info, args.finished)
    _write_beside_and_rename(args.out, json.dumps(result, indent=1) + "\n")
    width = max(map(len, result["stages"]), default=0)
    for name, stage in result["stages"].items():
        print(f"  {name:<{width}}  {stage['status']:<20} {stage['seconds']:7.1f} s")
    print(f"wrote {args.out}: {'passed' if result['passed'] else 'FAILED' if args.finished else 'so far'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
