"""The project's config sections, merged into torchtitan's ``JobConfig``.

torchtitan's ``ConfigManager`` merges this module's ``JobConfig`` into its own when a TOML
file (or the command line) names it in ``[job] custom_config_module``; the project's loader
(``titan_cotrain.config.load_job_config``) names it for you. Sections that torchtitan
already has (``[model]``, ``[training]``, ``[parallelism]``) gain fields; ``[draft] [rl] [rollout]
[task] [eval] [simulate]`` are new.

Every field's docstring is the documentation of its TOML key.
"""

# No `from __future__ import annotations`: torchtitan merges sections by inspecting real
# field types (`is_dataclass(f.type)`), and tyro builds the CLI from them.
from dataclasses import dataclass, field
from typing import Literal


@dataclass
class Job:
    extends: str = ""
    """Another TOML job file, relative to this one, that this file starts from: its keys apply
    first, this file's keys win, ``--section.key`` overrides win over both. Files may chain;
    a cycle is an error. Variants of a job stay one short file (``debug_cpu_frozen_draft.toml``)."""


@dataclass
class Model:
    name: str = "llama3"
    """Target architecture: ``llama3`` or ``qwen3``."""

    flavor: str = "debugmodel"
    """Named size of ``name`` (llama3: debugmodel, debugdeep, 8B, 70B; qwen3: debugmodel, 0.6B, 1.7B, 8B, 32B,
    and the mixtures of experts debugmoe, 30B-A3B, 235B-A22B). Ignored when ``hf_path`` is set."""

    hf_path: str = ""
    """Local Hugging Face folder (``config.json`` + ``*.safetensors``) to start the policy
    from. Its ``config.json`` fixes the shape; empty means random init of ``flavor``."""

    hf_assets_path: str = "assets/tokenizer"
    """Folder with ``tokenizer.json`` (torchtitan's key). Defaults to the project's
    character-level tokenizer. A model loaded from ``hf_path`` uses its own folder's."""

    n_layers: int = 0
    """Decoder layers of the randomly initialised ``flavor``, its widths unchanged; 0 keeps
    the flavor's. A real-scale config's layout at a few layers, for a smoke test of its
    parallelism (``scripts/smoke_8gpu.sh``); below 7 layers EAGLE-3's default tap layers do
    not exist, so name ``[draft] tap_layers``. Not with ``hf_path`` (its ``config.json`` fixes
    the shape)."""

    moe_aux_loss_weight: float = 0.001
    """Weight of a mixture-of-experts policy's load-balancing loss in its objective (Hugging
    Face's Qwen3-MoE ``router_aux_loss_coef``, whose default this is; 0 = off): ``E x sum_e f_e
    x P_e`` pooled over the sparse layers of each microbatch's forward (``f_e`` the fraction
    of top-k assignments to expert ``e``, ``P_e`` its mean router probability;
    ``titan_cotrain.models.moe``). Its gradient reaches only the routers' weights. The update
    adds it weighted by each microbatch's share of the policy loss's tokens and logs it as
    ``loss/moe_aux`` (``titan_cotrain.cotrain.step``). Unused by dense policies."""


@dataclass
class Training:
    max_nonfinite_steps: int = 3
    """Stop the job after this many consecutive steps with a skipped update. An update whose
    loss or gradient norm is not finite (NaN or inf, on any rank) is skipped, for the
    policy and the draft separately: no optimizer step, so its weights and optimizer state
    stay as they were; the step is logged (``nonfinite/policy``, ``nonfinite/draft``) and
    the job goes on. Weights that are not finite are never checkpointed or exported."""


@dataclass
class Parallelism:
    pipeline_fsdp_reduce_every_microbatch: bool = False
    """Under PP with FSDP: reshard every stage's parameters after each microbatch's backward
    and reduce-scatter its gradients then, instead of torch's schedules' default of keeping
    the unsharded parameters and gradients of all of a rank's stages until the last
    microbatch. Costs an all-gather and a reduce-scatter per microbatch; saves up to 2 x
    (the rank's stages' parameters) in bf16 (``titan_cotrain.parallel.fsdp.reduce_every_microbatch``):
    what a policy whose stages are large next to the GPU needs."""

    rank_order: Literal["auto", "pp_outer", "dp_outer"] = "auto"
    """Which process sits at each coordinate of the ``[pp, dp, cp]`` mesh
    (``titan_cotrain.parallel.rank_layout``). ``pp_outer``: torchtitan's order, rank ``(p x DP
    + b) x CP + c``; FSDP's groups (a stage's DP x CP ranks) are consecutive ranks. ``dp_outer``:
    rank ``(b x PP + p) x CP + c``; the CP x PP ranks of one data-parallel coordinate, of which
    ``[rollout] tensor_parallel_degree`` engine groups are made, are consecutive, so an engine
    group stays in one node (its two all-reduces per layer and decoding round in NVLink), and
    so do the pipeline's sends, while FSDP's gathers and reduce-scatters cross nodes. ``auto``:
    ``dp_outer`` when ``pp_outer`` would spread an engine group over more nodes than
    ``dp_outer`` does (node: torchrun's ``LOCAL_WORLD_SIZE``, else ``[simulate]
    gpus_per_node``), else ``pp_outer``. The two orders are the same without PP or without
    data parallelism."""


