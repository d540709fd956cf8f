"""A step's rollout phase: this data-parallel coordinate's prompts generated (each CP x PP
peer its share, ``rl.generation_group``), scored into GRPO samples, exchanged, and the rollout
metrics reduced over the job; the speculation tuner learns from what each call measured."""

import dataclasses
import time
from dataclasses import dataclass

import torch

from titan_cotrain.rl.batching import Sample
from titan_cotrain.rl.grpo import group_advantages, overlong_penalty
from titan_cotrain.rl.prefit import rl_offset
from titan_cotrain.rl.progress import RolloutProgress
from titan_cotrain.rl.rollout_metrics import rollout_metrics
from titan_cotrain.engine.round_stats import RoundTable, live_bucket
from titan_cotrain.engine.sampling import SamplingParams
from titan_cotrain.engine.speculation import SpeculationTuner
from titan_cotrain.rl.trainer_setup import rollout_draft_tokens

__all__ = ["RolloutPhase", "RolloutSettings"]


@dataclass(frozen=True)
class RolloutSettings:
    """What a rollout phase reads of the job config, resolved once (``from_config``)."""

    group_size: int
    """``[rl] group_size``: samples per prompt (a GRPO group)."""
    sft_steps: int
    """The steps before RL (``rl.prefit.rl_offset``: the warm start's and the draft prefit's):
    the RL prompt stream's step 1 is job step ``sft_steps + 1``."""
    temperature: float
    top_k: int
    top_p: float
    max_new_tokens: int
    stop_token_ids: tuple[int, ...]
    """``[rollout]`` sampling: the engine's ``SamplingParams``."""
    draft_tokens: int
    """The most tokens a round drafts (``rl.trainer_setup.rollout_draft_tokens``; 0: plain)."""
    adaptive: bool
    """``[rollout] adaptive_speculation``: the tuner picks ``k`` from what earlier calls measured."""
    per_round: bool
    """``[rollout] speculation_granularity == "round"`` (else one ``k`` per call)."""
    advantage: str = "grpo"
    normalize_std: bool = True
    """``[rl] advantage`` and ``normalize_std``: ``rl.grpo.group_advantages``' estimator."""
    overlong: str = "none"
    overlong_buffer: int = 0
    """``[rl] overlong`` and ``overlong_buffer``: what a truncated response gets."""
    dynamic_sampling: bool = False
    dynamic_sampling_max_rounds: int = 0
    """``[rl] dynamic_sampling`` and its most extra generation rounds per step."""

    @classmethod
    def from_config(cls, config) -> "RolloutSettings":
        ro, rl, task = config.rollout, config.rl, config.task
        return cls(group_size=rl.group_size, sft_steps=rl_offset(config), temperature=ro.temperature,
                   top_k=ro.top_k, top_p=ro.top_p, max_new_tokens=ro.max_new_tokens,
                   stop_token_ids=tuple(ro.stop_token_ids),
                   draft_tokens=rollout_draft_tokens(config), adaptive=ro.adaptive_speculation,
                   per_round=ro.speculation_granularity == "round",
                   advantage=rl.advantage, normalize_std=rl.normalize_std, overlong=rl.overlong,
                   overlong_buffer=rl.overlong_buffer, dynamic_sampling=rl.dynamic_sampling,
                   dynamic_sampling_max_rounds=rl.dynamic_sampling_max_rounds)


