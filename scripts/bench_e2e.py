"""End to end: the RL step with speculative rollouts against plain ones, on the embedded default
and on the long-tailed embedded job, each from one warm start, with the EAGLE-3 draft and with
the block drafter (``[draft] kind = "dflash"``).

Claims. On the long-tailed job (``train_configs/debug_cpu_longtail.toml``: response lengths
follow a capped Pareto law, so a few long responses decode at low concurrency, where
speculation pays most) the RL step with ``k`` chosen every decoding round takes at most
``GOALS["longtail"]["step"]`` x plain's step time and its rollout phase at most
``GOALS["longtail"]["rollout"]`` x plain's (1.4x faster), with the 90% noise band of the
step ratio below 1. On the embedded default (``debug_cpu.toml``, near-equal lengths) the
per-round choice is never slower than plain decoding: step ratio at most
``GOALS["default"]["step"]``.

Method. Per config, the warm start runs once (or ``--warm-start-<config>`` gives a step-<sft>
folder) and every run resumes a copy of it for ``--rl-steps`` RL steps, the first ``--skip``
left out (the adaptive arms' first calls measure by design: every ``k``, then plain decoding).
Each arm runs ``--rounds`` times, round ``r`` with RL seed ``--seed + r`` (its own prompts and
samples), the same seed in every arm of a round, so step ``i`` of round ``r`` is the same
batch of prompts in every arm. The arms:

* ``plain``: ``--rollout.no-speculative`` (the draft is still co-trained, decoding ignores it);
* ``per_call``: ``k`` chosen once per rollout phase from its first wave's size;
* ``per_round``: ``k`` chosen every decoding round from the live rows (the default);
* ``fixed_k3``: ``k = 3`` every round;
* ``dflash_per_round``: the block drafter (``DFLASH``: blocks of 8, 2 layers), ``k`` in 0..7
  chosen every decoding round. It resumes its own warm start: the same job and seed with the
  ``DFLASH`` flags, whose policy (weights, optimizer state, schedule) is the EAGLE-3 warm
  start's bit for bit (the drafter does not touch the policy's gradients);
  ``summary.<job>.dflash.same_policy_start`` says whether the two checkpoints' policy entries
  hash the same. Its records add the ratios against ``per_round`` (``*_over_eagle3``).

The arms' order is reversed every other round so that the machine's drift does not fall on
one arm; medians are over every run's kept steps. The noise band of a ratio is the 5th-95th
percentile of the ratio of medians over bootstrap resamples of the paired kept steps (the same
step of the same round in both arms: the same prompts); ``paired_*_ratio_median`` is the
median over those pairs of one arm's step (or rollout) time over plain's, and
``undrafted_steps`` counts the kept steps whose rollout drafted nothing (an adaptive arm's
tuner measuring plain decoding, or choosing it for the whole phase). Per step, from
``metrics.jsonl``: ``time/step_s``, ``time/rollout_s``,
``rollout/tail_share`` (wall time with at most a quarter of the rows live, over the
rollout's), ``rollout/acceptance_length`` (over the rounds that drafted) and
``rollout/draft_tokens`` (mean k), ``time/draft_per_round_s`` and ``time/verify_per_round_s``
(what a round the draft followed spent in the draft and in verification). Then, on the
long-tailed job, each family's co-trained draft (the ``per_round`` and ``dflash_per_round``
runs) against one frozen after the warm start (``--draft.freeze_after_sft``, also per round,
``FROZEN_ARMS``), one frozen run per round's seed: the step ratio and acceptance, whatever they
show. ``--configs`` naming one job keeps the other job's results from an existing ``--json``,
and ``--arms`` naming some arms keeps the others' records of the jobs run (each record carries
the settings and command that made it; a kept arm's ratios are against its own run's plain).

Checked first, exit 1 on failure: every run's copy of its warm start is unchanged (sha256),
every run ran all its steps, and the fixed-k arm's drafts are accepted (acceptance length > 1:
speculation was really on). Whether the goals are met is in the JSON (``summary``).
``records`` lists ``{config, arm, seeds, step_s_median, rollout_s_median, tail_share,
acceptance_length, noise_band}``; the README's table is generated from it.

    .venv/bin/python scripts/bench_e2e.py      # 2 warm starts (~10 + ~20 min) and the runs below
    .venv/bin/python scripts/bench_e2e.py --configs longtail --warm-start-longtail W   # ~50 min
    .venv/bin/python scripts/bench_e2e.py --arms plain per_round dflash_per_round dflash_per_round_frozen
    .venv/bin/python scripts/bench_e2e.py --quick   # 20 SFT, 4 RL steps, 1 seed, to assets/quick/
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchtools import command_line, pyplot, save_figure  # noqa: E402
from compare_cotrain import folder_hash, run  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = {"default": "debug_cpu.toml", "longtail": "debug_cpu_longtail.toml"}
PER_ROUND = ["--rollout.adaptive_speculation", "--rollout.speculation_granularity", "round"]
# The block drafter's job: blocks of 8 (up to 7 drafted tokens a round, the tuner choosing how
# many to verify), 2 layers reading 2 target layers; its warm start is the EAGLE-3 one's with
# these flags (the same seed: the policy's start is the same, which the benchmark checks).
DFLASH = ["--draft.kind", "dflash", "--draft.block_size", "8", "--draft.block_layers", "2",
          "--rollout.draft_tokens", "7"]
ARMS = {
    "plain": ["--rollout.no-speculative"],
    "per_call": ["--rollout.adaptive_speculation", "--rollout.speculation_granularity", "call"],
    "per_round": PER_ROUND,
    "fixed_k3": ["--rollout.no-adaptive_speculation", "--rollout.draft_tokens", "3"],
    "dflash_per_round": [*DFLASH, *PER_ROUND],
}
FROZEN = ["--draft.freeze_after_sft"]
# The long-tailed job's frozen twins of the co-trained per-round arms, each run in every round.
FROZEN_ARMS = {"per_round_frozen": [*PER_ROUND, *FROZEN], "dflash_per_round_frozen": [*DFLASH, *PER_ROUND, *FROZEN]}
TWINS = {"per_round": "per_round_frozen", "dflash_per_round": "dflash_per_round_frozen"}
# What the co-trained vs frozen comparison of each family is called in the summary.
TWIN_SUMMARY = {"per_round": "cotrained_vs_frozen", "dflash_per_round": "dflash_cotrained_vs_frozen"}
REQUIRED = ("plain", "per_round")
# per_round over plain: the most its median step (and rollout) time may take.
GOALS = {"default": {"step": 1.03}, "longtail": {"step": 0.83, "rollout": 1 / 1.4}}
# dflash_per_round against per_round (EAGLE-3): the least rollout speed-up it aims for.
DFLASH_GOALS = {"longtail": {"rollout_speedup_over_eagle3": 1.2}}
POLICY_SKIP = ("draft.", "draft_optimizer.", "draft_lr_scheduler.", "speculation.", "trainer.", "dataloader.")


def family(arm: str) -> str:
    """The draft family an arm runs, which names the warm start it resumes."""
    return "dflash" if arm.startswith("dflash") else "eagle3"


def policy_fingerprint(checkpoint: Path) -> str:
    """sha256 over the policy's entries of a DCP checkpoint folder (weights, optimizer state,
    LR schedule): every key but the draft's, the tuner's, the trainer's and the data's."""
    import hashlib
    import tempfile

    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory() as tmp:
        dcp_to_torch_save(checkpoint, Path(tmp) / "whole.pt")
        state = torch.load(Path(tmp) / "whole.pt", weights_only=False)
    flat = {}

    def walk(prefix, value):
        if isinstance(value, dict):
            for key, item in value.items():
                walk(f"{prefix}{key}.", item)
        else:
            flat[prefix[:-1]] = value

    walk("", state)
    digest = hashlib.sha256()
    for key in sorted(k for k in flat if not k.startswith(POLICY_SKIP)):
        value = flat[key]
        digest.update(key.encode() + b"\0")
        digest.update(value.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
                      if isinstance(value, torch.Tensor) else repr(value).encode())
    return digest.hexdigest()


def kept_steps(runs: list[list[dict]], skip: int) -> list[dict]:
    """Every run's RL steps after its first ``skip``, runs concatenated."""
    return [m for metrics in runs for m in [m for m in metrics if m["phase"] == "rl"][skip:]]