@dataclass
class ActivationCheckpoint:
    mode: Literal["full", "none"] = "none"
    """``full``: recompute every decoder layer of the policy and every TTT pass of the draft in
    backward; ``none``: keep activations. (torchtitan's ``selective`` mode is not supported for our models.)"""


@dataclass
class Compile:
    enable: bool = False
    """``torch.compile`` the training models, block by block (``titan_cotrain.parallel.compile``):
    each decoder block of the policy and the draft's TTT pass, ``fullgraph=True``, before
    FSDP. The first steps pay the compile time. The rollout engine has its own key,
    ``[rollout] compile``."""

    components: list[str] = field(default_factory=lambda: ["model", "draft"])
    """What ``enable`` compiles: ``model`` (the policy's decoder blocks) and ``draft`` (its
    TTT pass). ``[compile] backend`` (torchtitan's key, default ``inductor``) is the backend."""


@dataclass
class Draft:
    enable: bool = True
    """Co-train the EAGLE-3 draft. False gives plain RL: plain decoding whatever
    ``[rollout] speculative`` says, nothing exported but the policy."""

    kind: Literal["eagle3", "dflash"] = "eagle3"
    """The draft family: ``eagle3`` drafts ``k`` tokens in ``k`` passes; ``dflash``, a block
    drafter, drafts up to ``block_size - 1`` in one forward (docs/DESIGN.md section 16). It
    trains under FSDP, CP and PP like EAGLE-3, over the target's whole vocabulary, from a
    fresh drafter or ``init_path`` (a DFlash folder); its engine is not compiled (a
    tensor-parallel one keeps the drafter whole on every rank); ``ttt_steps``, ``hidden_size``, ``num_heads`` and ``num_kv_heads`` are
    EAGLE-3's and do not apply (``pass_decay`` weighs its block positions)."""

    block_size: int = 16
    """``dflash``: the block, the anchor and ``block_size - 1`` drafted positions
    (``[rollout] draft_tokens`` at most ``block_size - 1``)."""

    block_layers: int = 1
    """``dflash``: the drafter's decoder layers."""

    blocks_per_doc: int = 8
    """``dflash``: training blocks drawn per sequence at each update (random anchors among
    the positions whose next token is in the loss region)."""

    mask_token_id: int = -1
    """``dflash``: a row of the policy's embedding that no text uses (e.g. one of the padding
    rows past the tokenizer's last id), written into the exports: the drafter folder's
    ``dflash_config.mask_token_id``, and in the policy export that row holds the drafter's
    mask embedding, which is how SGLang embeds the mask token. -1: neither (the drafter folder
    then loads here, not in SGLang). Not with tied embeddings (the row would also be a logit)."""

    ttt_steps: int = 7
    """D: number of training-time-test passes per anchor."""

    loss_weight: float = 0.1
    """lambda in ``L = L_policy + lambda * L_draft``. The draft's gradients never reach
    the policy, so this only scales the draft's own gradients."""

    pass_decay: float = 0.8
    """gamma: pass d is weighted ``gamma ** (d - 1)``; 1.0 gives uniform weights."""

    vocab_size: int = 0
    """Draft vocabulary size V_d: the V_d most frequent target tokens of a corpus counted at
    start (``vocab_samples`` task samples, plus ``vocab_generations`` responses of the initial
    policy). 0 means the target's. The job is refused when the corpus holds fewer than V_d / 2
    distinct tokens (the rest of the vocabulary would be arbitrary ids). With ``init_path``
    the folder's ``d2t`` / ``t2d`` are the vocabulary: leave this 0 or equal to its size."""

    vocab_samples: int = 4096
    """Task samples (prompt + demonstration, through the task's ``sample`` and
    ``demonstration``) whose tokens are counted for a reduced ``vocab_size``."""

    vocab_generations: int = 0
    """Prompts (global, split over data-parallel ranks) that the initial policy answers at
    start, with the ``[rollout]`` sampling settings, to add its own responses' tokens to the
    count (EAGLE-3's practice: the draft should cover what the policy writes). Done at
    construction, from the policy ``[model] hf_path`` loads, not at the switch to RL: the
    reduced vocabulary sizes the draft's head and is trained from the first warm-start step,
    so it is chosen once. Needs ``hf_path`` (a random policy writes noise) and a reduced
    ``vocab_size`` without ``init_path``; 0 counts task samples only."""

    tap_layers: list[int] = field(default_factory=list)
    """Decoder layers (0-based, output of the layer) fused by the draft's ``fc``.
    Empty means EAGLE-3's ``[1, L//2 - 1, L - 4]``; for ``dflash``, ``block_layers`` layers
    spread from layer 1 to ``L - 3`` (``models.block_draft.block_target_layers``)."""

    hidden_size: int = 0
    """Draft hidden size. 0 means the target's."""

    num_heads: int = 0
    """Draft attention heads. 0 means the target's."""

    num_kv_heads: int = 0
    """Draft key/value heads. 0 means the target's."""

    intermediate_size: int = 0
    """Draft MLP width. 0 means the target's."""

    lr: float = 3e-4
    """Peak learning rate of the draft during RL. The draft's schedule has the policy's shape
    in each phase (``[task] sft_*`` over the warm start, ``[lr_scheduler]`` over RL), each
    from its own warm-up."""

    sft_lr: float = 0.0
    """Peak learning rate of the draft during the warm start; 0 means ``lr``."""

    grad_clip: float = 1.0
    """Max global grad norm of the draft's parameters, clipped separately from the policy."""

    loss_on: Literal["response", "all"] = "response"
    """Which predicted tokens count in the draft loss: rollout responses or every token."""

    init_path: str = ""
    """Optional folder to start the draft from: an EAGLE-3 folder, or with ``kind = "dflash"``
    a DFlash folder (its target layers, block size and depth must be the job's)."""

    freeze_after_sft: bool = False
    """Stop training the draft when RL starts (the frozen-draft baseline): rollouts keep
    using the draft as the warm start left it. Needs ``enable``."""

    prefit_steps: int = 0
    """Draft-only steps between the warm start and RL (``rl.prefit``): the policy answers
    training prompts by plain decoding and only the draft trains on those responses (the
    policy's forward gives the taps and the teacher); the policy's weights, optimizer state
    and LR schedule are untouched. They are job steps ``task.sft_steps + 1 ..
    task.sft_steps + prefit_steps``; RL's steps follow. 0: none. With a reduced ``vocab_size``,
    a fresh draft, ``[model] hf_path`` and no warm start, the prefit's first generations choose
    the draft's vocabulary (``vocab_generations`` is not used) and are then trained on."""

    prefit_prompts: int = 0
    """Prompts per prefit step, split over the data-parallel ranks; 0: ``rl.prompts_per_step``.
    Step ``i`` of the prefit asks the prompts RL's step ``i`` will (the stream after the warm
    start), so a prefit as long as a few RL steps covers exactly the first ones' prompts."""

    prefit_samples: int = 1
    """Responses per prompt in a prefit step (sampled at ``[rollout]``'s settings)."""

    prefit_lr: float = 0.0
    """The draft's peak LR in the prefit; 0: ``sft_lr`` when set (a fresh draft learns at the
    warm start's rate), else ``lr``."""

    prefit_warmup_steps: int = 0
    """Warm-up steps of the prefit's LR schedule (it has its own, like the warm start's)."""

    prefit_decay_type: Literal["linear", "sqrt", "cosine"] = "linear"
    """Decay of the prefit's schedule after its warm-up (``[lr_scheduler] decay_type``'s meaning)."""

    prefit_min_lr_factor: float = 1.0
    """The prefit's LR decays to ``prefit_min_lr_factor x`` its peak at its last step (1: no
    decay, the draft enters RL at the prefit's peak)."""


