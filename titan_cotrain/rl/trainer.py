"""The RL trainer: warm start, then rollouts -> rewards -> GRPO -> co-trained update, per step.

``Trainer.__init__`` builds everything once (``parallelize``: the models built on meta,
compiled, sharded and filled; the rollout engine with its KV budget, tensor-parallel when
asked). A step is a rollout phase (``rollout_phase``: refresh the engine, generate this rank's
share of its data-parallel coordinate's prompts, score, exchange with the CP x PP peers, GRPO
samples on the host) and an update phase (``update_phase``: pack, microbatched
forward/backward with the gradients scaled by the global counts, clipping, optimizer steps;
under PP one ``pipeline_step`` per minibatch); ``run`` is the loop. Step ``s`` is a warm-start
step for ``s <= task.sft_steps``, an RL step after, each phase on its own LR schedule; its
prompts and sampling seeds derive from ``(debug.seed, s, dp rank)``, so a resumed run repeats
the uninterrupted one exactly when the drafted tokens per round are fixed
(``[rollout] adaptive_speculation = false``). Which rank holds what under FSDP, CP and PP:
``docs/DESIGN.md`` sections 4, 5 and 10.
"""
import contextlib
import json
import os
import random
import time

import torch
import torch.distributed as dist

from titan_cotrain.components import titan
from titan_cotrain.config import resolve_model_args
from titan_cotrain.config.validate import rollout_draft_tokens
from titan_cotrain.cotrain.step import PackedBatch, clip_grad_norms, forward_backward, step_optimizers
from titan_cotrain.cotrain.vocab import chunked_token_logprobs
from titan_cotrain.data.packing import layout_from_document_ids
from titan_cotrain.data.prompts import ChatTemplate, PromptEncoder
from titan_cotrain.models.build import job_seed
from titan_cotrain.parallel.engine_tp import engine_tp_mesh
from titan_cotrain.parallel.parallelize import copy_shards, parallelize
from titan_cotrain.parallel.pipeline import gather_state_dict, pipeline_step
from titan_cotrain.parallel.pipeline import clip_grad_norms as pipeline_clip_grad_norms
from titan_cotrain.parallel.rank_layout import gpus_per_node, rank_layout
from titan_cotrain.rl.batching import Sample, pack_samples
from titan_cotrain.rl.draft_health import DraftCollapseWatch
from titan_cotrain.rl.draft_vocab import draft_vocab_from_generations, task_token_counts
from titan_cotrain.rl.export import export_job
from titan_cotrain.rl.generation_group import GenerationGroup
from titan_cotrain.rl.grpo import group_advantages, next_token_loss, ppo_loss
from titan_cotrain.rl.nonfinite import NonfiniteStop, NonfiniteWeights, all_finite, forward_is_finite, nonfinite_flags
from titan_cotrain.rl.kv_budget import KVBudget, kv_cache_setting, kv_pool_line
from titan_cotrain.rl.offload import TrainingStateOffload
from titan_cotrain.rl.progress import RolloutProgress, step_line
from titan_cotrain.rl.rollout import RolloutEngine
from titan_cotrain.rl.rollout_metrics import AcceptanceWatch, acceptance_over_tau, rollout_metrics
from titan_cotrain.rl.rollout_state import RoundTable, live_bucket
from titan_cotrain.rl.sampling import SamplingParams
from titan_cotrain.rl.speculation import SpeculationTuner
from titan_cotrain.rl.tasks import score
from titan_cotrain.rl.trainer_setup import TrainerState, build_task, lr_phases, tokenizer_folder, training_device

__all__ = ["Trainer"]

PROBE_TOKENS = 32  # the probe forward before a checkpoint or an export: a task demonstration's first tokens


