"""Rollouts that speculate with a block drafter (``models.block_draft``): one drafter forward
per round drafts up to ``B - 1`` tokens at once.

State of a sequence between rounds, ``n`` = committed tokens (as ``engine.rollout``)::

    tokens          x_0 ... x_{n-2}  x_{n-1}
    target KV       0   ... n-2               x_{n-1} is committed but not yet fed to the target
    drafter context 0   ... n-2               every drafter layer's context key/value of position p

One round with ``k <= B - 1`` drafted tokens, every sequence at its own ``n``:

1. draft: the block at anchor ``n - 1``, inputs ``[e(x_{n-1}), m, ..., m]``, sees the cached
   context before it (``BlockDrafter.draft_block``); its outputs at block positions ``1..k``
   are the proposals ``q_1 .. q_k``, each token drawn from its own ``q_j`` (greedy: argmax);
2. verify and accept as the EAGLE-3 rounds do (``RolloutEngine``): one target forward over
   ``[x_{n-1}, t_1 .. t_k]``, ``speculative_accept`` with each position's proposal in the
   ratio, ``a + 1`` tokens committed. The proposals of a block do not depend on one
   another's draws, so the rule's chain of ``min(1, p_j / q_j)`` tests is the usual one and
   the committed tokens follow the target's law;
3. catch up: the target's features at the ``k + 1`` verified positions become the drafter's
   context there (``write_context``); the slots past the last accepted one are stale until
   rewritten, and no block reads them (a block reads the slots before its anchor).

The drafter's pool holds ``n_layers`` layers of context keys and values per position, read
through the target's block tables, so prefix sharing, copy-on-write, continuous batching and
preemption (recompute: the target's features over the committed tokens, then
``write_context``) work as for the target's pool.

Tensor-parallel (``parallel.engine_tp``): the drafter stays whole on every rank of the engine
group, as EAGLE-3's draft does. It reads the policy through its modules, never its weights:
the embedding's lookup (rowwise over the vocabulary, all-reduced) and the head (colwise, the
logits all-gathered), so every rank drafts from the same whole rows; the taps are whole
(every layer's output is all-reduced). Not yet: the compiled steps (refused).
"""

from __future__ import annotations

import torch
from titan_cotrain.engine.generation import Generation, Round, Sequences
from titan_cotrain.engine.kv_budget import KVBudget
from titan_cotrain.engine.rollout import RolloutEngine
from titan_cotrain.engine.sampling import processed_logits, sample
from titan_cotrain.models.block_draft import BlockDrafter
from titan_cotrain.models.kv_cache import PagedKV, RowsKV
from titan_cotrain.models.transformer import Transformer

__all__ = ["BlockDraftEngine"]


class BlockDraftEngine(RolloutEngine):
    """A ``RolloutEngine`` whose draft is a ``BlockDrafter`` (module docstring). The policy
    must tap the drafter's ``target_layer_ids``. ``max_draft_tokens``: the most tokens a round
    drafts, at most ``block_size - 1`` (0: that). Other arguments as ``RolloutEngine``'s."""

    def __init__(self, policy: Transformer, drafter: BlockDrafter, *, max_batch_size: int, max_seq_len: int,
                 max_draft_tokens: int = 0, kv_cache_gib: float | KVBudget = 0.0, block_size: int = 16,
                 paged: bool = True, compile: bool = False) -> None:
        if drafter is None:
            raise ValueError("a block-drafting engine needs its drafter")
        if compile:
            raise NotImplementedError("compiled block drafting is not built yet: use compile = false with a block "
                                      "drafter")
        if tuple(policy.tap_layers) != tuple(drafter.args.target_layer_ids):
            raise ValueError(f"the policy taps layers {tuple(policy.tap_layers)}, the drafter reads "
                             f"{tuple(drafter.args.target_layer_ids)}: build the policy with the drafter's layers")
        most = drafter.args.block_size - 1
        k = max_draft_tokens or most
        if not 1 <= k <= most:
            raise ValueError(f"max_draft_tokens must be in 1..{most} (block_size - 1), got {max_draft_tokens}")
        super().__init__(policy, drafter, max_batch_size=max_batch_size, max_seq_len=max_seq_len,
                         max_draft_tokens=k, kv_cache_gib=kv_cache_gib, block_size=block_size, paged=paged)

    @staticmethod
    def _draft_shell(draft: BlockDrafter) -> BlockDrafter:
        """An uninitialised drafter of ``draft``'s shapes (``RolloutEngine.from_models`` fills
        it; with a ``tp_mesh`` there it stays whole on every rank)."""
        return BlockDrafter(draft.args)

    def _draft_to_target(self) -> torch.Tensor:
        """The drafter drafts over the policy's whole vocabulary: the identity map."""
        return torch.arange(self.policy.args.vocab_size, device=self.device)

    def _draft_cache(self, trunk: PagedKV | RowsKV, rows: int) -> PagedKV | RowsKV:
        return trunk

    def _prefill_draft(self, call: Generation, tokens: torch.Tensor, taps: torch.Tensor, last: torch.Tensor,
                       group: torch.Tensor, token: torch.Tensor, trunk_view: PagedKV | RowsKV, src: torch.Tensor,
                       dst: torch.Tensor, slots: list[int], rows: torch.Tensor) -> None:
        """The prompts' positions become the drafter's context (once per prompt, before the
        copy-on-write of their last blocks to the other samples)."""
        n, width = tokens.shape
        self.draft.write_context(taps, torch.arange(width, device=self.device).expand(n, width), trunk_view)
        if src.numel():
            self.draft_pool.copy_blocks(src, dst)

    def _recompute_draft(self, call: Generation, tokens: torch.Tensor, taps: torch.Tensor, table: torch.Tensor,
                         rows: torch.Tensor, lengths: torch.Tensor) -> None:
        """The resumed sequences' positions ``0 .. width - 2`` become the drafter's context again."""
        m, width = taps.shape[:2]
        self.draft.write_context(taps, torch.arange(width, device=self.device).expand(m, width),
                                 self.draft_pool.view(table))

    def _draft(self, seqs: Sequences, call: Generation, round_: Round) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One block per row at anchor ``n - 1``; block positions ``1 .. k`` are the proposals."""
        k, params = round_.k, call.params
        if not k:
            return seqs.last_token.new_zeros(seqs.length.shape[0], 0), None
        hidden = self.draft.draft_block(self.policy.embed_tokens(seqs.last_token), seqs.length - 1, round_.draft_cache)
        logits = processed_logits(self.draft.head_module_logits(hidden[:, 1:k + 1], self.policy.lm_head), params)
        if params.greedy:
            return logits.argmax(-1), None
        probs = logits.softmax(-1)
        return sample(probs, call.generator), probs

    def _catch_up(self, seqs: Sequences, round_: Round, taps: torch.Tensor, candidates: torch.Tensor,
                  start: torch.Tensor, n_accepted: torch.Tensor) -> None:
        """The verified positions ``start .. start + k`` become the drafter's context."""
        positions = start.view(-1, 1) + torch.arange(taps.shape[1], device=self.device)
        self.draft.write_context(taps, positions, round_.draft_cache)