@dataclass
class RL:
    group_size: int = 8
    """G: samples per prompt; advantages are normalised within each group."""

    prompts_per_step: int = 8
    """Prompts per training step (global, split across data-parallel ranks)."""

    clip_eps_low: float = 0.2
    """PPO ratio clip below 1."""

    clip_eps_high: float = 0.2
    """PPO ratio clip above 1."""

    kl_coef: float = 0.0
    """Weight of the KL penalty to the reference (initial) policy; 0 disables it."""

    updates_per_step: int = 1
    """Optimizer updates (minibatches) per batch of rollouts."""

    tis_cap: float = 0.0
    """Truncated importance sampling against the engine/trainer mismatch (the bf16 engine
    samples from a slightly different distribution than the trainer's policy): each token's
    PPO term is weighted by ``min(pi_trainer / pi_engine, tis_cap)`` and the PPO ratio is
    taken against the trainer's own log-probs instead of the engine's. 0 disables it (the
    ratio is against the engine's behaviour log-probs). Needs ``updates_per_step = 1``: the
    trainer's log-probs are the update's own, detached. ``rl/engine_kl`` (the k3 estimate of
    KL(engine || trainer) over response tokens, at the step's first update) is logged either
    way."""

    loss_aggregation: Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum",
                              "seq_mean_token_sum_norm"] = "token_mean"
    """How the per-token terms ``l_it`` of the step's N responses become one loss (exact under
    any microbatching, CP and PP split): ``token_mean`` sum_i sum_t l_it / sum_i |o_i| (DAPO);
    ``seq_mean_token_mean`` mean_i (sum_t l_it / |o_i|) (the original GRPO);
    ``seq_mean_token_sum`` mean_i sum_t l_it; ``seq_mean_token_sum_norm`` sum_i sum_t l_it /
    (N x rollout.max_new_tokens) (Dr. GRPO's constant normaliser). See ``docs/recipes.md``."""

    normalize_std: bool = True
    """Divide each group's centred rewards by the group's standard deviation (GRPO); false
    leaves them centred only (Dr. GRPO)."""

    advantage: Literal["grpo", "rloo"] = "grpo"
    """Advantage estimator: ``grpo`` r_i - mean_g r (divided by the group's std under
    ``normalize_std``); ``rloo`` the leave-one-out baseline r_i - mean_{j != i} r_j (never
    std-normalised)."""

    ratio_level: Literal["token", "sequence"] = "token"
    """``token``: PPO's per-token ratio. ``sequence`` (GSPO): s_i = exp(mean_t (log pi -
    log pi_old)) per response, clipped to [1 - clip_eps_low, 1 + clip_eps_high] (about 3e-4 /
    4e-4 are GSPO's values), each response's term averaged over its tokens."""

    overlong: Literal["none", "mask", "soft"] = "none"
    """Responses that reach ``rollout.max_new_tokens`` without stopping: ``none`` trained as
    any other; ``mask`` no loss on them; ``soft`` DAPO's linear penalty added to the reward,
    0 up to L - B tokens and ((L - B) - |y|) / B beyond (L ``max_new_tokens``, B
    ``overlong_buffer``)."""

    overlong_buffer: int = 0
    """B of ``overlong = "soft"``: the last B tokens of the budget are penalised linearly."""

    dynamic_sampling: bool = False
    """DAPO's dynamic sampling: groups whose rewards are all equal are dropped before the
    update, and the rollout draws more prompts (the next positions of the prompt stream) until
    the step holds ``prompts_per_step`` kept groups over all ranks or
    ``dynamic_sampling_max_rounds`` extra generation rounds have run."""

    dynamic_sampling_max_rounds: int = 3
    """The most extra generation rounds one step of dynamic sampling runs."""


