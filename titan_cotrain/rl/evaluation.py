"""Held-out evaluation, during training (``[eval]``) and after it (``python -m titan_cotrain.eval``).

The prompts (``eval_problems``): ``[eval] path``'s records, or the training file's held-out
split, or a synthetic task's own draws. ``Evaluation`` answers them on every rank: prompt
``i`` goes to data-parallel rank ``i mod dp``, and within a data-parallel coordinate its
context-parallel and pipeline peers share them out as they share a rollout
(``GenerationGroup.share``). Each rank scores its own responses, and the sums are reduced
over the job, so every prompt counts once whatever the layout. The engine is the one the
next rollout uses, already refreshed; its draft tokens per round are fixed (the tuner
neither chooses nor learns), and its sampling seed is the same at every evaluation, so two
evaluations differ by the weights.

The result (``Evaluation.__call__``), the same on every rank:

* ``accuracy``: the share of correct responses (a reward part named ``correct``: the math and
  gsm8k tasks', or a custom reward's that returns one; None without it, and no pass@k);
* ``pass_at_k``: ``{k: mean over prompts of 1 - C(n - c, k) / C(n, k)}``, the unbiased
  estimator from ``n`` samples of which ``c`` are correct, and ``pass_at_k_curve`` (k = 1..n);
* ``reward_mean``; each reward part's mean (``answer_found``, ``format``, ...; their names in
  ``parts``) over the calls that returned it, and the scorer's counts of failed calls;
* ``acceptance_length`` (tokens per target forward over the drafting rounds) and
  ``acceptance_rate`` (drafted token ``d`` accepted when ``1..d-1`` were), measured by the
  engines; ``response_len``, ``truncated_share``, ``tokens_per_s``, ``time_s``.

``eval_metrics(result)`` is its ``eval/`` view for TensorBoard and ``metrics.jsonl``;
``write_result`` writes the JSON, a plot and (``[eval] save_responses``) every response.
"""

import dataclasses
import hashlib
import json
import math
import os
import random
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from titan_cotrain.engine.round_stats import live_bucket
from titan_cotrain.engine.sampling import SamplingParams
from titan_cotrain.rl.batching import Sample
from titan_cotrain.rl.prefit import rl_offset
from titan_cotrain.rl.problems import ProblemStream
from titan_cotrain.rl.rewards import COUNTS, RewardScorer, RewardSettings
from titan_cotrain.rl.rollout_metrics import rollout_metrics
from titan_cotrain.rl.tasks import DATASET_TASKS, get_task

__all__ = ["EvalError", "EvalSettings", "Evaluation", "build_evaluation", "eval_metrics", "eval_problems", "pass_at_k",
           "settings_errors", "summary_line", "write_result"]


class EvalError(ValueError):
    """Nothing to evaluate: no checkpoint, or no evaluation prompts."""


