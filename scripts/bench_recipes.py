"""The four shipped recipes on a GSM8K-format task and a Qwen3-architecture Hugging Face
policy: held-out accuracy and pass@k before and after RL, over seeds.

Claim. None yet to meet: this measures what each recipe of ``train_configs/recipes/`` (GRPO,
DAPO, Dr. GRPO, GSPO) does to one warm-started policy in the same number of RL steps, with
the seeds' spread, so that a README table can say it (issue 39).

Method. Everything the job reads is written here first, from ``--data-seed``:

* a GSM8K-format JSON Lines file (``{"question", "answer": "<worked solution> #### N"}``) of
  two-step integer word problems from a few templates, small numbers, questions unique;
  ``[task] eval_size`` of them are held out (never trained on) for the evaluation;
* a Hugging Face folder of a tiny ``qwen3`` policy with tied embeddings, weights randomly
  initialised (``Transformer.init_weights``) and written by ``save_hf``, with a byte-level BPE
  tokenizer trained on the generated corpus (Qwen's pre-tokenizer: digits one by one) and a
  ChatML chat template (``<|im_start|>`` / ``<|im_end|>``, EOS ``<|im_end|>``); the job stops
  responses at ``<|endoftext|>`` too (``[rollout] stop_token_ids``).

One warm start (``[task] sft_steps`` on the worked solutions, 2 CPU processes) is evaluated
with ``python -m titan_cotrain.eval`` (``--samples`` responses per held-out prompt: accuracy
and pass@k). Then each recipe runs ``--steps`` RL steps per seed (``--debug.seed``: the RL
prompts and sampling), every run resuming a copy of that same warm start, and is evaluated
the same way (the evaluation's own sampling seed is the same for every checkpoint). Per run,
from ``metrics.jsonl``, per RL step: the share of correct responses (``task/correct``, over
the step's first sampling round under DAPO's dynamic sampling) and the reward (``reward/mean``:
the same with ``[task] format_reward`` 0, but for DAPO's overlong penalty), the rollout
acceptance length and the step time (their mean and median in the summary). The recipes keep
their own ``[rl]`` keys; ``[model]``, ``[task]``, ``[rollout]`` and ``[training]`` are set
here (``job_flags``). GRPO's KL reference is not in the warm start (the warm-start job has
none): its runs skip loading it, and the trainer copies the policy into it at the first RL
step, as in any run.

Checked first, exit 1 on failure: every job and evaluation exits 0; every run ran all its RL
steps and logged finite rewards, acceptance lengths and step times; every evaluation is
finite and of the checkpoint it was given (the step it reports); the warm start (its
checkpoint, policy folder and dataset) hashes the same before and after every run, and so
does every run's copy of it.

The JSON describes itself: the command, the settings, the dataset and the model, the warm
start's evaluation, per recipe each seed's values and their mean/min/max, and a flat
``records`` list (one row per recipe) for a README table.

    .venv/bin/python scripts/bench_recipes.py                 # warm start, then 4 recipes x 3 seeds x 200 RL steps
    .venv/bin/python scripts/bench_recipes.py --warm-start W  # W: a copy of an earlier run's <work>/warm_start
    .venv/bin/python scripts/bench_recipes.py --quick         # a smoke run (~1.5 min) into a temporary folder
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from titan_cotrain.config.loader import read_job_toml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchtools import command_line, pyplot, save_figure  # noqa: E402
from compare_cotrain import folder_hash, run, spread  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RECIPES = sorted(p.stem for p in (ROOT / "train_configs" / "recipes").glob("*.toml"))
BASE_CONFIG = "debug_cpu.toml"  # what every recipe extends: the warm start's and the evaluations' job

# Two-step word problems: (question, op1, op2, range of a, range of b). The solution applies
# op1 to (a, b), then op2 to (that, c); c is drawn in 1..10, and a subtrahend (b of a
# difference, c when it is subtracted) below what it is taken from, so no count goes negative.
NAMES = ("Ana", "Ben", "Cara", "Dev", "Eli", "Fay", "Gus", "Hana", "Ivo", "Jin")
ITEMS = ("pens", "apples", "stamps", "marbles", "books", "shells", "cards", "beads")
TEMPLATES = (
    ("{name} has {a} {item}. {name} buys {b} more and gives {c} away. How many {item} does {name} have now?",
     "+", "-", (2, 20), (1, 10)),
    ("{name} had {a} {item}. {name} lost {b} of them and then got {c} more. How many {item} does {name} have now?",
     "-", "+", (5, 20), (1, 19)),
    ("{name} has {a} boxes with {b} {item} in each box. {name} gives away {c} {item}. How many {item} are left?",
     "*", "-", (2, 5), (2, 9)),
    ("{name} buys {a} packs of {item} with {b} {item} in each pack and finds {c} more. "
     "How many {item} does {name} have?", "*", "+", (2, 5), (2, 9)),
)
OPERATIONS = {"+": lambda x, y: x + y, "-": lambda x, y: x - y, "*": lambda x, y: x * y}
EQUATION = re.compile(r"(\d+) ([-+*]) (\d+) = (\d+)\.")


def word_problem(rng: random.Random) -> dict:
    """One GSM8K-format record: ``answer`` is the worked solution, ``#### N`` at its end."""
    question, op1, op2, a_range, b_range = rng.choice(TEMPLATES)
    a = rng.randint(*a_range)
    b = rng.randint(b_range[0], min(b_range[1], a - 1)) if op1 == "-" else rng.randint(*b_range)
    first = OPERATIONS[op1](a, b)
    c = rng.randint(1, min(first, 10)) if op2 == "-" else rng.randint(1, 10)
    answer = OPERATIONS[op2](first, c)
    text = question.format(name=rng.choice(NAMES), item=rng.choice(ITEMS), a=a, b=b, c=c)
    return {"question": text, "answer": f"{a} {op1} {b} = {first}. {first} {op2} {c} = {answer}. #### {answer}"}


