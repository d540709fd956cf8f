"""Why RL did not raise held-out accuracy on the recipe benchmark's GSM8K-format task: GRPO
variants from one warm start, held-out accuracy measured during RL.

Question (issue 39). From the warm start of ``scripts/bench_recipes.py`` (a tiny tied-embedding
Qwen3 policy, 600 SFT steps), 100 GRPO steps at the embedded default's LR left held-out accuracy
flat and 4x that LR took it down. Which of the suspects is it: too small or too large a step, a
gain that is not RL's (no credit assignment), the tied head, or something in the loss?

Method. One warm start (``--warm-start``: a copy of a ``bench_recipes.py`` run's
``<work>/warm_start``, its sha256 recorded and checked before and after every run) is evaluated
once; then each variant (``VARIANTS``) runs ``--steps`` RL steps of a recipe from a copy of it,
with the benchmark's job flags (``bench_recipes.job_flags``) and one RL seed, writing a
checkpoint every ``--eval-every`` steps, and each checkpoint is evaluated on the held-out prompts
(``python -m titan_cotrain.eval``, ``--samples`` responses per prompt at the rollout temperature,
the same sampling seed for every checkpoint). Per RL step, from ``metrics.jsonl``: the share of
correct responses on the step's training prompts (``task/correct``), the KL to the reference,
the policy entropy, the policy's gradient norm before clipping and the LR. The variants:

* ``grpo``: the GRPO recipe as shipped (``train_configs/recipes/grpo.toml``);
* ``grpo_lr4x``: the same at 4x the policy's LR (``--optimizer.lr``);
* ``*_shuffled``: a control, each rank's advantages permuted across its groups
  (``scripts/shuffled_advantages_job.py``): the same update sizes, no credit assignment;
* ``grpo_untied``: an untied copy of the warm start (``tie_word_embeddings = false``, the head a
  copy of the embedding, its Adam moments a copy of the embedding's), written by ``untied_copy``;
* further variants named in ``VARIANTS`` (a setting of the recipe changed by a flag).

Checked first, exit 1 on failure: every job and evaluation exits 0; every run logged all its RL
steps with finite curves; every evaluation is finite and of the step asked; the warm start and
every run's copy of it hash the same before and after.

``--variants`` runs some of them; ``--merge`` keeps the other variants already in the JSON (each
variant records its own command line and runtime), so the investigation can grow run by run.

    .venv/bin/python scripts/investigate_rl_learning.py --warm-start W           # every variant, into assets/
    .venv/bin/python scripts/investigate_rl_learning.py --warm-start W --variants grpo_lr4x --merge
    .venv/bin/python scripts/investigate_rl_learning.py --quick                  # a smoke run, a temporary folder
    .venv/bin/python scripts/investigate_rl_learning.py --replot
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_recipes as bench  # noqa: E402
from benchtools import command_line, pyplot, save_figure  # noqa: E402
from compare_cotrain import folder_hash  # noqa: E402

ROOT = bench.ROOT
SHUFFLED_JOB = ROOT / "scripts" / "shuffled_advantages_job.py"
RECIPE_LR = 1.5e-4  # the LR the investigation ran at: train_configs/debug_cpu.toml's [optimizer] lr, which
# the recipes kept then (they now take a quarter of it, as the investigation found better)

# name -> what the run changes: the recipe, extra job flags, the policy's RL LR (default
# RECIPE_LR), the control job, the untied copy.
VARIANTS = {
    "grpo": dict(recipe="grpo", flags=[], description="GRPO recipe at LR 1.5e-4"),
    "grpo_lr_half": dict(recipe="grpo", flags=[], lr=RECIPE_LR / 2,
                         description="GRPO at half the policy LR"),
    "grpo_lr_quarter": dict(recipe="grpo", flags=[], lr=RECIPE_LR / 4,
                            description="GRPO at a quarter of the policy LR"),
    "grpo_lr4x": dict(recipe="grpo", flags=[], lr=4 * RECIPE_LR,
                      description="GRPO at 4x the policy LR"),
    "grpo_no_kl": dict(recipe="grpo", flags=["--rl.kl_coef", "0"], description="GRPO without its KL term"),
    "grpo_no_std": dict(recipe="grpo", flags=["--rl.no-normalize_std"],
                        description="GRPO with advantages not divided by the group's std"),
    "grpo_shuffled": dict(recipe="grpo", flags=[], shuffled=True,
                          description="GRPO, advantages shuffled across groups (control)"),
    "grpo_lr4x_shuffled": dict(recipe="grpo", flags=[], lr=4 * RECIPE_LR, shuffled=True,
                               description="GRPO at 4x LR, advantages shuffled across groups (control)"),
    "grpo_untied": dict(recipe="grpo", flags=[], untied=True,
                        description="GRPO on an untied copy of the warm start"),
    "grpo_lr4x_untied": dict(recipe="grpo", flags=[], lr=4 * RECIPE_LR, untied=True,
                             description="GRPO at 4x LR on an untied copy of the warm start"),
}
# A run's per-step curves: name in the JSON -> metrics.jsonl key (None where a step lacks it).
CURVES = {"correct": "task/correct", "reward": "reward/mean", "kl_ref": "rl/kl_ref", "entropy": "rl/entropy",
          "grad_norm": "grad_norm/policy", "lr": "lr/policy", "zero_advantage_groups": "rl/zero_advantage_groups",
          "acceptance_length": "rollout/acceptance_length", "step_s": "time/step_s"}
# The curves every run must log, finite at every step (the KL only where the recipe has one).
REQUIRED = ("correct", "reward", "entropy", "grad_norm", "lr", "acceptance_length", "step_s")

QUICK = dict(bench.QUICK, records=300, eval_size=8, sft_steps=4, steps=2, eval_every=2, samples=2, pass_k=[1, 2],
             variants=["grpo_shuffled", "grpo_untied"])
FULL = dict(bench.FULL, steps=60, eval_every=20, variants=list(VARIANTS))


def launch(dump: Path, extra: list[str], recipe: str, shuffled: bool) -> list[dict]:
    """One training job of ``recipes/<recipe>.toml`` on 2 CPU processes (``titan_cotrain.train``,
    or the shuffled-advantage control); its metrics, one dict per step."""
    entry = [str(SHUFFLED_JOB)] if shuffled else ["-m", "titan_cotrain.train"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", *entry,
           "--job.config_file", str(ROOT / "train_configs" / "recipes" / f"{recipe}.toml"),
           "--job.dump_folder", str(dump), *extra]
    print("+", " ".join(cmd[3:]), flush=True)
    subprocess.run(cmd, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}, check=True)
    return [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]


def code_commit() -> str:
    """The commit the code ran at (``git rev-parse HEAD`` of the checkout), a suffix
    ``+changes`` when tracked files differ from it."""
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "diff", "--quiet", "HEAD"], cwd=ROOT).returncode != 0
    return head + ("+changes" if dirty else "")


def untied_copy(warm: Path, folder: Path, sft_steps: int) -> None:
    """``folder``: ``warm``'s policy folder and ``step-<sft_steps>`` checkpoint, untied: the
    config says ``tie_word_embeddings = false``, the safetensors and the checkpoint hold
    ``lm_head.weight`` as a copy of the embedding, and the checkpoint's Adam state and param
    group of the head are copies of the embedding's (the tied weight's moments, which summed
    both roles' gradients: the nearest thing the tied run had)."""
    import torch
    from safetensors.torch import load_file, save_file
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save, torch_save_to_dcp

    shutil.copytree(warm / "policy", folder / "policy")
    config = json.loads((folder / "policy" / "config.json").read_text())
    (folder / "policy" / "config.json").write_text(json.dumps(config | {"tie_word_embeddings": False}, indent=2) + "\n")
    weights = load_file(folder / "policy" / "model.safetensors")
    weights["lm_head.weight"] = weights["model.embed_tokens.weight"].clone()
    save_file(weights, folder / "policy" / "model.safetensors", metadata={"format": "pt"})

    flat = folder / "warm_start.pt"
    dcp_to_torch_save(warm / f"step-{sft_steps}", flat)
    state = torch.load(flat, weights_only=False)
    state["lm_head.weight"] = state["embed_tokens.weight"].clone()
    optimizer = state["optimizer"]
    for key in [k for k in optimizer if ".embed_tokens.weight." in k]:
        value = optimizer[key]
        optimizer[key.replace(".embed_tokens.weight.", ".lm_head.weight.")] = (
            value.clone() if isinstance(value, torch.Tensor) else value)
    torch.save(state, flat)
    torch_save_to_dcp(flat, folder / f"step-{sft_steps}")
    flat.unlink()


