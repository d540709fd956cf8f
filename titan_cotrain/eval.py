"""Held-out evaluation of a trained policy and its draft, at the job's rollout settings.

``python -m titan_cotrain.eval --job.config_file F [--section.key value] [--checkpoint DIR |
--hf_policy DIR --eagle3_draft DIR] [--samples N] [--pass_k 1 4 8]``

The models come from the job's latest DCP checkpoint under its dump folder, from
``--checkpoint DIR`` (a ``step-N`` folder, or a checkpoint folder: its latest step), or from
what ``Trainer.export()`` writes: a Hugging Face policy folder and an EAGLE-3 draft folder.
The job's dataset task (``math``, ``gsm8k``) gives the held-out prompts (``[task] eval_size``
or ``eval_fraction``); each is answered ``--samples`` times (default ``rl.group_size``) by
the rollout engine, speculatively when the job's rollouts are. Written to
``<dump_folder>/eval/eval_step<N>.json`` (``eval_hf.json`` for exported folders):

* ``accuracy``: the share of correct responses; ``answer_found`` and ``format``: of those
  stating a final answer, and in the task's form; ``reward_mean`` (format bonus included);
* ``pass_at_k``: ``{k: mean over prompts of 1 - C(n - c, k) / C(n, k)}``, the unbiased
  estimator from ``n`` samples of which ``c`` are correct;
* ``acceptance_length`` (tokens per target forward) and ``acceptance_rate`` (drafted token
  ``d`` accepted when ``1..d-1`` were), measured by the engine;
and a plot of both beside it (``.png``, when matplotlib, the ``bench`` extra, is installed).

One process: the job's parallel degrees are replaced by 1 (a DCP checkpoint of any layout
loads), and launched by ``torchrun`` it must be with one rank.
"""

import argparse
import json
import math
import os
import re
import sys

import torch

from titan_cotrain.config import ConfigError, load_job_config
from titan_cotrain.data.prompts import PromptDatasetError
from titan_cotrain.parallel.process_end import exit_process, leave_process_group
from titan_cotrain.rl.progress import RolloutProgress

__all__ = ["EvalError", "evaluate", "main", "pass_at_k"]

ONE_PROCESS = ("--parallelism.data_parallel_replicate_degree", "1", "--parallelism.data_parallel_shard_degree", "-1",
               "--parallelism.context_parallel_degree", "1", "--parallelism.pipeline_parallel_degree", "1",
               "--metrics.no-enable_tensorboard")


class EvalError(ValueError):
    """Nothing to evaluate: no checkpoint, or no held-out prompts."""


