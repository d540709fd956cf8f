"""The KL term's reference log-probs, computed once per RL step before the update."""

import torch

from titan_cotrain.data.batch import PackedBatch
from titan_cotrain.cotrain.vocab import chunked_token_logprobs
from titan_cotrain.data.packing import layout_from_document_ids

__all__ = ["reference_logprobs"]


@torch.no_grad()
def reference_logprobs(reference, batch: PackedBatch, device: torch.device, temperature: float) -> torch.Tensor:
    """Token-aligned, like ``old_logprobs``: the log-prob of token t under the (sharded)
    ``reference``'s logits at t - 1, at the rollout ``temperature`` (0, greedy: 1); a host
    ``[B, S]`` tensor, row by row, the head in vocabulary chunks."""
    temperature = temperature if temperature > 0 else 1.0
    out = torch.zeros(batch.tokens.shape)
    for row in range(batch.tokens.shape[0]):
        tokens = batch.tokens[row:row + 1].to(device)
        layout = layout_from_document_ids(batch.document_ids[row:row + 1])
        following = torch.roll(tokens, -1, dims=1).reshape(-1)

        def head(hidden, weight, following=following):
            return chunked_token_logprobs(hidden, weight, following, scale=1.0 / temperature)

        logp = reference(tokens, cu_seqlens=tuple(layout.cu_seqlens.tolist()),
                         positions=layout.positions.to(device), head=head).head
        out[row, 1:] = logp[:-1].to("cpu", torch.float32)
    return out