def run_variant(name: str, warm: Path, manifest: dict, settings: dict, work: Path, failures: list[str]) -> dict:
    """Variant ``name``'s RL run from a copy of the warm start (or of its untied copy), each of
    its checkpoints evaluated; its curves and evaluations."""
    variant, sft = VARIANTS[name], manifest["sft_steps"]
    start, folder = time.perf_counter(), work / "runs" / name
    source = warm
    if variant.get("untied"):
        source = work / "untied"
        if not source.exists():
            untied_copy(warm, source, sft)
    step_dir = f"step-{sft}"
    shutil.copytree(source / step_dir, folder / "checkpoint" / step_dir)
    source_hash = folder_hash(source / step_dir)
    flags = bench.job_flags(warm, manifest, settings)
    flags[flags.index("--model.hf_path") + 1] = str(source / "policy")
    every = settings["eval_every"]
    # The warm-start job has no KL reference: a run with one copies the policy into it at its first RL step.
    recipe = bench.read_job_toml(ROOT / "train_configs" / "recipes" / f"{variant['recipe']}.toml")
    kl_coef = recipe.get("rl", {}).get("kl_coef", 0.0)
    if "--rl.kl_coef" in variant["flags"]:
        kl_coef = float(variant["flags"][variant["flags"].index("--rl.kl_coef") + 1])
    no_reference = ["--checkpoint.exclude_from_loading", "reference"] if kl_coef > 0 else []
    metrics = launch(folder, [*flags, "--training.steps", str(settings["steps"]), "--debug.seed", "0",
                              "--checkpoint.interval", str(every), *no_reference, *variant["flags"],
                              "--optimizer.lr", f"{variant.get('lr', RECIPE_LR):g}"],
                     variant["recipe"], variant.get("shuffled", False))
    if folder_hash(folder / "checkpoint" / step_dir) != source_hash:
        failures.append(f"{name}: the run changed its copy of the warm start")
    rl = [m for m in metrics if m["phase"] == "rl"]
    if len(rl) != settings["steps"]:
        failures.append(f"{name}: logged {len(rl)} of {settings['steps']} RL steps")
    curves = {field: [m.get(key) for m in rl] for field, key in CURVES.items()}
    for field in REQUIRED:
        if not curves[field] or not all(x is not None and math.isfinite(x) for x in curves[field]):
            failures.append(f"{name}: {CURVES[field]} missing or non-finite")
    evals = []
    for step in range(sft + every, sft + settings["steps"] + 1, every):
        result = bench.evaluate(work / "eval" / name / f"step-{step}", folder / "checkpoint" / f"step-{step}",
                                flags, settings)
        failures.extend(bench.eval_failures(f"{name} step {step}", result, step))
        evals.append(result | {"rl_step": step - sft})
    return {"description": variant["description"], "recipe": variant["recipe"], "flags": variant["flags"], "lr": variant.get("lr", RECIPE_LR),
            "shuffled_advantages": variant.get("shuffled", False), "untied": variant.get("untied", False),
            "command": command_line(), "commit": code_commit(), "runtime_s": round(time.perf_counter() - start, 1),
            "evals": evals, **curves}