class RolloutPhase:
    """``phase(step)``: step ``step``'s GRPO samples (host lists, the same on every CP and PP
    peer) and its rollout metrics (reduced over every rank, each rollout counted once).

    ``settings``: ``RolloutSettings``; ``engine``: the ``RolloutEngine``; ``generation``: the
    ``GenerationGroup``; ``problems``: the ``ProblemStream``; ``sync``: the ``HostSync``;
    ``run``: the ``RealRun``; ``show_progress``: draw the progress bar (the logging rank).

    Every rank calls it. Its collectives, per generation round, in order: whether every
    rank's prompts fit the engine (``prompts``, before anything is generated, so no rank stops
    alone), then after the generation ``_share``: the tuner's round tables summed over the job,
    the scored groups exchanged with the CP x PP peers, the reward parts' names gathered, the
    metrics' sums and the longest response (a max). Under dynamic sampling, one sum per round
    decides whether another runs, and one sums the kept and dropped groups. Nothing between
    them returns early on one rank only. ``state``: the ``TrainerState``, whose
    ``extra_prompt_rounds`` dynamic sampling advances (the prompt stream's position)."""

    def __init__(self, settings: RolloutSettings, engine, generation, problems, sync, run, device,
                 prompts_per_rank: int, show_progress: bool, state) -> None:
        self.settings, self.engine, self.generation, self.problems = settings, engine, generation, problems
        self.state = state  # the TrainerState: dynamic sampling's extra rounds move the prompt stream
        self.device = device
        self.sync, self.run, self.prompts_per_rank = sync, run, prompts_per_rank
        self.show_progress = show_progress and run.values_known
        self.speculation = SpeculationTuner(settings.draft_tokens)

    def sampling_params(self) -> SamplingParams:
        """The ``[rollout]`` sampling settings (responses end at the tokenizer's EOS and at
        ``stop_token_ids``)."""
        return SamplingParams.of(self.settings, self.problems.tokenizer.eos_id)

    def prompts(self, step: int, round_: int = 0):
        """Step ``step``'s problems for this data-parallel rank and their prompts, one per
        problem, for the step's generation round ``round_``: RL's ``block``-th block of the
        stream (``rl.problems``), after the warm start's positions; dynamic sampling's extra
        rounds take the next blocks. A collective: every rank stops if one's is too long for
        the engine."""
        stream, s = self.problems, self.settings
        block = step - s.sft_steps - 1 + self.state.extra_prompt_rounds + round_
        start = self.state.warm_start_positions + block * self.prompts_per_rank * stream.dp_degree
        problems = [stream.problem(position) for position in stream.positions(start, self.prompts_per_rank)]
        prompts = [stream.encode_prompt(p.prompt) for p in problems]
        longest = max(map(len, prompts))
        self.sync.stop_if_any_rank_failed(
            f"a prompt of {longest} tokens plus rollout.max_new_tokens = {s.max_new_tokens} exceeds "
            f"the engine's {self.engine.max_seq_len} positions (training.seq_len, or rollout.max_prompt_tokens "
            f"+ max_new_tokens)"
            if longest + s.max_new_tokens > self.engine.max_seq_len else None, step)
        return problems, prompts

    def __call__(self, step: int) -> tuple[list[Sample], dict[str, float]]:
        t0 = time.perf_counter()
        groups, metrics, stand_in = self._round(step, 0)
        if stand_in is not None:  # the simulator's rows
            return stand_in, {}
        if self.settings.dynamic_sampling:
            groups, more = self._dynamic_sampling(step, groups)
            metrics |= more
        # After the metrics' all-reduce, which every rank joins: the phase lasts as long as the
        # slowest rank's generation (a rank's own would hide the ranks it waits for later).
        metrics["time/rollout_s"] = time.perf_counter() - t0
        return [sample for group, _ in groups for sample in group], metrics

    def _round(self, step: int, round_: int):
        """One generation round of the step: ``(groups, metrics, None)``, the whole batch's
        scored groups (the same on every CP x PP peer) and their metrics; or the simulator's
        stand-in samples as ``(None, None, samples)``."""
        group_size = self.settings.group_size
        problems, prompts = self.prompts(step, round_)
        share = self.generation.share(len(problems))
        generator = self.run.rollout_generator(self.problems.generator_seed(step, self.generation.unit, round_),
                                               self.device)
        progress = RolloutProgress() if self.show_progress else None
        k, follows, adaptive = self._draft_tokens(len(problems))
        rollouts = None
        if share:
            rollouts = self.run.generate(self.engine, [prompts[i] for i in share], self.sampling_params(),
                                         samples_per_prompt=group_size, generator=generator, progress=progress,
                                         draft_tokens=k)
        if progress is not None:
            progress.close()
        stand_in = self.run.stand_in_samples([p for p in prompts for _ in range(group_size)],
                                             self.settings.max_new_tokens)
        if stand_in is not None:
            return None, None, stand_in
        groups, metrics = self._share(rollouts, [problems[i] for i in share], [prompts[i] for i in share],
                                      prompts, follows if adaptive else None)
        return groups, metrics, None

    def _dynamic_sampling(self, step: int, groups: list) -> tuple[list, dict[str, float]]:
        """DAPO's dynamic sampling over the first round's ``groups``: groups whose rewards are
        all equal are dropped, and further rounds draw the stream's next blocks until every
        data-parallel rank holds ``prompts_per_rank`` kept groups or
        ``dynamic_sampling_max_rounds`` extra rounds have run. Whether to run another round is
        decided by one all-reduce, so every rank runs the same rounds (a rank already full
        still generates its share: a round's collectives need every rank). Each rank trains on
        its first ``prompts_per_rank`` kept groups; one with none keeps a dropped group with no
        loss (every rank needs rows). The step's metrics are its first round's, plus the kept
        and dropped group counts (all rounds), the rounds run and the shortfall."""
        s, per_rank = self.settings, self.prompts_per_rank
        counted = float(self.generation.member == 0)  # one rank of those holding the same batch
        target = per_rank * self.problems.dp_degree

        def varies(group) -> bool:
            return len({sample.reward for sample in group[0]}) > 1

        kept = [g for g in groups if varies(g)]
        dropped, extra = len(groups) - len(kept), 0
        while True:
            have, = self.sync.all_reduce([min(len(kept), per_rank) * counted])
            if have >= target or extra >= s.dynamic_sampling_max_rounds:
                break
            extra += 1
            more, _, _ = self._round(step, extra)
            kept += [g for g in more if varies(g)]
            dropped += sum(not varies(g) for g in more)
        self.state.extra_prompt_rounds += extra  # the same on every rank: the stream moves on
        kept_total, dropped_total = self.sync.all_reduce([len(kept) * counted, dropped * counted])
        if not kept:
            group, details = groups[0]
            kept = [([dataclasses.replace(sample, trained=False) for sample in group], details)]
        return kept[:per_rank], {"rl/kept_groups": kept_total, "rl/dropped_groups": dropped_total,
                                 "rl/sampling_rounds": 1.0 + extra, "rl/kept_shortfall": max(target - have, 0.0)}

    def _share(self, rollouts, problems: list, prompts: list[list[int]], all_prompts: list[list[int]],
               follows: bool | None) -> tuple[list, dict[str, float]]:
        """The phase's collectives after the generation, in this order on every rank: the
        tuner's round tables summed over the job (``follows`` None: the tuner is not learning),
        this rank's scored groups of ``problems`` exchanged with its CP x PP peers for the whole
        batch of ``all_prompts`` (in problem order on every peer), and the metrics' sums."""
        if follows is not None:
            self._observe_speculation(rollouts, follows)
        groups = self.generation.exchange(self._score(problems, prompts, rollouts), len(all_prompts),
                                          self.generation.digest(all_prompts))
        samples = [sample for group, _ in groups for sample in group]
        details = [d for _, group_details in groups for d in group_details]
        # Each problem's rollouts are counted once in the sums (by the group's first member),
        # and each generation's statistics once (by its engine group's first rank).
        generated = rollouts.stats if rollouts is not None and self.generation.sends() else None
        metrics = rollout_metrics(self.sync.all_reduce, samples, details, generated, self.speculation.k_max,
                                  buckets=live_bucket(self.engine.max_batch_size) + 1,
                                  counted=self.generation.member == 0, group_size=self.settings.group_size,
                                  eos_id=self.problems.tokenizer.eos_id)
        return groups, metrics

    def _draft_tokens(self, n_problems: int) -> tuple[int, bool, bool]:
        """``(k, follows, adaptive)``: the tokens drafted per round of this call, whether the
        tuner follows its choice per round, and whether it learns from the call. The tuner's
        state is the same on every rank (what it learns is summed over the job), and so are
        the live rows an engine group's ranks see: its choices agree without a collective,
        per call and per round."""
        s, k_max = self.settings, self.speculation.k_max
        adaptive = s.adaptive and self.run.values_known and k_max > 0
        if not adaptive:
            return k_max, True, False
        if not s.per_round:
            # The job-wide first wave (the largest share), so every rank's tuner sees one bucket.
            wave = min(self.generation.max_share(n_problems) * s.group_size, self.engine.max_batch_size)
            k = self.speculation.choose_call(wave)
            return k, k > 0, True
        follows = self.speculation.start_call()
        return (self.speculation.choose_round if follows else 0), follows, True

    def _score(self, problems: list, prompts: list[list[int]], rollouts) -> list[tuple[list[Sample], list[dict]]]:
        """This rank's rollouts as GRPO groups: per problem (and its prompt), its
        ``rl.group_size`` samples (with group-normalised advantages) and the details of each
        response's reward (``ProblemStream.score``: the reward's parts, and its calls that
        failed or timed out)."""
        if rollouts is None:
            return []
        group_size = self.settings.group_size
        lengths = rollouts.response_lens.tolist()
        responses = [rollouts.tokens[i, :n].tolist() for i, n in enumerate(lengths)]
        logprobs = [rollouts.logprobs[i, :n].tolist() for i, n in enumerate(lengths)]
        texts = [self.problems.tokenizer.decode(ids) for ids in responses]
        rewards, details = self.problems.score([problems[i // group_size] for i in range(len(lengths))], texts)
        s = self.settings
        truncated = (~rollouts.finished).tolist()
        if s.overlong == "soft":  # DAPO's length penalty joins the reward (and is logged as a part)
            penalties = [overlong_penalty(n, s.max_new_tokens, s.overlong_buffer) for n in lengths]
            rewards = [r + p for r, p in zip(rewards, penalties)]
            details = [d | {"overlong_penalty": p} for d, p in zip(details, penalties)]
        advantages = group_advantages(torch.tensor(rewards), group_size, estimator=s.advantage,
                                      normalize_std=s.normalize_std)
        samples = [Sample(prompts[i // group_size], responses[i], logprobs[i], rewards[i], float(advantages[i]),
                          trained=not (s.overlong == "mask" and truncated[i]), truncated=truncated[i])
                   for i in range(len(lengths))]
        return [(samples[i:i + group_size], details[i:i + group_size]) for i in range(0, len(samples), group_size)]

    def _observe_speculation(self, rollouts, follows: bool) -> None:
        """Teach the tuner what this step's generations measured (``RoundTable``), summed over
        the job's engine groups (a collective): one call's timing is noisy, and every rank's
        tuner then holds the same numbers and makes the same choices."""
        stats = rollouts.stats if rollouts is not None and rollouts.stats.target_forwards else None
        buckets, k_max = live_bucket(self.engine.max_batch_size) + 1, self.speculation.k_max
        empty = RoundTable.empty(buckets, k_max)
        sends = stats is not None and self.generation.sends()
        table = stats.rounds if sends else empty
        count, prefill_s, *flat = self.sync.all_reduce([float(sends), stats.prefill_s if sends else 0.0,
                                                        *table.flat()])
        if count:
            self.speculation.observe(RoundTable.from_flat(flat, buckets, k_max), prefill_s / count, follows)