def arm_summary(steps: list[dict]) -> dict:
    drafting = [m["rollout/acceptance_length"] for m in steps if m.get("rollout/draft_tokens", 0.0) > 0]
    return {
        "step_s": [m["time/step_s"] for m in steps], "rollout_s": [m["time/rollout_s"] for m in steps],
        "tail_share": [m.get("rollout/tail_share", 0.0) for m in steps],
        "acceptance_length": [m.get("rollout/acceptance_length", 1.0) for m in steps],
        "draft_tokens": [round(m.get("rollout/draft_tokens", 0.0), 3) for m in steps],
        "rollout_tokens_per_s": [m["rollout/tokens_per_s"] for m in steps],
        # What a round the draft followed spent in the draft and in verification (steps that drafted).
        "draft_per_round_s": [m["time/draft_per_round_s"] for m in steps if "time/draft_per_round_s" in m],
        "verify_per_round_s": [m["time/verify_per_round_s"] for m in steps if "time/verify_per_round_s" in m],
        "median_step_s": statistics.median(m["time/step_s"] for m in steps),
        "median_rollout_s": statistics.median(m["time/rollout_s"] for m in steps),
        "median_tail_share": statistics.median(m.get("rollout/tail_share", 0.0) for m in steps),
        # Over the steps that drafted (1.0: none did).
        "median_acceptance_length": statistics.median(drafting) if drafting else 1.0,
    }


