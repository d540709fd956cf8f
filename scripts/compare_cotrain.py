"""Co-trained vs frozen draft on the embedded default, over several RL seeds: measured
rollout acceptance length and reward per RL step.

Claim: a draft co-trained during RL keeps up with the moving policy, a draft frozen after
the warm start falls behind; goal: the co-trained arm's acceptance length over the last
quarter of the RL steps is >= 1.3x the frozen arm's.

Method. One warm start is shared by every seed and arm: the co-trained run of the first
seed writes a checkpoint at the last SFT step (``step-<sft>``); every other run resumes from
a copy of that folder. So all arms start from the same policy, draft and optimizer states,
and the seeds vary only what RL does: ``--debug.seed`` drives each RL step's prompts and
sampling (the trainer derives them from ``(seed, step, dp rank)``). The frozen arm adds
``--draft.freeze_after_sft``; nothing else differs between the arms of one seed. The
per-seed ratio is co-trained / frozen of that seed's last-quarter mean acceptance length;
the summary gives each arm's mean, std and min/max over seeds and the ratio's.

Checked first, exit 1 on failure:
* every resumed run's warm-start copy has the warm start's hash (sha256 of the folder's
  files), before and after its run;
* the frozen arm's exported draft (``<dump>/export/draft``, read with ``load_eagle3``) is
  bitwise the warm start's: the warm start's own draft is exported by resuming a copy with
  ``--task.sft_steps <sft - 1> --training.steps 1`` (its last step is the warm start's: load,
  no step, export); and the co-trained arm's draft is not (so
  the comparison can see a change).

Speculative sampling is lossless in distribution, not sample for sample: the two arms of a
seed draw different random numbers once their drafts differ, so their reward curves agree
statistically, not bit for bit (the policy's gradients given the same samples are identical
with the draft loss on or off, which the tests check bitwise).

    .venv/bin/python scripts/compare_cotrain.py            # 600 SFT + 3 seeds x 2 arms x 100 RL steps
    .venv/bin/python scripts/compare_cotrain.py --quick    # 20 SFT, 3 RL steps, to assets/quick/
    .venv/bin/python scripts/compare_cotrain.py --replot   # redraw the PNG from the JSON
    .venv/bin/python scripts/compare_cotrain.py --resummarize --work W --json J --png P  # summary again from W's runs
    .venv/bin/python scripts/compare_cotrain.py --config debug_cpu_longtail.toml \
        --json assets/compare_cotrain_longtail.json --png assets/acceptance_vs_step_longtail.png
"""

import argparse
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchtools import command_line, pyplot, save_figure  # noqa: E402

GOAL_RATIO = 1.3
# --quick: a few minutes on 2 cores, most of it the 8 job launches; the draft barely trains.
QUICK_SFT_STEPS, QUICK_RL_STEPS = 20, 3
ARMS = ("cotrain", "frozen")


def run(dump: Path, extra: list[str], config: str = "debug_cpu.toml") -> list[dict]:
    """One training job of ``train_configs/<config>`` on 2 CPU processes; its metrics, one dict
    per step."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           "-m", "titan_cotrain.train", "--job.config_file", str(ROOT / "train_configs" / config),
           "--job.dump_folder", str(dump), *extra]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    print("+", " ".join(cmd[3:]), flush=True)
    subprocess.run(cmd, cwd=ROOT, env=env, check=True)
    return read_metrics(dump) if (dump / "metrics.jsonl").exists() else []


def folder_hash(folder: Path) -> str:
    """sha256 over the folder's files: relative path and contents, in sorted order."""
    digest = hashlib.sha256()
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        digest.update(str(path.relative_to(folder)).encode() + b"\0")
        digest.update(path.read_bytes())
    return digest.hexdigest()


def draft_state(dump: Path) -> dict:
    from titan_cotrain.models import load_eagle3

    draft, _ = load_eagle3(dump / "export" / "draft")
    return {k: v.detach().clone() for k, v in draft.state_dict().items()}


def same_weights(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and a[k].equal(b[k]) for k in a)