@dataclass
class Rollout:
    max_new_tokens: int = 64
    """Generation budget per response."""

    stop_token_ids: list[int] = field(default_factory=list)
    """Token ids that end a response besides the tokenizer's EOS (always a stop), e.g. Qwen3's
    ``<|im_end|>`` and ``<|endoftext|>``. The stop token is the response's last; a stop inside
    an accepted draft prefix ends the sequence there (speculation stays lossless)."""

    release_between_rollouts: bool = False
    """Free the engine's weights and KV caches on the device after each rollout phase, until
    the next step's weight refresh rewrites them: the update phase of the colocated trainer
    gets that memory (what a policy whose whole bf16 copy is a large share of a GPU needs)."""

    max_prompt_tokens: int = 0
    """Longest prompt the rollout engine takes; its KV caches hold ``max_prompt_tokens +
    max_new_tokens`` positions per sequence. 0: ``training.seq_len - max_new_tokens`` (a
    long-context job whose rows hold many rollouts should set it, or every cached sequence
    is sized for a whole row)."""

    split_prompts: bool = True
    """How the ranks that train the same rows (the context-parallel x pipeline peers of one
    data-parallel coordinate) get their rollouts, generated once either way and exchanged:
    true, each generates an equal share of the prompts (GRPO groups kept whole), ``cp x pp``
    times less work per rank; false, the first of them generates all and sends them (the
    rollouts a one-process job of the same seed generates)."""

    temperature: float = 1.0
    """Sampling temperature; 0 means greedy."""

    top_p: float = 1.0
    """Nucleus sampling threshold; 1.0 disables it. The PPO ratio scores the policy at the
    rollout temperature only, so a filter makes it approximate: keep it off for RL."""

    top_k: int = 0
    """Top-k sampling; 0 disables it (same caveat as ``top_p``)."""

    speculative: bool = True
    """Decode with the co-trained draft (lossless speculative sampling); false decodes plainly
    (the draft still trains). Without a draft (``[draft] enable = false``) decoding is plain
    and this is ignored, with a note at start: it is on by default, so plain RL needs only
    ``--draft.no-enable``."""

    draft_tokens: int = 4
    """k: tokens the draft proposes per verify round (the most, with ``adaptive_speculation``),
    >= 1 when decoding speculatively (for plain decoding set ``speculative = false``); unused
    otherwise."""

    adaptive_speculation: bool = True
    """Choose k in ``0..draft_tokens`` from what earlier rollout phases measured, for the
    highest expected tokens/s: per live-rows bucket (powers of two), the wall seconds of a
    round at each k and the per-position acceptance, summed over every rank so all ranks
    choose alike. With ``speculation_granularity = "round"`` k is chosen before every decoding
    round from the sequences still live, so a rollout's long tail (a few long responses at low
    concurrency, where speculation pays most) gets its own k; the draft follows a call only
    where that is estimated at least 5% faster than plain decoding. Re-estimated as the policy
    and the draft move (``titan_cotrain.engine.speculation``). The chosen k follows timings, so
    sampled rollouts are not reproducible run to run (their law is: speculative sampling is
    lossless at every k); false always drafts ``draft_tokens`` (bit-exact resumes)."""

    speculation_granularity: str = "round"
    """How often ``adaptive_speculation`` chooses k: ``"round"`` (every decoding round, from
    the live rows) or ``"call"`` (once per rollout phase, from the size of its first wave:
    the tail then runs at the bulk's k)."""

    acceptance_warning_fraction: float = 0.8
    """Warn when speculative rollouts accept less than this fraction of what the draft's
    training metric predicts, for ``acceptance_warning_steps`` RL steps in a row. Both measure
    the same draft on the same rollouts: the update scores the draft on what it drafted,
    before its own step: ``rollout/predicted_acceptance``, the draft's accuracy over the step's
    ``k`` passes, top-1 agreement for greedy rollouts (``draft/acc_pass<d>``) and ``sum_x
    min(teacher, draft)`` for sampled ones (``draft/accept_pass<d>``). A lasting gap means the
    engine feeds the draft other inputs than training does, which no other check sees
    (speculative sampling stays lossless whatever the draft computes). Each RL step logs
    ``rollout/acceptance_over_tau``, measured over predicted; the console line shows the two
    side by side. 0 disables the warning."""

    acceptance_warning_steps: int = 3
    """Consecutive speculative RL steps below ``acceptance_warning_fraction`` before the
    warning (steps that decode plainly do not count, nor end the run)."""

    collapse_fraction: float = 0.5
    """Draft health (``rl.draft_health.DraftCollapseWatch``): a speculative RL step collapsed
    when the tokens a drafting round gains (``rollout/acceptance_length - 1``) fall below this
    fraction of their running mean at the step's k. After ``collapse_steps`` such steps in a
    row (or with a dead position, ``collapse_position_rate``) the step logs
    ``draft/collapse = 1`` and a warning is printed once. 0 disables the length test."""

    collapse_position_rate: float = 0.05
    """A drafted position whose acceptance rate stays below this counts as a collapse (a draft
    past its ``max_position_embeddings`` or on stale weights accepts nearly nothing there). 0
    disables the position test."""

    collapse_steps: int = 3
    """Consecutive collapsed speculative RL steps before ``draft/collapse`` and the warning
    (plain-decoding steps do not count, nor end the run)."""

    tensor_parallel_degree: int = 1
    """Split the engine's policy copy over this many ranks (Megatron's colwise / rowwise
    layout, ``titan_cotrain.parallel.engine_tp``), for a policy whose bf16 copy does not fit
    one GPU beside its training state. The ranks of an engine group are consecutive CP x PP
    peers of one data-parallel coordinate (ranks that train the same rows), so it must divide
    ``context_parallel_degree x pipeline_parallel_degree``, and the policy's heads, FFN width
    and vocabulary; the KV heads it divides or is a multiple of. Each rank holds ``1 / t`` of
    the weights and of the target's KV cache (one KV head, with ``k_proj``/``v_proj`` whole, when
    ``t`` exceeds the KV heads); the draft stays whole. The engine groups of a coordinate share its prompts out.
    It may not exceed a node's processes (torchrun's ``LOCAL_WORLD_SIZE``, else ``[simulate]
    gpus_per_node``); ``[parallelism] rank_order`` keeps a group in one node, and a group whose
    ranks still lie on several nodes (``pp_outer`` chosen by hand) is warned about at start."""

    compile: bool = False
    """``torch.compile`` the engine's decoding steps (target decode / verify, the draft's chain
    step and catch-up), one graph per ``k``: compiled, the steps run every row of the engine
    against whole-sequence block tables (fixed shapes); on a GPU with
    ``mode="reduce-overhead"`` (CUDA graphs). The prefill (ragged prompt width) stays eager."""

    kv_cache_gib: float | Literal["auto"] = 0.0
    """GiB per rank for the rollout engine's KV cache (target + draft): a pool of
    ``kv_block_size``-position blocks (``titan_cotrain.models.kv_cache``) that sequences take
    as they grow and give back when they finish; a GRPO group's samples share their prompt's
    blocks. Sequences enter the running batch while the pool can hold them at their longest,
    the rest as others finish (continuous batching). One position costs ``2 (keys, values) x
    bytes per element x (target layers x max(kv heads / tensor_parallel_degree, 1) x head dim + draft
    kv heads x head dim)``; beside the pool each row keeps ``k - 1`` draft chain slots
    (``k = draft_tokens``). The caches and the engine's weights are bf16 on an accelerator and
    fp32 on CPU (no key sets it). 0 sizes the pool for the rank's whole batch at its longest
    (``S + k + 1`` positions a sequence, ``S = [training] seq_len``). ``"auto"``: what the GPU
    has left beside the training state, the engine's weights and the rollout's transient,
    less ``KV_MARGIN_FRACTION`` (10%) of the GPU for the CUDA context, NCCL's buffers and
    fragmentation (``titan_cotrain.engine.kv_budget``; the size is printed at start and is the
    scale simulator's ``kv_pool_gib``). It needs ``release_between_rollouts`` (the pool is
    then alive from the refresh to the end of the rollout, not during the update) and Adam or
    AdamW; refused when what is left holds no sequence. On a CPU, 0."""

    kv_block_size: int = 16
    """Positions per KV block. Smaller blocks waste less of a sequence's last block and share
    more of a prompt; larger ones mean fewer table entries and bigger copies. On a GPU the
    decode attention reads the pool in place with the flash kernel's paged path, which takes
    blocks of a multiple of 256 positions (the shipped real-scale configs set 256); other sizes
    run, with a warning, through the gathered reference path."""

    paged: bool = True
    """false: the static layout instead, one whole-sequence cache row per sequence, prompts in
    waves of what the budget holds, each sample prefilled on its own; no block gather in the
    decode attention (the fallback where that gather costs more than the memory it saves)."""

    offload_training_state: bool = False
    """Move the training state off the device while the engine generates: the policy's,
    draft's and reference's fp32 shards, any gradients and the optimizers' state go to (pinned)
    host memory after the engine's refresh and come back, bitwise, before the update
    (``titan_cotrain.rl.offload``). Frees their bytes for the rollout (11.9 GiB per rank at 8B,
    24.5 at 32B, 25.7 at 70B) at the cost of two host copies of them per step; the host holds
    them in buffers allocated once."""


