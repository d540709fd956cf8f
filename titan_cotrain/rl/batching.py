"""Rollout samples -> packed training rows (many documents per row).

A document is one sample: prompt tokens then response tokens (ending in EOS when the
model stopped). Only response tokens are trained on (``loss_mask``); each carries its
behaviour log-prob and its sample's advantage. Rows are filled first-fit by decreasing
length; the unused tail of a row is one padding document with an empty loss mask.

Under context parallelism (``pad_to = 2 cp``) rows are packed in the CP layout: every
document is padded *inside itself*, after its real tokens, to a multiple of ``2 cp``
tokens (pad tokens, out of the loss), so every document and the padding tail are whole
multiples of the zigzag layout's ``2 cp`` chunks and a row's CP layout is exactly
``seq_len`` tokens (``parallel.context_parallel.plan_padded_rows`` adds nothing). A
pipeline's stages need that fixed CP row length. The padding changes nothing a loss sees:
it follows the document's last real token, so no real token attends to it (causal mask),
and it is out of the loss mask, so neither the policy loss nor the draft's (on
``draft.loss_on = "response"``) scores it; with ``loss_on = "all"`` the draft trains on it
as it does on the padding tail.
"""

import logging
from dataclasses import dataclass

import torch

from titan_cotrain.data.batch import PackedBatch

__all__ = ["Sample", "pack_rank_batch", "pack_samples", "sequence_logratios"]

logger = logging.getLogger(__name__)


@dataclass
class Sample:
    """One rollout: ``prompt`` and ``response`` token ids, ``logprobs`` (behaviour
    log-prob of each response token), its ``reward`` and group-normalised ``advantage``;
    ``trained``: False for a response the loss leaves out (``[rl] overlong = "mask"``);
    ``truncated``: it reached ``max_new_tokens`` without a stop token."""

    prompt: list[int]
    response: list[int]
    logprobs: list[float]
    reward: float
    advantage: float = 0.0
    trained: bool = True
    truncated: bool = False

    def __len__(self) -> int:
        return len(self.prompt) + len(self.response)