def summarize(variant: dict, before: dict) -> dict:
    """Held-out accuracy at the last evaluation and its gain; the training prompts' share
    correct over the first and the last ``n`` RL steps (``n`` a quarter of the run)."""
    n = max(len(variant["correct"]) // 4, 1)
    last = variant["evals"][-1]
    return {"accuracy_last": last["accuracy"], "accuracy_gain": last["accuracy"] - before["accuracy"],
            "pass_at_k_last": last["pass_at_k"], "accuracy_best": max(e["accuracy"] for e in variant["evals"]),
            "correct_first_quarter": statistics.fmean(variant["correct"][:n]),
            "correct_last_quarter": statistics.fmean(variant["correct"][-n:]),
            "kl_ref_last": variant["kl_ref"][-1],
            "entropy_first": variant["entropy"][0],
            "entropy_last": variant["entropy"][-1]}


def plot(result: dict, path: Path) -> None:
    """Held-out accuracy against the RL step per variant (step 0: the warm start); the training
    prompts' share correct per RL step (a 10-step moving mean)."""
    plt = pyplot()
    fig, (held_out, train) = plt.subplots(1, 2, figsize=(13, 5))
    before = result["warm_start"]["eval"]
    for name, variant in result["variants"].items():
        steps = [0] + [e["rl_step"] for e in variant["evals"]]
        accuracy = [before["accuracy"]] + [e["accuracy"] for e in variant["evals"]]
        style = "--" if variant["shuffled_advantages"] else "-"
        line, = held_out.plot(steps, accuracy, style, marker="o", label=name)
        window = 10
        correct = variant["correct"]
        smooth = [statistics.fmean(correct[max(0, i - window + 1):i + 1]) for i in range(len(correct))]
        train.plot(range(1, len(correct) + 1), smooth, style, color=line.get_color(), label=name)
    held_out.set(xlabel="RL step", ylabel="held-out accuracy",
                 title=f"{before['prompts']} held-out prompts x {before['samples_per_prompt']} samples, "
                       f"T = {before['temperature']}")
    train.set(xlabel="RL step", ylabel="share correct (10-step moving mean)", title="the RL steps' training prompts")
    for ax in (held_out, train):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("why RL did not learn: GRPO variants from one warm start (dashed: advantages shuffled)")
    save_figure(fig, path)


def parse_settings(argv: list[str] | None = None) -> tuple[argparse.Namespace, dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--warm-start", type=Path, default=None,
                        help="a bench_recipes.py warm-start folder (<work>/warm_start) to copy; default: make one")
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), help="default: all (--quick: three)")
    parser.add_argument("--steps", type=int, help=f"RL steps per variant (default {FULL['steps']})")
    parser.add_argument("--eval-every", type=int, help=f"RL steps between evaluations (default {FULL['eval_every']})")
    parser.add_argument("--merge", action="store_true", help="keep the JSON's other variants")
    parser.add_argument("--quick", action="store_true", help="a smoke run into a temporary folder")
    parser.add_argument("--out", type=Path, default=None, help="folder of the JSON and PNG (default assets/)")
    parser.add_argument("--work", type=Path, default=None, help="run folders, cleared first")
    parser.add_argument("--replot", action="store_true", help="only redraw the PNG from the JSON")
    args = parser.parse_args(argv)
    settings = dict(QUICK if args.quick else FULL, data_seed=0, vocab_size=512)
    for key in ("steps", "eval_every", "variants"):
        if getattr(args, key) is not None:
            settings[key] = getattr(args, key)
    if args.warm_start is not None:
        manifest = json.loads((args.warm_start / "warm_start.json").read_text())
        settings |= {key: manifest[key] for key in bench.WARM_START_KEYS}
    if args.out is None:
        args.out = Path(tempfile.mkdtemp(prefix="investigate_rl_quick_")) if args.quick else ROOT / "assets"
    if args.work is None:
        args.work = args.out / "work" if args.quick else ROOT / "outputs" / "investigate_rl_learning"
    return args, settings


