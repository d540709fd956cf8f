"""The co-training objective: a policy forward feeds both the policy loss and the draft's TTT.

``L = L_policy + lambda * L_draft``, both means over the *global* batch (every microbatch,
every data-parallel and CP rank): token means, or for the policy a per-sequence aggregation
(its loss's own ``norm``, ``rl.grpo.ppo_loss``). The draft reads only detached tensors of the
policy (taps, embeddings, teacher), so the policy's gradients are exactly those of
``L_policy`` alone, and the two parameter sets never share a gradient.

That makes the normalisation exact after the fact: each microbatch backpropagates its loss
*sums* (``policy_sum + sum_d w_d ce_sum_d``), gradients accumulate (FSDP sums them over
ranks), and once the last microbatch is done one all-reduce of the counts gives the scales
``1 / N_policy`` for the policy's gradients and ``lambda / sum_d w_d N_d`` for the draft's.
The draft's count depends on the teacher's argmax, so it is only known after every forward:
scaling afterwards is what lets an update be any number of microbatches and still equal one
big batch. ``forward_backward`` is that update's gradient; ``clip_grad_norms`` clips the two
gradient norms separately and ``step_optimizers`` steps the two optimizers (either may be
skipped: the trainer skips an update whose loss or norm is not finite).

A mixture-of-experts policy adds its routers' load-balancing loss (``Transformer.moe_aux_loss``,
a mean over the microbatch's tokens) in the same way: each microbatch backpropagates
``moe_aux_loss_weight x n_mb x aux_mb``, ``n_mb`` its policy-token count, so after the
``1 / N_policy`` scale the update adds ``moe_aux_loss_weight`` times the policy-token-weighted
mean of the microbatches' losses over every microbatch and rank, logged as ``loss/moe_aux``.
Its gradient reaches only the routers; a dense policy's update is unchanged.
"""

import dataclasses
from collections.abc import Iterable, Sequence

import torch
import torch.distributed as dist

from titan_cotrain.components import titan
from titan_cotrain.components.shards import local_shard
from titan_cotrain.cotrain.block_loss import block_draft_sums, block_weights, sample_anchors
from titan_cotrain.cotrain.ttt import TTTStats, draft_loss, pass_weights, tau, ttt_unroll
from titan_cotrain.cotrain.vocab import chunked_policy_head
from titan_cotrain.data.batch import Microbatch, PackedBatch, PolicyLossFn, PrepareMicrobatch, labels_of
from titan_cotrain.data.packing import DocumentShift, layout_from_document_ids
from titan_cotrain.models.block_draft import BlockDrafter
from titan_cotrain.models.draft import Draft
from titan_cotrain.models.transformer import Transformer

__all__ = [
    "CotrainSums",
    "clip_grad_norms",
    "step_optimizers",
    "forward_backward",
    "metric_names",
    "add_moe_aux_sums",
    "add_policy_sums",
    "check_draft_loss_on",
    "draft_sums",
    "microbatch_sums",
    "policy_head",
    "prepare_microbatch",
    "scales_and_metrics",
]


class CotrainSums:
    """Detached fp32 sums of an update on this rank, kept on the device (no host sync):
    ``policy/sum``, ``policy/count``, ``metric/<name>`` and, with the draft, the per-pass
    ``draft/ce_sum``, ``draft/count``, ``draft/correct``, ``draft/overlap`` (``[D]`` each)."""

    def __init__(self) -> None:
        self.sums: dict[str, torch.Tensor] = {}

    def add(self, name: str, value: torch.Tensor) -> None:
        value = value.detach().float()
        self.sums[name] = self.sums[name] + value if name in self.sums else value

    def all_reduce(self, group) -> dict[str, torch.Tensor]:
        """The sums over ``group`` (None: the default group; not distributed: as they are),
        in one collective over one flat device tensor."""
        names = sorted(self.sums)
        if not names or not dist.is_initialized():
            return dict(self.sums)
        flat = torch.cat([self.sums[k].reshape(-1) for k in names])
        dist.all_reduce(flat, group=group)
        out, i = {}, 0
        for k in names:
            n = self.sums[k].numel()
            out[k] = flat[i:i + n].view_as(self.sums[k])
            i += n
        return out