def pass_at_k(n: int, c: int, k: int) -> float:
    """Probability that at least one of ``k`` of the ``n`` samples, ``c`` of them correct,
    drawn without replacement, is correct: ``1 - C(n - c, k) / C(n, k)``."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def _arguments(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """The evaluation's own flags, and the job's arguments with the model source and one
    process as overrides (the command line's last value wins)."""
    parser = argparse.ArgumentParser(prog="python -m titan_cotrain.eval", allow_abbrev=False,
                                     epilog="Other arguments are the job's: --job.config_file F --section.key value")
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--checkpoint", help="a DCP step-N folder or a checkpoint folder (default: the job's)")
    source.add_argument("--hf_policy", help="a Hugging Face policy folder (Trainer.export's policy/)")
    parser.add_argument("--eagle3_draft", help="the EAGLE-3 draft folder that goes with --hf_policy")
    parser.add_argument("--samples", type=int, default=0, help="responses per prompt (default: rl.group_size)")
    parser.add_argument("--pass_k", type=int, nargs="+", default=None, help="k of pass@k (default: 1 and samples)")
    args, job = parser.parse_known_args(argv)
    if args.eagle3_draft and not args.hf_policy:
        parser.error("--eagle3_draft goes with --hf_policy")
    job = [*job, *ONE_PROCESS]
    if args.hf_policy:
        job += ["--model.hf_path", args.hf_policy, "--checkpoint.no-enable"]
        job += ["--draft.init_path", args.eagle3_draft] if args.eagle3_draft else ["--draft.no-enable"]
    else:
        # The models and the step only: optimizer and schedule states are not needed.
        job += ["--checkpoint.enable", "--checkpoint.exclude_from_loading", "optimizer,lr_scheduler"]
        if args.checkpoint:
            folder, step = os.path.abspath(args.checkpoint), -1
            match = re.fullmatch(r"step-(\d+)", os.path.basename(folder))
            if match:
                folder, step = os.path.dirname(folder), int(match.group(1))
            job += ["--checkpoint.folder", folder, "--checkpoint.load_step", str(step)]
    return args, job


def evaluate(trainer, samples: int, ks: list[int]) -> dict:
    """The metrics of the module docstring for the engine's current weights."""
    task, cfg = trainer.task, trainer.config
    if task.name == "custom":
        raise EvalError("evaluation reports the accuracy of the math and gsm8k tasks' answer check; a custom "
                        "task's reward has no such check")
    problems = getattr(task, "held_out", [])
    if not problems:
        raise EvalError(f"task {task.name!r} has no held-out prompts: evaluation needs a dataset task "
                         "(math, gsm8k) with task.eval_size or task.eval_fraction set")
    encoded = [trainer.encode_prompt(p.prompt) for p in problems]
    # A prompt's samples share its prefill when its group fits the running batch.
    group = samples if samples <= trainer.engine.max_batch_size else 1
    prompts = [ids for ids in encoded for _ in range(samples // group)]
    generator = torch.Generator(device=trainer.device).manual_seed(trainer.seed)
    progress = RolloutProgress()
    rollouts = trainer.engine.generate(prompts, trainer.rollouts.sampling_params(), samples_per_prompt=group,
                                       generator=generator, progress=progress,
                                       draft_tokens=trainer.rollouts.speculation.k_max)
    progress.close()
    lengths = rollouts.response_lens.tolist()
    texts = [trainer.tokenizer.decode(rollouts.tokens[i, :n].tolist()) for i, n in enumerate(lengths)]
    rewards, details = trainer.problems.score([p for p in problems for _ in range(samples)], texts)
    correct = [d["correct"] == 1.0 for d in details]
    per_prompt = [sum(correct[i * samples:(i + 1) * samples]) for i in range(len(problems))]
    stats = rollouts.stats
    return {
        "task": task.name, "prompts": len(problems), "samples_per_prompt": samples,
        "temperature": cfg.rollout.temperature, "max_new_tokens": cfg.rollout.max_new_tokens,
        "accuracy": sum(correct) / len(correct), "reward_mean": sum(rewards) / len(rewards),
        "answer_found": sum(d["answer_found"] for d in details) / len(details),
        "format": sum(d["format"] for d in details) / len(details),
        "pass_at_k": {str(k): sum(pass_at_k(samples, c, k) for c in per_prompt) / len(per_prompt) for k in ks},
        "pass_at_k_curve": [sum(pass_at_k(samples, c, k) for c in per_prompt) / len(per_prompt)
                            for k in range(1, samples + 1)],
        "draft_tokens": trainer.rollouts.speculation.k_max, "acceptance_length": stats.acceptance_length,
        "acceptance_rate": list(stats.acceptance_rate), "response_len": sum(lengths) / len(lengths),
        "tokens_per_s": stats.tokens_per_s,
    }


def _plot(result: dict, path: str) -> bool:
    """Per-position acceptance and the pass@k curve, side by side; False without matplotlib."""
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (accept, passk) = plt.subplots(1, 2, figsize=(10, 4))
    rates = result["acceptance_rate"]
    accept.bar(range(1, len(rates) + 1), rates)
    accept.set(xlabel="drafted token position d", ylabel="acceptance rate", ylim=(0, 1),
               title=f"acceptance length {result['acceptance_length']:.2f} (k = {result['draft_tokens']})")
    curve = result["pass_at_k_curve"]
    passk.plot(range(1, len(curve) + 1), curve, marker="o")
    passk.set(xlabel="k", ylabel="pass@k", ylim=(0, 1),
              title=f"{result['task']}: {result['prompts']} held-out prompts, accuracy {result['accuracy']:.3f}")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True


def main(argv: list[str] | None = None) -> int:
    from titan_cotrain.rl.trainer import Trainer
    from titan_cotrain.train import init_distributed

    args, job = _arguments(sys.argv[1:] if argv is None else argv)
    if int(os.environ.get("WORLD_SIZE", "1")) != 1:
        print("eval error: evaluation runs on one process (torchrun --nproc_per_node 1, or plain python)",
              file=sys.stderr)
        return 2
    try:
        config = load_job_config(job, world_size=1)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    samples = args.samples or config.rl.group_size
    ks = args.pass_k or sorted({1, samples})
    if samples < 1 or not all(1 <= k <= samples for k in ks):
        print(f"eval error: --pass_k {ks} must lie in 1..--samples ({samples})", file=sys.stderr)
        return 2
    init_distributed(config)
    try:
        trainer = Trainer(config, world_size=1, rank=0)
        if not args.hf_policy and not trainer.checkpointer.load(step=config.checkpoint.load_step):
            raise EvalError(f"no checkpoint in {trainer.checkpointer.folder}")
        trainer.refresh_engine()
        result = {"config": str(config.job.config_file), "step": trainer.state.step,
                  "models": args.hf_policy or trainer.checkpointer.folder,
                  **evaluate(trainer, samples, ks)}
    except (PromptDatasetError, EvalError) as e:
        print(f"eval error: {e}", file=sys.stderr)
        return 2
    finally:
        leave_process_group(succeeded=False)  # one process: no peer to wait for
    folder = os.path.join(config.job.dump_folder, "eval")
    os.makedirs(folder, exist_ok=True)
    stem = os.path.join(folder, "eval_hf" if args.hf_policy else f"eval_step{result['step']}")
    result["plot"] = stem + ".png" if _plot(result, stem + ".png") else None
    with open(stem + ".json", "w") as f:
        json.dump(result, f, indent=1)
    passes = ", ".join(f"pass@{k} {v:.3f}" for k, v in result["pass_at_k"].items())
    print(f"eval: {result['prompts']} prompts x {samples}: accuracy {result['accuracy']:.3f}, {passes}, "
          f"acceptance length {result['acceptance_length']:.2f}; wrote {stem}.json"
          + ("" if result["plot"] else " (matplotlib not installed: plot skipped)"), flush=True)
    return 0


if __name__ == "__main__":
    exit_process(main())