@dataclass
class Task:
    name: str = "arithmetic"
    """Verifiable task that generates prompts and scores responses: ``arithmetic``,
    ``arithmetic_longtail`` (heavy-tailed response lengths, ``rl.tasks.LongTailArithmetic``) or
    ``sort`` (synthetic), or ``math``, ``gsm8k`` or ``custom`` (prompts and records from
    ``dataset_path``; see ``docs/datasets.md``; ``custom`` is scored by ``reward``, see
    ``docs/recipes.md``)."""

    reward: str = ""
    """The ``custom`` task's reward, ``"package.module:function"`` (the module found on
    ``PYTHONPATH``), called as ``function(record, prompt, response)`` with the record a dict of
    the file's fields and the prompt (as the policy saw it, chat template rendered) and
    response as text; it returns a float, or a dict of floats with one named ``reward`` (the
    others logged as ``task/<name>`` means). Checked at start: importable, and callable with
    three arguments. Read by ``custom`` only."""

    reward_workers: int = 0
    """Worker processes per rank that score responses (forked from a forkserver), each call
    under ``reward_timeout_s``; 0 scores in the rank's own process, one call after another,
    with no timeout."""

    reward_timeout_s: float = 60.0
    """With ``reward_workers`` > 0: a call that takes longer scores 0 and is counted
    (``task/reward_timeouts``, the step's count); its worker is killed and replaced."""

    reward_on_error: Literal["raise", "zero"] = "raise"
    """A reward call that raises (or whose worker dies) or returns anything but finite numbers:
    ``raise`` stops the step with the record, the response and the traceback; ``zero`` scores
    it 0 and counts it (``task/reward_errors``, the step's count)."""

    reward_max_error_fraction: float = 0.1
    """Under ``reward_on_error = "zero"``: the job stops once more than this share of a step's
    reward calls on a rank fail (timeouts are counted apart and never stop it)."""

    chat_template_kwargs: dict[str, bool | int | float | str] = field(default_factory=dict)
    """Extra variables for the chat template, as Hugging Face's ``apply_chat_template`` takes
    them, e.g. ``{ enable_thinking = false }``; the strings ``"true"`` and ``"false"`` reach
    the template as booleans. On the command line: ``--task.chat_template_kwargs
    enable_thinking false``, or, for a key the TOML file sets,
    ``--task.chat_template_kwargs.enable_thinking`` / ``.no-enable_thinking``."""

    seed: int = 0
    """Seed of the task's deterministic data generator; for a dataset task, of the held-out
    split and the order of the records."""

    dataset_path: str = ""
    """Local JSONL or Parquet file of a dataset task (``math``, ``gsm8k``, ``custom``): one
    record per problem, read with Hugging Face ``datasets`` (never downloaded). Not read under
    the scale simulator, whose prompts are synthetic (``[simulate] prompt_tokens``)."""

    dataset_format: Literal["", "json", "parquet"] = ""
    """Format of ``dataset_path``: ``json`` (JSON Lines) or ``parquet``. Empty: from the
    extension (``.jsonl``, ``.json``, ``.parquet``)."""

    prompt_field: str = "question"
    """Field of a record holding the prompt (GSM8K: ``question``; MATH: ``problem``): a
    question (a string), or chat messages (a list of ``{"role", "content"}``, which need a
    chat template)."""

    answer_field: str = "answer"
    """Field holding the reference answer. ``gsm8k``: an integer, or a solution ending in
    ``#### N``; ``math``: the answer, or a solution whose last ``\\boxed{}`` is it (MATH's
    ``solution``). Not read by ``custom``, whose reward reads the record."""

    solution_field: str = ""
    """Field of a worked solution, the warm start's demonstration. Empty: the answer field (a
    bare answer then becomes ``\\boxed{answer}`` / ``#### answer``)."""

    chat_template: bool = True
    """Render every prompt with the tokenizer's chat template (``chat_template.jinja`` or the
    ``chat_template`` of ``tokenizer_config.json`` in the tokenizer folder), the question as
    the user's message, when the folder has one. False, or no template: BOS + the question
    (chat-message prompts are then refused)."""

    system_prompt: str = ""
    """System message put before the question by the chat template (needs one), and before
    chat messages that have no system message of their own. Empty: none."""

    eval_size: int = 0
    """Records of the dataset held out for ``python -m titan_cotrain.eval`` (never trained
    on), chosen by ``seed``. Set this or ``eval_fraction``; 0 and 0: none."""

    eval_fraction: float = 0.0
    """Share of the dataset's records held out (rounded), instead of ``eval_size``."""

    format_reward: float = 0.0
    """Reward added when the final answer is in the task's form (``math``: ``\\boxed{}``;
    ``gsm8k``: ``#### N``), right or wrong; the reward is ``correct + format_reward x format``."""

    sft_steps: int = 0
    """Supervised warm-start steps on task demonstrations before RL (0 skips it)."""

    sft_batch_size: int = 32
    """Demonstrations per data-parallel rank per warm-start step."""

    sft_lr: float = 0.0
    """Peak learning rate of the policy during the warm start; 0 means ``[optimizer] lr``.
    Each phase has its own schedule: the warm start's (``sft_warmup_steps``,
    ``sft_decay_type``, ``sft_min_lr_factor``, torchtitan's warm-up/decay over ``sft_steps``)
    peaks here; RL's is ``[lr_scheduler]`` over ``[training] steps``, peaking at
    ``[optimizer] lr``, from its own warm-up at the first RL update. The draft follows the
    same shapes at ``[draft] sft_lr`` and ``[draft] lr``."""

    sft_warmup_steps: int = 0
    """Linear warm-up steps of the warm start's schedule (``[lr_scheduler] warmup_steps``'s
    meaning, over ``sft_steps``)."""

    sft_decay_type: Literal["linear", "sqrt", "cosine"] = "linear"
    """Decay of the warm start's schedule after its warm-up (``[lr_scheduler] decay_type``'s
    meaning)."""

    sft_min_lr_factor: float = 0.0
    """The warm start's LR decays to ``sft_min_lr_factor x`` its peak at ``sft_steps``
    (``[lr_scheduler] min_lr_factor``'s meaning)."""