def record(config: str, arm: str, seeds: list[int], s: dict) -> dict:
    """The fields of a ``records`` entry that an ``arm_summary`` gives."""
    return {"config": config, "arm": arm, "seeds": seeds, "steps": len(s["step_s"]),
            "step_s_median": s["median_step_s"], "rollout_s_median": s["median_rollout_s"],
            "tail_share": s["median_tail_share"], "acceptance_length": s["median_acceptance_length"],
            "mean_k": statistics.fmean(s["draft_tokens"]),
            "undrafted_steps": sum(k == 0 for k in s["draft_tokens"]),
            "draft_per_round_s": statistics.median(s["draft_per_round_s"]) if s["draft_per_round_s"] else None,
            "verify_per_round_s": statistics.median(s["verify_per_round_s"]) if s["verify_per_round_s"] else None}


def against(s: dict, base: dict, name: str, seed: int) -> dict:
    """``s``'s step and rollout time against arm ``base``'s (the same rounds' paired steps):
    ratios of medians, paired medians and the step ratio's noise band, keys ``*_over_<name>``."""
    return {f"step_over_{name}": s["median_step_s"] / base["median_step_s"],
            f"rollout_over_{name}": s["median_rollout_s"] / base["median_rollout_s"],
            f"paired_step_over_{name}": paired_ratio_median(s["step_s"], base["step_s"]),
            f"paired_rollout_over_{name}": paired_ratio_median(s["rollout_s"], base["rollout_s"]),
            f"step_noise_band_over_{name}": noise_band(s["step_s"], base["step_s"], seed),
            f"rollout_noise_band_over_{name}": noise_band(s["rollout_s"], base["rollout_s"], seed + 1)}


def paired_ratio_median(mine: list[float], theirs: list[float]) -> float:
    """Median over the paired steps (the same step of the same round) of ``mine / theirs``."""
    if len(mine) != len(theirs):
        raise ValueError(f"paired steps: {len(mine)} against {len(theirs)}")
    return statistics.median(a / b for a, b in zip(mine, theirs))


