"""The rollout engine: batched generation from paged KV caches, plain or speculative.

``RolloutEngine.generate`` takes ragged prompts and returns responses with the behaviour
log-probabilities of every token. Plain decoding is ``prefill`` then one
``decode_one_token`` per step. Speculative decoding (docs/DESIGN.md section 6) replaces the
step by a round of the EAGLE-3 draft and one verify forward of the target.

State of a sequence between rounds, ``n`` = committed tokens (prompt + response)::

    tokens      x_0 ... x_{n-2}  x_{n-1}
    target KV   0   ... n-2               x_{n-1} is committed but not yet fed to the target
    draft trunk 0   ... n-2               slot j = TTT pass-1 key of anchor j (taps_j, e(x_{j+1}))
    h1          pass-1 output at anchor n-2, i.e. the draft's first step for x_n

One round with ``k`` drafted tokens, every sequence at its own ``n``:

1. draft: q_1 = draft(h1); for d = 2..k, TTT pass d at anchor n-2 (``Draft.chain_step``)
   reads the token pass d-1 drafted and sees the trunk plus the chain's own keys;
2. verify: one target forward over ``[x_{n-1}, t_1 .. t_k]`` at positions ``n-1 .. n-1+k``
   gives p_1 .. p_{k+1} and the taps at those positions;
3. accept: ``speculative_accept`` keeps a prefix of ``a`` drafted tokens and draws one more
   (correction or bonus): ``a + 1`` tokens are committed;
4. catch up: TTT pass 1 (``Draft.extend``) over the ``k + 1`` verified positions, with the
   embeddings of the committed tokens after them. Anchors ``n-1 .. n-1+a`` are now right
   and the output at ``n-1+a`` is the next round's h1; the rest are stale slots that no
   query sees before they are rewritten.

Batching is continuous (``engine.kv_blocks``): the engine decodes a running batch of
``max_batch_size`` rows; between rounds, finished sequences leave it and waiting GRPO groups
are prefilled into the free rows, one prefill per prompt for its ``G`` samples, which share
the prompt's KV blocks. Sequences take blocks as they grow; when the pool runs dry the
youngest is preempted and later recomputed from its committed tokens (``_recompute``), so a
pool sized for a few sequences at their longest runs many at once. A round's shapes depend
only on ``(rows, k, block-table width)``, the width a power of two of blocks; free rows ride
along writing to the scratch block, so there is no Python loop over sequences on the device.

The engine steps as a serving engine does (nano-vllm's ``LLMEngine.step``): ``start`` makes a
call's state (``engine.generation.Generation``) and each ``step`` runs one round of it::

    schedule     admit (prefill new groups, recompute preempted sequences), grow (take the
                 blocks the round writes, preempt when the pool is dry), plan (compact the
                 rows, choose k, the caches' views): host bookkeeping, a few index tensors
    run          a speculative round (draft, verify, accept, catch up) or a plain decode
    postprocess  the round's one host sync: finished sequences leave their rows and blocks

``generate`` is ``start``, ``step`` until the call is done, ``finish``. The pieces are public
so that another driver can run a round its own way (the scale simulator's bounded rollout
plans and runs rounds without reading anything back).
"""

from __future__ import annotations

import functools
import logging
import time
import warnings
from collections.abc import Callable, Mapping, Sequence

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from titan_cotrain.components.private_torch import check_private_api
from titan_cotrain.models.draft import Draft, DraftKVCache
from titan_cotrain.models.kv_cache import PagedKV, RowsKV
from titan_cotrain.models.transformer import Transformer
from titan_cotrain.ops import flash
from titan_cotrain.parallel.engine_tp import kv_heads_per_rank
from titan_cotrain.parallel.storage import FreedStorages, device_storages
from titan_cotrain.engine.engine_copy import copy_state, empty_copy
from titan_cotrain.engine.generation import Generation, Rollouts, Round, Sequences
from titan_cotrain.engine.kv_blocks import Admitted, BlockAllocator, Resumed, Scheduler
from titan_cotrain.engine.kv_budget import KVBudget, KVPoolLayout
from titan_cotrain.engine.round_stats import RolloutStats, StepCounters, live_bucket
from titan_cotrain.engine.sampling import (
    SamplingParams,
    draw,
    greedy_accept,
    processed_logits,
    sample,
    speculative_accept,
)

__all__ = ["RolloutEngine", "RolloutStats", "Rollouts"]


