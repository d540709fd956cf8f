"""End to end: the embedded default's RL step with speculative rollouts against plain ones,
from one warm start and one seed.

Claim: speculation never makes the RL step slower (the engine picks how many tokens to draft,
0 included, from what it measures: ``[rollout] adaptive_speculation``). Goal: the speculative
arm's median step time is at most ``GOAL`` x the plain arm's (the 5% is the noise of a shared
2-core machine: runs of one arm differ by that much).

Method. The embedded default (``train_configs/debug_cpu.toml``, 2 processes) runs its warm
start once and writes a checkpoint at the warm start's last step. Every arm resumes a copy of
that folder with the same ``--debug.seed`` (so the same prompts at every step) and runs
``--rl-steps`` RL steps; the first ``--skip`` are dropped (the adaptive choice's first calls
measure ``k = k_max`` and ``k = 0`` by design). Each arm runs ``--rounds`` times, the arms'
order reversed every other round, so that the machine's drift (the first run after a warm
start is slower) does not fall on one arm; the median is over every run's kept steps (at
least 10). The arms:

* ``speculative``: the default with ``--rollout.adaptive_speculation``;
* ``plain``: ``--rollout.no-speculative`` (the draft is still co-trained, decoding ignores it);
* ``fixed_k``: the default as shipped, ``draft_tokens = 3`` drafted at every step (it keeps
  ``adaptive_speculation = false`` so acceptance lengths compare step to step).

Per step, from ``metrics.jsonl``: ``time/step_s`` (rollout + update + refresh) and
``rollout/tokens_per_s``; also the acceptance length and the ``k`` drafted. Checked first,
exit 1 on failure: the warm start's files are unchanged by every run (sha256), every arm ran
all its steps, and the fixed-k arm's drafts are accepted (acceptance length > 1: speculation
was really on). Whether the goal is met is in the JSON (``summary.goal_met``).

    .venv/bin/python scripts/bench_e2e.py                 # 600 SFT + 2 rounds x 3 arms x 14 RL steps: ~12 min
    .venv/bin/python scripts/bench_e2e.py --quick         # 20 SFT, 4 RL steps, to assets/quick/
    .venv/bin/python scripts/bench_e2e.py --warm-start W  # arms only, from a step-600 folder W: ~6 min
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchtools import command_line, pyplot, save_figure  # noqa: E402
from compare_cotrain import folder_hash, rl_curve, run  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
GOAL = 1.05
ARMS = {
    "speculative": ["--rollout.adaptive_speculation"],
    "plain": ["--rollout.no-speculative"],
    "fixed_k": [],
}


def arm_summary(runs: list[list[dict]], skip: int) -> dict:
    """One arm's timed steps: each run's RL steps after the first ``skip``, runs concatenated."""
    kept = [[m for m in metrics if m["phase"] == "rl"][skip:] for metrics in runs]
    timed = [m for run_steps in kept for m in run_steps]
    step_s = [m["time/step_s"] for m in timed]
    tokens = [m["rollout/tokens_per_s"] for m in timed]
    return {
        "step_s": step_s, "rollout_tokens_per_s": tokens,
        "rollout_s": [m["time/rollout_s"] for m in timed],
        "acceptance_length": [m.get("rollout/acceptance_length", 1.0) for m in timed],
        "draft_tokens": [m.get("rollout/draft_tokens", 0.0) for m in timed],
        "median_step_s": statistics.median(step_s), "median_rollout_tokens_per_s": statistics.median(tokens),
        "median_step_s_per_round": [statistics.median(m["time/step_s"] for m in run_steps) for run_steps in kept],
    }


def plot(result: dict, path: Path) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(2, 1, figsize=(9, 7), sharex=True)
    for arm, color in zip(ARMS, ("tab:blue", "tab:grey", "tab:orange")):
        runs = result[arm]
        steps = list(range(1, len(runs["step_s"]) + 1))
        axes[0].plot(steps, runs["step_s"], "o-", color=color, label=f"{arm} (median {runs['median_step_s']:.2f} s)")
        axes[1].plot(steps, runs["rollout_tokens_per_s"], "o-", color=color, label=arm)
    axes[0].set_ylabel("RL step (s)")
    axes[1].set_ylabel("rollout tokens/s (all ranks)")
    axes[1].set_xlabel("timed RL step (the rounds one after another)")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend()
    ratio = result["summary"]["speculative_over_plain"]
    fig.suptitle(f"embedded default, speculative / plain median step time {ratio:.2f}x (goal <= {GOAL})")
    save_figure(fig, path)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sft-steps", type=int, default=600)
    parser.add_argument("--rl-steps", type=int, default=14)
    parser.add_argument("--skip", type=int, default=4, help="first RL steps of each run left out of the medians")
    parser.add_argument("--rounds", type=int, default=2,
                        help="runs per arm, the arms' order reversed every other round (the machine drifts)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="20 SFT and 4 RL steps into assets/quick/ (a smoke run)")
    parser.add_argument("--warm-start", type=Path, default=None,
                        help="an existing warm-start checkpoint folder (step-<sft-steps>) every arm resumes from, "
                             "instead of running the warm start")
    parser.add_argument("--work", type=Path, default=None)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--png", type=Path, default=None)
    args = parser.parse_args()
    assets = ROOT / "assets" / ("quick" if args.quick else "")
    if args.quick:
        args.sft_steps, args.rl_steps, args.skip, args.rounds = 20, 4, 1, 1
    elif args.rl_steps - args.skip < 10:
        parser.error("the medians need at least 10 timed steps: --rl-steps - --skip >= 10")
    args.work = args.work or ROOT / "outputs" / ("bench_e2e_quick" if args.quick else "bench_e2e")
    args.json = args.json or assets / "bench_e2e.json"
    args.png = args.png or assets / "bench_e2e.png"
    start = time.perf_counter()
    if args.warm_start is not None and args.warm_start.resolve().is_relative_to(args.work.resolve()):
        parser.error("--warm-start must lie outside --work, which is cleared first")
    shutil.rmtree(args.work, ignore_errors=True)
    common = ["--task.sft_steps", str(args.sft_steps), "--checkpoint.interval", str(args.sft_steps),
              "--checkpoint.keep_latest_k", "0", "--debug.seed", str(args.seed),
              "--metrics.no-enable_tensorboard"]
    step_dir = f"step-{args.sft_steps}"
    warm = args.work / "warm_start" / "checkpoint" / step_dir
    if args.warm_start is not None:
        shutil.copytree(args.warm_start, warm)
    else:
        run(args.work / "warm_start", [*common, "--training.steps", "1"])
    warm_hash = folder_hash(warm)
    failures, runs = [], {arm: [] for arm in ARMS}
    for round_ in range(args.rounds):
        for arm in (list(ARMS) if round_ % 2 == 0 else list(ARMS)[::-1]):
            folder = args.work / arm / f"round-{round_}"
            shutil.copytree(warm, folder / "checkpoint" / step_dir)
            metrics = run(folder, [*common, "--training.steps", str(args.rl_steps), *ARMS[arm]])
            if folder_hash(folder / "checkpoint" / step_dir) != warm_hash:
                failures.append(f"{arm}, round {round_}: the run changed its copy of the warm start")
            if len(rl_curve(metrics, "time/step_s")) != args.rl_steps:
                failures.append(f"{arm}, round {round_}: ran {len(rl_curve(metrics, 'time/step_s'))} of "
                                f"{args.rl_steps} RL steps")
            runs[arm].append(metrics)
    if not failures and statistics.fmean(m.get("rollout/acceptance_length", 1.0) for metrics in runs["fixed_k"]
                                         for m in metrics if m["phase"] == "rl") <= 1.0:
        failures.append("fixed_k: no drafted token was accepted, speculation was not on")
    if failures:
        for failure in failures:
            print(f"FAIL: {failure}", file=sys.stderr)
        return 1
    result = {arm: arm_summary(arm_runs, args.skip) for arm, arm_runs in runs.items()}
    for arm, summary in result.items():
        print(f"{arm:12s} median step {summary['median_step_s']:.3f} s (per round "
              f"{', '.join(f'{s:.3f}' for s in summary['median_step_s_per_round'])}), rollout "
              f"{summary['median_rollout_tokens_per_s']:.0f} tok/s, k {summary['draft_tokens']}", flush=True)
    ratio = result["speculative"]["median_step_s"] / result["plain"]["median_step_s"]
    result["config"] = {"sft_steps": args.sft_steps, "rl_steps": args.rl_steps, "skip": args.skip, "rounds": args.rounds,
                        "seed": args.seed, "job": "train_configs/debug_cpu.toml, 2 CPU processes (gloo)",
                        "arms": {arm: flags for arm, flags in ARMS.items()}}
    result["summary"] = {
        "speculative_over_plain": ratio, "goal": GOAL, "goal_met": ratio <= GOAL,
        "fixed_k_over_plain": result["fixed_k"]["median_step_s"] / result["plain"]["median_step_s"],
        "runtime_s": time.perf_counter() - start,
    }
    result["command"] = command_line()
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=1) + "\n")
    plot(result, args.png)
    print(f"speculative / plain median step time {ratio:.3f} (goal <= {GOAL}: {'met' if ratio <= GOAL else 'NOT met'}); "
          f"fixed k / plain {result['summary']['fixed_k_over_plain']:.3f}; wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