def main(argv: list[str] | None = None) -> int:
    args, settings = parse_settings(argv)
    json_path, png_path = args.out / "investigate_rl_learning.json", args.out / "investigate_rl_learning.png"
    if args.replot:
        plot(json.loads(json_path.read_text()), png_path)
        return 0
    start, failures = time.perf_counter(), []
    shutil.rmtree(args.work, ignore_errors=True)
    warm = args.work / "warm_start"
    variants: dict[str, dict] = {}
    previous = None
    try:
        if args.warm_start is not None:
            shutil.copytree(args.warm_start, warm)
            manifest = json.loads((warm / "warm_start.json").read_text())
        else:
            manifest = bench.make_warm_start(warm, settings, args.work)
        warm_hash = folder_hash(warm)
        previous = json.loads(json_path.read_text()) if args.merge and json_path.exists() else None
        if previous is not None and previous["warm_start"]["sha256"] != warm_hash:
            failures.append(f"--merge: {json_path} is of another warm start")
            previous = None
        if previous is not None:
            before = previous["warm_start"]["eval"]
        else:
            flags = bench.job_flags(warm, manifest, settings)
            before = bench.evaluate(args.work / "eval" / "warm_start", warm / f"step-{manifest['sft_steps']}",
                                    flags, settings)
            failures += bench.eval_failures("warm start", before, manifest["sft_steps"])
        for name in settings["variants"]:
            variants[name] = run_variant(name, warm, manifest, settings, args.work, failures)
        if folder_hash(warm) != warm_hash:
            failures.append("the warm start changed during the runs")
    except subprocess.CalledProcessError as e:
        failures.append(bench.failed_command(e))
    if bench.report_failures(failures):
        return 1

    if previous is not None:
        variants = {k: v for k, v in previous["variants"].items() if k not in variants} | variants
    for variant in variants.values():
        variant["summary"] = summarize(variant, before)
    result = {
        "description": " ".join(" ".join(__doc__.split("\n\n")[:2]).split()),
        "command": command_line(),
        "settings": {**settings, "quick": args.quick, "recipe_lr": RECIPE_LR, "rl_seed": 0,
                     "hardware": f"{os.cpu_count()}-core CPU, gloo, 2 processes (evaluation: 1), 1 thread each"},
        "warm_start": {"sft_steps": manifest["sft_steps"], "sha256": warm_hash, "eval": before},
        "variants": variants,
        "checks": {"passed": True, "what": "every job and evaluation exited 0; every run logged all its RL steps "
                                           "with finite curves; every evaluation is finite and of the step asked; "
                                           "the warm start and every run's copy of it kept their sha256"},
        "runtime_s": round(time.perf_counter() - start, 1),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(result, indent=1) + "\n")
    plot(result, png_path)
    print(f"warm start: held-out accuracy {before['accuracy']:.3f}")
    for name, variant in variants.items():
        s = variant["summary"]
        print(f"{name:20s} " + " ".join(f"{e['rl_step']}:{e['accuracy']:.3f}" for e in variant["evals"])
              + f"  train correct {s['correct_first_quarter']:.3f} -> {s['correct_last_quarter']:.3f}"
              + (f"  kl {s['kl_ref_last']:.4f}" if s["kl_ref_last"] is not None else ""))
    print(f"wrote {json_path} and {png_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