def pack_samples(
    samples: list[Sample], seq_len: int, pad_id: int, rows_multiple_of: int = 1, pad_to: int = 1,
    inv_lens: bool = False,
) -> PackedBatch:
    """Pack ``samples`` into ``[R, seq_len]`` rows (``R`` rounded up to ``rows_multiple_of``);
    with ``inv_lens``, each response token also carries ``1 / len(response)`` (what a
    per-sequence loss aggregation reads). A sample not ``trained`` keeps its tokens but has
    no loss mask.

    Each sample's document spans its length rounded up to a multiple of ``pad_to`` (a
    divisor of ``seq_len``; ``2 cp`` under context parallelism, see the module docstring).
    Samples longer than ``seq_len`` cannot be trained on whole: they are skipped with a
    logged warning rather than truncated (a truncated sample would train on a wrong
    advantage). Raises ``ValueError`` when nothing is left to train on.
    """
    if pad_to < 1 or seq_len % pad_to:
        raise ValueError(f"pad_to = {pad_to} must be a positive divisor of seq_len = {seq_len}")

    def span(sample: Sample) -> int:
        return -(-len(sample) // pad_to) * pad_to

    fitting = [s for s in samples if len(s) <= seq_len]
    if len(fitting) < len(samples):
        logger.warning("skipped %d of %d samples longer than training.seq_len = %d",
                       len(samples) - len(fitting), len(samples), seq_len)
    if not any(s.response for s in fitting):
        raise ValueError(f"no trainable sample: {len(samples)} samples, none with a response within seq_len {seq_len}")
    rows: list[list[Sample]] = []
    free: list[int] = []
    for sample in sorted(fitting, key=len, reverse=True):
        for i, space in enumerate(free):
            if span(sample) <= space:
                rows[i].append(sample)
                free[i] -= span(sample)
                break
        else:
            rows.append([sample])
            free.append(seq_len - span(sample))
    n_rows = -(-len(rows) // rows_multiple_of) * rows_multiple_of
    tokens = torch.full((n_rows, seq_len), pad_id, dtype=torch.long)
    document_ids = torch.zeros(n_rows, seq_len, dtype=torch.long)
    loss_mask = torch.zeros(n_rows, seq_len, dtype=torch.bool)
    advantages = torch.zeros(n_rows, seq_len)
    old_logprobs = torch.zeros(n_rows, seq_len)
    inverse_lens = torch.zeros(n_rows, seq_len) if inv_lens else None
    for r, row in enumerate(rows):
        pos = 0
        for doc, sample in enumerate(row):
            p, n = len(sample.prompt), len(sample)
            tokens[r, pos : pos + n] = torch.tensor(sample.prompt + sample.response)
            document_ids[r, pos : pos + span(sample)] = doc
            loss_mask[r, pos + p : pos + n] = sample.trained
            advantages[r, pos + p : pos + n] = sample.advantage
            old_logprobs[r, pos + p : pos + n] = torch.tensor(sample.logprobs, dtype=torch.float32)
            if inverse_lens is not None and n > p:
                inverse_lens[r, pos + p : pos + n] = 1.0 / (n - p)
            pos += span(sample)
        document_ids[r, pos:] = len(row)  # the padding tail is a document of its own
    return PackedBatch(tokens, document_ids, loss_mask, advantages, old_logprobs, inv_lens=inverse_lens)


def sequence_logratios(batch: PackedBatch, logprobs: torch.Tensor) -> torch.Tensor:
    """GSPO's per-response ``mean_t (logprobs - old_logprobs)`` over each response's loss
    tokens, put on every one of them (``[B, S]``, 0 elsewhere): ``logprobs`` token-aligned
    like ``batch.old_logprobs`` (the policy's, before the update)."""
    mask = batch.loss_mask.float()
    rows = torch.arange(batch.tokens.shape[0]).unsqueeze(1).expand_as(batch.document_ids)
    segment = (rows * (int(batch.document_ids.max()) + 1) + batch.document_ids).flatten()
    n_segments = int(segment.max()) + 1
    delta = ((logprobs - batch.old_logprobs) * mask).flatten()
    totals = delta.new_zeros(n_segments).index_add_(0, segment, delta)
    counts = delta.new_zeros(n_segments).index_add_(0, segment, mask.flatten().to(delta))
    means = totals / counts.clamp(min=1)
    return means[segment].view_as(mask) * mask.to(means)


def pack_rank_batch(samples: list[Sample], config, sync, step: int) -> PackedBatch:
    """This rank's samples packed on the host for step ``step`` (in the CP layout under CP), then
    padded with empty rows to the most rows any rank has: FSDP's and the pipeline's
    collectives need the same number of forwards everywhere. ``sync``: the job's
    ``HostSync`` (a collective: every rank calls this; one all-reduce of the rows and the
    failures, ``HostSync.most_or_stop``). The batch stays on the host: the update moves each
    microbatch to the device after computing its attention metadata."""
    cp = config.parallelism.context_parallel_degree
    batch = error = None
    try:
        batch = pack_samples(samples, config.training.seq_len, pad_id=0,
                             rows_multiple_of=config.rl.updates_per_step, pad_to=2 * cp if cp > 1 else 1,
                             inv_lens=config.rl.loss_aggregation != "token_mean")
    except ValueError as e:  # nothing trainable on this rank
        error = str(e)
    # One collective: the most rows any rank packed, or every rank stops with the errors.
    rows = batch.tokens.shape[0] if batch is not None else 0
    extra = sync.most_or_stop(rows, error, step) - rows
    if extra:
        batch = batch.map(lambda t: torch.cat([t, t.new_zeros(extra, t.shape[1])]))
    return batch
