"""The draft's prefit: draft-only steps between the warm start and RL (``[draft] prefit_steps``).

A chat policy needs no warm start, but a fresh (or foreign) draft accepts little of what it
writes, and every rollout of the first RL steps would pay for that. A prefit step teaches the
draft the policy's own generations before RL: the rollout engine answers training prompts by
plain decoding (no draft, no tuner: the sequences are the policy's samples at the
``[rollout]`` settings), and the update trains the draft alone on them. The policy's forward
still runs (it gives the taps and the teacher logits, under FSDP, CP and PP as in
co-training), with a policy loss of zero weight; the policy's optimizer does not step and its
LR schedule does not advance, so its weights, optimizer state and step count stay bitwise what
they were.

Prompts: prefit step ``i`` (0-based) takes the ``i``-th block of ``[draft] prefit_prompts``
positions of the stream RL continues from after the warm start (``rl.problems``): the
prompts of RL's first steps. Sampling streams: ``ProblemStream.generator_seed(step, unit)``
of the job step, so a resumed prefit repeats the uninterrupted one.
"""

import dataclasses
import time
from dataclasses import dataclass

from titan_cotrain.data.batch import PolicyLoss
from titan_cotrain.engine.sampling import SamplingParams
from titan_cotrain.rl.batching import Sample
from titan_cotrain.rl.grpo import next_token_loss
from titan_cotrain.rl.progress import RolloutProgress

__all__ = ["DraftPrefit", "PrefitSettings", "frozen_policy_loss", "prefit_chooses_vocabulary", "prefit_errors", "rl_offset",
           "with_prefit_phase"]


def rl_offset(config) -> int:
    """The job step before RL's first: the warm start's steps and the prefit's. RL step ``n``
    is job step ``rl_offset + n``."""
    return config.task.sft_steps + (config.draft.prefit_steps if config.draft.enable else 0)


def with_prefit_phase(config, phases: list[tuple[object, int, float]]) -> list[tuple[object, int, float]]:
    """The draft's LR phases (``rl.trainer_setup.lr_phases``: the warm start's, RL's) with the
    prefit's between them: ``[draft] prefit_lr`` (or ``sft_lr``, or ``lr``) after ``prefit_warmup_steps``,
    decaying by ``prefit_decay_type`` to ``prefit_min_lr_factor`` of it. The policy's schedule
    has no such phase: it does not advance in the prefit."""
    d = config.draft
    prefit = dataclasses.replace(config.lr_scheduler, warmup_steps=d.prefit_warmup_steps,
                                 decay_type=d.prefit_decay_type, min_lr_factor=d.prefit_min_lr_factor,
                                 decay_ratio=None, total_steps=None)
    steps = d.prefit_steps if d.enable else 0
    return [phases[0], (prefit, steps, d.prefit_lr or d.sft_lr or d.lr), *phases[1:]]


def prefit_chooses_vocabulary(config) -> bool:
    """Whether the prefit's first generations choose the reduced draft vocabulary: a prefit
    right at the start (no warm start) of a fresh draft (no ``init_path``) with a reduced
    ``[draft] vocab_size``, on a policy from ``[model] hf_path`` (whose own writing is what the
    draft will propose). ``[draft] vocab_generations`` is then not used: the prefit's first
    step's ``prefit_prompts x prefit_samples`` responses are the generations."""
    d = config.draft
    return bool(d.enable and d.prefit_steps and d.vocab_size and not d.init_path and config.model.hf_path
                and not config.task.sft_steps)


def frozen_policy_loss(logits, rows) -> PolicyLoss:
    """The prefit's policy loss: the warm start's, times zero. It keeps the policy's graph
    whole (a pipeline stage's backward needs its output's gradient), adds nothing to the
    draft's, and the policy's optimizer is not stepped on it (``UpdateStep.step(...,
    train_policy=False)``)."""
    loss = next_token_loss(logits, rows)
    return PolicyLoss(loss.loss_sum * 0.0, loss.count)


@dataclass(frozen=True)
class PrefitSettings:
    """What the prefit reads of the job config, resolved once (``from_config``)."""

    steps: int
    """``[draft] prefit_steps``."""
    first_step: int
    """The prefit's first job step: ``[task] sft_steps + 1``."""
    prompts: int
    """Prompts per step, every data-parallel rank's (``prefit_prompts``, or ``rl.prompts_per_step``)."""
    samples: int
    temperature: float
    top_k: int
    top_p: float
    max_new_tokens: int
    stop_token_ids: tuple[int, ...]

    @classmethod
    def from_config(cls, config) -> "PrefitSettings":
        d, ro = config.draft, config.rollout
        return cls(steps=d.prefit_steps if d.enable else 0, first_step=config.task.sft_steps + 1,
                   prompts=d.prefit_prompts or config.rl.prompts_per_step, samples=d.prefit_samples,
                   temperature=ro.temperature, top_k=ro.top_k, top_p=ro.top_p, max_new_tokens=ro.max_new_tokens,
                   stop_token_ids=tuple(ro.stop_token_ids))

    def holds(self, step: int) -> bool:
        """Whether job step ``step`` is a prefit step."""
        return self.first_step <= step < self.first_step + self.steps


