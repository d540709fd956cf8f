"""Training-time test (TTT): the draft's D-pass unroll, its teacher, masks, loss and metrics.

All tensors are packed: the ``T`` tokens of a batch flattened, documents delimited by
``cu_seqlens``. For anchor ``i`` (in-document position) of a document of length ``n``,
pass ``d = 1..D`` (docs/DESIGN.md section 3):

=========== =========================================================================
input       ``[e(x_{i+d}) ; h^{d-1}_i]``, ``h^0 = fc(taps)``, ``h^p`` the pass-p output
RoPE        position ``i + d - 1``
keys        trunk: pass-1 keys at ``j <= i`` of the document; branch: passes ``2..d`` at ``i``
teacher     ``softmax`` of the policy's logits at ``i + d`` over the draft vocabulary
mask        ``i + d + 1 < n``, ``x_{i+d+1}`` in the loss region, teacher argmax in the draft vocab
=========== =========================================================================

The teacher renormalises the policy's logits over the draft vocabulary (gather, then
softmax); with ``V_d = V`` it is the policy's own distribution. Every shift by ``d``
stays inside a document: the unroll reads ``x_{i+d}`` through the microbatch's shift
(``titan_cotrain.data.packing.DocumentShift``; for a context-parallel shard its ``TTTHalo``,
which fetches the positions past each chunk edge), not knowing which it has. The passes
themselves run inside ``Draft.forward`` (one module call, so FSDP's hooks see them).
"""

from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F

from titan_cotrain.cotrain.vocab import chunked_soft_ce
from titan_cotrain.data.packing import DocumentShift, shift_in_document
from titan_cotrain.models.draft import Draft

__all__ = ["TTTStats", "draft_loss", "pass_weights", "ttt_masks", "ttt_unroll", "tau"]


@dataclass
class TTTStats:
    """Per-pass sums over the local tokens (``[D]`` each): ``ce_sum`` (differentiable),
    ``count`` (masked positions), ``correct`` (draft top-1 == teacher argmax) and ``overlap``
    (``sum_x min(teacher, draft)``: speculative sampling's acceptance chance at temperature 1;
    ``chunked_soft_ce``)."""

    ce_sum: torch.Tensor
    count: torch.Tensor
    correct: torch.Tensor
    overlap: torch.Tensor | None = None


def pass_weights(ttt_steps: int, decay: float, device=None) -> torch.Tensor:
    """``w_d = decay ** (d - 1)`` for ``d = 1..D`` (fp32)."""
    return decay ** torch.arange(ttt_steps, dtype=torch.float32, device=device)


def ttt_masks(
    cu_seqlens: torch.Tensor, loss_region: torch.Tensor, teacher_in_vocab: torch.Tensor, ttt_steps: int, shift=None
) -> torch.Tensor:
    """``[D, T]`` bool: which anchors each pass is trained on (the table's mask row).

    ``loss_region [T]``: token ``t`` may be predicted (e.g. a response token);
    ``teacher_in_vocab [T]``: the policy's argmax at ``t`` is in the draft vocabulary.
    Pass ``d`` at ``t`` needs ``x_{t+d+1}`` in the document and in the loss region, and the
    teacher at ``t + d`` in vocab. ``shift(x, d, fill)`` defaults to ``shift_in_document``
    (``ttt_unroll`` passes its shift's: a context-parallel shard's reads halo-extended inputs).
    """
    shift = shift or partial(shift_in_document, cu_seqlens=cu_seqlens)
    masks = []
    for d in range(1, ttt_steps + 1):
        target_ok = shift(loss_region, d + 1, fill=False)
        teacher_ok = shift(teacher_in_vocab, d, fill=False)
        masks.append(target_ok & teacher_ok)
    return torch.stack(masks)


