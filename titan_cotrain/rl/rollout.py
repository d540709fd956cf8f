"""The rollout engine: batched generation from static KV caches, plain or speculative.

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

All shapes are static per ``(batch, k)``: finished sequences ride along without moving and
their outputs are dropped, so there is no Python loop over sequences.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TypeVar

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from titan_cotrain.models.args import ModelArgs
from titan_cotrain.models.draft import Draft, DraftArgs, DraftKVCache
from titan_cotrain.models.kv_cache import KVCache
from titan_cotrain.models.transformer import Transformer, rope_inv_freq
from titan_cotrain.parallel.engine_tp import fill_from_whole, tensor_parallel_engine_policy
from titan_cotrain.rl.rollout_state import RolloutStats, Rollouts, Sequences, StepCounters
from titan_cotrain.rl.sampling import (
    SamplingParams,
    draw,
    greedy_accept,
    processed_logits,
    sample,
    speculative_accept,
)

__all__ = ["RolloutEngine", "RolloutStats", "Rollouts", "kv_bytes_per_sequence"]


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


def _whole(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A whole tensor in ``dtype`` from a state-dict entry: DTensors (FSDP2 shards) are cast
    first, then all-gathered, so the gather moves the engine's bytes (bf16), not fp32."""
    return t.to(dtype).full_tensor() if isinstance(t, DTensor) else t


@torch.no_grad()
def _copy_state(module: nn.Module, state: Mapping[str, torch.Tensor]) -> None:
    """``module``'s tensors <- ``state``'s, one whole tensor at a time; a tensor-parallel
    engine keeps its slice of each."""
    own = module.state_dict()
    missing, unexpected = own.keys() - state.keys(), state.keys() - own.keys()
    if missing or unexpected:
        raise KeyError(f"state dict does not match the engine's {type(module).__name__}: "
                       f"missing {sorted(missing)}, unexpected {sorted(unexpected)}")
    for name, dst in own.items():  # the module's order: the same on every rank, as collectives need
        fill_from_whole(dst, _whole(state[name], dst.dtype))


def _cache_slots(max_seq_len: int, max_draft_tokens: int) -> tuple[int, int]:
    """``(positions, chain slots)`` of the engine's caches. A round writes ``k + 1`` positions
    past the last committed one, even for a sequence that is finished and no longer moves;
    the draft's chain holds passes ``2..k``."""
    return max_seq_len + max_draft_tokens + 1, max(max_draft_tokens - 1, 0)


