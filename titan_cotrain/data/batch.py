"""The batch and loss types every layer passes: host rows (``PackedBatch``), their
label-aligned view (``LabelRows``), one microbatch on the device (``Microbatch``) and a
policy loss's sums (``PolicyLoss``). ``rl`` builds the rows, ``cotrain`` computes the
objective over them, ``parallel`` shards them; none of those owns the types.
"""

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch

__all__ = [
    "LabelRows",
    "Microbatch",
    "PackedBatch",
    "PolicyLoss",
    "PolicyLossFn",
    "PrepareMicrobatch",
    "labels_of",
]


@dataclass
class LabelRows:
    """Label-aligned view of a batch, ``[B, S]`` each: at position ``t`` the *next* token
    ``x_{t+1}`` of the same document (``next_tokens``, 0 past a document's end),
    ``next_token_mask`` (it exists and is a training target), and its advantage and
    behaviour / reference log-probs. Policy losses read these instead of slicing
    ``[:, 1:]``, so the same loss runs on a context-parallel shard (whose ``CPBatch``
    extends this with its local tokens, shifted before sharding)."""

    next_tokens: torch.Tensor
    next_token_mask: torch.Tensor
    next_advantages: torch.Tensor | None = None
    next_old_logprobs: torch.Tensor | None = None
    next_ref_logprobs: torch.Tensor | None = None
    next_inv_lens: torch.Tensor | None = None
    next_seq_logratios: torch.Tensor | None = None


@dataclass
class PackedBatch:
    """Packed training rows, all ``[B, S]`` and aligned with ``tokens``: ``document_ids``;
    ``loss_mask`` (bool), True where token ``t`` is a training target (the response region
    in RL). RL rows also carry ``advantages`` (each token its sample's advantage),
    ``old_logprobs`` (behaviour log-prob of token ``t``) and, with a KL term,
    ``ref_logprobs``; ``inv_lens`` (each response token ``1 / |o_i|``, its response's
    length: what a per-sequence loss aggregation weighs and counts a token by) and, for
    GSPO's sequence ratio, ``seq_logratios`` (each response token its response's
    ``mean_t (log pi - log pi_old)``, detached)."""

    tokens: torch.Tensor
    document_ids: torch.Tensor
    loss_mask: torch.Tensor
    advantages: torch.Tensor | None = None
    old_logprobs: torch.Tensor | None = None
    ref_logprobs: torch.Tensor | None = None
    inv_lens: torch.Tensor | None = None
    seq_logratios: torch.Tensor | None = None

    def map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> "PackedBatch":
        """The same rows with ``fn`` applied to every field present (moves, slices, pads)."""
        return PackedBatch(*(None if t is None else fn(t) for t in (
            self.tokens, self.document_ids, self.loss_mask, self.advantages, self.old_logprobs, self.ref_logprobs,
            self.inv_lens, self.seq_logratios)))

    def to(self, device) -> "PackedBatch":
        return self.map(lambda t: t.to(device))


def labels_of(batch: PackedBatch) -> LabelRows:
    """Shift every field of ``batch`` left by one token inside its document."""
    same_doc = torch.zeros_like(batch.loss_mask)
    same_doc[:, :-1] = batch.document_ids[:, 1:] == batch.document_ids[:, :-1]

    def nxt(x: torch.Tensor | None, fill=0):
        if x is None:
            return None
        out = torch.full_like(x, fill)
        out[:, :-1] = x[:, 1:]
        return torch.where(same_doc, out, torch.full_like(x, fill))

    return LabelRows(nxt(batch.tokens), nxt(batch.loss_mask, False), nxt(batch.advantages),
                     nxt(batch.old_logprobs), nxt(batch.ref_logprobs), nxt(batch.inv_lens), nxt(batch.seq_logratios))


class PolicyLoss(NamedTuple):
    """A policy loss over the local tokens: ``loss_sum``, ``count`` (tokens it sums over),
    ``metric_sums`` (per-token quantities summed, reported divided by the global count) and
    ``norm``, what the loss is divided by once summed over every rank and microbatch (None:
    ``count``, a token mean; a per-sequence aggregation counts sequences)."""

    loss_sum: torch.Tensor
    count: torch.Tensor
    metric_sums: dict[str, torch.Tensor] = {}
    norm: torch.Tensor | None = None


# (logits [B, S, V], label-aligned rows: LabelRows or a CP shard's CPBatch) -> PolicyLoss
PolicyLossFn = Callable[[torch.Tensor, LabelRows], PolicyLoss]


@dataclass
class Microbatch:
    """One microbatch as the objective sees it, on the device: label-aligned ``labels``
    (``LabelRows``, or a CP shard's ``CPBatch``), ``tokens``, ``positions [b, s]``, the draft's
    loss ``region [b, s]``, host ``cu_seqlens``, and ``shift``, where every token's TTT
    successors live (``data.packing.DocumentShift``, or under CP the shard's ``TTTHalo``).
    Whoever prepares it decides the layout (``PrepareMicrobatch``); the objective reads it."""

    labels: LabelRows
    tokens: torch.Tensor
    positions: torch.Tensor
    region: torch.Tensor
    cu_seqlens: torch.Tensor
    shift: object

    def packing(self) -> dict:
        """The model's packing kwargs: ``cu_seqlens`` (the CP shard's local ones under CP) as
        Python ints, since FSDP moves a root module's tensor inputs to the device, which would
        cost a sync per layer, and the device ``positions``."""
        return {"cu_seqlens": tuple(self.cu_seqlens.tolist()), "positions": self.positions}


# (host rows, device, *, ttt_steps, draft_loss_on) -> Microbatch: ``prepare_microbatch``, or
# under context parallelism ``parallel.context_parallel.prepare_cp_microbatch`` with its
# group bound (``parallel.parallelize`` picks it).
PrepareMicrobatch = Callable[..., Microbatch]