@dataclass
class Eval:
    enable: bool = False
    """Evaluate during training (``rl.evaluation``): the held-out prompts are answered by the
    rollout engine on every rank (split over the data-parallel ranks, results gathered) and
    scored, before the first RL step, every ``interval`` RL steps and at the end; logged under
    ``eval/`` (TensorBoard, ``metrics.jsonl``, a line with ``"phase": "eval"`` and the step of
    the policy evaluated) and written to ``<dump_folder>/eval/eval_step<N>.json``. It runs on
    the engine the next rollout uses, just refreshed: no extra copy of the weights."""

    interval: int = 0
    """RL steps between evaluations: the policy after RL step ``n x interval`` is evaluated
    (at the start of the next step, on the engine refreshed for its rollout); 0: only before
    the first RL step and at the end."""

    at_end: bool = True
    """Also evaluate the final policy at the end of the job (before the export)."""

    path: str = ""
    """The evaluation's own prompt file (JSON Lines or Parquet, read like ``[task]
    dataset_path``; every record is an evaluation prompt). Empty: the training file's held-out
    split (``[task] eval_size`` / ``eval_fraction``); a synthetic task draws ``prompts``
    problems of its own (seeded apart from the training stream, though a problem may recur
    there)."""

    task: str = ""
    """The task that scores ``path``'s records (``math``, ``gsm8k``, ``custom``); empty: the
    job's ``[task] name``."""

    reward: str = ""
    """The reward of a ``custom`` evaluation task (``[task] reward``'s form); empty: the job's."""

    prompt_field: str = ""
    answer_field: str = ""
    """Fields of ``path``'s records; empty: ``[task] prompt_field`` / ``answer_field``."""

    dataset_format: Literal["", "json", "parquet"] = ""
    """``path``'s format; empty: from its extension."""

    prompts: int = 0
    """The most evaluation prompts (the first ones of the file or split); 0: all. A synthetic
    task needs it (its problems are endless)."""

    samples: int = 0
    """Responses per prompt; 0: ``[rl] group_size``."""

    pass_k: list[int] = field(default_factory=list)
    """The ``k`` of ``eval/pass@k`` (each in ``1..samples``); empty: 1 and ``samples``."""

    temperature: float = -1.0
    """Sampling temperature of the evaluation (0: greedy); negative: ``[rollout] temperature``."""

    top_p: float = 0.0
    """Nucleus sampling of the evaluation; 0: ``[rollout] top_p``."""

    top_k: int = -1
    """Top-k of the evaluation (0: off); negative: ``[rollout] top_k``."""

    max_new_tokens: int = 0
    """The longest response of the evaluation; 0: ``[rollout] max_new_tokens`` (it may not
    exceed that: the engine's positions are sized by it)."""

    save_responses: bool = True
    """Write every response, its reward and whether it is correct beside the JSON
    (``eval_step<N>.responses.jsonl``)."""