def word_problems(n: int, seed: int) -> list[dict]:
    """``n`` records with distinct questions (so no held-out question is also a training one)."""
    rng, records, seen = random.Random(seed), [], set()
    while len(records) < n:
        record = word_problem(rng)
        if record["question"] not in seen:
            seen.add(record["question"])
            records.append(record)
    return records


def checked_answer(solution: str) -> int:
    """The answer of a worked solution, its arithmetic checked: each equation holds, the
    second starts from the first's result, and ``#### N`` is the last result."""
    equations = [tuple(m.groups()) for m in EQUATION.finditer(solution)]
    if len(equations) != 2:
        raise ValueError(f"{solution!r}: expected two equations")
    for x, op, y, result in equations:
        if OPERATIONS[op](int(x), int(y)) != int(result):
            raise ValueError(f"{solution!r}: {x} {op} {y} is not {result}")
    if equations[1][0] != equations[0][3]:
        raise ValueError(f"{solution!r}: the second step does not start from the first's result")
    stated = solution.rsplit("####", 1)[-1].strip()
    if stated != equations[1][3]:
        raise ValueError(f"{solution!r}: #### {stated} is not the last result {equations[1][3]}")
    return int(stated)


# Qwen2/Qwen3's pre-tokenizer pattern: words with one leading non-letter, digits one by one,
# punctuation runs, newlines, spaces; then the bytes mapped to printable characters (GPT-2's
# byte level), so any text encodes and decodes exactly.
PRE_TOKENIZER = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")
ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
# ChatML as Qwen3 renders messages without tools or thinking.
CHAT_TEMPLATE = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] "
                 "+ '<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
                 "{% endif %}")
# The policy: the qwen3 debug flavor's shape (8 layers: EAGLE-3's default taps 1, 3, 4 exist).
POLICY_SHAPE = dict(dim=64, n_layers=8, n_heads=4, n_kv_heads=2, head_dim=16, ffn_dim=128, max_seq_len=512)


