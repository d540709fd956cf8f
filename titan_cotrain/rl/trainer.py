"""The RL trainer: warm start, then rollouts -> rewards -> GRPO -> co-trained update, per step.

``Trainer.__init__`` builds everything once (``parallelize``: the models built on meta,
compiled, sharded and filled; the rollout engine with its KV budget, tensor-parallel when
asked; the ``UpdateStep``, single-stage or pipeline). ``rl_step`` is the one place an RL
step's phases are written, in order: offload, refresh the engine, rollout
(``rl.rollout_phase``: generate this rank's share of its data-parallel coordinate's prompts,
score, exchange with the CP x PP peers, GRPO samples on the host), release, restore, pack,
update (``UpdateStep.step``: microbatched forward/backward with the gradients scaled by the
global counts, clipping, optimizer steps); the run mode is told each phase as it begins (the
scale simulator measures them so). ``run`` is the loop. Step ``s`` is a warm-start step for
``s <= task.sft_steps``, an RL step after, each phase on its own LR schedule; its prompts are
its block of the job's prompt stream, drawn by global position (the same at any layout), and
its sampling seeds derive from ``(debug.seed, s, dp rank)`` (``rl.problems``), so a resumed run
at the same layout repeats the uninterrupted one exactly when the drafted tokens per round are
fixed (``[rollout] adaptive_speculation = false``), and one at another layout trains on the
same prompts. Which rank holds what under FSDP, CP and PP:
``docs/DESIGN.md`` sections 4, 5 and 10.
"""
import contextlib
import os
import time
from collections.abc import Iterator

import torch

from titan_cotrain.components import titan
from titan_cotrain.data.batch import PackedBatch
from titan_cotrain.data.prompts import ChatTemplate, PromptEncoder
from titan_cotrain.engine.build import build_rollout_engine
from titan_cotrain.engine.kv_budget import kv_pool_line
from titan_cotrain.models.build import job_seed, resolve_model_args
from titan_cotrain.parallel.engine_tp import engine_tp_mesh
from titan_cotrain.parallel.parallelize import copy_shards, parallelize
from titan_cotrain.parallel.pipeline import broadcast_state_dicts
from titan_cotrain.parallel.rank_layout import describe_role, gpus_per_node, rank_layout
from titan_cotrain.rl.batching import Sample, pack_rank_batch, sequence_logratios
from titan_cotrain.rl.draft_health import AcceptanceWatch, DraftCollapseWatch
from titan_cotrain.rl.draft_vocab_setup import draft_vocab_from_generations, task_token_counts
from titan_cotrain.rl.evaluation import build_evaluation, eval_metrics, summary_line, write_result
from titan_cotrain.rl.export import export_job
from titan_cotrain.rl.generation_group import GenerationGroup
from titan_cotrain.rl.grpo import next_token_loss, ppo_loss
from titan_cotrain.rl.host_sync import HostSync
from titan_cotrain.rl.job_log import JobLog
from titan_cotrain.rl.nonfinite import SaveGuard, count_skipped_updates
from titan_cotrain.rl.offload import TrainingStateOffload, offloaded
from titan_cotrain.rl.prefit import (
    DraftPrefit,
    PrefitSettings,
    frozen_policy_loss,
    prefit_chooses_vocabulary,
    rl_offset,
    with_prefit_phase,
)
from titan_cotrain.rl.problems import ProblemStream
from titan_cotrain.rl.run_mode import RealRun
from titan_cotrain.rl.reference import reference_logprobs
from titan_cotrain.rl.rewards import RewardScorer, RewardSettings
from titan_cotrain.rl.rollout_metrics import acceptance_over_tau
from titan_cotrain.rl.rollout_phase import RolloutPhase, RolloutSettings
from titan_cotrain.rl.trainer_setup import (
    TrainerState,
    build_task,
    lr_phases,
    tokenizer_folder,
    training_device,
)
from titan_cotrain.rl.update_step import build_update_step

__all__ = ["Trainer"]

PROBE_TOKENS = 32  # the probe forward before a checkpoint or an export: a task demonstration's first tokens