def rl_curve(metrics: list[dict], key: str) -> list[float]:
    return [m[key] for m in metrics if m["phase"] == "rl"]


def curves_of(metrics: list[dict], arm: str) -> dict[str, list[float]]:
    """One run's per-RL-step curves: acceptance length, reward, the rollout phase's and the
    step's seconds, the acceptance the draft's training accuracy predicts at the drafted k
    and the measured over it (``rollout/acceptance_over_tau``), the task's metrics and the
    per-position acceptance rates, the rollout's generated tokens per second and its mean and
    longest response; the co-trained arm adds ``draft/tau``."""
    curves = {"acceptance_length": rl_curve(metrics, "rollout/acceptance_length"),
              "reward": rl_curve(metrics, "reward/mean"),
              "rollout_s": rl_curve(metrics, "time/rollout_s"), "step_s": rl_curve(metrics, "time/step_s"),
              "tokens_per_s": rl_curve(metrics, "rollout/tokens_per_s"),
              "response_len": rl_curve(metrics, "rollout/response_len"),
              "response_len_max": rl_curve(metrics, "rollout/response_len_max")}
    # A step whose rollout drafted nothing (the tuner chose plain decoding) has no per-position
    # rates and no prediction: None there; its acceptance length is 1.
    rl = [m for m in metrics if m["phase"] == "rl"]
    if arm == "cotrain":  # the draft's training metrics, on the batches it trained on
        curves["draft_tau"] = rl_curve(metrics, "draft/tau")
        for key in ("rollout/predicted_acceptance", "rollout/acceptance_over_tau"):
            curves[key.split("/", 1)[1]] = [m.get(key) for m in rl]
    keys = sorted({key for m in rl for key in m if key.startswith("task/") or key.startswith("rollout/acceptance_rate_")})
    curves |= {key.split("/", 1)[1]: [m.get(key) for m in rl] for key in keys}
    curves["drafted"] = ["rollout/acceptance_rate_1" in m for m in rl]
    return curves


def read_metrics(dump: Path) -> list[dict]:
    return [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]


def resummarize(args) -> int:
    """Rebuild ``--json``'s curves and summary from the run folders under ``--work`` (their
    ``metrics.jsonl``), keeping its checks, command and runtime: what a summary added after
    the runs reads, without running them again."""
    result = json.loads(args.json.read_text())
    result["runs"] = {str(seed): {arm: curves_of(read_metrics(args.work / f"seed{seed}" / arm), arm) for arm in ARMS}
                      for seed in result["seeds"]}
    result["summary"] = summarize(result)
    result["resummarized_by"] = command_line()
    args.json.write_text(json.dumps(result, indent=2) + "\n")
    plot(result, args.png)
    print(json.dumps({k: v for k, v in result["summary"].items() if "quarter" not in k}, indent=2))
    return 0 if result["checks"]["passed"] else 1


def spread(xs: list[float]) -> dict:
    return {"mean": statistics.fmean(xs), "std": statistics.stdev(xs) if len(xs) > 1 else 0.0,
            "min": min(xs), "max": max(xs), "values": xs}