def train_tokenizer(texts: list[str], vocab_size: int):
    """A byte-level BPE ``tokenizers.Tokenizer`` trained on ``texts``; the three specials are
    ids 0-2 (``<|endoftext|>``, ``<|im_start|>``, ``<|im_end|>``)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRE_TOKENIZER), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[ENDOFTEXT, IM_START, IM_END],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(texts, trainer)
    return tokenizer


def write_policy_folder(folder: Path, records: list[dict], vocab_size: int, seed: int) -> dict:
    """A Hugging Face folder of a tiny random ``qwen3`` policy with tied embeddings that
    ``[model] hf_path`` loads: ``config.json`` + ``model.safetensors`` (``save_hf``),
    ``tokenizer.json`` (BPE trained on ``records``' questions and solutions, as the chat
    template renders them) and ``tokenizer_config.json`` (the chat template, EOS
    ``<|im_end|>``, no BOS). Returns what the job needs to know: the special tokens' ids and
    the model's shape."""
    import torch

    from titan_cotrain.models import ModelArgs, Transformer, save_hf

    texts = [f"{IM_START}user\n{r['question']}{IM_END}\n{IM_START}assistant\n{r['answer']}{IM_END}\n" for r in records]
    tokenizer = train_tokenizer(texts, vocab_size)
    args = ModelArgs(architecture="qwen3", qk_norm=True, norm_eps=1e-6, rope_theta=1e6, tie_embeddings=True,
                     vocab_size=tokenizer.get_vocab_size(), **POLICY_SHAPE)
    model = Transformer(args)
    model.init_weights(generator=torch.Generator().manual_seed(seed))
    save_hf(model, folder)
    tokenizer.save(str(folder / "tokenizer.json"))
    specials = {token: tokenizer.token_to_id(token) for token in (ENDOFTEXT, IM_START, IM_END)}
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast", "chat_template": CHAT_TEMPLATE,
        "bos_token": None, "eos_token": IM_END, "pad_token": ENDOFTEXT,
        "add_bos_token": False, "add_eos_token": False, "model_max_length": args.max_seq_len,
        "added_tokens_decoder": {str(i): {"content": token, "special": True, "lstrip": False, "rstrip": False,
                                          "normalized": False, "single_word": False}
                                 for token, i in specials.items()},
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return {"vocab_size": args.vocab_size, "special_token_ids": specials, **POLICY_SHAPE,
            "architecture": "qwen3", "tie_word_embeddings": True, "parameters": sum(p.numel() for p in model.parameters())}



# --quick: a smoke run of the script and its checks (a few minutes on 2 busy cores), not the measurement.
# Its jobs also take smaller batches (``flags``: warm-start demonstrations, RL prompts and groups per step).
QUICK = dict(records=300, eval_size=16, sft_steps=20, steps=3, seeds=1, recipes=["grpo", "gspo"], max_new_tokens=32,
             samples=2, pass_k=[1, 2], flags=["--task.sft_batch_size", "8", "--rl.prompts_per_step", "4",
                                               "--rl.group_size", "4"])
# max_new_tokens: the recipes' own budget, whose last 16 tokens DAPO's soft penalty covers; a
# worked solution takes at most about 30 (a smaller budget would penalise right answers).
FULL = dict(records=5000, eval_size=200, sft_steps=600, steps=200, seeds=3, recipes=RECIPES, max_new_tokens=64,
            samples=8, pass_k=[1, 4, 8], flags=[])
# What the warm start fixes (its manifest): a reused warm start brings its own.
WARM_START_KEYS = ("records", "eval_size", "sft_steps", "max_new_tokens", "data_seed", "vocab_size")
# A run's curves: name in the JSON -> its metrics.jsonl key, one value per RL step.
CURVES = {"correct": "task/correct", "reward": "reward/mean", "acceptance_length": "rollout/acceptance_length",
          "step_s": "time/step_s"}
# What the JSON keeps of an evaluation (titan_cotrain.eval's keys).
EVAL_FIELDS = ("step", "prompts", "samples_per_prompt", "temperature", "max_new_tokens", "accuracy", "pass_at_k",
               "answer_found", "format", "acceptance_length", "response_len")