@dataclass
class Simulate:
    enable: bool = False
    """Run the scale simulator instead of training: the real job, rank by rank, on a fake
    accelerator at the config's world size (no GPU, no memory used), reporting each rank's
    peak memory by category; exits non-zero when a rank does not fit ``gpu_memory_gib``."""

    check_at_start: bool = False
    """Run the simulator's check before training starts and refuse a config that does not fit
    (naming the rank and its biggest category). Off by default: a plain start."""

    gpu_memory_gib: float = 80.0
    """Memory of one GPU, the budget every simulated rank must fit (80 for H100, 141 for H200)."""

    gpus_per_node: int = 8
    """GPUs of one node of the simulated machine, where ``[parallelism] rank_order = "auto"`` and
    the engine-group check look for node boundaries. Any run without torchrun's
    ``LOCAL_WORLD_SIZE`` (the simulator, ranks started by hand) uses it; torchrun's value wins."""

    ranks: list[int] = field(default_factory=list)
    """Ranks to simulate. Empty: rank 0 and, under PP, a rank of the last stage."""

    decode_rounds: int = 2
    """Decoding rounds of the rollout engine to run (memory repeats from round to round)."""

    microbatches: int = 2
    """Training microbatches of the update to run (memory repeats from one to the next)."""

    prompt_tokens: int = 256
    """Length of the synthetic prompts of a dataset task (``[task] dataset_path`` is not read):
    the dataset's typical prompt, chat template included (at most the prompt budget)."""

    output: str = ""
    """Where to write the JSON report. Empty: ``assets/scale/<config file stem>.json``."""


@dataclass
class JobConfig:
    job: Job = field(default_factory=Job)
    model: Model = field(default_factory=Model)
    training: Training = field(default_factory=Training)
    parallelism: Parallelism = field(default_factory=Parallelism)
    activation_checkpoint: ActivationCheckpoint = field(default_factory=ActivationCheckpoint)
    compile: Compile = field(default_factory=Compile)
    draft: Draft = field(default_factory=Draft)
    rl: RL = field(default_factory=RL)
    rollout: Rollout = field(default_factory=Rollout)
    task: Task = field(default_factory=Task)
    eval: Eval = field(default_factory=Eval)
    simulate: Simulate = field(default_factory=Simulate)