def prefit_errors(config) -> list[str]:
    """``[draft] prefit_*`` values that cannot work, each naming its key."""
    d, errors = config.draft, []
    for key, ok, rule in (("prefit_steps", d.prefit_steps >= 0, ">= 0"),
                          ("prefit_prompts", d.prefit_prompts >= 0, ">= 0 (0 = rl.prompts_per_step)"),
                          ("prefit_samples", d.prefit_samples >= 1, ">= 1"),
                          ("prefit_lr", d.prefit_lr >= 0, ">= 0 (0 = draft.sft_lr, or draft.lr)"),
                          ("prefit_warmup_steps", 0 <= d.prefit_warmup_steps <= max(d.prefit_steps, 0),
                           "in [0, draft.prefit_steps]"),
                          ("prefit_min_lr_factor", 0 <= d.prefit_min_lr_factor <= 1, "in [0, 1]")):
        if not ok:
            errors.append(f"draft.{key} must be {rule}, got {getattr(d, key)!r}")
    if d.prefit_steps and not d.enable:
        errors.append(f"draft.prefit_steps = {d.prefit_steps} trains the draft: it needs draft.enable")
    if d.prefit_steps and d.freeze_after_sft:
        errors.append(f"draft.prefit_steps = {d.prefit_steps} and draft.freeze_after_sft: the prefit trains a draft "
                      "that RL would then never train; set one of them")
    return errors


class DraftPrefit:
    """``prefit(step)``: job step ``step``'s samples (the policy's responses, the same on every
    CP and PP peer) and metrics. Every rank calls it; its collectives: the prompts' length check,
    the exchange with the CP x PP peers (``GenerationGroup.exchange``) and one sum of the
    metrics. ``prompts_per_rank``: this data-parallel rank's share of ``settings.prompts``."""

    def __init__(self, settings: PrefitSettings, engine, generation, problems, sync, run, device, state,
                 show_progress: bool) -> None:
        self.settings, self.engine, self.generation, self.problems = settings, engine, generation, problems
        self.sync, self.run, self.device, self.state = sync, run, device, state
        self.show_progress = show_progress and run.values_known
        self.prompts_per_rank = settings.prompts // problems.dp_degree
        self._first = None  # the first step's generations, made early to choose the draft's vocabulary

    def generate_first(self) -> list[list[int]]:
        """The first prefit step's generations, made now (before the draft's reduced vocabulary
        exists: plain decoding does not read the draft) and kept for that step; returns this
        rank's share of their responses for the vocabulary's counts (each response counted by
        one rank: the first member of its CP x PP group)."""
        self._first = self(self.settings.first_step)
        return [s.response for s in self._first[0]] if self.generation.member == 0 else []

    def sampling_params(self) -> SamplingParams:
        return SamplingParams.of(self.settings, self.problems.tokenizer.eos_id)

    def prompts(self, step: int) -> list[list[int]]:
        """This data-parallel rank's prompts of step ``step``: its part of the prefit's block."""
        stream, s = self.problems, self.settings
        start = self.state.warm_start_positions + (step - s.first_step) * s.prompts
        prompts = [stream.encode_prompt(stream.problem(p).prompt)
                   for p in stream.positions(start, self.prompts_per_rank)]
        longest = max(map(len, prompts))
        self.sync.stop_if_any_rank_failed(
            f"a prefit prompt of {longest} tokens plus rollout.max_new_tokens = {s.max_new_tokens} exceeds the "
            f"engine's {self.engine.max_seq_len} positions" if longest + s.max_new_tokens > self.engine.max_seq_len
            else None, step)
        return prompts

    def __call__(self, step: int) -> tuple[list[Sample], dict[str, float]]:
        if self._first is not None and step == self.settings.first_step:
            first, self._first = self._first, None
            return first
        t0 = time.perf_counter()
        s = self.settings
        prompts = self.prompts(step)
        share = self.generation.share(len(prompts))
        generator = self.run.rollout_generator(self.problems.generator_seed(step, self.generation.unit), self.device)
        progress = RolloutProgress() if self.show_progress else None
        rollouts = None
        if share:
            rollouts = self.run.generate(self.engine, [prompts[i] for i in share], self.sampling_params(),
                                         samples_per_prompt=s.samples, generator=generator, progress=progress,
                                         draft_tokens=0)
        if progress is not None:
            progress.close()
        stand_in = self.run.stand_in_samples([p for p in prompts for _ in range(s.samples)], s.max_new_tokens)
        if stand_in is not None:
            return stand_in, {}
        own = []
        if rollouts is not None:
            lengths = rollouts.response_lens.tolist()
            own = [[rollouts.tokens[i * s.samples + j, :lengths[i * s.samples + j]].tolist()
                    for j in range(s.samples)] for i in range(len(share))]
        responses = self.generation.exchange(own, len(prompts), self.generation.digest(prompts))
        samples = [Sample(prompt, response, [0.0] * len(response), 0.0)
                   for prompt, group in zip(prompts, responses) for response in group]
        counted = float(self.generation.member == 0)
        tokens = sum(len(x.response) for x in samples)
        generated = rollouts.stats if rollouts is not None and self.generation.sends() else None
        n, total, speed = self.sync.all_reduce([len(samples) * counted, tokens * counted,
                                                generated.tokens_per_s if generated is not None else 0.0])
        return samples, {"prefit/responses": n, "prefit/response_len": total / n if n else 0.0,
                         "prefit/tokens_per_s": speed, "time/generate_s": time.perf_counter() - t0}