def quarter_bounds(n: int) -> list[int]:
    """Where the quarters of ``n`` steps start and end (the last takes what the others leave)."""
    size = max(n // 4, 1)
    return [min(i * size, n) for i in range(4)] + [n]


def quarters(curve: list[float]) -> list[float]:
    """The mean of each quarter of ``curve``."""
    bounds = quarter_bounds(len(curve))
    return [statistics.fmean(curve[a:b]) for a, b in zip(bounds, bounds[1:]) if b > a]


def by_quarter(result: dict, key: str) -> dict:
    """Per arm, ``key``'s quarter means (their mean over seeds) and the per-seed quarter values."""
    out = {}
    for arm in ARMS:
        per_seed = [quarters(result["runs"][str(s)][arm][key]) for s in result["seeds"]]
        out[arm] = {"over_seeds": [statistics.fmean(column) for column in zip(*per_seed)], "per_seed": per_seed}
    return out


def summarize(result: dict) -> dict:
    """Last-quarter acceptance length per seed and arm, the per-seed ratio, their spreads;
    acceptance length per quarter; the rollout phase's summed seconds per arm, per quarter and
    in all, and co-trained over frozen; its generated tokens per second and the mean response
    length, per quarter and over the run (when the run recorded them)."""
    n = len(result["steps"])
    tail = max(n - quarter_bounds(n)[3], 1)  # the last quarter, as the by-quarter fields take it
    last = {arm: [statistics.fmean(result["runs"][str(s)][arm]["acceptance_length"][-tail:])
                  for s in result["seeds"]] for arm in ARMS}
    ratios = [c / f for c, f in zip(last["cotrain"], last["frozen"])]
    reward = {arm: [statistics.fmean(result["runs"][str(s)][arm]["reward"][-tail:]) for s in result["seeds"]]
              for arm in ARMS}
    # Measured over predicted: how much of the training code's acceptance the engine realises.
    realised = [statistics.fmean(result["runs"][str(s)]["cotrain"]["acceptance_length"])
                / statistics.fmean(result["runs"][str(s)]["cotrain"]["draft_tau"]) for s in result["seeds"]]
    # The same at the k the engine drafted (the tuner's k per round, not training's): the
    # acceptance training's per-pass accuracy predicts for those rounds (rollout/predicted_acceptance).
    predicted = {}
    if all("predicted_acceptance" in result["runs"][str(s)]["cotrain"] for s in result["seeds"]):
        ratios_at_k = []
        for s in result["seeds"]:
            run = result["runs"][str(s)]["cotrain"]
            drafted = [(a, p) for a, p in zip(run["acceptance_length"], run["predicted_acceptance"]) if p is not None]
            ratios_at_k.append(statistics.fmean(a for a, _ in drafted) / statistics.fmean(p for _, p in drafted))
        predicted["cotrain_acceptance_over_predicted_at_drafted_k"] = spread(ratios_at_k)
    rollout = {arm: [sum(result["runs"][str(s)][arm]["rollout_s"]) for s in result["seeds"]] for arm in ARMS}
    undrafted = {arm: [result["runs"][str(s)][arm]["drafted"].count(False) for s in result["seeds"]]
                 for arm in ARMS}
    rollout_ratio = [c / f for c, f in zip(rollout["cotrain"], rollout["frozen"])]
    # The arms' policies drift apart (their samples differ), and so do the lengths they write: the
    # rollout's seconds follow the lengths; its speed is the tokens it generates per second.
    speed = {arm: [statistics.fmean(result["runs"][str(s)][arm]["tokens_per_s"]) for s in result["seeds"]]
             for arm in ARMS}
    lengths = {arm: [statistics.fmean(result["runs"][str(s)][arm]["response_len"]) for s in result["seeds"]]
               for arm in ARMS}
    return {
        "last_steps_averaged": tail,
        "acceptance_length_by_quarter": by_quarter(result, "acceptance_length"),
        "rollout_s_by_quarter": by_quarter(result, "rollout_s"),
        "rollout_s_total": {arm: spread(rollout[arm]) for arm in ARMS},
        "rollout_s_ratio_cotrain_over_frozen": spread(rollout_ratio),
        "tokens_per_s_by_quarter": by_quarter(result, "tokens_per_s"),
        "tokens_per_s": {arm: spread(speed[arm]) for arm in ARMS},
        "tokens_per_s_ratio_cotrain_over_frozen": spread([c / f for c, f in zip(speed["cotrain"], speed["frozen"])]),
        "response_len_by_quarter": by_quarter(result, "response_len"),
        "response_len": {arm: spread(lengths[arm]) for arm in ARMS},
        "undrafted_steps_per_seed": undrafted,
        "cotrain_acceptance_over_draft_tau": spread(realised),
        **predicted,
        "acceptance_length_last_quarter": {arm: spread(last[arm]) for arm in ARMS},
        "acceptance_ratio_cotrain_over_frozen": spread(ratios),
        "reward_last_quarter": {arm: spread(reward[arm]) for arm in ARMS},
        "goal_acceptance_ratio": GOAL_RATIO,
        "goal_met": statistics.fmean(ratios) >= GOAL_RATIO,
    }


def plot(result: dict, path: Path) -> None:
    """Acceptance length and reward per RL step: the mean over seeds, the min-max band."""
    plt = pyplot()
    speed = "tokens_per_s" in result["runs"][str(result["seeds"][0])]["cotrain"]  # runs before lack it
    panels = [("acceptance_length", "rollout acceptance length (at most k + 1)"),
              *([("tokens_per_s", "rollout: generated tokens per second")] if speed else []), ("reward", "mean reward")]
    fig, axes = plt.subplots(len(panels), 1, figsize=(9, 4 * len(panels)), sharex=True)
    steps = result["steps"]
    for ax, (key, title) in zip(axes, panels):
        for arm, color, label in (("cotrain", "tab:blue", "co-trained draft"),
                                  ("frozen", "tab:red", "draft frozen after the warm start")):
            curves = [result["runs"][str(s)][arm][key] for s in result["seeds"]]
            columns = list(zip(*curves))
            ax.plot(steps, [statistics.fmean(c) for c in columns], color=color, lw=2,
                    label=f"{label} (mean of {len(curves)} seeds)")
            ax.fill_between(steps, [min(c) for c in columns], [max(c) for c in columns], color=color, alpha=0.2,
                            lw=0)
        ax.set_title(title)
        ax.grid(alpha=0.3)
    tail = result["summary"]["last_steps_averaged"]
    axes[0].axvspan(steps[-tail], steps[-1], color="grey", alpha=0.1, label=f"last {tail} steps (the ratio)")
    axes[0].legend(loc="lower left")
    axes[-1].set_xlabel("RL step (after the shared warm start); bands: min-max over seeds")
    ratio = result["summary"]["acceptance_ratio_cotrain_over_frozen"]
    fig.suptitle(f"co-trained / frozen acceptance length, last quarter: {ratio['mean']:.2f}x "
                 f"(seeds {ratio['min']:.2f}-{ratio['max']:.2f}); {result['config']['sft_steps']} SFT steps")
    save_figure(fig, path)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="debug_cpu.toml",
                        help="the job under train_configs/ (debug_cpu_longtail.toml: the long-tailed job)")
    parser.add_argument("--sft-steps", type=int, default=600)
    parser.add_argument("--rl-steps", type=int, default=100)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--quick", action="store_true",
                        help=f"{QUICK_SFT_STEPS} SFT and {QUICK_RL_STEPS} RL steps, written to assets/quick/ "
                             "(a smoke run of the script and its checks, not the claim)")
    parser.add_argument("--warm-start", type=Path, default=None,
                        help="an existing warm-start checkpoint folder (step-<sft-steps>) every run resumes from, "
                             "instead of running the SFT phase in the first seed's co-trained arm")
    parser.add_argument("--work", type=Path, default=None, help="run folders (default outputs/compare_cotrain[_quick])")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--png", type=Path, default=None)
    parser.add_argument("--replot", action="store_true", help="only redraw --png from an existing --json")
    parser.add_argument("--resummarize", action="store_true",
                        help="rebuild --json's curves and summary from the run folders under --work, keeping its checks")
    args, extra = parser.parse_known_args()
    assets = ROOT / "assets" / ("quick" if args.quick else "")
    if args.quick:
        args.sft_steps, args.rl_steps = QUICK_SFT_STEPS, QUICK_RL_STEPS
    args.work = args.work or ROOT / "outputs" / ("compare_cotrain_quick" if args.quick else "compare_cotrain")
    args.json = args.json or assets / "compare_cotrain.json"
    args.png = args.png or assets / "acceptance_vs_step.png"
    if args.replot:
        plot(json.loads(args.json.read_text()), args.png)
        return 0
    if args.resummarize:
        return resummarize(args)

    start = time.perf_counter()
    shutil.rmtree(args.work, ignore_errors=True)
    common = ["--task.sft_steps", str(args.sft_steps), "--checkpoint.interval", str(args.sft_steps), "--checkpoint.keep_latest_k", "0", *extra]
    rl = ["--training.steps", str(args.rl_steps)]
    step_dir = f"step-{args.sft_steps}"
    first = args.seeds[0]

    def dump(seed: int, arm: str) -> Path:
        return args.work / f"seed{seed}" / arm

    def resume(folder: Path, warm: Path, flags: list[str]) -> list[dict]:
        """Run from a copy of the warm start; its hash must match before and after the run."""
        copy = folder / "checkpoint" / step_dir
        shutil.copytree(warm, copy)
        before = folder_hash(copy)
        metrics = run(folder, flags, args.config)
        hashes.append({"run": str(folder.relative_to(args.work)), "before": before, "after": folder_hash(copy)})
        return metrics

    hashes, runs = [], {}
    if args.warm_start is not None:
        warm = args.work / "warm_start" / step_dir
        shutil.copytree(args.warm_start, warm)
    else:
        # The first seed's co-trained arm runs the SFT phase and writes the warm start at its last step.
        runs[(first, "cotrain")] = run(dump(first, "cotrain"), [*common, *rl, "--debug.seed", str(first)], args.config)
        warm = dump(first, "cotrain") / "checkpoint" / step_dir
    warm_hash = folder_hash(warm)
    for seed in args.seeds:
        for arm in ARMS:
            if (seed, arm) not in runs:
                flags = [*common, *rl, "--debug.seed", str(seed)] + (["--draft.freeze_after_sft"] if arm == "frozen" else [])
                runs[(seed, arm)] = resume(dump(seed, arm), warm, flags)
    # The warm start's own draft: resume it in a job whose last step is the warm start's
    # (training.steps must be >= 1, so one fewer SFT step), which loads, steps nothing, exports.
    resume(args.work / "warm_start_export", warm, [*common, "--task.sft_steps", str(args.sft_steps - 1),
                                                    "--training.steps", "1"])

    failures = [f"{h['run']}: warm-start copy hash {h['before'][:12]} -> {h['after'][:12]}, warm start {warm_hash[:12]}"
                for h in hashes if not h["before"] == h["after"] == warm_hash]
    warm_draft = draft_state(args.work / "warm_start_export")
    drafts = {}
    for seed in args.seeds:
        for arm in ARMS:
            drafts[f"seed{seed}/{arm}"] = same_weights(draft_state(dump(seed, arm)), warm_draft)
            if arm == "frozen" and not drafts[f"seed{seed}/{arm}"]:
                failures.append(f"seed {seed}: the frozen arm's exported draft differs from the warm start's")
            if arm == "cotrain" and drafts[f"seed{seed}/{arm}"]:
                failures.append(f"seed {seed}: the co-trained arm's draft equals the warm start's: it did not train")

    result = {
        "description": __doc__.split("\n\n")[1].replace("\n", " "),
        "config": {"sft_steps": args.sft_steps, "rl_steps": args.rl_steps, "seeds": args.seeds, "quick": args.quick,
                   "config_file": f"train_configs/{args.config}", "extra_flags": extra, "processes": 2,
                   "hardware": f"{os.cpu_count()}-core CPU, gloo, 2 processes, 1 thread each"},
        "command": command_line(),
        "seeds": args.seeds,
        "steps": [m["step"] - args.sft_steps for m in runs[(first, "cotrain")] if m["phase"] == "rl"],
        "runs": {},
    }
    result["runs"] = {str(seed): {arm: curves_of(runs[(seed, arm)], arm) for arm in ARMS} for seed in args.seeds}
    result["summary"] = summarize(result)
    result["checks"] = {"warm_start_sha256": warm_hash, "warm_start_copies": hashes,
                        "draft_equals_warm_start": drafts, "passed": not failures, "failures": failures}
    result["runtime_seconds"] = round(time.perf_counter() - start, 1)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2) + "\n")
    plot(result, args.png)
    print(json.dumps(result["summary"], indent=2))
    for failure in failures:
        print(f"FAIL: {failure}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