def job_flags(warm: Path, manifest: dict, settings: dict) -> list[str]:
    """The ``[model]``, ``[task]``, ``[rollout]`` and ``[training]`` keys every job sets over
    its recipe (the recipe keeps its ``[rl]``): the warm start's policy folder and dataset
    under ``warm``, its length, the generation budget and the stop at ``<|endoftext|>``; a
    checkpoint at the warm start's last step (and the job's last), all kept; then
    ``settings["flags"]`` (``--quick``'s smaller batches)."""
    return ["--model.hf_path", str(warm / "policy"), "--task.name", "gsm8k",
            "--task.dataset_path", str(warm / "gsm8k.jsonl"), "--task.eval_size", str(manifest["eval_size"]),
            "--task.sft_steps", str(manifest["sft_steps"]), "--task.format_reward", "0",
            "--rollout.max_new_tokens", str(manifest["max_new_tokens"]),
            "--rollout.stop_token_ids", str(manifest["policy"]["special_token_ids"][ENDOFTEXT]),
            "--training.seq_len", "128", "--checkpoint.interval", str(manifest["sft_steps"]),
            "--checkpoint.keep_latest_k", "0", "--metrics.no-enable_tensorboard", *settings["flags"]]


def make_warm_start(folder: Path, settings: dict, work: Path) -> dict:
    """Write the dataset and the policy folder into ``folder``, run the warm start (its job
    under ``work``: the base config, 2 processes) and keep its ``step-<sft_steps>`` checkpoint
    in ``folder``; returns the manifest written beside them (``warm_start.json``)."""
    folder.mkdir(parents=True)
    records = word_problems(settings["records"], settings["data_seed"])
    (folder / "gsm8k.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    policy = write_policy_folder(folder / "policy", records, settings["vocab_size"], settings["data_seed"])
    manifest = {key: settings[key] for key in WARM_START_KEYS} | {"policy": policy}
    step_dir = f"step-{settings['sft_steps']}"
    start = time.perf_counter()
    # training.steps must be >= 1: one RL step follows the warm start's checkpoint, not kept.
    metrics = run(work / "warm_start_job", [*job_flags(folder, manifest, settings), "--training.steps", "1",
                                            "--debug.seed", str(settings["data_seed"])], BASE_CONFIG)
    manifest["runtime_s"] = round(time.perf_counter() - start, 1)
    manifest["sft_loss_last"] = [m["loss/policy"] for m in metrics if m["phase"] == "sft"][-1]
    shutil.copytree(work / "warm_start_job" / "checkpoint" / step_dir, folder / step_dir)
    (folder / "warm_start.json").write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def evaluate(dump: Path, checkpoint: Path, flags: list[str], settings: dict) -> dict:
    """``python -m titan_cotrain.eval`` of ``checkpoint`` (a ``step-N`` folder) on the
    held-out prompts, one process; ``EVAL_FIELDS`` of its JSON. The job is the base config
    with ``flags`` and its default seed: every checkpoint is evaluated at the same settings,
    with the same sampling seed."""
    cmd = [sys.executable, "-m", "titan_cotrain.eval", "--job.config_file", str(ROOT / "train_configs" / BASE_CONFIG),
           "--job.dump_folder", str(dump), *flags, "--checkpoint", str(checkpoint),
           "--samples", str(settings["samples"]), "--pass_k", *map(str, settings["pass_k"])]
    print("+", " ".join(cmd[1:]), flush=True)
    subprocess.run(cmd, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}, check=True)
    [path] = (dump / "eval").glob("eval_step*.json")
    result = json.loads(path.read_text())
    return {key: result[key] for key in EVAL_FIELDS}


def eval_failures(name: str, result: dict, step: int) -> list[str]:
    """What is wrong with an evaluation: another step than asked, a non-finite number."""
    failures = [] if result["step"] == step else [f"{name}: evaluated step {result['step']}, not {step}"]
    numbers = [result["accuracy"], result["acceptance_length"], *result["pass_at_k"].values()]
    if not all(math.isfinite(x) for x in numbers):
        failures.append(f"{name}: non-finite accuracy, pass@k or acceptance length: {numbers}")
    return failures