def noise_band(mine: list[float], theirs: list[float], seed: int, resamples: int = 2000) -> list[float]:
    """5th and 95th percentile of median(mine) / median(theirs) over bootstrap resamples of the
    paired steps: step ``i`` of both lists is the same RL step of the same round (the same
    prompts: both runs have that round's seed), so a step whose batch holds a long response is
    slow in every arm and a resample takes it, or not, for both."""
    if len(mine) != len(theirs):
        raise ValueError(f"paired steps: {len(mine)} against {len(theirs)}")
    rng, n = random.Random(seed), len(mine)
    ratios = []
    for _ in range(resamples):
        picked = rng.choices(range(n), k=n)
        ratios.append(statistics.median(mine[i] for i in picked) / statistics.median(theirs[i] for i in picked))
    ratios.sort()
    return [ratios[resamples // 20], ratios[resamples - resamples // 20 - 1]]


def resume(work: Path, warm: Path, step_dir: str, config: str, flags: list[str], failures: list[str],
           name: str) -> list[dict]:
    """A run resumed from a copy of ``warm``; a changed copy or a short run is a failure."""
    shutil.copytree(warm, work / "checkpoint" / step_dir)
    metrics = run(work, flags, config)
    if folder_hash(work / "checkpoint" / step_dir) != folder_hash(warm):
        failures.append(f"{name}: the run changed its copy of the warm start")
    steps = [m for m in metrics if m["phase"] == "rl"]
    want = int(flags[flags.index("--training.steps") + 1])
    if len(steps) != want:
        failures.append(f"{name}: ran {len(steps)} of {want} RL steps")
    return metrics


def plot(result: dict, path: Path) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(2, len(CONFIGS), figsize=(12, 7), squeeze=False)
    colors = dict(zip([*ARMS, *FROZEN_ARMS], ("tab:grey", "tab:green", "tab:blue", "tab:orange", "tab:red",
                                                "tab:cyan", "tab:pink")))
    for col, config in enumerate(CONFIGS):
        arms = result["configs"].get(config)
        if arms is None:
            continue
        for arm, summary in arms.items():
            if arm not in colors:
                continue
            steps = list(range(1, len(summary["step_s"]) + 1))
            axes[0][col].plot(steps, summary["step_s"], "o-", ms=3, color=colors[arm],
                              label=f"{arm} (median {summary['median_step_s']:.2f} s)")
            axes[1][col].plot(steps, summary["rollout_s"], "o-", ms=3, color=colors[arm], label=arm)
        axes[0][col].set_title(f"{config} ({CONFIGS[config]})")
        axes[0][col].set_ylabel("RL step (s)")
        axes[1][col].set_ylabel("rollout phase (s)")
        axes[1][col].set_xlabel("timed RL step (the runs one after another)")
        for ax in axes[:, col]:
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
    fig.suptitle("RL step and rollout time per arm: plain, EAGLE-3 (k per call, k per round, k = 3), "
                 "the block drafter (k per round)")
    save_figure(fig, path)


def keep_earlier(previous: dict | None, configs: list[str], kept_jobs: list[str], records: list[dict],
                 result: dict, summary: dict) -> None:
    """Add to this run's ``records``, ``result`` and ``summary`` what an earlier run's JSON
    (``previous``) holds and this run did not make: the arms it left out of the jobs it ran
    (``--arms``; their ratios are against that run's plain arm, its settings in each record),
    a co-trained vs frozen comparison it did not run, and the jobs it left out (``kept_jobs``)."""
    if previous is None:
        return
    made = {(r["config"], r["arm"]) for r in records}
    for r in previous["records"]:
        if r["config"] in configs and (r["config"], r["arm"]) not in made and "settings" in r:
            records.append(r)
            if r["arm"] in previous["configs"].get(r["config"], {}):
                result["configs"][r["config"]][r["arm"]] = previous["configs"][r["config"]][r["arm"]]
    if "longtail" in configs or "longtail" in kept_jobs:
        summary |= {key: previous["summary"][key] for key in TWIN_SUMMARY.values()
                    if key not in summary and key in previous["summary"]}
    for config in kept_jobs:
        records += [r for r in previous["records"] if r["config"] == config]
        summary[config] = previous["summary"][config]
        result["configs"][config] = previous["configs"][config]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=list(CONFIGS))
    parser.add_argument("--arms", nargs="+", choices=[*ARMS, *FROZEN_ARMS], default=[*ARMS, *FROZEN_ARMS],
                        help="the arms to run (plain and per_round always among them); the other arms' records "
                             "of the jobs run are kept from --json, with the settings that made them")
    parser.add_argument("--sft-steps", type=int, default=600)
    parser.add_argument("--rl-steps", type=int, default=33)
    parser.add_argument("--skip", type=int, default=3, help="first RL steps of each run left out of the medians")
    parser.add_argument("--rounds", type=int, default=3,
                        help="runs per arm, round r with RL seed --seed + r, the arms' order reversed every "
                             "other round (the machine drifts)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="20 SFT and 4 RL steps into assets/quick/ (a smoke run)")
    for config in CONFIGS:
        parser.add_argument(f"--warm-start-{config}", type=Path, default=None,
                            help=f"an existing step-<sft-steps> checkpoint folder of {CONFIGS[config]} every "
                                 "EAGLE-3 run resumes from, instead of running the warm start")
        parser.add_argument(f"--warm-start-{config}-dflash", type=Path, default=None,
                            help=f"the same for the block drafter's runs ({CONFIGS[config]} with the DFLASH flags)")
    parser.add_argument("--work", type=Path, default=None)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--png", type=Path, default=None)
    args = parser.parse_args()
    assets = ROOT / "assets" / ("quick" if args.quick else "")
    if args.quick:
        args.sft_steps, args.rl_steps, args.skip, args.rounds = 20, 4, 1, 1
    elif args.rounds * (args.rl_steps - args.skip) < 10:
        parser.error("the medians need at least 10 timed steps per arm: --rounds x (--rl-steps - --skip) >= 10")
    missing = [arm for arm in REQUIRED if arm not in args.arms]
    if missing:
        parser.error(f"--arms must include {', '.join(missing)}: every ratio is against plain, the block drafter's "
                     "also against per_round")
    args.work = args.work or ROOT / "outputs" / ("bench_e2e_quick" if args.quick else "bench_e2e")
    args.json = args.json or assets / "bench_e2e.json"
    args.png = args.png or assets / "bench_e2e.png"
    start = time.perf_counter()
    warm_given = {(c, f): getattr(args, f"warm_start_{c}" + ("_dflash" if f == "dflash" else ""))
                  for c in CONFIGS for f in ("eagle3", "dflash")}
    for path in warm_given.values():
        if path is not None and path.resolve().is_relative_to(args.work.resolve()):
            parser.error("--warm-start-* must lie outside --work, which is cleared first")
    previous = json.loads(args.json.read_text()) if args.json.exists() else None
    kept_jobs = [c for c in CONFIGS if c not in args.configs and previous and c in previous.get("summary", {})]
    unsourced = sorted({r["config"] for r in (previous or {}).get("records", [])
                        if r["config"] in kept_jobs and "settings" not in r})
    if unsourced:
        parser.error(f"{args.json} does not say what made its {', '.join(unsourced)} records (no settings): "
                     "run every job (--configs default longtail)")
    shutil.rmtree(args.work, ignore_errors=True)
    common = ["--task.sft_steps", str(args.sft_steps), "--checkpoint.interval", str(args.sft_steps),
              "--checkpoint.keep_latest_k", "0", "--metrics.no-enable_tensorboard"]
    steps = ["--training.steps", str(args.rl_steps)]
    step_dir = f"step-{args.sft_steps}"
    failures, result, records = [], {"configs": {}}, []
    kept_by, same_start = {}, {}
    for config in args.configs:
        arms = {arm: flags for arm, flags in ARMS.items() if arm in args.arms}
        if config == "longtail":  # each co-trained per-round arm's frozen twin runs in each round beside it
            arms |= {arm: flags for arm, flags in FROZEN_ARMS.items() if arm in args.arms}
        warm = {}
        for fam in sorted({family(arm) for arm in arms}):
            warm[fam] = args.work / config / f"warm_start{'_dflash' if fam == 'dflash' else ''}" / "checkpoint" / step_dir
            if warm_given[config, fam] is not None:
                shutil.copytree(warm_given[config, fam], warm[fam])
            else:
                run(warm[fam].parents[1], [*common, "--debug.seed", str(args.seed), "--training.steps", "1",
                                           *(DFLASH if fam == "dflash" else [])], CONFIGS[config])
        if len(warm) == 2:  # the families' warm starts train the same policy from the same seed
            same_start[config] = policy_fingerprint(warm["eagle3"]) == policy_fingerprint(warm["dflash"])
        runs = {arm: [] for arm in arms if arm in ARMS}
        for round_ in range(args.rounds):
            for arm in (list(arms) if round_ % 2 == 0 else list(arms)[::-1]):
                metrics = resume(args.work / config / arm / f"round-{round_}", warm[family(arm)], step_dir,
                                 CONFIGS[config], [*common, "--debug.seed", str(args.seed + round_), *steps,
                                                   *arms[arm]], failures, f"{config} {arm}, round {round_}")
                if arm in runs:
                    runs[arm].append(metrics)
                if config == "longtail":
                    kept_by.setdefault(f"{config}/seeds", {}).setdefault(arm, {})[args.seed + round_] = \
                        kept_steps([metrics], args.skip)
        if "fixed_k3" in runs and statistics.fmean(
                m.get("rollout/acceptance_length", 1.0) for m in kept_steps(runs["fixed_k3"], 0)) <= 1.0:
            failures.append(f"{config} fixed_k3: no drafted token was accepted, speculation was not on")
        kept_by[config] = {arm: kept_steps(arm_runs, args.skip) for arm, arm_runs in runs.items()}
    if failures:
        for failure in failures:
            print(f"FAIL: {failure}", file=sys.stderr)
        return 1

    summary = {}
    seeds_run = list(range(args.seed, args.seed + args.rounds))
    for config in args.configs:
        arms = result["configs"][config] = {arm: arm_summary(steps_) for arm, steps_ in kept_by[config].items()}
        plain = arms["plain"]
        for arm, s in arms.items():
            fields = {}
            if arm != "plain":
                vs = against(s, plain, "plain", args.seed)
                fields = {"step_over_plain": vs["step_over_plain"], "rollout_over_plain": vs["rollout_over_plain"],
                          "paired_step_ratio_median": vs["paired_step_over_plain"],
                          "paired_rollout_ratio_median": vs["paired_rollout_over_plain"],
                          "noise_band": vs["step_noise_band_over_plain"],
                          "rollout_noise_band": vs["rollout_noise_band_over_plain"]}
                if family(arm) == "dflash":
                    fields |= against(s, arms["per_round"], "eagle3", args.seed)
            records.append(record(config, arm, seeds_run, s) | {"noise_band": None, "rollout_noise_band": None}
                           | fields)
        mine = next(r for r in records if r["config"] == config and r["arm"] == "per_round")
        goal = GOALS[config]
        met = mine["step_over_plain"] <= goal["step"]
        if "rollout" in goal:
            met = met and mine["rollout_over_plain"] <= goal["rollout"] and mine["noise_band"][1] < 1.0
        summary[config] = {"per_round_step_over_plain": mine["step_over_plain"],
                           "per_round_rollout_over_plain": mine["rollout_over_plain"],
                           "per_round_noise_band": mine["noise_band"], "goal": goal, "goal_met": met,
                           "plain_tail_share": arms["plain"]["median_tail_share"],
                           "plain_rollout_share_of_step": arms["plain"]["median_rollout_s"]
                           / arms["plain"]["median_step_s"]}
        block = next((r for r in records if r["config"] == config and r["arm"] == "dflash_per_round"), None)
        if block is not None:
            speedup = 1 / block["rollout_over_eagle3"]
            dgoal = DFLASH_GOALS.get(config)
            summary[config]["dflash"] = {
                "same_policy_start": same_start.get(config),
                "rollout_speedup_over_eagle3": speedup, "paired_rollout_speedup_over_eagle3":
                1 / block["paired_rollout_over_eagle3"], "step_over_eagle3": block["step_over_eagle3"],
                "acceptance_length": block["acceptance_length"], "eagle3_acceptance_length": mine["acceptance_length"],
                "draft_per_round_s": block["draft_per_round_s"], "eagle3_draft_per_round_s": mine["draft_per_round_s"],
                "goal": dgoal, "goal_met": None if dgoal is None else speedup >= dgoal["rollout_speedup_over_eagle3"]}
    seeds = kept_by.get("longtail/seeds", {})
    for co_arm, fr_arm in TWINS.items():
        if co_arm not in seeds or fr_arm not in seeds:
            continue
        per_seed = []
        for seed in sorted(seeds[co_arm]):
            co, fr = arm_summary(seeds[co_arm][seed]), arm_summary(seeds[fr_arm][seed])
            per_seed.append({"seed": seed, "cotrained_step_s": co["median_step_s"], "frozen_step_s": fr["median_step_s"],
                             "frozen_over_cotrained_step": fr["median_step_s"] / co["median_step_s"],
                             "cotrained_acceptance_length": co["median_acceptance_length"],
                             "frozen_acceptance_length": fr["median_acceptance_length"]})
        for arm, name in ((co_arm, f"{co_arm}_cotrained"), (fr_arm, fr_arm)):
            s = arm_summary([m for steps_ in seeds[arm].values() for m in steps_])
            records.append(record("longtail", name, sorted(seeds[arm]), s) | {"noise_band": None})
        summary[TWIN_SUMMARY[co_arm]] = per_seed
    settings = {"sft_steps": args.sft_steps, "rl_steps": args.rl_steps, "skip": args.skip,
                "rounds": args.rounds, "seeds": seeds_run, "arms": args.arms, "command": command_line(),
                "runtime_s": time.perf_counter() - start}
    for r in records:
        r["settings"] = settings
    keep_earlier(previous, args.configs, kept_jobs, records, result, summary)
    result["records"] = records
    result["config"] = {"jobs": {c: f"train_configs/{CONFIGS[c]}, 2 CPU processes (gloo)"
                                 for c in CONFIGS if c in summary},
                        "arms": ARMS, "frozen": FROZEN, "frozen_arms": FROZEN_ARMS, "dflash": DFLASH}
    result["summary"] = summary
    result["command"] = command_line()
    for r in records:
        ratio = f", x{r['step_over_plain']:.3f} plain" if "step_over_plain" in r else ""
        ratio += f", x{r['rollout_over_eagle3']:.3f} EAGLE-3's rollout" if "rollout_over_eagle3" in r else ""
        band = f" (noise {r['noise_band'][0]:.2f}-{r['noise_band'][1]:.2f})" if r.get("noise_band") else ""
        print(f"{r['config']:9s} {r['arm']:26s} step {r['step_s_median']:.3f} s, rollout {r['rollout_s_median']:.3f} s, "
              f"tail {r['tail_share']:.2f}, accept {r['acceptance_length']:.2f}, k {r['mean_k']:.2f}{ratio}{band}",
              flush=True)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=1) + "\n")
    plot(result, args.png)
    for config, s in summary.items():
        if isinstance(s, dict) and "goal_met" in s:
            print(f"{config}: per-round / plain step {s['per_round_step_over_plain']:.3f}, rollout "
                  f"{s['per_round_rollout_over_plain']:.3f} (goal {s['goal']}: {'met' if s['goal_met'] else 'NOT met'})")
            if "dflash" in s:
                d = s["dflash"]
                print(f"{config}: block drafter's rollout {d['rollout_speedup_over_eagle3']:.3f}x EAGLE-3's speed, "
                      f"accept {d['acceptance_length']:.2f} vs {d['eagle3_acceptance_length']:.2f}, same policy "
                      f"start: {d['same_policy_start']} (goal {d['goal']}: {d['goal_met']})")
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
