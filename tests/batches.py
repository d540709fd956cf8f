"""Synthetic packed batches for tests (random tokens, random document lengths)."""

import torch

from titan_cotrain.data.batch import PackedBatch


def synthetic_packed_batch(batch: int, seq_len: int, vocab: int, generator: torch.Generator) -> PackedBatch:
    """Random tokens ``[B, S]`` packed from documents of random lengths; every token is a target."""
    tokens = torch.randint(0, vocab, (batch, seq_len), generator=generator)
    doc_lengths = torch.randint(1, seq_len + 1, (batch, seq_len), generator=generator)
    document_ids = torch.empty(batch, seq_len, dtype=torch.long)
    for row in range(batch):
        starts = doc_lengths[row].cumsum(0)
        document_ids[row] = torch.bucketize(torch.arange(seq_len), starts[starts < seq_len], right=True)
    return PackedBatch(tokens, document_ids, torch.ones(batch, seq_len, dtype=torch.bool))