def metric_names(policy_metrics: Iterable[str], ttt_steps: int | None, moe_aux: bool = False) -> list[str]:
    """The keys of an update's metrics, in order: ``loss/policy``, ``loss/moe_aux`` for a
    mixture-of-experts policy (``moe_aux``), the policy loss's own ``policy_metrics`` (its
    ``PolicyLoss.metric_sums`` keys) and, when the draft trained (``ttt_steps`` not None),
    ``loss/draft``, ``draft/loss_pass<d>``, ``draft/acc_pass<d>`` (top-1 agreement with the
    teacher: greedy decoding's acceptance) and ``draft/accept_pass<d>`` (``sum_x min(teacher,
    draft)``: sampling's at temperature 1) per pass, ``draft/tau``."""
    names = ["loss/policy", *(["loss/moe_aux"] if moe_aux else []), *policy_metrics]
    if ttt_steps is not None:
        passes = (f"draft/{kind}_pass{d + 1}" for d in range(ttt_steps) for kind in ("loss", "acc", "accept"))
        names += ["loss/draft", *passes, "draft/tau"]
    return names


def scales_and_metrics(sums: dict[str, torch.Tensor], ttt_steps: int, pass_decay: float,
                       draft_loss_weight: float) -> tuple[torch.Tensor, torch.Tensor | None, dict[str, torch.Tensor]]:
    """``(policy gradient scale, draft gradient scale or None, metrics)`` from global sums;
    all device tensors (no host sync). The metrics' keys are ``metric_names``'."""
    count = sums["policy/count"].clamp(min=1)
    # A per-sequence aggregation's normaliser (its sequences), else the token count.
    norm = sums["policy/norm"].clamp(min=1e-12) if "policy/norm" in sums else count
    policy_metrics = [name[len("metric/"):] for name in sums if name.startswith("metric/")]
    moe_aux = "moe/aux_sum" in sums
    values = [sums["policy/sum"] / norm, *([sums["moe/aux_sum"] / norm] if moe_aux else []),
              *(sums[f"metric/{name}"] / count for name in policy_metrics)]
    draft_scale = None
    draft_on = "draft/count" in sums
    if draft_on:
        ce, counts = sums["draft/ce_sum"], sums["draft/count"]
        weights = pass_weights(ttt_steps, pass_decay, device=ce.device)
        weighted_count = (weights * counts).sum().clamp(min=1e-12)
        draft_scale = draft_loss_weight / weighted_count
        accuracy = sums["draft/correct"] / counts.clamp(min=1)
        accept = sums["draft/overlap"] / counts.clamp(min=1)
        values += [draft_loss(TTTStats(ce, counts, sums["draft/correct"]), weights, weighted_count),
                   *(v for d in range(ttt_steps) for v in (ce[d] / counts[d].clamp(min=1), accuracy[d], accept[d])),
                   tau(accuracy)]
    names = metric_names(policy_metrics, ttt_steps if draft_on else None, moe_aux)
    return 1.0 / norm, draft_scale, dict(zip(names, values, strict=True))


@torch.no_grad()
def scale_gradients(params, scale: torch.Tensor) -> None:
    """``grad *= scale`` for every parameter with a gradient (FSDP shards: their local part)."""
    grads = [p.grad for p in params if p.grad is not None]
    local = [local_shard(g) for g in grads]
    if local:
        torch._foreach_mul_(local, scale.to(local[0].dtype))


def check_draft_loss_on(draft_loss_on: str) -> None:
    if draft_loss_on not in ("response", "all"):
        raise ValueError(f"draft_loss_on must be 'response' or 'all', got {draft_loss_on!r}")


