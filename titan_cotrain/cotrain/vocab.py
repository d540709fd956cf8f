"""Vocabulary-sized tensors one chunk of tokens at a time: the policy loss with the draft's
teacher, and the draft's soft cross-entropy.

At Qwen3's ``V = 151,936`` the whole ``[T, V]`` fp32 logits of ``T = 16K`` tokens are
9 GiB, and a log-softmax and its gradient each as much again. Both functions here cut the
flattened tokens into chunks of ``chunk_tokens`` and recompute each chunk's logits in
backward, so at any time, forward or backward, at most one chunk's ``[c, V]`` tensors are
alive. Shapes are static (every position is computed and weighted by its mask; no boolean
indexing, no host reads), so they also run on the fake-tensor simulator.

Both are called *inside* the owning module's forward (``Transformer.forward(head=...)``,
``Draft.forward``), where FSDP has the head weights gathered. The policy head takes the
weight itself and is one ``autograd.Function``: its backward writes every chunk's
gradient into a single ``[V, H]`` buffer (autograd summing per-chunk ``[V, H]`` gradients
would hold two) and the teacher is made once, in forward. The draft's head is an opaque
callable (norm + ``lm_head``), so its chunks are recomputed by ``torch.utils.checkpoint``.

Default chunk, ``DEFAULT_CHUNK_TOKENS = 2048``. Recomputing costs one head GEMM more
(four instead of three) whatever the chunk; at 2048 tokens the GEMM ``[2048, H] x [H, V]``
is still 2.5 TFLOP at Qwen3-8B, compute-bound, so cutting costs nothing beyond that. A
chunk's working set is about four ``[c, V]`` fp32 tensors (logits, log-softmax, their
gradients), 4.6 GiB at ``V = 152K``: ``scripts/bench_vocab_chunks.py`` measures the
policy loss + teacher at T = 16K at 6.9 GiB above the inputs (1024 tokens: 4.6 GiB)
against 29.8 GiB whole. Lower it where memory is tighter than the head GEMM's efficiency.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import NamedTuple, TypeVar

import torch
from torch.autograd.function import once_differentiable
from torch.utils.checkpoint import checkpoint

from titan_cotrain.data.batch import LabelRows, PolicyLoss, PolicyLossFn

__all__ = ["DEFAULT_CHUNK_TOKENS", "HeadOutput", "chunked_policy_head", "chunked_soft_ce", "slice_rows"]

DEFAULT_CHUNK_TOKENS = 2048

Rows = TypeVar("Rows", bound=LabelRows)


class HeadOutput(NamedTuple):
    """What ``chunked_policy_head`` returns: the policy loss sums over all local tokens and,
    with a draft vocabulary, the draft's teacher ``teacher_logprobs [T, V_d]`` and
    ``teacher_in_vocab: bool [T]`` (None without one)."""

    policy: PolicyLoss
    teacher_logprobs: torch.Tensor | None
    teacher_in_vocab: torch.Tensor | None


def slice_rows(rows: Rows, start: int, end: int) -> Rows:
    """Tokens ``[start, end)`` of the flattened ``[B, S]`` rows, as the same dataclass with
    every tensor field ``[1, end - start, ...]`` (a view when the field is contiguous).

    Works for any ``LabelRows`` subclass (a CP shard's ``CPBatch``); non-tensor fields
    (``None``) pass through. A tensor field not shaped ``[B, S, ...]`` is an error: it
    could not be cut along the tokens.
    """
    b, s = rows.next_tokens.shape

    def cut(x):
        if not isinstance(x, torch.Tensor):
            return x
        if tuple(x.shape[:2]) != (b, s):
            raise ValueError(f"a {type(rows).__name__} field of shape {tuple(x.shape)} is not [B, S] = [{b}, {s}]")
        return x.reshape(b * s, *x.shape[2:])[start:end].unsqueeze(0)

    return dataclasses.replace(rows, **{f.name: cut(getattr(rows, f.name)) for f in dataclasses.fields(rows)})


@dataclasses.dataclass
class _PolicyHeadPlan:
    """The non-tensor arguments of ``_ChunkedPolicyHead``. Its forward keeps the first
    chunk's ``PolicyLoss`` in ``first_part``: the metric names and the result type to rebuild
    from the flat tensors an ``autograd.Function`` returns."""

    rows: LabelRows
    loss_fn: PolicyLossFn
    chunk_tokens: int
    draft_ids: torch.Tensor | None
    t2d: torch.Tensor | None
    teacher_dtype: torch.dtype
    first_part: PolicyLoss | None = None

    def spans(self, total: int) -> list[tuple[int, int]]:
        return [(start, min(start + self.chunk_tokens, total)) for start in range(0, total, self.chunk_tokens)]


def _head_logits(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``[c, H] x [V, H] -> [c, V]`` fp32, the numerics of ``lm_head(x).float()``."""
    return (hidden @ weight.T).float()


def _forward_chunk(hidden: torch.Tensor, weight: torch.Tensor, rows: LabelRows, plan: _PolicyHeadPlan):
    """One chunk's ``PolicyLoss`` and teacher; its ``[c, V]`` logits die on return."""
    logits = _head_logits(hidden, weight)
    part = plan.loss_fn(logits[None], rows)
    if plan.draft_ids is None:
        return part, None, None
    teacher = logits[:, plan.draft_ids].log_softmax(-1).to(plan.teacher_dtype)
    return part, teacher, plan.t2d[logits.argmax(-1)]


def _backward_chunk(hidden: torch.Tensor, weight: torch.Tensor, rows: LabelRows, plan: _PolicyHeadPlan,
                    grad_loss: torch.Tensor, grad_hidden: torch.Tensor | None, grad_weight: torch.Tensor | None):
    """Recompute one chunk's logits and loss, write ``d loss / d hidden`` of the chunk into
    ``grad_hidden [c, H]`` and add ``d loss / d weight`` to ``grad_weight [V, H]``."""
    logits = _head_logits(hidden, weight).requires_grad_()
    with torch.enable_grad():
        loss_sum = plan.loss_fn(logits[None], rows).loss_sum
    (grad_logits,) = torch.autograd.grad(loss_sum, logits, grad_loss)
    # The cast's backward: the gradient reaches the matmul in the weight's dtype.
    grad_logits = grad_logits.to(weight.dtype)
    if grad_hidden is not None:
        torch.mm(grad_logits, weight, out=grad_hidden)
    if grad_weight is not None:
        grad_weight.addmm_(grad_logits.T, hidden)


class _ChunkedPolicyHead(torch.autograd.Function):
    """``(hidden [T, H], weight [V, H], plan) -> (loss_sum, count, teacher | None,
    in_vocab | None, *metric sums)``; only ``loss_sum`` is differentiable."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, plan: _PolicyHeadPlan):
        total = hidden.shape[0]
        teacher = in_vocab = None
        if plan.draft_ids is not None:
            teacher = hidden.new_empty((total, plan.draft_ids.numel()), dtype=plan.teacher_dtype)
            in_vocab = hidden.new_empty(total, dtype=torch.bool)
        parts = []
        for start, end in plan.spans(total):
            part, chunk_teacher, chunk_in_vocab = _forward_chunk(
                hidden[start:end], weight, slice_rows(plan.rows, start, end), plan)
            parts.append(part)
            if teacher is not None:
                teacher[start:end] = chunk_teacher
                in_vocab[start:end] = chunk_in_vocab
        plan.first_part = parts[0]
        loss_sum = torch.stack([p.loss_sum for p in parts]).sum()
        count = torch.stack([p.count for p in parts]).sum()
        metrics = [torch.stack([p.metric_sums[name] for p in parts]).sum() for name in parts[0].metric_sums]
        if parts[0].norm is not None:  # the loss's own normaliser rides with the metrics
            metrics.append(torch.stack([p.norm for p in parts]).sum())
        ctx.mark_non_differentiable(count, *metrics, *(t for t in (teacher, in_vocab) if t is not None))
        ctx.save_for_backward(hidden, weight)
        ctx.plan = plan
        # Unmaterialised, the teacher's (unused) gradient is None, not a [T, V_d] of zeros.
        ctx.set_materialize_grads(False)
        return loss_sum, count, teacher, in_vocab, *metrics

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_loss: torch.Tensor, *_):
        hidden, weight = ctx.saved_tensors
        if grad_loss is None:
            return None, None, None
        plan = ctx.plan
        # Contiguous, so that every chunk's rows are a valid ``out=`` of ``mm``.
        grad_hidden = hidden.new_empty(hidden.shape) if ctx.needs_input_grad[0] else None
        grad_weight = torch.zeros_like(weight) if ctx.needs_input_grad[1] else None
        for start, end in plan.spans(hidden.shape[0]):
            _backward_chunk(hidden[start:end], weight, slice_rows(plan.rows, start, end), plan, grad_loss,
                            None if grad_hidden is None else grad_hidden[start:end], grad_weight)
        return grad_hidden, grad_weight, None


def chunked_policy_head(
    hidden: torch.Tensor,
    head_weight: torch.Tensor,
    rows: LabelRows,
    loss_fn: PolicyLossFn,
    *,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    draft_ids: torch.Tensor | None = None,
    t2d: torch.Tensor | None = None,
    teacher_dtype: torch.dtype = torch.bfloat16,
) -> HeadOutput:
    """The policy loss of ``lm_head``'s logits, and the draft's teacher, ``chunk_tokens`` at a time.

    ``hidden [T, H]``: the final-normed hidden states (``lm_head``'s input), ``head_weight
    [V, H]``; ``rows``: a ``LabelRows`` (or ``CPBatch``) of shape ``[B, S]``, ``B * S = T``.
    ``loss_fn`` sees each chunk's logits ``[1, c, V]`` (fp32) with ``slice_rows(rows)`` of
    it and must be a sum over tokens (``ppo_loss``, ``next_token_loss``): the returned
    ``policy`` adds the chunks' ``loss_sum``, ``count``, ``metric_sums`` and ``norm``. Values and
    gradients (w.r.t. ``hidden`` and ``head_weight``) are those of ``loss_fn`` on the whole
    ``(hidden @ head_weight.T).float()`` up to summation order (the weight's gradient is
    summed over chunks in its own dtype: in bf16, one rounding per chunk, as over
    microbatches); ``loss_fn`` runs twice per chunk (forward, and backward's recompute) and
    must be deterministic.

    With ``draft_ids: int64 [V_d]`` (the target id of every draft id) and ``t2d: bool [V]``:
    ``teacher_logprobs [T, V_d] = log_softmax(logits[:, draft_ids])``, detached, stored in
    ``teacher_dtype``, and ``teacher_in_vocab [T] = t2d[logits.argmax(-1)]`` (from the fp32
    logits). bf16 is enough for the teacher: it is a soft target, renormalised in fp32 by
    ``chunked_soft_ce``; bf16's 8-bit mantissa moves a probability by at most ~0.4% of
    itself per unit of ``|log p|``, small next to the draft's own distance from the
    teacher, and the argmax that gates the mask comes from the fp32 logits. It halves the ``[T, V_d]``
    tensor that lives until the draft's backward (and the CP halo that carries it).
    """
    if rows.next_tokens.numel() != hidden.shape[0]:
        raise ValueError(f"rows {tuple(rows.next_tokens.shape)} do not cover the {hidden.shape[0]} hidden rows")
    if (draft_ids is None) != (t2d is None):
        raise ValueError("give both draft_ids and t2d, or neither")
    plan = _PolicyHeadPlan(rows, loss_fn, chunk_tokens, draft_ids, t2d, teacher_dtype)
    loss_sum, count, teacher, in_vocab, *metrics = _ChunkedPolicyHead.apply(hidden, head_weight, plan)
    names = plan.first_part.metric_sums
    norm = metrics.pop() if plan.first_part.norm is not None else None
    policy = plan.first_part._replace(loss_sum=loss_sum, count=count, metric_sums=dict(zip(names, metrics)),
                                      norm=norm)
    return HeadOutput(policy, teacher, in_vocab)


def _soft_ce_chunk(hidden: torch.Tensor, teacher_index: torch.Tensor, mask: torch.Tensor,
                   head: Callable[[torch.Tensor], torch.Tensor], teacher_logprobs: torch.Tensor):
    """One chunk's masked ``(ce_sum, correct, overlap)``; ``hidden [c, H]``, ``teacher_index, mask [c]``."""
    logits = head(hidden).float()  # [c, V_d]
    teacher = teacher_logprobs[teacher_index]
    teacher_probs, draft_logprobs = teacher.softmax(-1, dtype=torch.float32), logits.log_softmax(-1)
    ce = -(teacher_probs * draft_logprobs).sum(-1)
    ce_sum = torch.where(mask, ce, 0.0).sum()
    # After ce_sum: checkpoint's recompute stops once the last tensor backward needs is
    # back (early stop, on by default), so the argmaxes and the overlap are not recomputed.
    # argmax takes NaN for the largest value: two rows of NaN would agree, so a position
    # counts as correct only where both rows are finite (a NaN step reports accuracy 0).
    finite = logits.amax(-1).isfinite() & teacher.amax(-1).isfinite()
    counted = finite & mask
    correct = ((logits.argmax(-1) == teacher.argmax(-1)) & counted).sum()
    with torch.no_grad():  # a metric: sum_x min(p(x), q(x)), speculative sampling's acceptance chance
        overlap = torch.where(counted, torch.minimum(teacher_probs, draft_logprobs.exp()).sum(-1), 0.0).sum()
    return ce_sum, correct, overlap


def chunked_soft_ce(
    hidden: torch.Tensor,
    head: Callable[[torch.Tensor], torch.Tensor],
    teacher_logprobs: torch.Tensor,
    teacher_index: torch.Tensor,
    mask: torch.Tensor,
    *,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One TTT pass's soft cross-entropy against the teacher, ``chunk_tokens`` anchors at a time.

    ``hidden [T, H]``: the pass output; ``head``: ``[c, H] -> [c, V_d]`` logits (the draft's
    ``norm`` + ``lm_head``, called here so it runs inside ``Draft.forward``);
    ``teacher_logprobs [T_ext, V_d]`` (``chunked_policy_head``'s, rows possibly extended by
    the CP halo); ``teacher_index: int64 [T]``, the teacher row of anchor ``t`` at this pass,
    in ``[0, T_ext)`` at every anchor, masked or not; ``mask: bool [T]``, the anchors that count.

    Returns ``ce_sum = sum_t mask_t * CE(softmax(teacher_t), softmax(draft_t))`` (fp32,
    differentiable w.r.t. ``hidden`` and the head's parameters), ``correct = sum_t mask_t *
    [argmax draft_t == argmax teacher_t]`` (both rows finite), ``count = mask.sum()`` (int64) and
    ``overlap = sum_t mask_t * sum_x min(teacher_t(x), draft_t(x))`` (fp32, no gradient): the
    chance that speculative sampling at temperature 1 accepts a token the draft drafts at
    ``t``, as ``correct`` is greedy decoding's (an upper bound with a reduced vocabulary: the
    teacher is renormalised over it). Masked-out
    anchors are computed and dropped by ``where``. Each chunk is checkpointed: its
    ``[c, V_d]`` tensors are rebuilt in backward, none are kept from forward to backward.
    """
    ce_sums, corrects, overlaps = [], [], []
    for chunk in zip(hidden.split(chunk_tokens), teacher_index.split(chunk_tokens), mask.split(chunk_tokens)):
        # No RNG state to preserve: the head is deterministic (no dropout in the draft).
        ce_sum, correct, overlap = checkpoint(_soft_ce_chunk, *chunk, head, teacher_logprobs,
                                              use_reentrant=False, preserve_rng_state=False)
        ce_sums.append(ce_sum)
        corrects.append(correct)
        overlaps.append(overlap)
    return torch.stack(ce_sums).sum(), torch.stack(corrects).sum(), mask.sum(), torch.stack(overlaps).sum()


@torch.no_grad()
def chunked_token_logprobs(hidden: torch.Tensor, head_weight: torch.Tensor, next_tokens: torch.Tensor, *,
                           scale: float = 1.0, chunk_tokens: int = DEFAULT_CHUNK_TOKENS) -> torch.Tensor:
    """``[T]`` fp32: ``log_softmax(scale * hidden @ head_weight.T)[t, next_tokens[t]]``, one
    ``[c, V]`` chunk at a time, without gradients (the KL reference's log-probs)."""
    out = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
    for start in range(0, hidden.shape[0], chunk_tokens):
        end = min(start + chunk_tokens, hidden.shape[0])
        logits = _head_logits(hidden[start:end], head_weight) * scale
        out[start:end] = logits.log_softmax(-1).gather(-1, next_tokens[start:end, None]).squeeze(-1)
    return out