def ttt_unroll(
    draft: Draft,
    taps: torch.Tensor,
    embeddings: torch.Tensor,
    tokens: torch.Tensor,
    positions: torch.Tensor,
    cu_seqlens: torch.Tensor,
    loss_region: torch.Tensor,
    ttt_steps: int,
    shift=None,
    *,
    teacher_logits: torch.Tensor | None = None,
    teacher: tuple[torch.Tensor, torch.Tensor] | None = None,
    chunk_tokens: int = 2048,
) -> TTTStats:
    """Run the D TTT passes and score each against the policy's teacher.

    ``taps [T, n_taps * H_t]`` and ``embeddings [T, H_t]`` (the policy's token embeddings)
    come from the policy's forward and are detached here, so no gradient of the draft ever
    reaches the policy. ``tokens, positions [T]`` (positions restart per document; on the
    device), ``cu_seqlens`` (host), ``loss_region [T]`` bool.

    The teacher is either ``teacher = (logprobs [T, V_d], in_vocab: bool [T])`` as the
    policy's chunked head made it (``titan_cotrain.cotrain.vocab.chunked_policy_head``), or
    whole ``teacher_logits [T, V]`` (tests and references). Each pass's soft CE runs in
    chunks of ``chunk_tokens`` anchors inside ``Draft.forward``, at every anchor weighted by
    its mask: static shapes, no ``[T, V_d]`` draft logits beyond one chunk.

    ``shift``: where each anchor's successors live, ``extend(*xs)`` and ``shift(x, d, fill)``
    over ``D + 1`` positions (default: ``DocumentShift`` of ``cu_seqlens``). A context-parallel
    shard's (``CPShard.ttt_halo``) fetches the successors past each chunk edge in one halo
    exchange; the inputs are then this rank's shard (``positions`` global) and the returned
    sums cover the local anchors (sum them over the group).
    """
    taps, embeddings = taps.detach(), embeddings.detach()
    if teacher is None:
        if teacher_logits is None:
            raise ValueError("ttt_unroll needs teacher=(logprobs, in_vocab) or teacher_logits")
        teacher_logits = teacher_logits.detach()
        draft_ids = torch.arange(draft.args.draft_vocab_size, device=tokens.device) + draft.d2t
        teacher = (F.log_softmax(teacher_logits.float()[:, draft_ids], dim=-1),
                   draft.t2d[teacher_logits.argmax(dim=-1)])
    teacher_logprobs, teacher_in_vocab = (t.detach() for t in teacher)
    shift = shift or DocumentShift(cu_seqlens, ttt_steps + 1, tokens.device)
    tokens, embeddings, teacher_logprobs, teacher_in_vocab, loss_region = shift.extend(
        tokens, embeddings, teacher_logprobs, teacher_in_vocab, loss_region
    )
    masks = ttt_masks(cu_seqlens, loss_region, teacher_in_vocab, ttt_steps, shift.shift)
    rows = torch.arange(teacher_logprobs.shape[0], device=teacher_logprobs.device)

    def score(d: int, hidden: torch.Tensor, head) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return chunked_soft_ce(hidden, head, teacher_logprobs, shift.shift(rows, d), masks[d - 1],
                               chunk_tokens=chunk_tokens)

    # Python ints, so FSDP's moving of the root's tensor inputs to the device leaves them on the host.
    host_cu = tuple(cu_seqlens.tolist()) if cu_seqlens.device.type == "cpu" else cu_seqlens
    ce_sums, corrects, counts, overlaps = zip(*draft(taps, embeddings, tokens, positions, host_cu, masks, score=score,
                                                     shift_rows=shift.rows))
    return TTTStats(torch.stack(ce_sums), torch.stack(counts), torch.stack(corrects), torch.stack(overlaps))


def draft_loss(stats: TTTStats, weights: torch.Tensor, denominator: torch.Tensor | float) -> torch.Tensor:
    """``sum_d w_d ce_sum_d / denominator``.

    ``denominator`` is ``sum_d w_d count_d`` over the whole update (every microbatch, every
    data-parallel and CP rank): the draft's loss as ``scales_and_metrics`` reports it.
    """
    denom = torch.as_tensor(denominator, dtype=torch.float32).to(stats.ce_sum.device).clamp(min=1e-12)
    return (weights.to(stats.ce_sum.device) * stats.ce_sum).sum() / denom


def tau(accuracy: torch.Tensor) -> torch.Tensor:
    """Simulated acceptance length ``1 + sum_k prod_{d<=k} acc_d`` from per-pass accuracy ``[D]``."""
    return 1 + torch.cumprod(accuracy, dim=0).sum()