def prepare_microbatch(batch: PackedBatch, device, *, ttt_steps: int, draft_loss_on: str = "response") -> Microbatch:
    """Attention metadata of host rows ``batch`` computed on the host (``cu_seqlens``,
    positions, the TTT shifts of ``ttt_steps`` passes), then the model inputs moved to
    ``device``: every row whole on this rank."""
    check_draft_loss_on(draft_loss_on)
    layout = layout_from_document_ids(batch.document_ids)
    labels = labels_of(batch)
    region = batch.loss_mask if draft_loss_on == "response" else torch.ones_like(batch.loss_mask)
    labels = dataclasses.replace(labels, **{f.name: getattr(labels, f.name).to(device)
                                            for f in dataclasses.fields(labels) if getattr(labels, f.name) is not None})
    return Microbatch(labels, batch.tokens.to(device), layout.positions.to(device), region.to(device),
                      layout.cu_seqlens, DocumentShift(layout.cu_seqlens, ttt_steps + 1, device))


def policy_head(mb: Microbatch, policy_loss_fn: PolicyLossFn, draft: Draft | None, chunk_tokens: int,
                keep: dict | None = None):
    """The ``head(hidden, weight)`` a policy forward runs in place of its ``lm_head``: the
    chunked policy loss of ``mb`` and, with an EAGLE-3 draft, its teacher (``HeadOutput``).
    ``keep`` (a block drafter's): gets the head's input, detached, and a copy of its weight
    (the gathered weight is freed after the forward; the drafter's teacher and logits need it
    through the backward)."""
    draft_ids = t2d = None
    if draft is not None:
        draft_ids = torch.arange(draft.args.draft_vocab_size, device=draft.d2t.device) + draft.d2t
        t2d = draft.t2d

    def head(hidden: torch.Tensor, weight: torch.Tensor):
        if keep is not None:
            keep["hidden"], keep["weight"] = hidden.detach(), weight.detach().clone()
        # The teacher in the compute dtype: bf16 under mixed precision, exact fp32 / fp64 otherwise.
        return chunked_policy_head(hidden, weight, mb.labels, policy_loss_fn, chunk_tokens=chunk_tokens,
                                   draft_ids=draft_ids, t2d=t2d, teacher_dtype=hidden.dtype)

    return head


def add_policy_sums(sums: CotrainSums, head_out) -> torch.Tensor:
    """Record a microbatch's policy sums; returns its differentiable loss sum."""
    policy_sum, policy_count, metric_sums, norm = head_out.policy
    sums.add("policy/sum", policy_sum)
    sums.add("policy/count", policy_count)
    if norm is not None:
        sums.add("policy/norm", norm)
    for name, value in metric_sums.items():
        sums.add(f"metric/{name}", value)
    return policy_sum


def add_moe_aux_sums(sums: CotrainSums, aux: torch.Tensor, policy) -> torch.Tensor:
    """Record a microbatch's load-balancing loss ``aux`` (0-dim, a mean over its tokens)
    weighted by its share of the policy loss's normaliser (``policy``: its ``PolicyLoss``; the
    token count under token-mean aggregation); returns that differentiable ``weight x aux``."""
    weighted = (policy.count if policy.norm is None else policy.norm).detach() * aux
    sums.add("moe/aux_sum", weighted)
    return weighted


def draft_sums(draft: Draft, mb: Microbatch, taps: torch.Tensor, embeddings: torch.Tensor, head_out,
               sums: CotrainSums, *, ttt_steps: int, pass_decay: float, chunk_tokens: int) -> torch.Tensor:
    """The draft's TTT over microbatch ``mb``: ``taps [T, n_taps * H_t]`` and ``embeddings
    [T, H_t]`` (the policy's, detached) and the teacher of ``head_out``; records the per-pass
    sums and returns the weighted CE sum ``sum_d w_d ce_sum_d`` to backpropagate."""
    stats = ttt_unroll(
        draft, taps=taps, embeddings=embeddings, tokens=mb.tokens.reshape(-1), positions=mb.positions.reshape(-1),
        cu_seqlens=mb.cu_seqlens, teacher=(head_out.teacher_logprobs, head_out.teacher_in_vocab),
        loss_region=mb.region.reshape(-1), ttt_steps=ttt_steps, shift=mb.shift, chunk_tokens=chunk_tokens,
    )
    sums.add("draft/ce_sum", stats.ce_sum)
    sums.add("draft/count", stats.count)
    sums.add("draft/correct", stats.correct)
    sums.add("draft/overlap", stats.overlap)
    return (pass_weights(ttt_steps, pass_decay, device=stats.ce_sum.device) * stats.ce_sum).sum()