class Trainer:
    """Builds everything a job config asks for; ``run()`` trains to ``task.sft_steps +
    training.steps`` steps, resuming from the latest checkpoint when there is one.

    ``simulation`` (the ``[simulate]`` section, set by the scale simulator only): the same
    code on the simulated accelerator, whose device values are unknown, so host reads
    answer zeros and rollouts are the worst case (see ``titan_cotrain.simulate``).
    """

    def __init__(self, config, world_size: int, rank: int, simulation=None) -> None:
        self.config, self.rank, self.world_size = config, rank, world_size
        self.simulation = simulation
        # Which process sits at each mesh coordinate: [parallelism] rank_order.
        self.layout = layout = rank_layout(config, world_size)
        self.parallel_dims = dims = titan.build_parallel_dims(config.parallelism, world_size, layout.mesh_ranks())
        self.device = training_device()
        if world_size > 1:
            dims.build_mesh()
        # Context-parallel and pipeline peers train the same rows: they draw the same prompts
        # (everything random is keyed by dp rank) and share out their generation.
        self.dp_degree = dims.dp_replicate * dims.dp_shard
        self.dp_rank = dims.get_mesh("batch").get_local_rank() if dims.dp_enabled else 0
        self.seed = job_seed(config)
        self.tokenizer_folder = folder = tokenizer_folder(config, simulation)
        self.tokenizer = titan.load_tokenizer(folder)
        self.encode_prompt = PromptEncoder(self.tokenizer,
                                           ChatTemplate.from_folder(folder) if config.task.chat_template else None,
                                           config.task.system_prompt)
        ro = config.rollout
        # The engine's positions per sequence; what a prompt may take of them.
        max_seq_len = ro.max_prompt_tokens + ro.max_new_tokens if ro.max_prompt_tokens else config.training.seq_len
        self.task, prompts = build_task(config, self.encode_prompt, max_seq_len - ro.max_new_tokens, self.seed,
                                        simulation)
        self.total_steps = config.task.sft_steps + config.training.steps
        self.prompts_per_rank = config.rl.prompts_per_step // self.dp_degree

        vocab = resolve_model_args(config).vocab_size
        if self.tokenizer.get_vocab_size() > vocab:
            raise ValueError(f"tokenizer has {self.tokenizer.get_vocab_size()} tokens but the model's vocabulary "
                             f"is {vocab}")
        counts = None
        if config.draft.enable and config.draft.vocab_size and not config.draft.init_path:
            # Building needs the maps' shapes only: where their values come later (from the
            # policy's generations, once it is filled) or do not matter (simulated), every id
            # counts once.
            later = simulation is not None or config.draft.vocab_generations
            counts = torch.ones(vocab, dtype=torch.int64) if later else task_token_counts(self)
        models = parallelize(config, dims, world_size, self.device, policy_loss_fn=next_token_loss,
                             token_counts=counts, fill=simulation is None)
        self.policy, self.draft, self.reference, self.pipeline = (models.policy, models.draft, models.reference,
                                                                  models.pipeline)
        self.prepare_microbatch = models.prepare_microbatch  # under CP: this rank's zigzag shard
        self.log_rank = 0
        if self.pipeline is not None:  # the last stage's rank of data-parallel and CP coordinate 0
            self.log_rank = layout.rank(self.pipeline.plan.stage_ranks[-1], 0, 0)
        self.cotrain = config.draft.enable  # under PP, self.draft is None off the last stage
        self.generation = GenerationGroup(layout, rank, config.rollout.split_prompts,
                                          dp_rank=self.dp_rank, communicate=simulation is None,
                                          tensor_parallel=config.rollout.tensor_parallel_degree)
        self.engine_mesh = None
        if config.rollout.tensor_parallel_degree > 1:
            self.engine_mesh = engine_tp_mesh(self.device.type, self.generation.engine_groups())
            nodes = self.generation.nodes_spanned(gpus_per_node(config))
            if nodes > 1 and rank == 0:
                print(f"warning: an engine group of [rollout] tensor_parallel_degree = "
                      f"{config.rollout.tensor_parallel_degree} spans {nodes} nodes in the {layout.order} rank layout "
                      "([parallelism] rank_order): its all-reduces cross nodes", flush=True)
        engine_prompts = self.generation.max_share(self.prompts_per_rank)
        rows = max(engine_prompts * config.rl.group_size, 1)
        kv_cache = kv_cache_setting(
            config, [self.policy, self.draft, self.reference, *(self.pipeline.model_parts if self.pipeline else [])],
            self.device, models.engine_policy.args, rows=rows, prompts=engine_prompts,
            prompt_tokens=max_seq_len - ro.max_new_tokens, draft_tokens=rollout_draft_tokens(config),
            n_taps=len(models.engine_policy.tap_layers) if models.engine_draft is not None else 0,
            simulated_gib=simulation.gpu_memory_gib if simulation is not None else None)
        if self.engine_mesh is not None and isinstance(kv_cache, KVBudget):
            kv_cache = kv_cache.agreed(self.engine_mesh.get_group(), self.device)  # one schedule per engine group
        self.engine = RolloutEngine.from_models(
            models.engine_policy, models.engine_draft, device=self.device, max_batch_size=rows,
            max_seq_len=max_seq_len,
            max_draft_tokens=rollout_draft_tokens(config),
            kv_cache_gib=kv_cache, block_size=config.rollout.kv_block_size,
            paged=config.rollout.paged, load=models.engine_loadable, tp_mesh=self.engine_mesh,
            compile=config.rollout.compile,
        )
        if ro.kv_cache_gib == "auto" and rank == self.log_rank:
            print(kv_pool_line(self.engine, kv_cache), flush=True)
        self.speculation = SpeculationTuner(self.draft_tokens)
        self.acceptance_watch = AcceptanceWatch(ro.acceptance_warning_fraction, ro.acceptance_warning_steps)
        self.collapse_watch = DraftCollapseWatch(ro.collapse_fraction, ro.collapse_position_rate, ro.collapse_steps)
        if config.rollout.speculative and not config.draft.enable and rank == self.log_rank:
            print("note: [draft] enable = false: rollouts decode plainly ([rollout] speculative ignored)", flush=True)
        if config.draft.vocab_generations and simulation is None:
            draft_vocab_from_generations(self)
        self.policy_opt = titan.build_optimizers([self.policy], config.optimizer, self.parallel_dims)
        self.policy_lr = titan.build_lr_schedulers(self.policy_opt, lr_phases(
            config, config.task.sft_lr or config.optimizer.lr, config.optimizer.lr))
        self.draft_opt = self.draft_lr = None
        states = {}
        if self.draft is not None:
            self.draft_opt = titan.build_optimizers([self.draft], config.optimizer, self.parallel_dims)
            self.draft_lr = titan.build_lr_schedulers(self.draft_opt, lr_phases(
                config, config.draft.sft_lr or config.draft.lr, config.draft.lr))
            states = {"draft": titan.model_stateful(self.draft), "draft_optimizer": self.draft_opt,
                      "draft_lr_scheduler": self.draft_lr}
        if self.reference is not None:
            states["reference"] = titan.model_stateful(self.reference)
        self.state = TrainerState()
        states["trainer"] = self.state
        self.checkpointer = titan.build_checkpointer(config.checkpoint, config.job.dump_folder, self.policy,
                                                     self.policy_opt, self.policy_lr, states)
        self.offload = None
        if config.rollout.offload_training_state:
            parts = self.pipeline.model_parts if self.pipeline is not None else []
            self.offload = TrainingStateOffload([self.policy, self.draft, self.reference, *parts],
                                                [self.policy_opt, self.draft_opt], self.device,
                                                copy=simulation is None)
        self.tb = None
        if simulation is None and rank == self.log_rank:
            if prompts is not None:
                print(f"task {config.task.name}: {prompts.summary()}", flush=True)
            os.makedirs(config.job.dump_folder, exist_ok=True)
            if config.metrics.enable_tensorboard:
                self.tb = titan.tensorboard_logger(os.path.join(config.job.dump_folder,
                                                                config.metrics.save_tb_folder))

    @property
    def role(self) -> str:
        """``"pp stage s / dp d / cp c"``: where this rank sits in the mesh (for reports)."""
        dims, parts = self.parallel_dims, []
        if self.pipeline is not None:
            parts.append(f"pp stages {self.pipeline.plan.stages_of(dims.get_mesh('pp').get_local_rank())}")
        if dims.dp_enabled:
            parts.append(f"dp {self.dp_rank}/{self.dp_degree}")
        if dims.cp_enabled:
            parts.append(f"cp {dims.get_mesh('cp').get_local_rank()}/{dims.cp}")
        return ", ".join(parts) or "single"

    # ----------------------------------------------------------------- data
    def rng(self, step: int, salt: str) -> random.Random:
        return random.Random(f"{self.seed}/{step}/{self.dp_rank}/{salt}")

    def stream_positions(self, index: int, per_rank: int) -> range:
        """This data-parallel rank's places in the job's stream of problems at the ``index``-th
        step of a phase (warm start or RL): the phase's steps take consecutive slices of the
        stream, the DP ranks consecutive parts of each (so a dataset task's epoch goes to
        the ranks without repeats; CP and PP peers share theirs)."""
        first = (index * self.dp_degree + self.dp_rank) * per_rank
        return range(first, first + per_rank)

    def demonstration(self, rng: random.Random, position: int | None = None) -> tuple[list[int], list[int]]:
        """A task sample's prompt and demonstration response, as token ids (``position``: as
        in ``Task.sample``)."""
        problem = self.task.sample(rng, position)
        response = self.tokenizer.encode(self.task.demonstration(problem, rng), add_bos=False, add_eos=True)
        return self.encode_prompt(problem.prompt), response

    def _to_host(self, values: dict[str, torch.Tensor | float]) -> dict[str, float]:
        """Device scalars -> floats in one transfer (the step's one host sync for metrics).
        Simulated: the values are unknown, every one reads 0."""
        names = list(values)
        if not names:
            return {}
        if self.simulation is not None:
            return dict.fromkeys(names, 0.0)
        flat = torch.stack([torch.full((), values[k], dtype=torch.float32, device=self.device)
                            if not isinstance(values[k], torch.Tensor) else values[k].float().reshape(())
                            for k in names])
        return dict(zip(names, flat.tolist()))

    def _all_reduce(self, values: list[float], op=dist.ReduceOp.SUM) -> list[float]:
        """Host numbers summed (or maxed) over every rank, through one device collective."""
        t = torch.tensor(values, dtype=torch.float64).to(self.device)
        if dist.is_initialized():
            dist.all_reduce(t, op=op)
        return list(self._to_host({str(i): v for i, v in enumerate(t)}).values())

    def _pack(self, samples: list[Sample]) -> PackedBatch:
        """Pack this rank's samples on the host (in the CP layout under CP); every rank ends up
        with the same number of rows (FSDP's and the pipeline's collectives need the same
        number of forwards everywhere). The batch stays on the host: the update moves each
        microbatch to the device after computing its attention metadata."""
        cp = self.parallel_dims.cp
        batch = error = None
        try:
            batch = pack_samples(samples, self.config.training.seq_len, pad_id=0,
                                 rows_multiple_of=self.config.rl.updates_per_step, pad_to=2 * cp if cp > 1 else 1)
        except ValueError as e:  # nothing trainable on this rank
            error = str(e)
        self._stop_if_any_rank_failed(error)
        rows = batch.tokens.shape[0]
        most = self._all_reduce([rows], dist.ReduceOp.MAX)[0]
        most = rows if self.simulation is not None else int(most)
        extra = most - rows
        if extra:
            batch = batch.map(lambda t: torch.cat([t, t.new_zeros(extra, t.shape[1])]))
        return batch

    def _stop_if_any_rank_failed(self, error: str | None) -> None:
        """Every rank calls this with its own ``error`` (None: fine). If any rank has one,
        all raise the same ``ValueError`` naming the failing ranks, so no rank is left
        waiting at the next collective for one that has stopped."""
        failed = bool(self._all_reduce([float(error is not None)], dist.ReduceOp.MAX)[0]) if dist.is_initialized() \
            else error is not None
        errors = [error]
        if failed and dist.is_initialized():
            errors = [None] * dist.get_world_size()
            dist.all_gather_object(errors, error)
        if failed:
            raise ValueError(f"step {self.state.step + 1}: "
                             + "; ".join(f"rank {r}: {e}" for r, e in enumerate(errors) if e))

    # ---------------------------------------------------------------- steps
    def _pad_to_schedule(self, minibatch: PackedBatch) -> PackedBatch:
        """Under PP: empty rows (loss mask 0) up to a multiple of one schedule step's rows."""
        per_step = self.pipeline.n_microbatches * self.pipeline.microbatch_size
        extra = -minibatch.tokens.shape[0] % per_step
        return minibatch.map(lambda t: torch.cat([t, t.new_zeros(extra, t.shape[1])])) if extra else minibatch

    def _update(self, batch: PackedBatch, loss_fn, train_draft: bool) -> dict[str, float]:
        """One or more optimizer updates (``rl.updates_per_step`` minibatches of rows). Without
        PP each minibatch runs in microbatches of ``training.local_batch_size`` rows whose
        gradients accumulate into one update; under PP a minibatch is padded to whole
        schedule steps, which accumulate into its update. An update whose loss or gradient
        norm is not finite on any rank is skipped for that model (``nonfinite/*``: the
        fraction of this step's updates skipped)."""
        cfg = self.config
        n = cfg.rl.updates_per_step if batch.advantages is not None else 1
        sim = self.simulation
        metrics: dict[str, float] = {}
        draft = self.draft if train_draft else None
        for chunk in range(n):
            rows = slice(chunk * batch.tokens.shape[0] // n, (chunk + 1) * batch.tokens.shape[0] // n)
            minibatch = batch.map(lambda t: t[rows])
            if self.pipeline is None:
                out = forward_backward(self.policy, draft, minibatch, loss_fn, ttt_steps=cfg.draft.ttt_steps,
                                       pass_decay=cfg.draft.pass_decay, draft_loss_weight=cfg.draft.loss_weight,
                                       draft_loss_on=cfg.draft.loss_on, prepare=self.prepare_microbatch,
                                       device=self.device,
                                       microbatch_rows=cfg.training.local_batch_size,
                                       max_microbatches=sim.microbatches if sim is not None else None)
                out |= clip_grad_norms(self.policy, draft, cfg.training.max_norm, cfg.draft.grad_clip)
            else:
                minibatch = self._pad_to_schedule(minibatch)
                if sim is not None:  # one schedule step: memory repeats from one to the next
                    minibatch = minibatch.map(lambda t: t[:self.pipeline.n_microbatches * self.pipeline.microbatch_size])
                out = pipeline_step(self.pipeline, minibatch, policy_loss_fn=loss_fn, train_draft=train_draft)
                out |= pipeline_clip_grad_norms(self.pipeline, cfg.training.max_norm, cfg.draft.grad_clip,
                                                train_draft=train_draft)
            host = self._to_host(out | nonfinite_flags(out, self.device))
            step_optimizers(self.policy_opt, self.draft_opt if train_draft else None,
                            step_policy=not host["nonfinite/policy"], step_draft=not host["nonfinite/draft"])
            for key, value in host.items():  # the mean over minibatches
                metrics[key] = metrics.get(key, 0.0) + value / n
            if sim is not None:
                break
        return metrics

    def sft_step(self, step: int) -> dict[str, float]:
        """Warm start: next-token training of the policy on demonstrations, draft co-trained."""
        rng = self.rng(step, "sft")
        samples = []
        for position in self.stream_positions(step - 1, self.config.task.sft_batch_size):
            prompt, response = self.demonstration(rng, position)
            samples.append(Sample(prompt, response, [0.0] * len(response), 0.0))
        batch = self._pack(samples)
        batch.advantages = batch.old_logprobs = None
        return self._update(batch, next_token_loss, train_draft=self.cotrain)

    def rl_step(self, step: int) -> dict[str, float]:
        """Refresh the engine, generate and score (``rollout_phase``), update (``update_phase``)."""
        t0 = time.perf_counter()
        with self.training_state_away() as parameters_away:
            self.refresh_engine()
            if self.reference is not None and step == self.config.task.sft_steps + 1:
                copy_shards(self.policy, self.reference)  # the reference of the KL term: the policy RL starts from
            t_refresh = time.perf_counter() - t0
            parameters_away()
            samples, metrics = self.rollout_phase(step)
        if self.offload is not None:
            metrics |= {"time/offload_s": self.offload.seconds, "memory/offloaded_gib": self.offload.host_bytes / 2**30}
        metrics |= self.update_phase(step, samples)
        metrics |= acceptance_over_tau(metrics)
        metrics |= self.collapse_watch.judge(metrics)
        metrics["time/refresh_s"] = t_refresh
        return metrics

    @contextlib.contextmanager
    def training_state_away(self):
        """With ``[rollout] offload_training_state``, the training state off the device for
        the block and back after it, also after an error; else nothing. The gradients and
        the optimizers' state leave first; the block refreshes the engine (which reads the
        parameters) and then calls the function this yields, which moves the parameters too:
        the KV pool the refresh allocates never sits beside the optimizers' state."""
        if self.offload is None:
            yield lambda: None
            return
        self.offload.away(weights=False)
        try:
            yield self.offload.away
        finally:
            self.offload.back()

    def _prompts(self, step: int):
        cfg = self.config
        rng = self.rng(step, "prompts")
        positions = self.stream_positions(step - cfg.task.sft_steps - 1, self.prompts_per_rank)
        problems = [self.task.sample(rng, position) for position in positions]
        encoded = [self.encode_prompt(p.prompt) for p in problems]
        prompts = [ids for ids in encoded for _ in range(cfg.rl.group_size)]
        longest = max(map(len, prompts))
        self._stop_if_any_rank_failed(
            f"a prompt of {longest} tokens plus rollout.max_new_tokens = {cfg.rollout.max_new_tokens} exceeds "
            f"the engine's {self.engine.max_seq_len} positions (training.seq_len, or rollout.max_prompt_tokens "
            f"+ max_new_tokens)"
            if longest + cfg.rollout.max_new_tokens > self.engine.max_seq_len else None)
        return problems, prompts

    def sampling_params(self) -> SamplingParams:
        """The ``[rollout]`` sampling settings (responses end at the tokenizer's EOS)."""
        ro = self.config.rollout
        return SamplingParams(temperature=ro.temperature, top_k=ro.top_k, top_p=ro.top_p,
                              max_new_tokens=ro.max_new_tokens, eos_token_id=self.tokenizer.eos_id)

    @property
    def draft_tokens(self) -> int:
        """k of speculative rollouts (the most the adaptive choice drafts): ``[rollout]
        draft_tokens``, 0 without speculation or a draft."""
        return rollout_draft_tokens(self.config)

    def rollout_phase(self, step: int) -> tuple[list[Sample], dict[str, float]]:
        """Step ``step``'s rollouts of this rank's data-parallel coordinate, scored and turned
        into GRPO samples (host lists, the same on every CP and PP peer: each generates its
        share of the problems and the shares are exchanged, ``rl.generation_group``), and the
        rollout metrics (reduced over every rank, each rollout counted once)."""
        cfg = self.config
        group_size = cfg.rl.group_size
        problems, prompts = self._prompts(step)
        share = self.generation.share(len(problems))
        own_prompts = [prompts[i * group_size + j] for i in share for j in range(group_size)]
        unique_prompts = [prompts[i * group_size] for i in share]
        params = self.sampling_params()
        generator = None  # the simulated device has no generators (and its draws are fake)
        if self.simulation is None:
            seed = (self.seed * 1_000_003 + step) * 1009 + self.dp_rank
            generator = torch.Generator(device=self.device).manual_seed(seed + 7919 * self.generation.unit)
        t0 = time.perf_counter()
        progress = RolloutProgress() if self.rank == self.log_rank and self.simulation is None else None
        k_max = self.speculation.k_max
        adaptive = cfg.rollout.adaptive_speculation and self.simulation is None and k_max > 0
        follows = True
        # The tuner's state is the same on every rank (what it learns is summed over the job),
        # and so are the live rows an engine group's ranks see: its choices agree without a
        # collective, per call and per round.
        if not adaptive:
            k = k_max
        elif cfg.rollout.speculation_granularity == "call":
            # The job-wide first wave (the largest share), so every rank's tuner sees one bucket.
            wave = min(self.generation.max_share(len(problems)) * group_size, self.engine.max_batch_size)
            k = self.speculation.choose_call(wave)
            follows = k > 0
        else:
            follows = self.speculation.start_call()
            k = self.speculation.choose_round if follows else 0
        rollouts = None
        if own_prompts:
            rollouts = self.engine.generate(unique_prompts, params, samples_per_prompt=group_size,
                                            generator=generator, progress=progress, draft_tokens=k,
                                            max_rounds=self.simulation.decode_rounds if self.simulation else None)
        if adaptive:
            self._observe_speculation(rollouts, follows)
        if progress is not None:
            progress.close()
        if cfg.rollout.release_between_rollouts:
            self.engine.release()
        if self.simulation is not None:
            # Unknown contents: train on the worst case, every response as long as allowed.
            n = cfg.rollout.max_new_tokens
            samples = [Sample(prompt, [1] * n, [0.0] * n, 0.0, 0.0) for prompt in prompts]
            return samples, {}

        # Per problem: its group of samples and their details, in problem order on every peer.
        groups = self.generation.exchange(self._score([problems[i] for i in share], own_prompts, rollouts),
                                          len(problems), self.generation.digest(prompts))
        samples = [sample for group, _ in groups for sample in group]
        details = [d for _, group_details in groups for d in group_details]
        # Each problem's rollouts are counted once in the sums (by the group's first member),
        # and each generation's statistics once (by its engine group's first rank).
        generated = rollouts.stats if rollouts is not None and self.generation.sends() else None
        metrics = rollout_metrics(self._all_reduce, samples, details, generated, k_max,
                                  buckets=live_bucket(self.engine.max_batch_size) + 1,
                                  counted=self.generation.member == 0)
        # After the metrics' all-reduce, which every rank joins: the phase lasts as long as the
        # slowest rank's generation (a rank's own would hide the ranks it waits for later).
        metrics["time/rollout_s"] = time.perf_counter() - t0
        return samples, metrics

    def _score(self, problems: list, prompts: list[list[int]], rollouts) -> list[tuple[list[Sample], list[dict]]]:
        """This rank's rollouts as GRPO groups: per problem, its ``rl.group_size`` samples (with
        group-normalised advantages) and the task's details of each response."""
        if rollouts is None:
            return []
        group_size = self.config.rl.group_size
        lengths = rollouts.response_lens.tolist()
        responses = [rollouts.tokens[i, :n].tolist() for i, n in enumerate(lengths)]
        logprobs = [rollouts.logprobs[i, :n].tolist() for i, n in enumerate(lengths)]
        texts = [self.tokenizer.decode(ids) for ids in responses]
        rewards, details = score(self.task, [problems[i // group_size] for i in range(len(prompts))], texts)
        advantages = group_advantages(torch.tensor(rewards), group_size)
        samples = [Sample(prompt, responses[i], logprobs[i], rewards[i], float(advantages[i]))
                   for i, prompt in enumerate(prompts)]
        return [(samples[i:i + group_size], details[i:i + group_size]) for i in range(0, len(samples), group_size)]

    def update_phase(self, step: int, samples: list[Sample]) -> dict[str, float]:
        """Pack ``samples`` and run the RL update(s) on them (policy and, unless frozen, draft)."""
        cfg = self.config
        batch = self._pack(samples)
        if self.reference is not None:
            batch.ref_logprobs = self._reference_logprobs(batch)
        t0 = time.perf_counter()
        loss_fn = ppo_loss(cfg.rl.clip_eps_low, cfg.rl.clip_eps_high, cfg.rl.kl_coef, cfg.rollout.temperature,
                           cfg.rl.tis_cap)
        metrics = self._update(batch, loss_fn, train_draft=self.cotrain and not cfg.draft.freeze_after_sft)
        metrics["time/train_s"] = time.perf_counter() - t0
        return metrics

    @torch.no_grad()
    def _reference_logprobs(self, batch: PackedBatch) -> torch.Tensor:
        """Token-aligned, like old_logprobs: the log-prob of token t under the (sharded)
        reference's logits at t - 1, at the rollout temperature; a host ``[B, S]`` tensor,
        computed once per step before the update, row by row, the head in vocabulary chunks."""
        temperature = self.config.rollout.temperature if self.config.rollout.temperature > 0 else 1.0
        out = torch.zeros(batch.tokens.shape)
        for row in range(batch.tokens.shape[0]):
            tokens = batch.tokens[row:row + 1].to(self.device)
            layout = layout_from_document_ids(batch.document_ids[row:row + 1])
            following = torch.roll(tokens, -1, dims=1).reshape(-1)

            def head(hidden, weight, following=following):
                return chunked_token_logprobs(hidden, weight, following, scale=1.0 / temperature)

            logp = self.reference(tokens, cu_seqlens=tuple(layout.cu_seqlens.tolist()),
                                  positions=layout.positions.to(self.device), head=head).head
            out[row, 1:] = logp[:-1].to("cpu", torch.float32)
        return out

    def _observe_speculation(self, rollouts, follows: bool) -> None:
        """Teach the tuner what this step's generations measured (``RoundTable``), summed over
        the job's engine groups (a collective): one call's timing is noisy, and every rank's
        tuner then holds the same numbers and makes the same choices."""
        stats = rollouts.stats if rollouts is not None and rollouts.stats.target_forwards else None
        buckets, k_max = live_bucket(self.engine.max_batch_size) + 1, self.speculation.k_max
        empty = RoundTable.empty(buckets, k_max)
        sends = stats is not None and self.generation.sends()
        table = stats.rounds if sends else empty
        count, prefill_s, *flat = self._all_reduce([float(sends), stats.prefill_s if sends else 0.0, *table.flat()])
        if count:
            self.speculation.observe(RoundTable.from_flat(flat, buckets, k_max), prefill_s / count, follows)

    def refresh_engine(self) -> None:
        """The rollout engine's models <- the trained weights (a collective: every rank
        calls it; FSDP shards are gathered one tensor at a time, PP stages broadcast)."""
        if self.pipeline is not None:
            self.engine.restore()  # the streamed state takes the engine's shapes
            self.engine.load_weights(*gather_state_dict(self.pipeline, self.engine.policy, self.engine.draft))
        else:
            self.engine.load_weights(self.policy.state_dict(),
                                     self.draft.state_dict() if self.draft is not None else None)

    def checkpoint_state_dicts(self) -> dict:
        """What a checkpoint save reads from every ``Stateful`` (the simulator's checkpoint call)."""
        return {key: value.state_dict() for key, value in self.checkpointer.states.items() if value is not None}

    # ------------------------------------------------------------------ run
    def _log(self, step: int, phase: str, metrics: dict[str, float]) -> None:
        """The logging rank (0; under PP the last stage's of rank 0's column): TensorBoard, one JSON line in
        ``<dump_folder>/metrics.jsonl``, one console line."""
        if self.rank != self.log_rank:
            return
        if self.tb is not None:
            self.tb.log(metrics, step)
        with open(os.path.join(self.config.job.dump_folder, "metrics.jsonl"), "a") as f:
            f.write(json.dumps({"step": step, "phase": phase.strip(), **metrics}) + "\n")
        sft_steps = self.config.task.sft_steps
        done, total = (step, sft_steps) if phase.strip() == "sft" else (step - sft_steps, self.config.training.steps)
        print(step_line(phase, done, total, metrics), flush=True)

    def run(self) -> None:
        cfg = self.config
        self.checkpointer.load(step=cfg.checkpoint.load_step)
        if self.rank == self.log_rank and self.state.step:
            print(f"resumed from step {self.state.step}", flush=True)
        while self.state.step < self.total_steps:
            step = self.state.step + 1
            t0 = time.perf_counter()
            sft = step <= cfg.task.sft_steps
            metrics = self.sft_step(step) if sft else self.rl_step(step)
            metrics["lr/policy"] = self.policy_lr.schedulers[0].get_last_lr()[0]
            self.policy_lr.step()
            if self.draft_lr is not None:
                metrics["lr/draft"] = self.draft_lr.schedulers[0].get_last_lr()[0]
                self.draft_lr.step()
            metrics["time/step_s"] = time.perf_counter() - t0
            metrics |= titan.device_memory_stats()
            self.state.step = step
            self._log(step, "sft" if sft else "rl ", metrics)
            self._warn_of_acceptance(step, metrics)
            self._count_nonfinite(step, metrics)
            if titan.checkpoint_due(self.checkpointer, step, last_step=step == self.total_steps):
                self._check_usable(f"the checkpoint of step {step}")
            self.checkpointer.save(step, last_step=step == self.total_steps)
        self.checkpointer.close()
        self.export()
        if self.tb is not None:
            self.tb.close()

    def _warn_of_acceptance(self, step: int, metrics: dict[str, float]) -> None:
        """Print the ``AcceptanceWatch``'s and the ``DraftCollapseWatch``'s warnings (the logging
        rank; every rank keeps the counts)."""
        for watch in (self.acceptance_watch, self.collapse_watch):
            warning = watch.observe(step, metrics)
            if warning and self.rank == self.log_rank:
                print(f"warning: {warning}", flush=True)

    def _count_nonfinite(self, step: int, metrics: dict[str, float]) -> None:
        """Count consecutive steps with a skipped update; stop at ``training.max_nonfinite_steps``,
        or at once when the job's last step had one: nothing is checkpointed or exported then
        (every rank alike: the verdicts are the same on every rank)."""
        skipped = [part for part in ("policy", "draft") if metrics.get(f"nonfinite/{part}", 0.0) > 0]
        if not skipped:
            self.state.nonfinite_steps = 0
            return
        self.state.nonfinite_steps += 1
        limit = self.config.training.max_nonfinite_steps
        if self.rank == self.log_rank:
            print(f"step {step}: non-finite loss or gradient norm of the {' and the '.join(skipped)}: update "
                  f"skipped ({self.state.nonfinite_steps} in a row, the job stops at {limit})", flush=True)
        if self.state.nonfinite_steps >= limit:
            raise NonfiniteStop(
                f"at step {step}: {limit} consecutive steps had a non-finite loss or gradient norm "
                f"(training.max_nonfinite_steps = {limit}); the weights are those of the last finite update, the "
                "last checkpoint is before it. Lower the learning rates (optimizer.lr, draft.lr, task.sft_lr, draft.sft_lr) or the "
                "gradient clips (training.max_norm, draft.grad_clip).")
        if step == self.total_steps:
            raise NonfiniteStop(
                f"at step {step}, the job's last: the update of the {' and the '.join(skipped)} was skipped "
                f"(non-finite loss or gradient norm, {self.state.nonfinite_steps} step(s) in a row), so the weights "
                "are not trained to the end: nothing is exported and this step is not checkpointed. Resume from an "
                "earlier checkpoint, if there is one, with lower learning rates (optimizer.lr, draft.lr) or gradient "
                "clips (training.max_norm, draft.grad_clip).")

    def _check_finite(self, what: str, *modules, collective: bool = True) -> None:
        if self.simulation is None and not all_finite(modules, self.device, collective=collective):
            raise NonfiniteWeights(f"{what} is not written: the weights are not finite")

    def _check_usable(self, what: str) -> None:
        """Refuse to write ``what`` (a checkpoint) unless every rank's training shards are finite
        and the probe forward through the models is (``_check_probe``, on the rollout engine's
        whole copies, refreshed for it: the next step refreshes them anyway)."""
        self._check_finite(what, self.policy, self.draft, self.reference)
        if self.simulation is None:
            with self.training_state_away():  # the refreshed pool beside the parameters only
                self.refresh_engine()
                self._check_probe(what)
                if self.config.rollout.release_between_rollouts:
                    self.engine.release()

    def _check_probe(self, what: str) -> None:
        """Refuse to write ``what`` unless one forward of a probe (the first ``PROBE_TOKENS``
        tokens of a fixed task demonstration) through the engine's policy and draft is finite,
        on every rank (a collective). The weights must be finite already."""
        if self.simulation is not None:
            return
        prompt, response = self.demonstration(random.Random(f"{self.seed}/probe"), 0)
        tokens = torch.tensor([(prompt + response)[:PROBE_TOKENS]], device=self.device)
        if not forward_is_finite(self.engine.policy, self.engine.draft, tokens):
            models = "the policy and the draft" if self.engine.draft is not None else "the policy"
            raise NonfiniteWeights(
                f"{what} is not written: the weights are finite, but a forward of {models} on a probe of "
                f"{tokens.shape[1]} tokens is not (the last updates made them unusable). Lower the learning rates "
                "(optimizer.lr, draft.lr, task.sft_lr, draft.sft_lr) or the gradient clips (training.max_norm, "
                "draft.grad_clip).")

    def export(self) -> None:
        """Write the final policy and draft to ``<dump_folder>/export`` (``rl.export``)."""
        export_job(self)
