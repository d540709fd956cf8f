"""The draft's prefit: what it costs, and what it saves in the first RL steps.

Claim. A draft prefit (``[draft] prefit_steps``) on the policy's own generations makes the
first RL steps' speculative rollouts accept more, and so decode faster, than a fresh draft
does; this measures by how much against the prefit's own cost (issue 41), so a user can choose
``prefit_steps``.

Method. The embedded job (``train_configs/debug_cpu.toml``, 2 CPU processes) warm-starts
``--sft-steps`` steps; its checkpoint of the last warm-start step is exported by
``python -m titan_cotrain.export`` as a Hugging Face policy folder, which every run then loads
(``[model] hf_path``) with a fresh random draft and no warm start, as a user with a chat
policy starts. Each ``--prefit`` length then runs that many prefit steps and ``--rl-steps``
RL steps (the default's speculation: 3 drafted tokens per round, fixed). From
``metrics.jsonl``: ``acceptance_rl_step1`` (the engine's measured acceptance length at RL step 1),
``acceptance_over_tau_rl_step1`` (it over what the draft's training accuracy predicts at
k = 3), ``rollout_s_first<N>`` (the rollout phase's seconds summed over the RL steps),
``prefit_s`` (the prefit steps' wall time summed) and the acceptance per RL step.

Checked first, exit 1 on failure: every job exits 0; each run logged its prefit and RL steps
with finite acceptance and times; the prefit left the policy as the export wrote it (the run's
own export of the final policy is not compared: RL trains it; instead the first RL step's
``loss/policy`` must be finite and the prefit steps' ``loss/policy`` exactly 0).

    .venv/bin/python scripts/bench_draft_prefit.py            # ~20 min on 2 free cores, into assets/
    .venv/bin/python scripts/bench_draft_prefit.py --quick    # a smoke run (~1.5 min) into a temporary folder
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "train_configs" / "debug_cpu.toml"
FULL = {"sft_steps": 600, "prefit": [0, 50, 200], "rl_steps": 20}
QUICK = {"sft_steps": 4, "prefit": [0, 2], "rl_steps": 2}
# The quick run's job: tiny batches and responses, so that it checks the machinery only.
QUICK_FLAGS = ["--task.sft_batch_size", "8", "--rl.prompts_per_step", "2", "--rl.group_size", "2",
               "--rollout.max_new_tokens", "12", "--training.seq_len", "64", "--lr_scheduler.warmup_steps", "1",
               "--task.sft_warmup_steps", "1"]


def _run(args: list[str], nproc: int | None = 2) -> subprocess.CompletedProcess:
    launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"] if nproc else []
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, *launcher, *args], cwd=ROOT, env=env, capture_output=True, text=True)


def _metrics(folder: Path) -> list[dict]:
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]


def warm_start(work: Path, settings: dict, flags: list[str], failures: list[str]) -> Path | None:
    """The warm start's job, then its last warm-start checkpoint exported: the policy folder."""
    dump, steps = work / "warm_start", settings["sft_steps"]
    t0 = time.perf_counter()
    job = _run(["-m", "titan_cotrain.train", "--job.config_file", str(CONFIG), *flags, "--job.dump_folder", str(dump),
                "--task.sft_steps", str(steps), "--training.steps", "1", "--checkpoint.interval", str(steps),
                "--checkpoint.keep_latest_k", "0", "--metrics.no-enable_tensorboard"])
    if job.returncode:
        failures.append(f"warm start exited {job.returncode}: {job.stderr[-2000:]}")
        return None
    export = _run(["-m", "titan_cotrain.export", "--checkpoint", str(dump / "checkpoint" / f"step-{steps}"),
                   "--out", str(work / "hf"), "--job.config_file", str(CONFIG), *flags], nproc=None)
    if export.returncode:
        failures.append(f"export exited {export.returncode}: {export.stderr[-2000:]}")
        return None
    settings["warm_start_s"] = time.perf_counter() - t0
    return work / "hf" / "policy"