def microbatch_sums(
    policy: Transformer,
    draft: Draft | BlockDrafter | None,
    mb: Microbatch,
    policy_loss_fn: PolicyLossFn,
    sums: CotrainSums,
    *,
    ttt_steps: int,
    pass_decay: float,
    chunk_tokens: int = 2048,
    moe_aux_loss_weight: float = 0.0,
    blocks_per_doc: int = 8,
    anchor_seed: int = 0,
) -> torch.Tensor:
    """Forward one prepared microbatch through the policy (and the draft's TTT, or a block
    drafter's blocks at ``blocks_per_doc`` anchors per sequence drawn from ``anchor_seed``),
    add its detached sums to ``sums`` and return the loss *sum* to backpropagate
    (``policy_sum [+ moe_aux_loss_weight x n_policy x aux] + sum_d w_d ce_sum_d``; scaled
    after the update, see the module docstring)."""
    block = isinstance(draft, BlockDrafter)
    keep = {} if block else None
    head = policy_head(mb, policy_loss_fn, None if block else draft, chunk_tokens, keep)
    out = policy(mb.tokens, return_taps=draft is not None, head=head, **mb.packing())
    loss = add_policy_sums(sums, out.head)
    aux = policy.moe_aux_loss()
    if aux is not None:
        weighted = add_moe_aux_sums(sums, aux, out.head.policy)
        if moe_aux_loss_weight:  # 0: logged only
            loss = loss + moe_aux_loss_weight * weighted
    if draft is not None:
        b, s = mb.tokens.shape
        taps, embeddings = torch.cat(out.taps, dim=-1).reshape(b * s, -1), out.embeddings.reshape(b * s, -1)
        if block:
            loss = loss + block_sums(draft, mb, taps, embeddings, keep, sums, pass_decay=pass_decay,
                                     blocks_per_doc=blocks_per_doc, seed=anchor_seed, chunk_tokens=chunk_tokens)
        else:
            loss = loss + draft_sums(draft, mb, taps, embeddings, out.head, sums, ttt_steps=ttt_steps,
                                     pass_decay=pass_decay, chunk_tokens=chunk_tokens)
    return loss


def block_sums(drafter: BlockDrafter, mb: Microbatch, features: torch.Tensor, embeddings: torch.Tensor, keep: dict,
               sums: CotrainSums, *, pass_decay: float, blocks_per_doc: int, seed: int,
               chunk_tokens: int) -> torch.Tensor:
    """A block drafter's sums over microbatch ``mb`` (``cotrain.block_loss``), recorded under the
    draft's names (block position ``j`` in pass ``j``'s place); returns ``sum_j w_j ce_sum_j``.
    ``keep``: the policy head's input and weight (``policy_head``)."""
    region = mb.region.reshape(-1)
    anchors = sample_anchors(mb.cu_seqlens, region, blocks_per_doc, seed, positions=mb.positions.reshape(-1),
                             tokens=mb.tokens.reshape(-1), shift=mb.shift)
    stats = block_draft_sums(drafter, features, embeddings, mb.positions.reshape(-1), mb.cu_seqlens, region,
                             keep["hidden"], keep["weight"], anchors, chunk_rows=chunk_tokens, shift=mb.shift)
    for name, value in (("ce_sum", stats.ce_sum), ("count", stats.count), ("correct", stats.correct),
                        ("overlap", stats.overlap)):
        sums.add(f"draft/{name}", value)
    return (block_weights(drafter.args.block_size, pass_decay, device=stats.ce_sum.device) * stats.ce_sum).sum()


def microbatches(batch: PackedBatch, rows: int) -> list[PackedBatch]:
    """``batch`` cut into consecutive row slices of at most ``rows`` rows (0: one slice)."""
    n = batch.tokens.shape[0]
    rows = rows or n
    return [batch.map(lambda t, lo=lo: t[lo:lo + rows]) for lo in range(0, n, rows)]