def pass_at_k(n: int, c: int, k: int) -> float:
    """Probability that at least one of ``k`` of the ``n`` samples, ``c`` of them correct,
    drawn without replacement, is correct: ``1 - C(n - c, k) / C(n, k)``."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


@dataclass(frozen=True)
class EvalSettings:
    """What an evaluation reads of the job config (``[eval]``, its defaults resolved from
    ``[rl]`` and ``[rollout]``), once (``from_config``)."""

    interval: int
    at_end: bool
    samples: int
    pass_k: tuple[int, ...]
    temperature: float
    top_p: float
    top_k: int
    max_new_tokens: int
    stop_token_ids: tuple[int, ...]
    prompts: int
    save_responses: bool
    rl_offset: int
    """RL step ``n`` is job step ``rl_offset + n`` (``rl.prefit.rl_offset``: the warm start's
    and the draft prefit's steps come first)."""

    @classmethod
    def from_config(cls, config) -> "EvalSettings":
        e, ro = config.eval, config.rollout
        samples = e.samples or config.rl.group_size
        return cls(interval=e.interval, at_end=e.at_end, samples=samples,
                   pass_k=tuple(e.pass_k) if e.pass_k else tuple(sorted({1, samples})),
                   temperature=ro.temperature if e.temperature < 0 else e.temperature,
                   top_p=e.top_p or ro.top_p, top_k=ro.top_k if e.top_k < 0 else e.top_k,
                   max_new_tokens=e.max_new_tokens or ro.max_new_tokens, stop_token_ids=tuple(ro.stop_token_ids),
                   prompts=e.prompts, save_responses=e.save_responses, rl_offset=rl_offset(config))

    def due(self, step: int) -> bool:
        """Whether the policy after job step ``step`` is evaluated during training: the one RL
        starts from (``step == rl_offset``) and every ``interval``-th RL step's."""
        done = step - self.rl_offset
        return done == 0 or (done > 0 and self.interval > 0 and done % self.interval == 0)


def settings_errors(config) -> list[str]:
    """``[eval]``'s values that cannot work, each as one line naming its key."""
    e, errors = config.eval, []
    samples = e.samples or config.rl.group_size
    for key, ok, rule in (("interval", e.interval >= 0, ">= 0"), ("prompts", e.prompts >= 0, ">= 0 (0 = all)"),
                          ("samples", e.samples >= 0, ">= 0 (0 = rl.group_size)"),
                          ("top_p", 0 <= e.top_p <= 1, "in [0, 1] (0 = rollout.top_p)"),
                          ("max_new_tokens", 0 <= e.max_new_tokens <= config.rollout.max_new_tokens,
                           f"in [0, rollout.max_new_tokens = {config.rollout.max_new_tokens}] (0 = that; the "
                           "engine's positions are sized by it)")):
        if not ok:
            errors.append(f"eval.{key} must be {rule}, got {getattr(e, key)!r}")
    if not all(1 <= k <= samples for k in e.pass_k):
        errors.append(f"eval.pass_k = {list(e.pass_k)}: every k must lie in 1..{samples} (eval.samples, or "
                      "rl.group_size)")
    task = e.task or config.task.name
    if (e.task or e.reward or e.prompt_field or e.answer_field or e.dataset_format) and not e.path:
        errors.append("eval.task, reward, prompt_field, answer_field and dataset_format describe eval.path's "
                      "records: set eval.path")
    if e.path and task not in DATASET_TASKS:
        errors.append(f"eval.path = {e.path!r} is scored by task {task!r}, which reads no records: set eval.task to "
                      f"one of {', '.join(sorted(DATASET_TASKS))}")
    if e.path and task == "custom" and not (e.reward or config.task.reward):
        errors.append("eval.task = 'custom' needs eval.reward (or task.reward)")
    if e.enable and not e.path and config.task.name not in DATASET_TASKS and not e.prompts:
        errors.append(f"eval.enable with the synthetic task {config.task.name!r}: set eval.prompts (how many "
                      "problems to draw) or eval.path")
    if (e.enable and not e.path and config.task.name in DATASET_TASKS
            and not (config.task.eval_size or config.task.eval_fraction)):
        errors.append("eval.enable needs evaluation prompts: set task.eval_size or task.eval_fraction (the "
                      "training file's held-out split), or eval.path (a file of their own)")
    return errors


def eval_problems(config, task, encode, max_prompt_tokens: int, seed: int, run) -> tuple[object, list, str]:
    """``(task, problems, source)`` of the evaluation: ``[eval] path``'s records scored by
    ``[eval] task`` (read by ``run.prompt_splits``, every record an evaluation prompt, in the
    seeded order of ``[task] seed``), or the job ``task``'s held-out split, or ``[eval] prompts``
    draws of a synthetic task (keyed by the job ``seed`` and the index); at most ``[eval]
    prompts`` of them."""
    e = config.eval
    if e.path:
        t = config.task
        task_config = dataclasses.replace(
            t, name=e.task or t.name, reward=e.reward or t.reward, dataset_path=e.path,
            dataset_format=e.dataset_format, prompt_field=e.prompt_field or t.prompt_field,
            answer_field=e.answer_field or t.answer_field, solution_field="", eval_size=0, eval_fraction=0.0)
        splits = run.prompt_splits(task_config, encode, max_prompt_tokens)
        task = get_task(task_config.name, splits, t.format_reward, t.seed, task_config.reward)
        problems, source = task.train, e.path
    elif task.name in DATASET_TASKS:
        problems, source = task.held_out, f"{config.task.dataset_path} (held out)"
    else:
        problems = [task.sample(random.Random(f"{seed}/eval/{i}")) for i in range(e.prompts)]
        source = f"{task.name} (drawn for the evaluation)"
    problems = problems[:e.prompts] if e.prompts else problems
    if not problems:
        raise EvalError(f"no evaluation prompts in {source}")
    return task, problems, source


class Evaluation:
    """``evaluation(step)``: the result of the module docstring for the engine's current
    weights (the policy after job step ``step``), the same on every rank; None on a simulated
    device, where nothing is read back. Every rank calls it (its collectives: the responses'
    sums in ``rollout_metrics``, one sum of the correctness counts and, with
    ``save_responses``, one gather of the responses to the logging rank ``log_rank``).

    ``problems``: the evaluation's; ``stream``: the ``ProblemStream`` that scores them (the
    job's, or one for ``[eval] path``'s task); the rest as ``RolloutPhase`` takes them;
    ``draft_tokens``: k of every round (0: plain decoding)."""

    def __init__(self, settings: EvalSettings, problems: list, source: str, stream: ProblemStream, engine,
                 generation, sync, run, device, draft_tokens: int, log_rank: int) -> None:
        self.settings, self.problems, self.source, self.stream = settings, problems, source, stream
        self.engine, self.generation, self.sync, self.run, self.device = engine, generation, sync, run, device
        self.draft_tokens, self.log_rank = draft_tokens, log_rank
        self.own_scorer = False  # build_evaluation: [eval] path's task scores with a scorer of its own
        dp_rank, dp_degree = stream.dp_rank, stream.dp_degree
        self.mine = list(range(len(problems)))[dp_rank::dp_degree]  # this data-parallel coordinate's prompts
        self.share = [self.mine[i] for i in self.generation.share(len(self.mine))]  # those this rank generates
        key = f"{stream.seed}/eval/{dp_rank}/{generation.unit}"
        self.seed = int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "little") >> 1

    @property
    def task_name(self) -> str:
        return self.stream.task.name

    def sampling_params(self) -> SamplingParams:
        return SamplingParams.of(self.settings, self.stream.tokenizer.eos_id)

    def __call__(self, step: int) -> dict | None:
        t0 = time.perf_counter()
        s, n = self.settings, self.settings.samples
        problems = [self.problems[i] for i in self.share]
        prompts = [self.stream.encode_prompt(p.prompt) for p in problems]
        # A prompt's samples share its prefill when its group fits the running batch.
        group = n if n <= self.engine.max_batch_size else 1
        rollouts = None
        if prompts:
            generator = self.run.rollout_generator(self.seed, self.device)
            rollouts = self.run.generate(self.engine, [ids for ids in prompts for _ in range(n // group)],
                                         self.sampling_params(), samples_per_prompt=group, generator=generator,
                                         draft_tokens=self.draft_tokens)
        if not self.run.values_known:
            return None
        sends = self.generation.sends()
        lengths = rollouts.response_lens.tolist() if rollouts is not None else []
        responses = [rollouts.tokens[i, :m].tolist() for i, m in enumerate(lengths)]
        texts = [self.stream.tokenizer.decode(ids) for ids in responses]
        asked = [p for p in problems for _ in range(n)]
        rewards, details = self.stream.score(asked, texts) if texts else ([], [])
        truncated = (~rollouts.finished).tolist() if rollouts is not None else []
        samples = [Sample(prompts[i // n], responses[i], [], rewards[i], truncated=truncated[i])
                   for i in range(len(responses))]
        generated = rollouts.stats if rollouts is not None and sends else None
        k = self.draft_tokens
        reduced = rollout_metrics(self.sync.all_reduce, samples, details, generated, k,
                                  buckets=live_bucket(self.engine.max_batch_size) + 1, counted=sends, group_size=n,
                                  eos_id=self.stream.tokenizer.eos_id)
        weight = float(sends)
        # A call that failed (timed out, or raised under reward_on_error = "zero") scored 0: not correct.
        correct = [d.get("correct", 0.0 if any(d.get(c) for c in COUNTS) else None) for d in details]
        graded = all(c is not None for c in correct)
        per_prompt = [sum(correct[i * n:(i + 1) * n]) for i in range(len(problems))] if graded else []
        curve = [sum(pass_at_k(n, round(c), j) for c in per_prompt) * weight for j in range(1, n + 1)]
        counts = self.sync.all_reduce([len(problems) * weight, float(not graded and bool(details)), *curve])
        n_prompts, ungraded, curve = counts[0], counts[1], counts[2:]
        parts = sorted(name[len("task/"):] for name in reduced if name.startswith("task/"))
        result = {
            "step": step, "task": self.task_name, "source": self.source, "prompts": round(n_prompts),
            "samples_per_prompt": n, "temperature": s.temperature, "top_p": s.top_p, "top_k": s.top_k,
            "max_new_tokens": s.max_new_tokens,
            "accuracy": None if ungraded else curve[0] / n_prompts,  # pass@1: the share of correct responses
            "reward_mean": reduced["reward/mean"], "parts": parts,
            **{name: reduced[f"task/{name}"] for name in parts},
            "pass_at_k": {} if ungraded else {str(j): curve[j - 1] / n_prompts for j in s.pass_k},
            "pass_at_k_curve": [] if ungraded else [c / n_prompts for c in curve],
            "draft_tokens": k, "acceptance_length": reduced["rollout/acceptance_length"],
            "acceptance_rate": [reduced.get(f"rollout/acceptance_rate_{d}", float("nan")) for d in range(1, k + 1)],
            "response_len": reduced["rollout/response_len"],
            "truncated_share": reduced["rollout/truncated_share"], "tokens_per_s": reduced["rollout/tokens_per_s"],
        }
        if s.save_responses:
            own = [{"prompt": self.share[i // n], "sample": i % n, "response": texts[i], "reward": rewards[i],
                    "correct": correct[i]} for i in range(len(texts))] if sends else []
            result["responses"] = self._gather(own)
        result["time_s"] = time.perf_counter() - t0
        return result

    def close(self) -> None:
        """Stop the scorer's workers when the evaluation has a scorer of its own."""
        if self.own_scorer:
            self.stream.scorer.close()

    def _gather(self, own: list[dict]) -> list[dict] | None:
        """Every rank's responses on the logging rank, by prompt and sample (None elsewhere)."""
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return own
        everyone = [None] * dist.get_world_size() if dist.get_rank() == self.log_rank else None
        dist.gather_object(own, everyone, dst=self.log_rank)
        if everyone is None:
            return None
        return sorted((r for rank in everyone for r in rank), key=lambda r: (r["prompt"], r["sample"]))


def eval_metrics(result: dict) -> dict[str, float]:
    """The ``eval/`` scalars of a result (TensorBoard and ``metrics.jsonl``)."""
    scalars = {"eval/prompts": result["prompts"], "eval/reward_mean": result["reward_mean"],
               "eval/response_len": result["response_len"], "eval/truncated_share": result["truncated_share"],
               "eval/acceptance_length": result["acceptance_length"], "eval/tokens_per_s": result["tokens_per_s"],
               "eval/time_s": result["time_s"]}
    if result["accuracy"] is not None:
        scalars["eval/accuracy"] = result["accuracy"]
    scalars |= {f"eval/pass@{k}": v for k, v in result["pass_at_k"].items()}
    scalars |= {f"eval/acceptance_rate_{d}": v for d, v in enumerate(result["acceptance_rate"], 1) if v == v}
    scalars |= {f"eval/{name}": result[name] for name in result["parts"] if name != "correct"}  # accuracy is it
    return scalars


def summary_line(result: dict) -> str:
    """One console line of a result."""
    graded = "ungraded" if result["accuracy"] is None else f"accuracy {result['accuracy']:.3f}"
    passes = "".join(f", pass@{k} {v:.3f}" for k, v in result["pass_at_k"].items())
    return (f"eval step {result['step']}: {result['prompts']} prompts x {result['samples_per_prompt']}: {graded}"
            f"{passes}, reward {result['reward_mean']:.3f}, acceptance length {result['acceptance_length']:.2f}, "
            f"{result['time_s']:.1f} s" + (f"; wrote {result['json']}" if result.get("json") else ""))


def write_result(result: dict, folder: str, stem: str) -> str:
    """``<folder>/<stem>.json`` (the result, its responses apart), ``<stem>.responses.jsonl``
    (every response, when saved) and ``<stem>.png`` (when matplotlib is installed); returns the
    JSON's path."""
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, stem)
    result = dict(result)
    responses = result.pop("responses", None)
    if responses is not None:
        with open(path + ".responses.jsonl", "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in responses)
        result["responses"] = path + ".responses.jsonl"
    result["plot"] = path + ".png" if _plot(result, path + ".png") else None
    with open(path + ".json", "w") as f:
        json.dump(result, f, indent=1)
    return path + ".json"


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
    accuracy = "ungraded" if result["accuracy"] is None else f"accuracy {result['accuracy']:.3f}"
    passk.set(xlabel="k", ylabel="pass@k", ylim=(0, 1),
              title=f"{result['task']}: {result['prompts']} prompts, {accuracy} (step {result['step']})")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True


def build_evaluation(trainer) -> "Evaluation | None":
    """The trainer's ``Evaluation`` when ``[eval] enable`` (None otherwise): its prompts
    (``eval_problems``), and for ``[eval] path``'s own task a scorer of its own."""
    config = trainer.config
    if not config.eval.enable:
        return None
    ro = config.rollout
    max_prompt = (ro.max_prompt_tokens or config.training.seq_len - ro.max_new_tokens)
    task, problems, source = eval_problems(config, trainer.task, trainer.encode_prompt, max_prompt, trainer.seed,
                                           trainer.mode)
    stream = trainer.problems
    if task is not trainer.task:
        scorer = RewardScorer(task, RewardSettings.from_config(config.task))
        if trainer.mode.values_known:
            scorer.start()
        stream = ProblemStream(task, trainer.tokenizer, trainer.encode_prompt, trainer.seed, trainer.dp_rank,
                               trainer.dp_degree, scorer)
    evaluation = Evaluation(EvalSettings.from_config(config), problems, source, stream, trainer.engine,
                            trainer.generation, trainer.sync, trainer.mode, trainer.device,
                            trainer.rollouts.speculation.k_max, trainer.log_rank)
    evaluation.own_scorer = stream is not trainer.problems
    return evaluation
