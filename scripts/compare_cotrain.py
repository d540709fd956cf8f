"""Co-trained vs frozen draft on the embedded default: measured rollout acceptance length
and reward per RL step.

Both arms share the warm start: the co-trained run writes a checkpoint at the last SFT
step, and the frozen run resumes from a copy of it with ``--draft.freeze_after_sft``, so
the two differ only in whether the draft keeps training during RL. Same seeds, same
prompts. Writes ``assets/compare_cotrain.json`` and ``assets/acceptance_vs_step.png``.

Speculative sampling is lossless in distribution, not sample for sample: the two arms
draw different random numbers once their drafts differ, so their reward curves agree
statistically (the policy's gradients are identical given the same samples, which the
tests check bitwise), not bit for bit. The script reports both curves and their means.

    .venv/bin/python scripts/compare_cotrain.py [--rl-steps N] [extra --section.key value ...]
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from pngplot import BLACK, BLUE, GREY, GRID, RED, Canvas  # noqa: E402


def run(dump: Path, extra: list[str]) -> list[dict]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           "-m", "titan_cotrain.train", "--job.config_file", str(ROOT / "train_configs" / "debug_cpu.toml"),
           "--job.dump_folder", str(dump), *extra]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    print("+", " ".join(cmd[3:]), flush=True)
    subprocess.run(cmd, cwd=ROOT, env=env, check=True)
    return [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]


def rl_curve(metrics: list[dict], key: str) -> list[float]:
    return [m[key] for m in metrics if m["phase"] == "rl"]


def _panel(canvas: Canvas, box: tuple[int, int, int, int], curves: dict[str, list[float]], title: str) -> None:
    """Two curves (co-trained blue, frozen red) over the RL steps in ``box`` = left, right, top, bottom."""
    left, right, top, bottom = box
    lo = min(min(c) for c in curves.values())
    hi = max(max(c) for c in curves.values())
    lo, hi = lo - 0.05 * (hi - lo + 1e-6), hi + 0.05 * (hi - lo + 1e-6)
    n = max(len(c) for c in curves.values())

    def xy(i: int, v: float) -> tuple[float, float]:
        return left + (right - left) * i / max(n - 1, 1), bottom - (bottom - top) * (v - lo) / (hi - lo)

    for k in range(5):
        y = top + (bottom - top) * k / 4
        canvas.line(left, y, right, y, GRID)
        canvas.text(10, int(y) - 7, f"{hi - (hi - lo) * k / 4:.2f}", GREY)
    canvas.line(left, top, left, bottom, BLACK, 2)
    canvas.line(left, bottom, right, bottom, BLACK, 2)
    for name, color in (("frozen", RED), ("cotrain", BLUE)):
        points = [xy(i, v) for i, v in enumerate(curves[name])]
        for (x0, y0), (x1, y1) in zip(points, points[1:]):
            canvas.line(x0, y0, x1, y1, color, 3)
    canvas.text(left, top - 25, title, BLACK)


def plot(result: dict, path: Path) -> None:
    canvas = Canvas(900, 860)
    steps = result["steps"]
    _panel(canvas, (90, 860, 60, 430), {k: result[k]["acceptance_length"] for k in ("cotrain", "frozen")},
           "ROLLOUT ACCEPTANCE LENGTH PER RL STEP")
    canvas.text(100, 70, "CO-TRAINED DRAFT", BLUE)
    canvas.text(100, 90, "FROZEN AFTER WARM START", RED)
    _panel(canvas, (90, 860, 520, 790), {k: result[k]["reward"] for k in ("cotrain", "frozen")},
           "MEAN REWARD PER RL STEP")
    canvas.text(90, 810, f"RL STEP {steps[0]} TO {steps[-1]}", GREY)
    canvas.save(path)


def mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sft-steps", type=int, default=600)
    parser.add_argument("--rl-steps", type=int, default=100)
    parser.add_argument("--warm-start", type=Path, default=None,
                        help="an existing warm-start checkpoint folder (step-<sft-steps>) both arms resume from, "
                             "instead of running the SFT phase in the co-trained arm")
    parser.add_argument("--work", type=Path, default=ROOT / "outputs" / "compare_cotrain")
    parser.add_argument("--json", type=Path, default=ROOT / "assets" / "compare_cotrain.json")
    parser.add_argument("--png", type=Path, default=ROOT / "assets" / "acceptance_vs_step.png")
    parser.add_argument("--replot", action="store_true", help="only redraw --png from an existing --json")
    args, extra = parser.parse_known_args()
    if args.replot:
        plot(json.loads(args.json.read_text()), args.png)
        return 0
    shutil.rmtree(args.work, ignore_errors=True)
    common = ["--task.sft_steps", str(args.sft_steps), "--training.steps", str(args.rl_steps),
              "--checkpoint.interval", str(args.sft_steps), "--checkpoint.keep_latest_k", "0", *extra]
    warm_start = args.work / "cotrain" / "checkpoint" / f"step-{args.sft_steps}"
    if args.warm_start is not None:
        shutil.copytree(args.warm_start, warm_start)
    cotrain = run(args.work / "cotrain", common)
    frozen_dump = args.work / "frozen"
    shutil.copytree(warm_start, frozen_dump / "checkpoint" / f"step-{args.sft_steps}")
    frozen = run(frozen_dump, [*common, "--draft.freeze_after_sft"])

    result = {"steps": [m["step"] - args.sft_steps for m in cotrain if m["phase"] == "rl"]}
    for name, metrics in (("cotrain", cotrain), ("frozen", frozen)):
        result[name] = {"acceptance_length": rl_curve(metrics, "rollout/acceptance_length"),
                        "reward": rl_curve(metrics, "reward/mean")}
        result[name] |= {key.split("/", 1)[1]: rl_curve(metrics, key) for key in sorted(metrics[-1])
                         if key.startswith("task/") or key.startswith("rollout/acceptance_rate_")}
    tail = max(len(result["steps"]) // 4, 1)
    ratio = mean(result["cotrain"]["acceptance_length"][-tail:]) / mean(result["frozen"]["acceptance_length"][-tail:])
    result["summary"] = {
        "sft_steps": args.sft_steps, "rl_steps": args.rl_steps, "last_steps_averaged": tail,
        "acceptance_ratio_cotrain_over_frozen": ratio,
        "mean_reward_cotrain": mean(result["cotrain"]["reward"]),
        "mean_reward_frozen": mean(result["frozen"]["reward"]),
        "first_rl_step_reward": [result["cotrain"]["reward"][0], result["frozen"]["reward"][0]],
        "goal_acceptance_ratio": 1.3, "goal_met": ratio >= 1.3,
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2) + "\n")
    plot(result, args.png)
    print(json.dumps(result["summary"], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