def _pad_prompts(prompts: Sequence[torch.Tensor | Sequence[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad ragged prompts with token 0: host ``tokens [B, P_max]``, ``lens [B]``."""
    rows = [torch.as_tensor(p, dtype=torch.int64).flatten() for p in prompts]
    if not rows or any(r.numel() == 0 for r in rows):
        raise ValueError("generate needs at least one prompt, and every prompt at least one token")
    lens = torch.tensor([r.numel() for r in rows])
    tokens = torch.zeros(len(rows), int(lens.max()), dtype=torch.int64)
    for i, r in enumerate(rows):
        tokens[i, : r.numel()] = r
    return tokens, lens


# Inductor counts every graph it runs without CUDA graphs (when it compiles one, or when its
# graph tree gives up on one at run time) and says why on its ``cudagraphs`` log. Both are
# private to torch, the same in 2.11-2.13.
_CUDAGRAPH_SKIPS_TORCH = ("2.11", "2.12", "2.13")


class _CudaGraphSkips(logging.Handler):
    """Inductor's count of graphs run without CUDA graphs (``count``) and the last reason its
    ``cudagraphs`` log gave (``last``: "skipping cudagraphs due to ...")."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        check_private_api("torch._inductor.cudagraph_utils.cudagraphs_log, counters['inductor']['cudagraph_skips']",
                          "titan_cotrain.engine.rollout._CudaGraphSkips", _CUDAGRAPH_SKIPS_TORCH)
        from torch._inductor.cudagraph_utils import cudagraphs_log

        self.last: str | None = None
        cudagraphs_log.addHandler(self)

    def emit(self, record: logging.LogRecord) -> None:
        self.last = record.getMessage()

    @staticmethod
    def count() -> int:
        from torch._dynamo.utils import counters

        return counters["inductor"]["cudagraph_skips"]


@functools.cache
def _cudagraph_skips() -> _CudaGraphSkips:
    return _CudaGraphSkips()


class _CompiledStep:
    """A fixed-shape decoding step under ``torch.compile``, called ``name`` in warnings.

    With ``cuda_graphs`` (an engine on CUDA) the mode is ``reduce-overhead``: a decode step is
    launch-bound. Inductor captures a graph only if every input it writes in place has a
    static address (the engine marks its caches so); otherwise it runs the graph kernel by
    kernel and says so in one log line. The step then warns once, naming itself and
    inductor's reason, and keeps the reason in ``skipped``; ``ran`` says whether it has run.

    Up to ``graphs`` graphs of the step are kept: past dynamo's recompile limit a step would
    fall back to eager silently. The limit is raised only while the step runs, so the
    process's setting stays what it was."""

    def __init__(self, fn: Callable, name: str, graphs: int, cuda_graphs: bool) -> None:
        self.name, self.graphs, self.cuda_graphs = name, graphs, cuda_graphs
        self.compiled = torch.compile(fn, dynamic=False, mode="reduce-overhead" if cuda_graphs else None)
        self.ran = False
        self.skipped: str | None = None

    def __call__(self, *args, **kwargs):
        limit = max(torch._dynamo.config.recompile_limit, self.graphs)
        with torch._dynamo.config.patch(recompile_limit=limit):
            if not self.cuda_graphs:
                return self.compiled(*args, **kwargs)
            skips = _cudagraph_skips()
            before, skips.last = skips.count(), None
            out = self.compiled(*args, **kwargs)
        self.ran = True
        if skips.count() != before and self.skipped is None:
            self.skipped = skips.last or "inductor counted a skip and gave no reason"
            warnings.warn(f"[rollout] the compiled {self.name} runs without CUDA graphs, so every decoding round "
                          f"launches its kernels one by one: {self.skipped}", stacklevel=2)
        return out


class RolloutEngine:
    """Batched generation for the RL loop, plain or with the EAGLE-3 draft.

    ``policy`` and ``draft`` are the engine's own inference copies (plain modules, not
    FSDP-wrapped; ``from_models`` makes them from the trainer's models); ``load_weights``
    refreshes them in place from the trainer's state after every step.

    The KV cache (target and draft trunk) is a pool of blocks of ``block_size`` positions,
    allocated once in the policy's dtype (``models.kv_cache``): ``kv_cache_gib`` GiB of it
    (0: enough for ``max_batch_size`` sequences of ``max_seq_len`` tokens, prompt +
    response, at their longest; a ``engine.kv_budget.KVBudget``, ``"auto"``: what the GPU has
    left beside the training state, these weights and the transient). ``max_batch_size`` is
    the running batch's rows; a sequence holds the blocks of the positions it has reached,
    so a budget that would hold few sequences at their longest runs more at once, and
    ``generate`` takes any number of prompts (``engine.kv_blocks`` admits them as rows and
    blocks free up).

    ``paged=False`` is the static layout instead: one block of ``max_seq_len + k + 1``
    positions per row, ``max_batch_size`` lowered to the rows a budget holds, prompts in
    waves (a wave starts when the last one has finished), no shared prompt blocks (the
    benchmark's baseline). On a GPU both layouts attend through the paged flash kernel where
    it reads the pool (torch 2.13, blocks of a multiple of 256 positions: a static row is one
    block); elsewhere the paged layout gathers its rows' blocks and the static one reads views.

    A tensor-parallel policy copy (``from_models(tp_mesh=...)``, ``parallel.engine_tp``)
    holds ``1 / t`` of the KV heads per rank, so its pool does too; every rank of its mesh
    calls ``generate`` with the same prompts and seed and gets the same rollouts (the
    schedule follows the sequences' lengths, the same on every rank).

    ``compile`` wraps the fixed-shape steps (target decode / verify, draft chain step and
    catch-up) in ``torch.compile``: one graph per ``k`` (and chain depth), as the steps then
    always run every row against block tables of a whole sequence's width (CUDA graphs want
    fixed shapes; uncompiled, a round decodes only the rows in use, over the blocks they
    reach). Worth it on GPU, slow to build on CPU. The prefill (ragged width) stays eager.
    On CUDA the steps run as CUDA graphs: the caches they write are static addresses
    (docs/DESIGN.md section 14), and ``cuda_graphs_captured`` says whether torch captured them.
    """

    def __init__(self, policy: Transformer, draft: Draft | None = None, *, max_batch_size: int, max_seq_len: int,
                 max_draft_tokens: int = 4, kv_cache_gib: float | KVBudget = 0.0, block_size: int = 16,
                 paged: bool = True, compile: bool = False) -> None:
        if draft is not None and draft.args.target_dim != policy.args.dim:
            raise ValueError(f"draft expects target width {draft.args.target_dim}, policy has {policy.args.dim}")
        self.policy, self.draft = policy.eval(), draft.eval() if draft is not None else None
        self._released: FreedStorages | None = None  # what ``release`` freed
        self.max_seq_len = max_seq_len
        self.max_draft_tokens = max_draft_tokens if draft is not None else 0
        weight = policy.embed_tokens.weight
        dtype = weight.dtype
        self.tensor_parallel = weight.device_mesh.size() if isinstance(weight, DTensor) else 1
        self.layout = layout = KVPoolLayout.from_budget(
            kv_cache_gib, policy.args, draft.args if draft is not None else None, dtype,
            engine_weights=self.weight_bytes, max_batch_size=max_batch_size, max_seq_len=max_seq_len,
            max_draft_tokens=self.max_draft_tokens, block_size=block_size, paged=paged,
            tensor_parallel=self.tensor_parallel)
        if (paged and weight.device.type == "cuda" and flash.has_paged_kernel()
                and block_size % flash.PAGE_MULTIPLE):
            warnings.warn(f"[rollout] kv_block_size = {block_size} is not a multiple of {flash.PAGE_MULTIPLE}: the "
                          "paged flash kernel cannot read the pool, so every decoding step gathers its rows' blocks "
                          f"instead (set kv_block_size = {flash.PAGE_MULTIPLE})", stacklevel=2)
        self.compiled = compile
        self.target_pool = policy.new_kv_pool(layout.n_blocks, layout.block_size, dtype,
                                              n_kv_heads=kv_heads_per_rank(policy.args.n_kv_heads,
                                                                           self.tensor_parallel))
        self.draft_pool = self.chain_k = self.chain_v = None
        if draft is not None:
            self.draft_pool = draft.new_kv_pool(layout.n_blocks, layout.block_size, dtype)
        if draft is not None and draft.args.chain_cache:
            chain_shape = (layout.max_batch_size, layout.chain_slots, draft.args.n_kv_heads, draft.args.head_dim)
            self.chain_k = torch.zeros(chain_shape, dtype=dtype, device=self.device)
            self.chain_v = torch.zeros(chain_shape, dtype=dtype, device=self.device)
        self.compiled_steps: list[_CompiledStep] = []
        if compile:
            # The steps write the caches in place: CUDA graphs capture a step only if those are
            # static addresses (docs/DESIGN.md section 14).
            for cache in self.cache_tensors():
                torch._dynamo.mark_static_address(cache)

        def step(fn: Callable, name: str) -> Callable:
            if not compile:
                return fn
            # One graph per k for the verify (k + 1 positions, taps or not) and the catch-up:
            # k chosen per round reaches every k in 0..max_draft_tokens in one call.
            self.compiled_steps.append(_CompiledStep(fn, name, 2 * (max_draft_tokens + 2), self.device.type == "cuda"))
            return self.compiled_steps[-1]

        self._target_step = step(policy.forward_cached, "policy.forward_cached (decode, verify)")
        eagle = isinstance(draft, Draft)
        self._draft_chain_step = step(draft.chain_step, "draft.chain_step") if eagle else None
        self._draft_extend = step(draft.extend, "draft.extend") if eagle else None

    # The pool's layout, read through the engine (``KVPoolLayout``).
    max_batch_size = property(lambda self: self.layout.max_batch_size, doc="Rows of the running batch.")
    paged = property(lambda self: self.layout.paged, doc="Blocks taken as sequences grow (else static rows).")
    block_size = property(lambda self: self.layout.block_size, doc="Positions of a KV block.")
    blocks_per_sequence = property(lambda self: self.layout.blocks_per_sequence,
                                   doc="Blocks of one sequence at its longest.")
    kv_block_bytes = property(lambda self: self.layout.block_bytes, doc="Bytes of one block (target and draft trunk).")

    @property
    def weight_bytes(self) -> int:
        """Device bytes of the engine's weights and buffers (this rank's slice of a tensor-parallel copy)."""
        tensors = [t for m in (self.policy, self.draft) if m is not None for t in (*m.parameters(), *m.buffers())]
        return sum(storage.nbytes() for storage in device_storages(tensors, self.device.type))

    @property
    def cuda_graphs_captured(self) -> bool | None:
        """Whether torch runs every compiled step that has run so far as CUDA graphs; None
        when none has run on CUDA (not compiled, another device, nothing generated yet)."""
        ran = [s for s in self.compiled_steps if s.cuda_graphs and s.ran]
        return not any(s.skipped for s in ran) if ran else None

    @property
    def cuda_graph_skips(self) -> dict[str, str]:
        """The compiled steps torch runs without CUDA graphs, each with inductor's reason."""
        return {s.name: s.skipped for s in self.compiled_steps if s.skipped}

    @property
    def kv_pool_bytes(self) -> int:
        """Device bytes of the KV caches (pools and draft chains)."""
        return sum(t.nbytes for t in self.cache_tensors())

    @classmethod
    def from_models(cls, policy: Transformer, draft: Draft | None = None, *, device: torch.device | str,
                    dtype: torch.dtype | None = None, max_batch_size: int, max_seq_len: int,
                    max_draft_tokens: int = 4, kv_cache_gib: float | KVBudget = 0.0, block_size: int = 16,
                    paged: bool = True, compile: bool = False, load: bool = True,
                    tp_mesh: DeviceMesh | None = None) -> RolloutEngine:
        """An engine with its own copies of the trainer's ``policy`` and ``draft`` on ``device``.

        The sources may be FSDP-wrapped (DTensor shards), plain, or on another device; they
        are never copied whole. The copies are built on the meta device, materialised on
        ``device`` in ``dtype`` (default: fp32 on CPU, so CPU rollouts match the trainer's
        fp32 policy exactly; bf16 on an accelerator), and filled by ``load_weights``, one
        tensor at a time, buffers (``d2t``, ``t2d``) included. With sharded sources this is
        a collective: every rank of their mesh calls it. ``load=False`` takes only the
        shapes (sources on the meta device, e.g. a pipeline's whole model): fill the engine
        with ``load_weights`` later. ``tp_mesh``: split the policy's copy over this engine
        group's ranks (``parallel.engine_tp``; the draft stays whole). Other arguments as
        ``__init__``.
        """
        device = torch.device(device)
        dtype = dtype or (torch.float32 if device.type == "cpu" else torch.bfloat16)
        own_policy = empty_copy(lambda: Transformer(policy.args, policy.tap_layers), device, dtype, tp_mesh)
        own_draft = empty_copy(lambda: cls._draft_shell(draft), device, dtype) if draft is not None else None
        engine = cls(own_policy, own_draft, max_batch_size=max_batch_size, max_seq_len=max_seq_len,
                     max_draft_tokens=max_draft_tokens, kv_cache_gib=kv_cache_gib, block_size=block_size, paged=paged,
                     compile=compile)
        if load:
            engine.load_weights(policy.state_dict(), draft.state_dict() if draft is not None else None)
        return engine

    @staticmethod
    def _draft_shell(draft: Draft) -> Draft:
        """An uninitialised draft of ``draft``'s shapes (``from_models`` fills it)."""
        d2t, t2d = draft.d2t, draft.t2d
        return Draft(draft.args, torch.empty(d2t.shape, dtype=d2t.dtype), torch.empty(t2d.shape, dtype=t2d.dtype))

    @property
    def device(self) -> torch.device:
        return self.policy.embed_tokens.weight.device

    def load_weights(self, policy_state: Mapping[str, torch.Tensor],
                     draft_state: Mapping[str, torch.Tensor] | None = None) -> None:
        """Copy new weights into the engine's models in place; caches and compiled graphs stay.

        The states are ``state_dict()``s of the trained models (same names; values are cast
        to the engine's dtype and moved to its device). FSDP2-sharded entries (DTensors) are
        gathered one tensor at a time, in the engine's dtype, so the peak is one whole
        parameter (a tensor-parallel copy keeps its slice of it); the gather is a
        collective: every rank of the training mesh calls this, in the same order,
        generating or not.
        """
        self.restore()
        copy_state(self.policy, policy_state)
        if draft_state is not None:
            if self.draft is None:
                raise ValueError("this engine has no draft to load weights into")
            copy_state(self.draft, draft_state)

    def release(self) -> None:
        """Free the device memory of the weights and KV caches until the next ``load_weights``
        (which rewrites every weight anyway): between rollouts, the update phase of a colocated
        trainer gets it. Their storages shrink to nothing and the tensors stay (FSDP2's way of
        freeing unsharded parameters), so compiled graphs and a tensor-parallel copy's DTensors
        keep pointing at them: no recompile; on CUDA a graph whose storages come back at other
        addresses is recorded anew at its next call. Buffers (RoPE, the draft's vocabulary
        maps) stay."""
        if self._released is not None:
            return
        tensors = [p for m in (self.policy, self.draft) if m is not None for p in m.parameters()]
        tensors += self.cache_tensors()
        self._released = FreedStorages(device_storages(tensors, self.device.type))

    def restore(self) -> None:
        """Re-allocate what ``release`` freed (weights uninitialised, caches zeroed); a no-op
        otherwise. ``load_weights`` calls it; call it first when a state mapping is built from
        the engine's own shapes (a pipeline's streamed weights)."""
        if self._released is None:
            return
        self._released.restore()
        self._released = None
        for t in self.cache_tensors():
            t.zero_()

    def cache_tensors(self) -> list[torch.Tensor]:
        """The KV caches' storage (target and draft pools, the draft's chains), for memory reports."""
        pools = [self.target_pool] + ([self.draft_pool] if self.draft_pool is not None else [])
        chains = [self.chain_k, self.chain_v] if self.chain_k is not None else []
        return [t for pool in pools for t in (pool.k, pool.v)] + chains

    @torch.no_grad()
    def generate(self, prompts: Sequence[torch.Tensor | Sequence[int]], params: SamplingParams, *,
                 samples_per_prompt: int = 1, draft_tokens: int | Callable[[int], int] | None = None,
                 generator: torch.Generator | None = None,
                 progress: Callable[[int, int], None] | None = None) -> Rollouts:
        """Sample ``samples_per_prompt`` (``G``) responses per prompt.

        ``prompts``: token ids, ragged, any number. Row ``i * G + g`` of the result is sample
        ``g`` of prompt ``i``; a prompt is prefilled once for its ``G`` samples (they share its
        KV blocks; the static layout prefills each). ``draft_tokens`` is ``k`` (default: the
        engine's ``max_draft_tokens``; 0 decodes without the draft), or a function that picks
        ``k`` in ``0..max_draft_tokens`` before every decoding round from the number of
        sequences that round decodes (``SpeculationTuner.choose_round``): the draft then
        follows the whole call (reads every prompt, and catches up over the token of a round
        that drafts nothing) so that any round can draft. ``generator`` (on the engine's
        device) seeds every draw; greedy results do not depend on the schedule, sampled ones
        do (same distribution, other draws). ``progress(finished, total)``, if given, is called
        after every decoding round with the number of finished responses. A finished call
        leaves its caches zeroed.
        """
        call = self.start(prompts, params, samples_per_prompt=samples_per_prompt, draft_tokens=draft_tokens,
                          generator=generator, progress=progress)
        while not call.done():
            self.step(call)
        return self.finish(call)

    def start(self, prompts: Sequence[torch.Tensor | Sequence[int]], params: SamplingParams, *,
              samples_per_prompt: int = 1, draft_tokens: int | Callable[[int], int] | None = None,
              generator: torch.Generator | None = None,
              progress: Callable[[int, int], None] | None = None) -> Generation:
        """A ``generate`` call with nothing run yet (arguments as ``generate``): its prompts
        queued as GRPO groups, every row free, the outputs allocated."""
        if self._released is not None:
            raise RuntimeError("the engine's weights and caches were released: load_weights first")
        choose = draft_tokens if callable(draft_tokens) else None
        if choose is not None and self.draft is None:
            raise ValueError("a per-round choice of draft_tokens needs an engine with a draft")
        k = self.max_draft_tokens if draft_tokens is None or choose is not None else draft_tokens
        if not 0 <= k <= self.max_draft_tokens:
            raise ValueError(f"draft_tokens must be in 0..{self.max_draft_tokens} for this engine, got {k}")
        if samples_per_prompt < 1:
            raise ValueError(f"samples_per_prompt must be >= 1, got {samples_per_prompt}")
        vocab = self.policy.args.vocab_size
        if outside := [t for t in params.stop_token_ids if t >= vocab]:
            raise ValueError(f"stop_token_ids {outside} are outside the policy's vocabulary of {vocab} tokens")
        prompt, prompt_lens = _pad_prompts(prompts)
        if prompt.shape[1] + params.max_new_tokens > self.max_seq_len:
            raise ValueError(f"longest prompt ({prompt.shape[1]}) + max_new_tokens ({params.max_new_tokens}) "
                             f"exceeds the engine's max_seq_len {self.max_seq_len}")
        samples = samples_per_prompt
        if not self.paged and samples > 1:  # the static layout has no shared blocks: G prompts
            prompt, prompt_lens, samples = prompt.repeat_interleave(samples, 0), prompt_lens.repeat_interleave(samples), 1
        total = len(prompt_lens) * samples
        scheduler = Scheduler(BlockAllocator(self.target_pool.n_blocks, scratch=self.paged), self.block_size,
                              self.max_batch_size, prompt_lens.tolist(), samples, params.max_new_tokens, k,
                              waves=not self.paged)
        draft_to_target = self._draft_to_target() if k else None
        counters = StepCounters(synchronize=torch.get_device_module(self.device).synchronize,
                                k_max=self.max_draft_tokens, buckets=live_bucket(self.max_batch_size) + 1,
                                width=min(self.max_batch_size, total))
        seqs = Sequences.start(self.max_batch_size, total, params.max_new_tokens, k,
                               self.draft.args.dim if k else 0, self.device, self.policy.embed_tokens.weight.dtype)
        stops = torch.tensor(params.stops, dtype=torch.int64, device=self.device)
        return Generation(params, stops, generator, prompt, prompt_lens, samples, k, choose, draft_to_target,
                          scheduler, seqs, counters, progress)

    def step(self, call: Generation) -> None:
        """One decoding round of ``call``, as a serving engine steps: schedule, run, postprocess."""
        round_ = self.schedule(call)
        self.run(call, round_)
        self.postprocess(call, round_)

    def schedule(self, call: Generation) -> Round:
        """The host's part of a round: ``admit``, then cover the positions the round writes
        (preempting the youngest sequences when the pool runs dry), then ``plan``."""
        self.admit(call)
        started = time.perf_counter()
        call.seqs.free(call.scheduler.grow(), self.device)
        return self.plan(call, started)

    @torch.no_grad()
    def admit(self, call: Generation) -> None:
        """Fill free rows (``Scheduler.admit``): recompute the preempted sequences that
        return, prefill the groups that enter."""
        admitted = call.scheduler.admit()
        if not admitted:
            return
        with call.counters.timed("prefill"):
            if admitted.resumed:
                self._recompute(call, admitted.resumed)
            if admitted.prompts:
                self._prefill(call, admitted)

    def plan(self, call: Generation, started: float | None = None, *, width: int | None = None) -> Round:
        """The next round over the rows as they are: busy rows compacted to the front, its
        ``k`` chosen, the caches' views. The block tables are ``width`` blocks wide (default:
        what the rows reach, a sequence at its longest when compiled). ``started``: when the
        round began (default: now)."""
        scheduler = call.scheduler
        if self.paged:
            call.seqs.move(*scheduler.compact(), self.device)
        live = scheduler.live()
        k = call.choose(live) if call.choose is not None else call.k
        if not 0 <= k <= call.k:
            raise ValueError(f"the per-round choice of draft_tokens must be in 0..{call.k}, got {k}")
        # Compiled steps see one shape per k: every row, the widest table.
        rows = self.max_batch_size if self.compiled else scheduler.running_rows()
        if width is None and self.compiled:
            width = self.blocks_per_sequence
        target_cache, draft_cache = self._caches(scheduler, call.drafting, rows, width)
        return Round(k, live, rows, target_cache, draft_cache, time.perf_counter() if started is None else started)

    @torch.no_grad()
    def run(self, call: Generation, round_: Round) -> None:
        """The device's part of a round: a speculative round of ``round_.k`` drafted tokens
        when the draft follows the call, else a plain decoding step, over the round's rows."""
        running = call.seqs.head(round_.rows)
        if call.drafting:
            self._speculative_round(running, call, round_)
        else:
            with call.counters.timed("verify"):
                self._decode_one_token(running, call, round_.target_cache)
        call.seqs.absorb(running)

    def postprocess(self, call: Generation, round_: Round) -> None:
        """After a round: its one host sync (every row's length and whether it still decodes),
        finished sequences retired from their rows and blocks, the round counted, progress told."""
        seqs, scheduler = call.seqs, call.scheduler
        length, active = torch.stack([seqs.length, seqs.active.long()]).tolist()
        seqs.retire(scheduler.retire(length, [bool(a) for a in active]), self.device)
        mode = 1 + round_.k if call.drafting else 0
        call.counters.round_done(mode, round_.live, time.perf_counter() - round_.started)
        if call.progress is not None:
            call.progress(scheduler.retired, call.total)

    def finish(self, call: Generation) -> Rollouts:
        """The finished ``call``'s responses and statistics (the counters read back once).
        Nothing a rollout leaves in the caches reaches the next: stale slots are masked, but a
        non-finite one would still poison the masked products (0 * inf), so they are zeroed
        (one memset)."""
        seqs, scheduler = call.seqs, call.scheduler
        stats = call.counters.stats(int(seqs.out_len.sum()), call.params.max_new_tokens,
                                    prompts=len(call.prompt_lens), drafting=call.drafting,
                                    kv_peak_bytes=scheduler.allocator.peak * self.kv_block_bytes,
                                    preemptions=scheduler.preemptions, recomputed_tokens=scheduler.recomputed)
        result = seqs.result(call.prompt_lens.repeat_interleave(call.samples).to(self.device),
                             call.params.max_new_tokens, stats)
        for cache in self.cache_tensors():
            cache.zero_()
        return result

    def _caches(self, scheduler: Scheduler, drafting: bool, rows: int,
                width: int | None) -> tuple[PagedKV | RowsKV, DraftKVCache | None]:
        """The views of the pools for one round over the first ``rows`` rows: their block
        tables (``width`` blocks wide, default what they reach), or the static layout's rows."""
        if self.paged:
            table = torch.tensor(scheduler.table(rows, width), dtype=torch.int64, device=self.device)
            views = [pool.view(table) if pool is not None else None for pool in (self.target_pool, self.draft_pool)]
        else:
            views = [pool.rows(0, rows) if pool is not None else None for pool in (self.target_pool, self.draft_pool)]
        target, trunk = views
        if not drafting:
            return target, None
        return target, self._draft_cache(trunk, rows)

    def _draft_to_target(self) -> torch.Tensor:
        """``int64 [V_d]``: the target id of each draft id."""
        return self.draft.d2t + torch.arange(self.draft.args.draft_vocab_size, device=self.device)

    def _draft_cache(self, trunk: PagedKV | RowsKV, rows: int) -> DraftKVCache:
        """What a round's draft reads, over the first ``rows`` rows: the trunk's view and the chains."""
        # A round over every row (a compiled one) gets the chains themselves: a view of them
        # would be a tensor of its own, without their static-address mark.
        chains = [chain if rows == len(chain) else chain[:rows] for chain in (self.chain_k, self.chain_v)]
        return DraftKVCache(trunk, *chains)

    def _prefill(self, call: Generation, admitted: Admitted) -> None:
        """Bring the ``admitted`` groups into their rows: one target forward over their
        (right-padded) prompts, ``G`` first tokens drawn from each prompt's last logits, the
        rows' block tables (copy-on-write of each prompt's last block) and, when drafting,
        TTT pass 1: over the prompt positions once per prompt, then at the last one per
        sample (anchor ``P - 1`` reads the sample's first token). The prefill attends to
        the prompts' positions only."""
        seqs, scheduler, params, drafting = call.seqs, call.scheduler, call.params, call.drafting
        device = self.device
        # Group of each sample row, from the host counts (a data-dependent repeat_interleave
        # has no static shape for the simulator's fake tensors).
        group = torch.tensor([i for i, count in enumerate(admitted.counts()) for _ in range(count)], device=device)
        lens = torch.tensor(admitted.lengths, device=device)
        width = int(max(admitted.lengths))
        tokens = call.prompt[admitted.prompts, :width].to(device)
        n = len(admitted.prompts)
        if self.paged:
            table = torch.tensor(scheduler.padded_tables(admitted.prompt_blocks, width), dtype=torch.int64,
                                 device=device)
            target_view = self.target_pool.view(table)
            trunk_view = self.draft_pool.view(table) if drafting else None
        else:  # waves fill rows 0 .. n - 1, which are blocks 0 .. n - 1
            target_view = self.target_pool.rows(admitted.prompt_blocks[0][0], n, width)
            trunk_view = self.draft_pool.rows(admitted.prompt_blocks[0][0], n, width) if drafting else None
        last = lens - 1
        out = self.policy.forward_cached(tokens, target_view, torch.zeros_like(lens), return_taps=drafting,
                                         logits_at=last)
        logits = processed_logits((out.logits if drafting else out)[:, 0], params)[group]
        token = draw(logits, params, call.generator)
        logprob = logits.log_softmax(-1).gather(-1, token.unsqueeze(-1))
        # Copy-on-write of each prompt's last block for samples 1..G-1: the target's keys are
        # written now; the draft's only after its pass over the prompt below.
        src, dst = (torch.tensor(blocks, dtype=torch.int64, device=device) for blocks in scheduler.fork(admitted))
        if src.numel():
            self.target_pool.copy_blocks(src, dst)
        slots = [s for group_slots in admitted.slots for s in group_slots]
        rows = torch.tensor(slots, device=device)
        seqs.admit(rows, torch.tensor(scheduler.output_rows(slots), device=device), lens[group])
        self._commit(seqs, *seqs.new_tokens(rows, token, logprob.squeeze(-1)), params.max_new_tokens, call.stops)
        if drafting:
            self._prefill_draft(call, tokens, torch.cat(out.taps, -1), last, group, token, trunk_view, src, dst,
                                slots, rows)

    def _prefill_draft(self, call: Generation, tokens: torch.Tensor, taps: torch.Tensor, last: torch.Tensor,
                       group: torch.Tensor, token: torch.Tensor, trunk_view: PagedKV | RowsKV, src: torch.Tensor,
                       dst: torch.Tensor, slots: list[int], rows: torch.Tensor) -> None:
        """The draft's part of a prefill (``_prefill``): ``tokens [n, width]`` the admitted
        prompts (their last positions ``last [n]``), ``taps`` the target's there, ``token``
        the samples' first tokens (sample ``i`` of prompt ``group[i]``, in row ``rows[i]``,
        slot ``slots[i]``), ``trunk_view`` the draft pool over the prompts' blocks, ``src ->
        dst`` the copy-on-write of their last blocks."""
        seqs, scheduler, device = call.seqs, call.scheduler, self.device
        n = tokens.shape[0]
        chain = (self.chain_k[:n], self.chain_v[:n])
        self.draft.extend(taps, self._draft_embed(torch.roll(tokens, -1, dims=1)), torch.zeros_like(last),
                          DraftKVCache(trunk_view, *chain))
        if src.numel():
            self.draft_pool.copy_blocks(src, dst)
        taps_last = taps[group, last[group]].unsqueeze(1)
        if self.paged:
            table = scheduler.table()
            sample_view = self.draft_pool.view(torch.tensor([table[s] for s in slots], dtype=torch.int64,
                                                            device=device))
        else:
            sample_view = trunk_view
        chain = (self.chain_k[: len(rows)], self.chain_v[: len(rows)])
        hidden = self.draft.extend(taps_last, self._draft_embed(token.unsqueeze(1)), last[group],
                                   DraftKVCache(sample_view, *chain))
        seqs.draft_hidden[rows] = hidden[:, 0]

    def _recompute(self, call: Generation, resumed: list[Resumed]) -> None:
        """Bring preempted sequences back into their new rows as decoding had left them
        (``engine.kv_blocks``): with ``n`` committed tokens ``x_0 .. x_{n-1}`` (prompt, then the
        response so far, read from the outputs on the device), one target forward over
        ``x_0 .. x_{n-2}`` rewrites their KV at positions ``0 .. n-2`` and, when drafting,
        TTT pass 1 over the same anchors (embeddings of ``x_1 .. x_{n-1}``) rewrites the
        trunk and gives ``h1`` at anchor ``n - 2``. Nothing is drawn: the rows go on from
        ``x_{n-1}``, their outputs untouched."""
        if not self.paged:
            raise RuntimeError("the static layout never preempts")
        seqs, prompt, drafting = call.seqs, call.prompt, call.drafting
        device = self.device
        m = len(resumed)
        which = [r.prompt for r in resumed]
        lengths = torch.tensor([r.length for r in resumed], device=device)
        starts = call.prompt_lens[which].to(device)  # where each response begins
        width = max(r.length for r in resumed)
        j = torch.arange(width, device=device)
        from_prompt = prompt[which].to(device).gather(1, j.clamp(max=prompt.shape[1] - 1).expand(m, -1))
        out_rows = torch.tensor([r.seq for r in resumed], device=device)
        columns = (j - starts.unsqueeze(1)).clamp(min=0, max=seqs.tokens.shape[1] - 1)
        tokens = torch.where(j < starts.unsqueeze(1), from_prompt, seqs.tokens[out_rows].gather(1, columns))
        table = torch.tensor(call.scheduler.padded_tables([r.blocks for r in resumed], width - 1), dtype=torch.int64,
                             device=device)
        zeros = torch.zeros_like(lengths)
        out = self.policy.forward_cached(tokens[:, :-1], self.target_pool.view(table), zeros,
                                         return_taps=drafting, logits_at=lengths - 2)
        rows = torch.tensor([r.slot for r in resumed], device=device)
        seqs.resume(rows, out_rows, lengths, lengths - starts, tokens.gather(1, (lengths - 1).unsqueeze(1))[:, 0])
        if drafting:
            self._recompute_draft(call, tokens, torch.cat(out.taps, -1), table, rows, lengths)

    def _recompute_draft(self, call: Generation, tokens: torch.Tensor, taps: torch.Tensor, table: torch.Tensor,
                         rows: torch.Tensor, lengths: torch.Tensor) -> None:
        """The draft's part of ``_recompute``: the resumed sequences' committed ``tokens [m,
        width]`` (``lengths [m]`` of them), the target's ``taps`` at positions ``0 .. width - 2``,
        their block ``table``, their ``rows``."""
        m = len(rows)
        cache = DraftKVCache(self.draft_pool.view(table), self.chain_k[:m], self.chain_v[:m])
        hidden = self.draft.extend(taps, self._draft_embed(tokens[:, 1:]), torch.zeros_like(lengths), cache)
        call.seqs.draft_hidden[rows] = hidden[torch.arange(m, device=self.device), lengths - 2]

    def _decode_one_token(self, seqs: Sequences, call: Generation, target_cache: PagedKV | RowsKV) -> None:
        """Plain decoding of ``call``'s rows ``seqs``: feed ``x_{n-1}`` to the target and sample ``x_n``."""
        params = call.params
        logits = self._target_step(seqs.last_token.unsqueeze(1), target_cache, seqs.length - 1)
        logits = processed_logits(logits[:, 0], params)
        token = draw(logits, params, call.generator)
        logprob = logits.log_softmax(-1).gather(-1, token.unsqueeze(-1))
        call.counters.record(torch.zeros_like(token), seqs.active, seqs.response_len)
        self._commit(seqs, token.unsqueeze(-1), logprob, torch.ones_like(token), params.max_new_tokens, call.stops)

    def _speculative_round(self, seqs: Sequences, call: Generation, round_: Round) -> torch.Tensor:
        """``round_`` over ``call``'s rows ``seqs``: draft ``k`` tokens, verify them in one target
        forward, commit ``a + 1``, catch up (``k = 0``: a plain decoding step whose taps the
        draft catches up over). Returns ``a [B]``, the drafted tokens each row accepted (before
        a stop token or the length limit cut them)."""
        k, params, generator, counters = round_.k, call.params, call.generator, call.counters
        target_cache, draft_to_target = round_.target_cache, call.draft_to_target
        b = seqs.length.shape[0]
        rows = torch.arange(b, device=seqs.length.device)
        with counters.timed("draft"):
            drafted, draft_probs = self._draft(seqs, call, round_)
        with counters.timed("verify"):
            verify_tokens = torch.cat([seqs.last_token.unsqueeze(1), draft_to_target[drafted]], dim=1)
            start = seqs.length - 1
            out = self._target_step(verify_tokens, target_cache, start, return_taps=True)
            logits = processed_logits(out.logits, params)
            if not k:  # a plain decoding step, its taps kept for the draft's catch-up
                n_accepted, next_token = torch.zeros_like(start), draw(logits[:, 0], params, generator)
            elif params.greedy:
                n_accepted, next_token = greedy_accept(verify_tokens[:, 1:], logits)
            else:
                n_accepted, next_token = speculative_accept(
                    drafted, draft_probs, draft_to_target, logits.softmax(-1), generator
                )
            # Candidate j is the token at position n + j: drafted ones, then the drawn one at a.
            candidates = torch.cat([verify_tokens[:, 1:], verify_tokens.new_zeros(b, 1)], dim=1)
            candidates[rows, n_accepted] = next_token
            logprobs = logits.log_softmax(-1).gather(-1, candidates.unsqueeze(-1)).squeeze(-1)
            counters.record(n_accepted, seqs.active, seqs.response_len)
            self._commit(seqs, candidates, logprobs, n_accepted + 1, params.max_new_tokens, call.stops)
        with counters.timed("draft"):
            self._catch_up(seqs, round_, torch.cat(out.taps, -1), candidates, start, n_accepted)
        return n_accepted

    def _draft(self, seqs: Sequences, call: Generation, round_: Round) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A round's ``k`` drafted tokens: ``drafted [B, k]`` draft ids and, when sampling, the
        distributions they were drawn from, ``[B, k, V_d]`` (None when greedy). EAGLE-3: the
        draft's step from ``h1``, then ``Draft.chain_step`` for each further token."""
        k, params, generator = round_.k, call.params, call.generator
        b = seqs.length.shape[0]
        anchor = seqs.length - 2
        hidden, drafted, draft_probs = seqs.draft_hidden, [], []
        for depth in range(1, k + 1):
            if depth > 1:
                embeds = self._draft_embed(call.draft_to_target[drafted[-1]])
                hidden = self._draft_chain_step(embeds, hidden, anchor, depth, round_.draft_cache)
            logits = processed_logits(self.draft.logits(hidden), params)
            if params.greedy:
                drafted.append(logits.argmax(-1))
            else:
                draft_probs.append(logits.softmax(-1))
                drafted.append(sample(draft_probs[-1], generator))
        drafted = torch.stack(drafted, 1) if k else seqs.last_token.new_zeros(b, 0)
        return drafted, torch.stack(draft_probs, 1) if draft_probs else None

    def _catch_up(self, seqs: Sequences, round_: Round, taps: torch.Tensor, candidates: torch.Tensor,
                  start: torch.Tensor, n_accepted: torch.Tensor) -> None:
        """After the verify: the draft reads the ``k + 1`` verified positions from ``start``
        (``taps`` there, the committed ``candidates`` after them); EAGLE-3's TTT pass 1 over
        them, its output at the last accepted one the next round's ``h1``."""
        rows = torch.arange(seqs.length.shape[0], device=seqs.length.device)
        hidden = self._draft_extend(taps, self._draft_embed(candidates), start, round_.draft_cache)
        seqs.draft_hidden = hidden[rows, n_accepted]

    def _draft_embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """The draft's input embeddings of target ids: the current policy's table."""
        return self.draft.embed(tokens, self.policy.embed_tokens(tokens))

    @staticmethod
    def _commit(seqs: Sequences, candidates: torch.Tensor, logprobs: torch.Tensor, n_new: torch.Tensor,
                max_new_tokens: int, stops: torch.Tensor) -> None:
        """Append the first ``n_new[b]`` of ``candidates [B, s]`` (with ``logprobs``) to every
        active sequence, cut after its first stop token (any of ``stops [n_stop]``: a drafted
        token too, which drops the accepted ones after it) and at ``max_new_tokens``; mark
        the sequences that stopped finished and the ones that are done inactive."""
        s = candidates.shape[1]
        j = torch.arange(s, device=candidates.device)
        keep = (j < n_new.unsqueeze(1)) & (j < (max_new_tokens - seqs.response_len).unsqueeze(1))
        stop = keep & torch.isin(candidates, stops)
        stopped = stop.any(1)
        first_stop = torch.where(stopped, stop.long().argmax(1), s)
        keep &= j <= first_stop.unsqueeze(1)
        keep &= seqs.active.unsqueeze(1)
        n_kept = keep.sum(1)
        # Columns past n_kept hold junk that a later round overwrites or the mask drops; free
        # rows write to the outputs' scratch row.
        columns = seqs.response_len.unsqueeze(1) + j
        out_rows = seqs.out_row.unsqueeze(1).expand_as(columns)
        seqs.tokens[out_rows, columns] = candidates
        seqs.logprobs[out_rows, columns] = logprobs.to(seqs.logprobs.dtype)
        seqs.last_token = torch.where(n_kept > 0, candidates.gather(1, (n_kept - 1).clamp(min=0).unsqueeze(1))
                                      .squeeze(1), seqs.last_token)
        seqs.response_len += n_kept
        seqs.length += n_kept
        seqs.finished |= stopped & seqs.active
        seqs.active &= ~stopped & (seqs.response_len < max_new_tokens)