class Trainer:
    """Builds everything a job config asks for; ``run()`` trains to ``task.sft_steps +
    training.steps`` steps, resuming from the latest checkpoint when there is one.

    ``mode`` (default ``RealRun()``): how the job meets its device; the scale simulator passes
    a ``titan_cotrain.simulate.Simulation`` (device values unknown: host reads answer zeros,
    rollouts are the worst case, the work is cut to what sets the peak memory).
    """

    def __init__(self, config, world_size: int, rank: int, mode: RealRun | None = None) -> None:
        self.config, self.rank, self.world_size = config, rank, world_size
        self.mode = run = mode or RealRun()
        # Which process sits at each mesh coordinate: [parallelism] rank_order.
        self.layout = layout = rank_layout(config, world_size)
        self.parallel_dims = dims = titan.build_parallel_dims(config.parallelism, world_size, layout.mesh_ranks())
        self.device = training_device()
        if world_size > 1:
            dims.build_mesh()
        self.sync = HostSync(self.device, run)
        # Context-parallel and pipeline peers train the same rows: they draw the same prompts
        # (everything random is keyed by dp rank) and share out their generation.
        self.dp_degree = dims.dp_replicate * dims.dp_shard
        self.dp_rank = dims.get_mesh("batch").get_local_rank() if dims.dp_enabled else 0
        self.seed = job_seed(config)
        self.tokenizer_folder = folder = tokenizer_folder(config, run.tokenizer_fallback)
        self.tokenizer = titan.load_tokenizer(folder)
        self.encode_prompt = PromptEncoder(self.tokenizer,
                                           ChatTemplate.from_folder(folder) if config.task.chat_template else None,
                                           config.task.system_prompt, config.task.chat_template_kwargs)
        ro = config.rollout
        # The engine's positions per sequence; what a prompt may take of them.
        max_seq_len = ro.max_prompt_tokens + ro.max_new_tokens if ro.max_prompt_tokens else config.training.seq_len
        self.task, prompts = build_task(config, self.encode_prompt, max_seq_len - ro.max_new_tokens, self.seed, run)
        # The reward's worker processes, if any, start now and last the job (the simulator scores nothing).
        self.scorer = RewardScorer(self.task, RewardSettings.from_config(config.task))
        if run.values_known:
            self.scorer.start()
        self.problems = ProblemStream(self.task, self.tokenizer, self.encode_prompt, self.seed, self.dp_rank,
                                      self.dp_degree, self.scorer)
        self.prefit_settings = PrefitSettings.from_config(config)
        self.rl_offset = rl_offset(config)  # RL step n is job step rl_offset + n
        self.total_steps = self.rl_offset + config.training.steps
        self.prompts_per_rank = config.rl.prompts_per_step // self.dp_degree

        vocab = resolve_model_args(config).vocab_size
        if self.tokenizer.get_vocab_size() > vocab:
            raise ValueError(f"tokenizer has {self.tokenizer.get_vocab_size()} tokens but the model's vocabulary "
                             f"is {vocab}")
        counts = None
        if config.draft.enable and config.draft.vocab_size and not config.draft.init_path:
            # Building needs the maps' shapes only: where their values come later (from the
            # policy's generations, once it is filled) or do not matter (unknown), every id
            # counts once.
            later = not run.values_known or config.draft.vocab_generations or prefit_chooses_vocabulary(config)
            counts = (torch.ones(vocab, dtype=torch.int64) if later
                      else task_token_counts(self.problems, config.draft.vocab_samples, vocab))
        models = parallelize(config, dims, world_size, self.device, policy_loss_fn=next_token_loss,
                             token_counts=counts, fill=run.values_known)
        self.policy, self.draft, self.reference, self.pipeline = (models.policy, models.draft, models.reference,
                                                                  models.pipeline)
        self.log_rank = 0
        if self.pipeline is not None:  # the last stage's rank of data-parallel and CP coordinate 0
            self.log_rank = layout.rank(self.pipeline.plan.stage_ranks[-1], 0, 0)
        self.log = JobLog(config, active=rank == self.log_rank, writes=run.values_known)
        self.cotrain = config.draft.enable  # under PP, self.draft is None off the last stage
        self.generation = GenerationGroup(layout, rank, config.rollout.split_prompts,
                                          dp_rank=self.dp_rank, communicate=run.values_known,
                                          tensor_parallel=config.rollout.tensor_parallel_degree)
        self.engine_mesh = None
        if config.rollout.tensor_parallel_degree > 1:
            self.engine_mesh = engine_tp_mesh(self.device.type, self.generation.engine_groups())
            nodes = self.generation.nodes_spanned(gpus_per_node(config))
            if nodes > 1 and rank == 0:
                print(f"warning: an engine group of [rollout] tensor_parallel_degree = "
                      f"{config.rollout.tensor_parallel_degree} spans {nodes} nodes in the {layout.order} rank layout "
                      "([parallelism] rank_order): its all-reduces cross nodes", flush=True)
        rollout_settings = RolloutSettings.from_config(config)
        self.engine, kv_cache = build_rollout_engine(
            config, models, self.device, run, prompts=self.generation.max_share(self.prompts_per_rank),
            max_seq_len=max_seq_len, draft_tokens=rollout_settings.draft_tokens, tp_mesh=self.engine_mesh)
        if ro.kv_cache_gib == "auto":
            self.log.say(kv_pool_line(self.engine, kv_cache))
        self.state = TrainerState(self.dp_degree * config.task.sft_batch_size, config.task.sft_steps)
        self.rollouts = RolloutPhase(rollout_settings, self.engine, self.generation, self.problems, self.sync, run,
                                     self.device, self.prompts_per_rank, show_progress=rank == self.log_rank,
                                     state=self.state)
        self.acceptance_watch = AcceptanceWatch(ro.acceptance_warning_fraction, ro.acceptance_warning_steps)
        self.collapse_watch = DraftCollapseWatch(ro.collapse_fraction, ro.collapse_position_rate, ro.collapse_steps)
        if config.rollout.speculative and not config.draft.enable:
            self.log.say("note: [draft] enable = false: rollouts decode plainly ([rollout] speculative ignored)")
        self.evaluation = build_evaluation(self)  # None without [eval] enable
        self.prefit, self._prefit_engine_ready = None, False
        if self.prefit_settings.steps:
            self.prefit = DraftPrefit(self.prefit_settings, self.engine, self.generation, self.problems, self.sync,
                                      run, self.device, self.state, show_progress=rank == self.log_rank)
        if (config.draft.vocab_generations or prefit_chooses_vocabulary(config)) and run.values_known:
            responses = None
            if prefit_chooses_vocabulary(config):
                # The prefit's first generations choose the vocabulary, then train the draft
                # (kept for its first step): nothing is generated twice.
                if self.pipeline is not None:
                    self.refresh_engine()
                responses = self.prefit.generate_first()
            draft_vocab_from_generations(config, self.problems, self.engine, self.rollouts.sampling_params(),
                                         self.draft, refresh_engine=self.refresh_engine if self.pipeline else None,
                                         responses=responses)
        self.policy_opt = titan.build_optimizers([self.policy], config.optimizer, self.parallel_dims)
        self.policy_lr = titan.build_lr_schedulers(self.policy_opt, lr_phases(
            config, config.task.sft_lr or config.optimizer.lr, config.optimizer.lr))
        self.draft_opt = self.draft_lr = None
        states = {}
        if self.draft is not None:
            self.draft_opt = titan.build_optimizers([self.draft], config.optimizer, self.parallel_dims)
            self.draft_lr = titan.build_lr_schedulers(self.draft_opt, with_prefit_phase(config, lr_phases(
                config, config.draft.sft_lr or config.draft.lr, config.draft.lr)))
            states = {"draft": titan.model_stateful(self.draft), "draft_optimizer": self.draft_opt,
                      "draft_lr_scheduler": self.draft_lr}
        if self.reference is not None:
            states["reference"] = titan.model_stateful(self.reference)
        self.update = build_update_step(config, models, self.policy_opt, self.draft_opt, self.device, run)
        rl = config.rl
        self.rl_loss = ppo_loss(rl.clip_eps_low, rl.clip_eps_high, rl.kl_coef, ro.temperature, rl.tis_cap,
                                aggregation=rl.loss_aggregation, ratio_level=rl.ratio_level,
                                max_new_tokens=ro.max_new_tokens)
        self.train_draft_in_rl = self.cotrain and not config.draft.freeze_after_sft
        states["trainer"], states["speculation"] = self.state, self.rollouts.speculation
        # Checkpoints written before the warm start's position and the tuner were saved still load.
        partial = {"trainer": "the warm start's prompt positions follow from the step at this layout",
                   "speculation": "the speculation tuner starts fresh"}
        self.checkpointer = titan.build_checkpointer(config.checkpoint, config.job.dump_folder, self.policy,
                                                     self.policy_opt, self.policy_lr, states, partial, self.log.say)
        self.offload = None
        if config.rollout.offload_training_state:
            parts = self.pipeline.model_parts if self.pipeline is not None else []
            self.offload = TrainingStateOffload([self.policy, self.draft, self.reference, *parts],
                                                [self.policy_opt, self.draft_opt], self.device,
                                                copy=run.values_known)
        self.guard = SaveGuard(self.device, self._probe_tokens, active=run.values_known)
        if prompts is not None and run.values_known:
            self.log.say(f"task {config.task.name}: {prompts.summary()}")

    def _probe_tokens(self) -> list[int]:
        """The probe of ``SaveGuard``: the first ``PROBE_TOKENS`` tokens of the stream's first demonstration."""
        prompt, response = self.problems.demonstration(0)
        return (prompt + response)[:PROBE_TOKENS]

    @property
    def role(self) -> str:
        """Where this rank sits in the mesh (for reports): ``rank_layout.describe_role``."""
        return describe_role(self.parallel_dims, self.pipeline.plan if self.pipeline is not None else None)

    # ---------------------------------------------------------------- steps
    def draft_seed(self, step: int) -> int:
        """The seed of a block drafter's random anchors at ``step`` on this rank: a function of
        the job's seed, the step and the data-parallel rank (the ranks of a CP group share a
        batch and draw its anchors together), so a resumed step draws what it drew before."""
        return (self.seed * 1_000_003 + step) * 1024 + self.dp_rank

    def sft_step(self, step: int) -> dict[str, float]:
        """Warm start: next-token training of the policy on demonstrations (this rank's part of
        the prompt stream's next block), draft co-trained."""
        samples = []
        for position in self.problems.positions(self.state.warm_start_block(), self.config.task.sft_batch_size):
            prompt, response = self.problems.demonstration(position)
            samples.append(Sample(prompt, response, [0.0] * len(response), 0.0))
        batch = pack_rank_batch(samples, self.config, self.sync, step)
        batch.advantages = batch.old_logprobs = batch.inv_lens = None
        return self.update.step(batch, next_token_loss, train_draft=self.cotrain, warm_start=True,
                                seed=self.draft_seed(step))

    def prefit_step(self, step: int) -> dict[str, float]:
        """A draft-only step of the prefit (``rl.prefit``), its phases named for the run mode
        as ``prefit <phase>``: ``refresh`` the engine's copies (at the first prefit step a
        process runs: the policy does not change in the prefit, and plain decoding does not
        read the draft), ``generate`` the policy's responses to the step's prompts, ``release``
        the engine when ``[rollout] release_between_rollouts``, ``pack`` them, ``update`` the
        draft alone (the policy's optimizer does not step); ``offload`` and ``restore`` as in
        ``rl_step``."""
        phase = self.mode.phase
        with offloaded(self.offload, phase) as parameters_away:
            with phase("prefit refresh"):
                if not self._prefit_engine_ready:
                    self.refresh_engine()
                    self._prefit_engine_ready = True
                parameters_away()
            with phase("prefit generate"):
                samples, metrics = self.prefit(step)
            with phase("prefit release"):
                if self.config.rollout.release_between_rollouts:
                    self.engine.release()
                    self._prefit_engine_ready = False
        with phase("prefit pack"):
            batch = pack_rank_batch(samples, self.config, self.sync, step)
            batch.advantages = batch.old_logprobs = batch.inv_lens = None
        with phase("prefit update"):
            metrics |= self.update.step(batch, frozen_policy_loss, train_draft=True, warm_start=True,
                                        train_policy=False, seed=self.draft_seed(step))
        return metrics

    def rl_step(self, step: int) -> dict[str, float]:
        """One RL step. This is the one place its phases and their order are written; the run
        mode (``mode.phase``) is told as each begins, which is how the scale simulator measures
        every phase of the step the trainer takes:

        ``offload`` the gradients and optimizers' state leave the device
        (``[rollout] offload_training_state``); ``refresh`` the engine's copies <- the trained
        weights, then the parameters leave too; ``eval`` (``[eval]``, when due) the policy of
        the step before is evaluated on the refreshed engine; ``rollout`` this step's prompts are generated,
        scored and exchanged (``RolloutPhase``); ``release`` the engine's weights and pool are
        freed (``[rollout] release_between_rollouts``); ``restore`` the training state comes
        back; ``pack`` the samples become rows, with the KL reference's log-probs (the
        reference is the policy RL starts from: copied at the first RL step); ``update``.
        """
        phase = self.mode.phase
        t0 = time.perf_counter()
        with offloaded(self.offload, phase) as parameters_away:
            with phase("refresh"):
                self.refresh_engine()
                t_refresh = time.perf_counter() - t0
                parameters_away()  # the refresh has read them; the rollout does not
            if self.evaluation is not None and self.evaluation.settings.due(step - 1):
                with phase("eval"):
                    self.evaluate(step - 1)
            with phase("rollout"):
                samples, metrics = self.rollouts(step)
            with phase("release"):
                if self.config.rollout.release_between_rollouts:
                    self.engine.release()
        if self.offload is not None:
            metrics |= {"time/offload_s": self.offload.seconds, "memory/offloaded_gib": self.offload.host_bytes / 2**30}
        with phase("pack"):
            if self.reference is not None and step == self.rl_offset + 1:
                copy_shards(self.policy, self.reference)
            batch = self.pack(samples, step)
        with phase("update"):
            t1 = time.perf_counter()
            metrics |= self.update.step(batch, self.rl_loss, train_draft=self.train_draft_in_rl, warm_start=False,
                                        seed=self.draft_seed(step))
            metrics["time/train_s"] = time.perf_counter() - t1
        metrics |= acceptance_over_tau(metrics, sampled=self.config.rollout.temperature > 0)
        metrics |= self.collapse_watch.judge(metrics)
        metrics["time/refresh_s"] = t_refresh
        return metrics

    def pack(self, samples: list[Sample], step: int) -> PackedBatch:
        """``samples`` packed into this rank's rows (``pack_rank_batch``), with the KL
        reference's log-probs when ``[rl] kl_coef`` asks for them and, for GSPO's sequence
        ratio (``[rl] ratio_level = "sequence"``), each response's mean log-ratio of the policy
        as the update starts to the behaviour (one no-grad forward of the policy)."""
        batch = pack_rank_batch(samples, self.config, self.sync, step)
        temperature = self.config.rollout.temperature
        if self.reference is not None:
            batch.ref_logprobs = reference_logprobs(self.reference, batch, self.device, temperature)
        if self.config.rl.ratio_level == "sequence":
            batch.seq_logratios = sequence_logratios(
                batch, reference_logprobs(self.policy, batch, self.device, temperature))
        return batch

    def evaluate(self, step: int, stem: str | None = None, log: bool = True, models: str | None = None
                 ) -> dict | None:
        """``rl.evaluation``'s result for the engine's current weights, taken as the policy
        after job step ``step`` (every rank calls it; None on a simulated device): written to
        ``<dump_folder>/eval/<stem>.json`` (default ``eval_step<step>``) and printed by the
        logging rank, and with ``log`` logged under ``eval/`` (TensorBoard, ``metrics.jsonl``).
        ``models``: where the weights came from (default: the job's checkpoint folder)."""
        result = self.evaluation(step)
        if result is None:
            return None
        result = {"config": str(self.config.job.config_file), "models": models or getattr(self.checkpointer, "folder", None),
                  **result}
        if self.rank == self.log_rank:
            result["json"] = write_result(result, os.path.join(self.config.job.dump_folder, "eval"),
                                          stem or f"eval_step{step}")
            line = summary_line(result)
            if log:
                self.log.eval(step, eval_metrics(result), line)
            else:
                print(line, flush=True)
        return result

    def refresh_engine(self) -> None:
        """The rollout engine's models <- the trained weights (a collective: every rank
        calls it; FSDP shards are gathered one tensor at a time, PP stages broadcast)."""
        if self.pipeline is not None:
            self.engine.restore()  # the streamed state takes the engine's shapes
            self.engine.load_weights(*broadcast_state_dicts(self.pipeline, self.engine.policy, self.engine.draft))
        else:
            self.engine.load_weights(self.policy.state_dict(),
                                     self.draft.state_dict() if self.draft is not None else None)

    def checkpoint_state_dicts(self) -> dict:
        """What a checkpoint save reads from every ``Stateful`` (the simulator's checkpoint call)."""
        return {key: value.state_dict() for key, value in self.checkpointer.states.items() if value is not None}

    # ------------------------------------------------------------------ run
    def run(self) -> None:
        cfg = self.config
        self.checkpointer.load(step=cfg.checkpoint.load_step)
        if self.state.step:
            self.log.say(f"resumed from step {self.state.step}")
        while self.state.step < self.total_steps:
            step = self.state.step + 1
            t0 = time.perf_counter()
            kind = "sft" if step <= cfg.task.sft_steps else "prefit" if self.prefit_settings.holds(step) else "rl"
            metrics = {"sft": self.sft_step, "prefit": self.prefit_step, "rl": self.rl_step}[kind](step)
            metrics["lr/policy"] = self.policy_lr.schedulers[0].get_last_lr()[0]
            if kind != "prefit":  # the prefit leaves the policy's schedule where it was
                self.policy_lr.step()
            if self.draft_lr is not None:
                metrics["lr/draft"] = self.draft_lr.schedulers[0].get_last_lr()[0]
                self.draft_lr.step()
            metrics["time/step_s"] = time.perf_counter() - t0
            metrics |= titan.device_memory_stats()
            self.state.step = step
            self.log.step(step, kind, metrics)
            for watch in (self.acceptance_watch, self.collapse_watch):  # every rank keeps the counts
                warning = watch.observe(step, metrics)
                if warning:
                    self.log.say(f"warning: {warning}")
            count_skipped_updates(self.state, step, metrics, cfg.training.max_nonfinite_steps,
                                  last_step=step == self.total_steps, announce=self.log.say)
            if titan.checkpoint_due(self.checkpointer, step, last_step=step == self.total_steps):
                self._check_usable(f"the checkpoint of step {step}")
            self.checkpointer.save(step, last_step=step == self.total_steps)
        settings = self.evaluation.settings if self.evaluation is not None else None
        if settings is not None and (settings.at_end or settings.due(self.state.step)):
            with self._refreshed_engine():
                self.evaluate(self.state.step)
        self.checkpointer.close()
        self.scorer.close()
        if self.evaluation is not None:
            self.evaluation.close()
        self.export()
        self.log.close()

    def _check_usable(self, what: str) -> None:
        """Refuse to write ``what`` (a checkpoint) unless every rank's training shards are finite
        and the probe forward through the models is (on the rollout engine's whole copies,
        refreshed for it: the next step refreshes them anyway)."""
        self.guard.weights(what, self.policy, self.draft, self.reference)
        if self.guard.active:
            with self._refreshed_engine():
                self.guard.probe(what, self.engine.policy, self.engine.draft)

    @contextlib.contextmanager
    def _refreshed_engine(self) -> Iterator[None]:
        """The engine refreshed outside a step (a checkpoint's probe, the final evaluation): its
        pool beside the parameters only (the rest of the training state offloaded, when
        ``[rollout] offload_training_state``), released after when ``release_between_rollouts``."""
        with offloaded(self.offload):
            self.refresh_engine()
            yield
            if self.config.rollout.release_between_rollouts:
                self.engine.release()

    def export(self) -> None:
        """Write the final policy and draft to ``<dump_folder>/export`` (``rl.export``)."""
        export_job(self)