def run_prefit(policy: Path, prefit: int, work: Path, settings: dict, flags: list[str],
               failures: list[str]) -> dict | None:
    dump = work / f"prefit{prefit}"
    shutil.rmtree(dump, ignore_errors=True)
    t0 = time.perf_counter()
    job = _run(["-m", "titan_cotrain.train", "--job.config_file", str(CONFIG), *flags, "--job.dump_folder", str(dump),
                "--model.hf_path", str(policy), "--task.sft_steps", "0", "--draft.prefit_steps", str(prefit),
                "--training.steps", str(settings["rl_steps"]), "--checkpoint.no-enable",
                "--metrics.no-enable_tensorboard"])
    wall = time.perf_counter() - t0
    if job.returncode:
        failures.append(f"prefit {prefit}: exited {job.returncode}: {job.stderr[-2000:]}")
        return None
    metrics = _metrics(dump)
    prefit_rows = [m for m in metrics if m["phase"] == "prefit"]
    rl = [m for m in metrics if m["phase"] == "rl"]
    name = f"prefit {prefit}"
    if len(prefit_rows) != prefit or len(rl) != settings["rl_steps"]:
        failures.append(f"{name}: {len(prefit_rows)} prefit and {len(rl)} RL steps logged")
        return None
    if any(m["loss/policy"] != 0.0 for m in prefit_rows):
        failures.append(f"{name}: a prefit step has a nonzero policy loss")
    values = [m[k] for m in rl for k in ("rollout/acceptance_length", "time/rollout_s", "loss/policy")]
    values += [m["time/step_s"] for m in prefit_rows]
    if not all(math.isfinite(v) for v in values):
        failures.append(f"{name}: a non-finite acceptance, time or loss")
    first = rl[0]
    return {"prefit_steps": prefit,
            "acceptance_rl_step1": first["rollout/acceptance_length"],
            "acceptance_over_tau_rl_step1": first.get("rollout/acceptance_over_tau"),
            "draft_acc_pass1_rl_step1": first.get("draft/acc_pass1"),
            f"rollout_s_first{settings['rl_steps']}": sum(m["time/rollout_s"] for m in rl),
            "prefit_s": sum(m["time/step_s"] for m in prefit_rows),
            "prefit_draft_loss_last": prefit_rows[-1]["loss/draft"] if prefit_rows else None,
            "acceptance_by_rl_step": [m["rollout/acceptance_length"] for m in rl],
            "rollout_s_by_rl_step": [m["time/rollout_s"] for m in rl],
            "reward_by_rl_step": [m["reward/mean"] for m in rl],
            "job_wall_s": wall}


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (accept, cost) = plt.subplots(1, 2, figsize=(11, 4))
    n = result["settings"]["rl_steps"]
    for r in result["records"]:
        accept.plot(range(1, n + 1), r["acceptance_by_rl_step"], marker="o", label=f"prefit {r['prefit_steps']}")
    accept.set(xlabel="RL step", ylabel="acceptance length (k = 3)", title="rollout acceptance, first RL steps")
    accept.legend()
    names = [str(r["prefit_steps"]) for r in result["records"]]
    rollout = [r[f"rollout_s_first{n}"] for r in result["records"]]
    prefit = [r["prefit_s"] for r in result["records"]]
    cost.bar(names, rollout, label=f"rollout, first {n} RL steps")
    cost.bar(names, prefit, bottom=rollout, label="prefit")
    cost.set(xlabel="prefit steps", ylabel="seconds", title="rollout time saved vs the prefit's cost")
    cost.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prefit", type=int, nargs="+", help=f"prefit lengths (default {FULL['prefit']})")
    parser.add_argument("--rl-steps", type=int, help=f"RL steps per run (default {FULL['rl_steps']})")
    parser.add_argument("--sft-steps", type=int, help=f"warm-start steps (default {FULL['sft_steps']})")
    parser.add_argument("--policy", type=Path, default=None,
                        help="an exported warm-start policy folder to reuse (default: warm-start and export one)")
    parser.add_argument("--quick", action="store_true", help="a smoke run into a temporary folder")
    parser.add_argument("--out", type=Path, default=None, help="where the JSON and PNG go (default assets/)")
    parser.add_argument("--work", type=Path, default=None, help="the jobs' folders (default outputs/bench_draft_prefit)")
    args = parser.parse_args()
    settings = dict(QUICK if args.quick else FULL)
    for key in ("prefit", "rl_steps", "sft_steps"):
        if getattr(args, key) is not None:
            settings[key] = getattr(args, key)
    flags = QUICK_FLAGS if args.quick else []
    out = args.out or (Path(tempfile.mkdtemp(prefix="bench_draft_prefit_")) if args.quick else ROOT / "assets")
    work = args.work or (out / "work" if args.quick else ROOT / "outputs" / "bench_draft_prefit")
    work.mkdir(parents=True, exist_ok=True)
    failures: list[str] = []
    t0 = time.perf_counter()
    policy = args.policy.resolve() if args.policy else warm_start(work, settings, flags, failures)
    settings["policy_reused"] = args.policy is not None
    records = []
    if policy is not None:
        for prefit in settings["prefit"]:
            record = run_prefit(policy, prefit, work, settings, flags, failures)
            if record is not None:
                records.append(record)
    result = {
        "description": __doc__.split("\n\n")[1].replace("\n", " "),
        "command": "python scripts/bench_draft_prefit.py" + (" --quick" if args.quick else ""),
        "settings": {**settings, "flags": flags, "config": "train_configs/debug_cpu.toml", "draft_tokens": 3,
                     "prefit_lr": "[draft] sft_lr of the config (3e-3), constant after no warm-up (the defaults)",
                     "hardware": "2-core CPU, gloo, 2 processes, 1 thread each"},
        "records": records,
        "checks": {"passed": not failures, "failures": failures},
        "runtime_s": time.perf_counter() - t0,
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_draft_prefit.json").write_text(json.dumps(result, indent=1) + "\n")
    if records:
        plot(result, out / "bench_draft_prefit.png")
    n = settings["rl_steps"]
    for r in records:
        print(f"prefit {r['prefit_steps']:>4}: acceptance at RL step 1 {r['acceptance_rl_step1']:.2f} "
              f"(over tau {r['acceptance_over_tau_rl_step1']}), rollout {r[f'rollout_s_first{n}']:.1f} s over {n} RL "
              f"steps, prefit {r['prefit_s']:.1f} s", flush=True)
    print(f"wrote {out / 'bench_draft_prefit.json'}" + ("" if not failures else f"; FAILED: {failures}"), flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