def curves_and_failures(name: str, metrics: list[dict], steps: int) -> tuple[dict, list[str]]:
    """A run's ``CURVES`` (NaN where a step lacks the key), and what is wrong with them:
    missing RL steps, a missing or non-finite value."""
    rl = [m for m in metrics if m["phase"] == "rl"]
    failures = [] if len(rl) == steps else [f"{name}: logged {len(rl)} of {steps} RL steps"]
    curves = {field: [m.get(key, math.nan) for m in rl] for field, key in CURVES.items()}
    for field, values in curves.items():
        if not values or not all(math.isfinite(x) for x in values):
            failures.append(f"{name}: {CURVES[field]} missing or non-finite: {values}")
    return curves, failures


def run_recipe(recipe: str, seed: int, warm: Path, manifest: dict, settings: dict, work: Path,
               failures: list[str]) -> dict:
    """``recipe``'s RL run of seed ``seed`` from a copy of the warm start, then its evaluation;
    the seed's curves and values. A changed copy, a short run or a bad number is a failure."""
    name, step_dir = f"{recipe}, seed {seed}", f"step-{manifest['sft_steps']}"
    folder = work / "runs" / recipe / f"seed-{seed}"
    done = folder / "result.json"  # a finished run's values: a re-run of the script keeps them
    if done.exists():
        print(f"{name}: kept from {done}", flush=True)
        return json.loads(done.read_text())
    shutil.rmtree(folder, ignore_errors=True)  # an unfinished run starts again
    shutil.copytree(warm / step_dir, folder / "checkpoint" / step_dir)
    flags = job_flags(warm, manifest, settings)
    # The warm-start job has no KL reference (its kl_coef is 0): a recipe with one skips loading
    # it, and the trainer copies the policy into it at the first RL step, as in any run.
    kl_coef = read_job_toml(ROOT / "train_configs" / "recipes" / f"{recipe}.toml").get("rl", {}).get("kl_coef", 0.0)
    no_reference = ["--checkpoint.exclude_from_loading", "reference"] if kl_coef > 0 else []
    metrics = run(folder, [*flags, "--training.steps", str(settings["steps"]), "--debug.seed", str(seed),
                           *no_reference], f"recipes/{recipe}.toml")
    if folder_hash(folder / "checkpoint" / step_dir) != folder_hash(warm / step_dir):
        failures.append(f"{name}: the run changed its copy of the warm start")
    curves, bad = curves_and_failures(name, metrics, settings["steps"])
    if bad:
        failures += bad
        return {"seed": seed}
    last = manifest["sft_steps"] + settings["steps"]
    result = evaluate(work / "eval" / recipe / f"seed-{seed}", folder / "checkpoint" / f"step-{last}", flags, settings)
    bad = eval_failures(name, result, last)
    failures += bad
    values = {"seed": seed, "eval": result, "acceptance_length_mean": statistics.fmean(curves["acceptance_length"]),
              "step_s_median": statistics.median(curves["step_s"]), **curves}
    if not bad:
        done.write_text(json.dumps(values) + "\n")
    return values