def forward_backward(
    policy: Transformer,
    draft: Draft | None,
    batch: PackedBatch,
    policy_loss_fn: PolicyLossFn,
    *,
    ttt_steps: int,
    pass_decay: float,
    draft_loss_weight: float,
    draft_loss_on: str = "response",
    group=None,
    prepare: PrepareMicrobatch = prepare_microbatch,
    device: torch.device | str | None = None,
    microbatch_rows: int = 0,
    max_microbatches: int | None = None,
    chunk_tokens: int = 2048,
    moe_aux_loss_weight: float = 0.0,
    blocks_per_doc: int = 8,
    anchor_seed: int = 0,
) -> dict[str, torch.Tensor]:
    """The gradient of one update over ``batch`` (host rows), in microbatches of
    ``microbatch_rows`` rows (0: all at once); returns detached metrics (device tensors).
    A mixture-of-experts policy adds ``moe_aux_loss_weight`` times its load-balancing loss
    (module docstring).

    ``group`` holds every rank whose tokens share the global token mean: the data-parallel
    ranks times the context-parallel ones (None: the default group, or no communication
    when not distributed). ``prepare`` turns each microbatch's host rows into this rank's
    model inputs (``ParallelModels.prepare_microbatch``: under CP, the zigzag shard of rows
    that are the same on every rank of the CP group). Every rank must run the same number of
    microbatches (FSDP's collectives). ``max_microbatches`` stops early (the simulator's
    bound; the scales then cover only the microbatches run).
    """
    sums = CotrainSums()
    device = device or policy.embed_tokens.weight.device
    for rows in microbatches(batch, microbatch_rows)[:max_microbatches]:
        mb = prepare(rows, device, ttt_steps=ttt_steps, draft_loss_on=draft_loss_on)
        loss = microbatch_sums(policy, draft, mb, policy_loss_fn, sums, ttt_steps=ttt_steps, pass_decay=pass_decay,
                               chunk_tokens=chunk_tokens, moe_aux_loss_weight=moe_aux_loss_weight,
                               blocks_per_doc=blocks_per_doc, anchor_seed=anchor_seed)
        loss.backward()
    policy_scale, draft_scale, metrics = scales_and_metrics(sums.all_reduce(group), ttt_steps, pass_decay,
                                                            draft_loss_weight)
    scale_gradients(policy.parameters(), policy_scale)
    if draft is not None:
        scale_gradients(draft.parameters(), draft_scale)
    return metrics


def clip_grad_norms(
    policy_params: Iterable[torch.Tensor],
    draft_params: Iterable[torch.Tensor] | None,
    policy_max_norm: float,
    draft_max_norm: float,
    *,
    pp_mesh=None,
    clipped_alike: Sequence[torch.Tensor] = (),
) -> dict[str, torch.Tensor]:
    """Clip the policy's and the draft's gradient norms separately (``draft_params`` None: no
    draft trained here); the global norms before clipping (device scalars, ``grad_norm/policy``
    and ``grad_norm/draft``), over the PP column with ``pp_mesh`` (every PP rank calls it).
    ``clipped_alike``: policy parameters clipped by the policy's factor but not counted in its
    norm (a tied embedding's second copy under PP, counted on the rank of the first stage)."""
    counted = [p for p in policy_params if not any(p is q for q in clipped_alike)]
    norm = titan.clip_grad_norm_(counted, policy_max_norm, pp_mesh=pp_mesh)
    if clipped_alike:
        torch.nn.utils.clip_grads_with_norm_(list(clipped_alike), policy_max_norm, norm)
    metrics = {"grad_norm/policy": norm}
    if draft_params is not None:
        metrics["grad_norm/draft"] = titan.clip_grad_norm_(draft_params, draft_max_norm, pp_mesh=pp_mesh)
    return metrics


def step_optimizers(policy_optimizers, draft_optimizers, *, step_policy: bool = True, step_draft: bool = True) -> None:
    """Step the optimizers asked for and zero both models' gradients (a skipped update
    leaves its parameters and its optimizer state untouched). ``draft_optimizers`` may be
    None (no draft, or a rank without it)."""
    if step_policy:
        policy_optimizers.step()
    policy_optimizers.zero_grad()
    if draft_optimizers is not None:
        if step_draft:
            draft_optimizers.step()
        draft_optimizers.zero_grad()