def kv_bytes_per_sequence(policy: ModelArgs, draft: DraftArgs | None, max_seq_len: int, max_draft_tokens: int,
                          dtype: torch.dtype, tensor_parallel: int = 1) -> int:
    """KV-cache bytes one sequence takes on one rank of a ``RolloutEngine``: keys and values
    of every target layer (``1 / tensor_parallel`` of its KV heads) over ``L = max_seq_len +
    k + 1`` positions plus, with a draft (whole on every rank), the draft's over ``L`` trunk
    and ``k - 1`` chain slots (``k = max_draft_tokens``), in ``dtype``."""
    positions, chain = _cache_slots(max_seq_len, max_draft_tokens)
    elements = policy.n_layers * (policy.n_kv_heads // tensor_parallel) * policy.head_dim * positions
    if draft is not None:
        elements += draft.n_kv_heads * draft.head_dim * (positions + chain)
    return 2 * elements * dtype.itemsize


_Model = TypeVar("_Model", Transformer, Draft)


def _empty_copy(build: Callable[[], _Model], device: torch.device, dtype: torch.dtype,
                tp_mesh: DeviceMesh | None = None) -> _Model:
    """``build()`` on the meta device (split over ``tp_mesh`` when given), materialised
    uninitialised on ``device`` with its parameters in ``dtype``; the weights are the
    caller's to load. The RoPE frequencies (a non-persistent buffer, in no state dict) are
    recomputed, in fp32 as the trainer's are."""
    with torch.device("meta"):
        model = build().to(dtype)
    if tp_mesh is not None:
        tensor_parallel_engine_policy(model, tp_mesh)
    # to_empty gives each alias of a shared parameter (tied embeddings) a tensor of its own.
    ties: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        ties.setdefault(id(param), []).append(name)
    model.to_empty(device=device)
    for first, *aliases in ties.values():
        for alias in aliases:
            owner, _, leaf = alias.rpartition(".")
            setattr(model.get_submodule(owner), leaf, model.get_parameter(first))
    a = model.args
    model.rope_inv_freq = rope_inv_freq(a.head_dim, a.rope_theta, a.rope_scaling).to(device)
    return model


class RolloutEngine:
    """Batched generation for the RL loop, plain or with the EAGLE-3 draft.

    ``policy`` and ``draft`` are the engine's own inference copies (plain modules, not
    FSDP-wrapped; ``from_models`` makes them from the trainer's models); ``load_weights``
    refreshes them in place from the trainer's state after every step. KV caches for
    ``max_batch_size`` sequences of ``max_seq_len`` tokens (prompt + response) and chains of
    up to ``max_draft_tokens`` are allocated here, once, in the policy's dtype. A
    ``kv_cache_gib`` budget (0: none) lowers ``max_batch_size`` to the sequences that fit
    (``kv_bytes_per_sequence`` each); ``generate`` runs more prompts in waves of at most
    ``max_batch_size``, a smaller batch using the caches' leading rows.

    A tensor-parallel policy copy (``from_models(tp_mesh=...)``, ``parallel.engine_tp``)
    holds ``1 / t`` of the KV heads per rank, so its caches do too; every rank of its mesh
    calls ``generate`` with the same prompts and seed and gets the same rollouts.

    ``compile`` wraps the fixed-shape steps (target decode / verify, draft chain step and
    catch-up) in ``torch.compile``: one graph per ``(batch, k)``, worth it on GPU, slow to
    build on CPU. The prefill (ragged prompt width) stays eager.
    """

    def __init__(self, policy: Transformer, draft: Draft | None = None, *, max_batch_size: int, max_seq_len: int,
                 max_draft_tokens: int = 4, kv_cache_gib: float = 0.0, compile: bool = False) -> None:
        if draft is not None and draft.args.target_dim != policy.args.dim:
            raise ValueError(f"draft expects target width {draft.args.target_dim}, policy has {policy.args.dim}")
        self.policy, self.draft = policy.eval(), draft.eval() if draft is not None else None
        self._released: list | None = None  # what ``release`` freed
        self.max_seq_len = max_seq_len
        self.max_draft_tokens = max_draft_tokens if draft is not None else 0
        weight = policy.embed_tokens.weight
        dtype = weight.dtype
        self.tensor_parallel = weight.device_mesh.size() if isinstance(weight, DTensor) else 1
        if kv_cache_gib:
            per_sequence = kv_bytes_per_sequence(policy.args, draft.args if draft is not None else None, max_seq_len,
                                                 self.max_draft_tokens, dtype, self.tensor_parallel)
            fits = int(kv_cache_gib * 2**30 // per_sequence)
            if fits < 1:
                raise ValueError(
                    f"[rollout] kv_cache_gib = {kv_cache_gib} holds no sequence: one needs "
                    f"{per_sequence / 2**30:.4f} GiB ({per_sequence} bytes: max_seq_len {max_seq_len} + "
                    f"{self.max_draft_tokens} draft tokens + 1 positions in {dtype})")
            max_batch_size = min(max_batch_size, fits)
        self.max_batch_size = max_batch_size
        positions, chain = _cache_slots(max_seq_len, self.max_draft_tokens)
        self.target_cache = policy.new_kv_cache(max_batch_size, positions, dtype,
                                                n_kv_heads=policy.args.n_kv_heads // self.tensor_parallel)
        self.draft_cache = (
            draft.new_kv_cache(max_batch_size, positions, chain_len=chain, dtype=dtype) if draft is not None else None
        )
        # CUDA graphs on a GPU: a decode step is launch-bound.
        mode = "reduce-overhead" if self.device.type == "cuda" else None
        maybe_compile = (lambda fn: torch.compile(fn, dynamic=False, mode=mode)) if compile else (lambda fn: fn)
        self._target_step = maybe_compile(policy.forward_cached)
        self._draft_chain_step = maybe_compile(draft.chain_step) if draft is not None else None
        self._draft_extend = maybe_compile(draft.extend) if draft is not None else None

    @classmethod
    def from_models(cls, policy: Transformer, draft: Draft | None = None, *, device: torch.device | str,
                    dtype: torch.dtype | None = None, max_batch_size: int, max_seq_len: int,
                    max_draft_tokens: int = 4, kv_cache_gib: float = 0.0, compile: bool = False,
                    load: bool = True, tp_mesh: DeviceMesh | None = None) -> RolloutEngine:
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
        own_policy = _empty_copy(lambda: Transformer(policy.args, policy.tap_layers), device, dtype, tp_mesh)
        own_draft = None
        if draft is not None:
            d2t, t2d = draft.d2t, draft.t2d
            own_draft = _empty_copy(lambda: Draft(draft.args, torch.empty(d2t.shape, dtype=d2t.dtype),
                                                  torch.empty(t2d.shape, dtype=t2d.dtype)), device, dtype)
        engine = cls(own_policy, own_draft, max_batch_size=max_batch_size, max_seq_len=max_seq_len,
                     max_draft_tokens=max_draft_tokens, kv_cache_gib=kv_cache_gib, compile=compile)
        if load:
            engine.load_weights(policy.state_dict(), draft.state_dict() if draft is not None else None)
        return engine

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
        _copy_state(self.policy, policy_state)
        if draft_state is not None:
            if self.draft is None:
                raise ValueError("this engine has no draft to load weights into")
            _copy_state(self.draft, draft_state)

    def release(self) -> None:
        """Free the device memory of the weights and KV caches until the next ``load_weights``
        (which rewrites every weight anyway): between rollouts, the update phase of a colocated
        trainer gets it. Their storages shrink to nothing and the tensors stay (FSDP2's way of
        freeing unsharded parameters), so compiled graphs and a tensor-parallel copy's DTensors
        keep pointing at them. Buffers (RoPE, the draft's vocabulary maps) stay."""
        if self._released is not None:
            return
        tensors = [p for m in (self.policy, self.draft) if m is not None for p in m.parameters()]
        tensors += self.cache_tensors()
        storages = [(t.to_local() if isinstance(t, DTensor) else t).untyped_storage() for t in tensors]
        self._released = [(storage, storage.nbytes()) for storage in storages]
        for storage, _ in self._released:
            storage.resize_(0)

    def restore(self) -> None:
        """Re-allocate what ``release`` freed (weights uninitialised, caches zeroed); a no-op
        otherwise. ``load_weights`` calls it; call it first when a state mapping is built from
        the engine's own shapes (a pipeline's streamed weights)."""
        if self._released is None:
            return
        for storage, nbytes in self._released:
            storage.resize_(nbytes)
        self._released = None
        for t in self.cache_tensors():
            t.zero_()

    def cache_tensors(self) -> list[torch.Tensor]:
        """The KV caches' storage (target and draft keys and values), for memory reports."""
        caches = [self.target_cache] + ([self.draft_cache] if self.draft_cache is not None else [])
        return [t for cache in caches for t in (cache.k, cache.v)]

    @torch.no_grad()
    def generate(self, prompts: Sequence[torch.Tensor | Sequence[int]], params: SamplingParams, *,
                 draft_tokens: int | None = None, generator: torch.Generator | None = None,
                 progress: Callable[[int, int], None] | None = None,
                 max_rounds: int | None = None) -> Rollouts | None:
        """Sample one response per prompt.

        ``prompts``: token ids, ragged, any number: beyond ``max_batch_size`` they run in
        waves of that many, in order, each reusing the caches. ``draft_tokens`` is ``k``
        (default: the engine's ``max_draft_tokens``; 0 decodes without the draft).
        ``generator`` (on the engine's device) seeds every draw; it is consumed wave after
        wave, so greedy results do not depend on the waves but sampled ones do (same
        distribution, other draws). ``progress(finished, total)``, if given, is called after
        every decoding round with the number of finished responses of the whole call.
        ``max_rounds``: run the first wave only, exactly that many decoding rounds, and
        return None, reading nothing back from the device (the scale simulator's bounded
        rollout, whose device values are unknown; memory repeats from wave to wave).
        """
        if self._released is not None:
            raise RuntimeError("the engine's weights and caches were released: load_weights first")
        k = self.max_draft_tokens if draft_tokens is None else draft_tokens
        if not 0 <= k <= self.max_draft_tokens:
            raise ValueError(f"draft_tokens must be in 0..{self.max_draft_tokens} for this engine, got {k}")
        prompt, prompt_lens = _pad_prompts(prompts)
        if prompt.shape[1] + params.max_new_tokens > self.max_seq_len:
            raise ValueError(f"longest prompt ({prompt.shape[1]}) + max_new_tokens ({params.max_new_tokens}) "
                             f"exceeds the engine's max_seq_len {self.max_seq_len}")
        draft_to_target = self.draft.d2t + torch.arange(self.draft.args.draft_vocab_size, device=self.device) if k else None
        counters = StepCounters(synchronize=torch.get_device_module(self.device).synchronize)
        total, waves = len(prompt_lens), []
        for start in range(0, total, self.max_batch_size):
            lens = prompt_lens[start: start + self.max_batch_size]
            report = None if progress is None else (lambda done, _, start=start: progress(start + done, total))
            waves.append(self._generate_wave(prompt[start: start + len(lens), : int(lens.max())].to(self.device),
                                             lens.to(self.device), k, params, generator, draft_to_target, counters,
                                             report, max_rounds))
            if max_rounds is not None:
                return None
        seqs = Sequences.cat(waves)
        return seqs.result(prompt_lens.to(self.device), params.max_new_tokens,
                           counters.stats(int(seqs.response_len.sum()), k))

    def _generate_wave(self, prompt: torch.Tensor, prompt_lens: torch.Tensor, k: int, params: SamplingParams,
                       generator, draft_to_target: torch.Tensor | None, counters: StepCounters,
                       progress: Callable[[int, int], None] | None, max_rounds: int | None = None) -> Sequences:
        """Decode ``prompt [b, P]`` (``b <= max_batch_size``) to the end in the caches' first ``b`` rows."""
        b = prompt.shape[0]
        target_cache = self.target_cache.rows(b)
        draft_cache = self.draft_cache.rows(b) if k else None
        seqs = Sequences.start(prompt_lens, params.max_new_tokens, k)
        with counters.timed("prefill"):
            self._prefill(seqs, prompt, prompt_lens, params, generator, target_cache, draft_cache)
        rounds = 0
        # The one host sync per round (none with max_rounds).
        while (rounds < max_rounds) if max_rounds is not None else bool(seqs.active.any()):
            rounds += 1
            if k:
                self._speculative_round(seqs, k, params, generator, target_cache, draft_cache, draft_to_target,
                                        counters)
            else:
                with counters.timed("verify"):
                    self._decode_one_token(seqs, params, generator, target_cache, counters)
            if progress is not None:
                progress(b - int(seqs.active.sum()), b)
        return seqs

    def _prefill(self, seqs: Sequences, prompt: torch.Tensor, prompt_lens: torch.Tensor, params: SamplingParams,
                 generator, target_cache: KVCache, draft_cache: DraftKVCache | None) -> None:
        """Target forward over the (right-padded) prompts, the first response token, and,
        when drafting, TTT pass 1 over the prompt positions. Both attend only to the first
        ``P`` cache positions (views), not the whole cache."""
        b, width = prompt.shape
        rows = torch.arange(b, device=prompt.device)
        last = prompt_lens - 1
        out = self.policy.forward_cached(prompt, target_cache.rows(b, width), torch.zeros_like(prompt_lens),
                                         return_taps=draft_cache is not None, logits_at=last)
        logits = processed_logits((out.logits if draft_cache is not None else out)[:, 0], params)
        token = draw(logits, params, generator)
        logprob = logits.log_softmax(-1).gather(-1, token.unsqueeze(-1))
        self._commit(seqs, token.unsqueeze(-1), logprob, torch.ones_like(token), params)
        if draft_cache is not None:
            # Anchor j reads e(x_{j+1}): the prompt shifted left, the sampled token after its end.
            next_tokens = torch.roll(prompt, -1, dims=1)
            next_tokens[rows, last] = token
            hidden = self.draft.extend(torch.cat(out.taps, -1), self._draft_embed(next_tokens),
                                       torch.zeros_like(prompt_lens), draft_cache.rows(b, width))
            seqs.draft_hidden = hidden[rows, last]

    def _decode_one_token(self, seqs: Sequences, params: SamplingParams, generator, target_cache: KVCache,
                          counters: StepCounters) -> None:
        """Plain decoding: feed ``x_{n-1}`` to the target and sample ``x_n``."""
        logits = self._target_step(seqs.last_token.unsqueeze(1), target_cache, seqs.length - 1)
        logits = processed_logits(logits[:, 0], params)
        token = draw(logits, params, generator)
        logprob = logits.log_softmax(-1).gather(-1, token.unsqueeze(-1))
        counters.record(torch.zeros_like(token), seqs.active)
        self._commit(seqs, token.unsqueeze(-1), logprob, torch.ones_like(token), params)

    def _speculative_round(self, seqs: Sequences, k: int, params: SamplingParams, generator,
                           target_cache: KVCache, draft_cache: DraftKVCache, draft_to_target: torch.Tensor,
                           counters: StepCounters) -> None:
        """Draft ``k`` tokens, verify them in one target forward, commit ``a + 1``, catch up."""
        b = seqs.length.shape[0]
        rows = torch.arange(b, device=seqs.length.device)
        anchor = seqs.length - 2
        with counters.timed("draft"):
            hidden, drafted, draft_probs = seqs.draft_hidden, [], []
            for depth in range(1, k + 1):
                if depth > 1:
                    embeds = self._draft_embed(draft_to_target[drafted[-1]])
                    hidden = self._draft_chain_step(embeds, hidden, anchor, depth, draft_cache)
                logits = processed_logits(self.draft.logits(hidden), params)
                if params.greedy:
                    drafted.append(logits.argmax(-1))
                else:
                    draft_probs.append(logits.softmax(-1))
                    drafted.append(sample(draft_probs[-1], generator))
            drafted = torch.stack(drafted, 1)  # [B, k] draft-vocabulary ids
        with counters.timed("verify"):
            verify_tokens = torch.cat([seqs.last_token.unsqueeze(1), draft_to_target[drafted]], dim=1)
            start = seqs.length - 1
            out = self._target_step(verify_tokens, target_cache, start, return_taps=True)
            logits = processed_logits(out.logits, params)
            if params.greedy:
                n_accepted, next_token = greedy_accept(verify_tokens[:, 1:], logits)
            else:
                n_accepted, next_token = speculative_accept(
                    drafted, torch.stack(draft_probs, 1), draft_to_target, logits.softmax(-1), generator
                )
            # Candidate j is the token at position n + j: drafted ones, then the drawn one at a.
            candidates = torch.cat([verify_tokens[:, 1:], verify_tokens.new_zeros(b, 1)], dim=1)
            candidates[rows, n_accepted] = next_token
            logprobs = logits.log_softmax(-1).gather(-1, candidates.unsqueeze(-1)).squeeze(-1)
            counters.record(n_accepted, seqs.active)
            self._commit(seqs, candidates, logprobs, n_accepted + 1, params)
        with counters.timed("draft"):
            hidden = self._draft_extend(torch.cat(out.taps, -1), self._draft_embed(candidates), start, draft_cache)
            seqs.draft_hidden = hidden[rows, n_accepted]

    def _draft_embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """The draft's input embeddings of target ids: the current policy's table."""
        return self.draft.embed(tokens, self.policy.embed_tokens(tokens))

    @staticmethod
    def _commit(seqs: Sequences, candidates: torch.Tensor, logprobs: torch.Tensor, n_new: torch.Tensor,
                params: SamplingParams) -> None:
        """Append the first ``n_new[b]`` of ``candidates [B, s]`` (with ``logprobs``) to every
        active sequence, cut after an EOS and at ``max_new_tokens``; retire finished ones."""
        s = candidates.shape[1]
        j = torch.arange(s, device=candidates.device)
        keep = (j < n_new.unsqueeze(1)) & (j < (params.max_new_tokens - seqs.response_len).unsqueeze(1))
        hit_eos = torch.zeros_like(seqs.active)
        if params.eos_token_id is not None:
            eos = keep & (candidates == params.eos_token_id)
            hit_eos = eos.any(1)
            first_eos = torch.where(hit_eos, eos.long().argmax(1), s)
            keep &= j <= first_eos.unsqueeze(1)
        keep &= seqs.active.unsqueeze(1)
        n_kept = keep.sum(1)
        # Columns past n_kept hold junk that a later round overwrites or the mask drops.
        columns = seqs.response_len.unsqueeze(1) + j
        seqs.tokens.scatter_(1, columns, candidates)
        seqs.logprobs.scatter_(1, columns, logprobs.to(seqs.logprobs.dtype))
        seqs.last_token = torch.where(n_kept > 0, candidates.gather(1, (n_kept - 1).clamp(min=0).unsqueeze(1))
                                      .squeeze(1), seqs.last_token)
        seqs.response_len += n_kept
        seqs.length += n_kept
        seqs.finished |= hit_eos & seqs.active
        seqs.active &= ~hit_eos & (seqs.response_len < params.max_new_tokens)