def summarize(runs: list[dict], before: dict) -> dict:
    """A recipe's values over its seeds (``spread``: mean, std, min, max, values): held-out
    accuracy, its gain over the warm start, pass@k, the mean rollout acceptance length and the
    median step time of a run, the share of correct responses over a run's last quarter of RL steps."""
    tail = max(len(runs[0]["correct"]) // 4, 1)
    return {
        "accuracy": spread([r["eval"]["accuracy"] for r in runs]),
        "accuracy_gain": spread([r["eval"]["accuracy"] - before["accuracy"] for r in runs]),
        "pass_at_k": {k: spread([r["eval"]["pass_at_k"][k] for r in runs]) for k in before["pass_at_k"]},
        "acceptance_length": spread([r["acceptance_length_mean"] for r in runs]),
        "step_s_median": spread([r["step_s_median"] for r in runs]),
        "correct_last_quarter": spread([statistics.fmean(r["correct"][-tail:]) for r in runs]),
    }


def record(recipe: str, result: dict) -> dict:
    """The README row of a recipe: before and after, each after-value as mean/min/max over seeds."""
    before, s = result["warm_start"]["eval"], result["recipes"][recipe]["summary"]

    def short(x: dict) -> dict:
        return {key: x[key] for key in ("mean", "min", "max")}

    return {"recipe": recipe, "config": result["recipes"][recipe]["config"],
            "description": result["recipes"][recipe]["description"], "seeds": result["settings"]["seeds"],
            "rl_steps": result["settings"]["steps"], "accuracy_before": before["accuracy"],
            "accuracy_after": short(s["accuracy"]), "accuracy_gain": short(s["accuracy_gain"]),
            "pass_at_k_before": before["pass_at_k"], "pass_at_k_after": {k: short(v) for k, v in s["pass_at_k"].items()},
            "acceptance_length": short(s["acceptance_length"]), "step_s_median": short(s["step_s_median"])}


def plot(result: dict, path: Path) -> None:
    """Held-out accuracy after RL per recipe (mean over seeds, min-max bar, each seed a dot)
    against the warm start's; the reward per RL step (mean over seeds, min-max band)."""
    plt = pyplot()
    fig, (acc, reward) = plt.subplots(1, 2, figsize=(13, 5))
    recipes, before = list(result["recipes"]), result["warm_start"]["eval"]
    colors = dict(zip(RECIPES, ("tab:orange", "tab:green", "tab:blue", "tab:purple")))
    top_k = max(before["pass_at_k"], key=int)
    for x, recipe in enumerate(recipes):
        s = result["recipes"][recipe]["summary"]
        for summary, offset, label in ((s["accuracy"], -0.15, "accuracy"), (s["pass_at_k"][top_k], 0.15, f"pass@{top_k}")):
            acc.bar(x + offset, summary["mean"], 0.3, color=colors[recipe], alpha=1.0 if label == "accuracy" else 0.45,
                    yerr=[[summary["mean"] - summary["min"]], [summary["max"] - summary["mean"]]], capsize=4)
            acc.plot([x + offset] * len(summary["values"]), summary["values"], "k.", ms=5)
        runs = result["recipes"][recipe]["runs"]
        columns = list(zip(*(r["correct"] for r in runs)))
        steps = range(1, len(columns) + 1)
        reward.plot(steps, [statistics.fmean(c) for c in columns], color=colors[recipe], lw=2, label=recipe)
        reward.fill_between(steps, [min(c) for c in columns], [max(c) for c in columns], color=colors[recipe],
                            alpha=0.2, lw=0)
    acc.axhline(before["accuracy"], color="grey", ls="--", label=f"warm start: accuracy {before['accuracy']:.3f}")
    acc.axhline(before["pass_at_k"][top_k], color="grey", ls=":",
                label=f"warm start: pass@{top_k} {before['pass_at_k'][top_k]:.3f}")
    acc.set_xticks(range(len(recipes)), recipes)
    acc.set(ylabel=f"held-out accuracy (dark), pass@{top_k} (light), after RL", ylim=(0, 1.15),
            title=f"{before['prompts']} held-out prompts x {before['samples_per_prompt']} samples; bars: mean, "
            "min-max over seeds (dots)")
    reward.set(xlabel="RL step (after the warm start)", ylabel="share of correct responses", ylim=(0, 1),
               title="RL steps' responses correct: mean, min-max band over seeds")
    acc.legend(fontsize=8, loc="upper center", ncol=2)
    reward.legend(fontsize=8, loc="lower left", ncol=len(recipes))
    for ax in (acc, reward):
        ax.grid(alpha=0.3)
    settings = result["settings"]
    fig.suptitle(f"recipes on a GSM8K-format task: tiny qwen3 policy, {settings['sft_steps']} warm-start steps, "
                 f"{settings['steps']} RL steps")
    save_figure(fig, path)


def parse_settings(argv: list[str] | None = None) -> tuple[argparse.Namespace, dict]:
    """The command line, and the settings it resolves to: ``FULL`` or ``QUICK``, each flag
    given overriding; a reused warm start's ``WARM_START_KEYS`` come from its manifest."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, help=f"RL steps per run (default {FULL['steps']})")
    parser.add_argument("--seeds", type=int, help=f"RL seeds 0..N-1 per recipe (default {FULL['seeds']})")
    parser.add_argument("--sft-steps", type=int, help=f"warm-start steps (default {FULL['sft_steps']})")
    parser.add_argument("--recipes", nargs="+", choices=RECIPES, help="default: all")
    parser.add_argument("--data-seed", type=int, default=0, help="the dataset, tokenizer and initial weights")
    parser.add_argument("--warm-start", type=Path, default=None,
                        help="a warm-start folder of an earlier run (<work>/warm_start) to reuse instead of making one")
    parser.add_argument("--quick", action="store_true",
                        help=f"a smoke run: {QUICK['records']} records, {QUICK['sft_steps']} warm-start and "
                             f"{QUICK['steps']} RL steps, 1 seed, {' and '.join(QUICK['recipes'])}, into a temporary folder")
    parser.add_argument("--out", type=Path, default=None,
                        help="folder of bench_recipes.json and .png (default assets/; --quick: a temporary folder)")
    parser.add_argument("--work", type=Path, default=None,
                        help="run folders, cleared first (default outputs/bench_recipes; --quick: <out>/work)")
    parser.add_argument("--replot", action="store_true", help="only redraw the PNG from <out>/bench_recipes.json")
    parser.add_argument("--resume", action="store_true",
                        help="keep --work and the runs it finished (same settings only): an interrupted benchmark "
                             "goes on where it stopped")
    args = parser.parse_args(argv)
    settings = dict(QUICK if args.quick else FULL, data_seed=args.data_seed, vocab_size=512)
    for key in ("steps", "seeds", "sft_steps", "recipes"):
        if getattr(args, key) is not None:
            settings[key] = getattr(args, key)
    if args.warm_start is not None:
        manifest = json.loads((args.warm_start / "warm_start.json").read_text())
        if args.sft_steps is not None and args.sft_steps != manifest["sft_steps"]:
            parser.error(f"--sft-steps {args.sft_steps}: the warm start {args.warm_start} has {manifest['sft_steps']}")
        settings |= {key: manifest[key] for key in WARM_START_KEYS}
    if args.out is None:
        args.out = Path(tempfile.mkdtemp(prefix="bench_recipes_quick_")) if args.quick else ROOT / "assets"
    if args.work is None:
        args.work = args.out / "work" if args.quick else ROOT / "outputs" / "bench_recipes"
    if args.warm_start is not None and args.warm_start.resolve().is_relative_to(args.work.resolve()):
        parser.error("--warm-start must lie outside --work, which is cleared first")
    return args, settings


def failed_command(e: subprocess.CalledProcessError) -> str:
    """A job or evaluation that exited non-zero, as a check's failure."""
    return f"exit status {e.returncode}: {' '.join(map(str, e.cmd[1:]))}"


def report_failures(failures: list[str]) -> bool:
    """Print every failure; whether there was one (the script then exits 1)."""
    for failure in failures:
        print(f"FAIL: {failure}", file=sys.stderr)
    return bool(failures)


def measure(args: argparse.Namespace, settings: dict, failures: list[str]) -> dict:
    """The warm start (made, or copied from ``--warm-start``) and its evaluation, then every
    recipe's runs; the JSON's measured parts. Appends what the checks find to ``failures``."""
    kept = args.work / "settings.json"
    if args.resume and kept.exists() and json.loads(kept.read_text()) != settings:
        raise SystemExit(f"--resume: {args.work} ran other settings ({kept}); run without --resume to start over")
    if not (args.resume and kept.exists()):
        shutil.rmtree(args.work, ignore_errors=True)
    args.work.mkdir(parents=True, exist_ok=True)
    kept.write_text(json.dumps(settings) + "\n")
    warm = args.work / "warm_start"
    if (warm / "warm_start.json").exists():
        manifest = json.loads((warm / "warm_start.json").read_text())
    elif args.warm_start is not None:
        shutil.rmtree(warm, ignore_errors=True)
        shutil.copytree(args.warm_start, warm)
        manifest = json.loads((warm / "warm_start.json").read_text())
    else:
        manifest = make_warm_start(warm, settings, args.work)
    warm_hash, flags = folder_hash(warm), job_flags(warm, manifest, settings)
    before = evaluate(args.work / "eval" / "warm_start", warm / f"step-{manifest['sft_steps']}", flags, settings)
    failures += eval_failures("warm start", before, manifest["sft_steps"])
    recipes = {}
    for recipe in settings["recipes"]:
        job = read_job_toml(ROOT / "train_configs" / "recipes" / f"{recipe}.toml")["job"]
        recipes[recipe] = {"config": f"train_configs/recipes/{recipe}.toml", "description": job["description"],
                           "runs": [run_recipe(recipe, seed, warm, manifest, settings, args.work, failures)
                                    for seed in range(settings["seeds"])]}
    if folder_hash(warm) != warm_hash:
        failures.append("the warm start (checkpoint, policy folder or dataset) changed during the runs")
    with open(warm / "gsm8k.jsonl") as f:
        example = json.loads(f.readline())
    return {
        "dataset": {"records": manifest["records"], "held_out": manifest["eval_size"], "example": example,
                    "templates": [t[0] for t in TEMPLATES]},
        "policy": manifest["policy"],
        "warm_start": {"sft_steps": manifest["sft_steps"], "runtime_s": manifest["runtime_s"],
                       "sft_loss_last": manifest["sft_loss_last"], "sha256": warm_hash, "eval": before,
                       "job_flags": job_flags(Path("<warm_start>"), manifest, settings)},
        "recipes": recipes,
    }


def main() -> int:
    args, settings = parse_settings()
    json_path, png_path = args.out / "bench_recipes.json", args.out / "bench_recipes.png"
    if args.replot:
        plot(json.loads(json_path.read_text()), png_path)
        return 0
    start, failures = time.perf_counter(), []
    try:
        measured = measure(args, settings, failures)
    except subprocess.CalledProcessError as e:
        failures.append(failed_command(e))
    if report_failures(failures):
        return 1

    before = measured["warm_start"]["eval"]
    for recipe in measured["recipes"].values():
        recipe["summary"] = summarize(recipe["runs"], before)
    seeds = list(range(settings["seeds"]))
    result = {
        "description": " ".join(" ".join(__doc__.split("\n\n")[:2]).split()),
        "command": command_line(),
        "settings": {**settings, "seeds": seeds, "base_config": f"train_configs/{BASE_CONFIG}", "quick": args.quick,
                     "warm_start_reused": args.warm_start is not None,
                     "hardware": f"{os.cpu_count()}-core CPU, gloo, 2 processes (evaluation: 1), 1 thread each"},
        **measured,
        "checks": {"passed": True, "runs": len(measured["recipes"]) * len(seeds),
                   "what": "every job and evaluation exited 0; every run logged all its RL steps with finite "
                           "reward, acceptance length and step time; every evaluation is finite and of the step "
                           "asked; the warm start and every run's copy of it kept their sha256"},
    }
    result["records"] = [record(recipe, result) for recipe in result["recipes"]]
    result["runtime_s"] = round(time.perf_counter() - start, 1)
    args.out.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(result, indent=1) + "\n")
    plot(result, png_path)
    print(f"warm start ({settings['sft_steps']} steps): accuracy {before['accuracy']:.3f}, "
          + ", ".join(f"pass@{k} {v:.3f}" for k, v in before["pass_at_k"].items()))
    for r in result["records"]:
        after = r["accuracy_after"]
        print(f"{r['recipe']:8s} after {r['rl_steps']} RL steps: accuracy {after['mean']:.3f} "
              f"({after['min']:.3f}-{after['max']:.3f} over {len(seeds)} seeds), "
              + ", ".join(f"pass@{k} {v['mean']:.3f}" for k, v in r["pass_at_k_after"].items())
              + f"; acceptance {r['acceptance_length']['mean']:.2f}, step {r['step_s_median']['mean']:.2f} s")
    print(f"wrote {json_path} and {png_path}")
    return 0

if __name__ == "__main__":
    sys.exit(main())
