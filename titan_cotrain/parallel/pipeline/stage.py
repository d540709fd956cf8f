"""The stage module: a contiguous range of the policy's decoder layers, under their
whole-model names, plus the embedding on the first stage and the final norm and the head on
the last (which also holds the draft, as a model of its own). Its layers run through the
policy's own layer loop (``models.transformer.run_layers``).

Every forward is called with the index of its microbatch and the run's context
(``forward(x, microbatch=i, context=...)``): ``MicrobatchIndexedStage`` adds the schedule's
own chunk id, ``pipeline_step`` passes the ``PipelineStepContext`` (the microbatches'
metadata, prepared once per run of the schedule) to ``schedule.step``. Both are host objects,
not tensors: FSDP moves a root module's tensor inputs to the device, so the only tensor a
stage receives is its activation, and nothing the host needs costs a sync. An
activation-checkpoint rerun gets the forward's arguments again, its index included.

A mixture of experts' load-balancing loss pools the routers of every sparse layer
(``models.moe``), which the stages hold apart: a stage of a mixture-of-experts policy also
receives and passes on ``load [2, E]`` (fp32; row 0 the top-k assignments per expert, row 1
the sums of the router probabilities, differentiable in the routers' weights), to which it
adds its own layers' records; the last stage hands the total to the loss, whose backward
reaches every stage's routers back through the pipeline. ``[2, E]`` per microbatch is all
it costs on the wire.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch
from torch import nn
from torch.distributed.pipelining import PipelineStage

from titan_cotrain.models.draft import Draft
from titan_cotrain.models.moe import RouterLoad, router_load
from titan_cotrain.models.transformer import Transformer, run_layers
from titan_cotrain.ops.attention import packed_cu_seqlens
from titan_cotrain.parallel.pipeline.step_context import PipelineStepContext
from titan_cotrain.parallel.tap_channel import EMBEDDINGS, TapChannel

__all__ = ["LocalPolicy", "MicrobatchIndexedStage", "StageHead", "TransformerStage"]


class StageHead(Protocol):
    """What the last stage runs in place of its ``lm_head`` (``CotrainLoss.head``)."""

    def __call__(self, hidden: torch.Tensor, weight: torch.Tensor, *, microbatch: int,
                 context: PipelineStepContext, router_load: RouterLoad | None) -> torch.Tensor: ...


class MicrobatchIndexedStage(PipelineStage):
    """torch's ``PipelineStage``, calling its module with the index of the microbatch each
    forward runs: ``microbatch=i``, the schedule's own chunk id (every torch schedule, GPipe to
    DualPipeV, runs microbatch ``i`` of a stage as ``forward_one_chunk(i, ...)``), beside the
    keyword arguments given to ``schedule.step``. A Python int rather than an index tensor
    split by the schedule, which FSDP would move to the device and the stage would read back
    with a sync."""

    def forward_one_chunk(self, fwd_chunk_id: int, args: tuple[Any, ...], kwargs: dict[str, Any] | None = None,
                          save_forward_output: bool = True):
        return super().forward_one_chunk(fwd_chunk_id, args, {**(kwargs or {}), "microbatch": fwd_chunk_id},
                                         save_forward_output)


class TransformerStage(nn.Module):
    """One pipeline stage of the target.

    ``forward(x, microbatch=i, context=...)``: ``x`` is ``tokens: int64 [mb, S_local]`` on the
    first stage, the packed hidden stream ``[mb * S_local, H]`` elsewhere (a fresh tensor,
    never a view, which zero-bubble schedules detach in place); ``i`` and ``context`` as the
    module docstring says. Returns the hidden stream, or on the last stage what ``head``
    returns for the final-normed hidden ``[mb * S_local, H]`` and the ``lm_head`` weight (the
    co-training loss's policy sum, ``CotrainLoss.head``): no ``[mb, S, V]`` logits. A mixture
    of experts' stages take and return ``(x, load)`` (the module docstring; the first stage
    starts it), and the head gets the pooled ``RouterLoad`` of every sparse layer (None for a
    dense policy). The ops are ``Transformer.forward``'s, so hidden states and taps are
    bitwise the single-device ones. With a ``channel``, in a run that trains the draft, the
    detached ``[mb, S_local, H]`` output of every tapped layer it holds (and the embedding
    output) is sent the moment it is computed. ``head``: the last stage's, required there.
    """

    def __init__(self, policy: Transformer, layers: range, *, first: bool, last: bool,
                 draft: Draft | None = None, channel: TapChannel | None = None,
                 head: StageHead | None = None) -> None:
        super().__init__()
        if last and head is None:
            raise ValueError("the last stage runs the head in place of its lm_head: pass head")
        self.embed_tokens = policy.embed_tokens if first else None
        self.layers = nn.ModuleDict({str(i): policy.layers[i] for i in layers})
        self.norm = policy.norm if last else None
        self.lm_head = policy.lm_head if last else None
        # Held, not registered as a submodule: the draft is an FSDP root of its own, since its
        # forward and backward run in the loss, outside this stage's forward and backward.
        self.__dict__["draft"] = draft if last else None
        self.head = head if last else None
        self.register_buffer("rope_inv_freq", policy.rope_inv_freq, persistent=False)
        # A mixture of experts (with a sparse layer anywhere) passes on its routers' load.
        n_sparse = policy.args.n_sparse_layers
        self.n_experts, self.n_sparse_layers = (policy.args.n_experts, n_sparse) if n_sparse else (0, 0)
        self.channel = channel
        sources = ({EMBEDDINGS} if first else set()) | (set(layers) & set(policy.tap_layers))
        self.tap_sources = frozenset(sources) if channel is not None else frozenset()
        # This stage's routers' records per microbatch, kept from a forward for its
        # activation-checkpoint rerun (the next run's forward of that microbatch replaces them).
        self._router_loads: dict[int, torch.Tensor] = {}

    def forward(self, x: torch.Tensor, load: torch.Tensor | None = None, *, microbatch: int,
                context: PipelineStepContext):
        mb = context.microbatches[microbatch]
        b, s = mb.positions.shape
        if self.embed_tokens is not None:
            x = self.embed_tokens(x.reshape(-1))
            self._tap(context, microbatch, EMBEDDINGS, x, b, s)
        x = run_layers(((int(name), layer) for name, layer in self.layers.items()), self.rope_inv_freq, x,
                       mb.positions, packed_cu_seqlens(mb.cu_seqlens),
                       lambda layer, out: self._tap(context, microbatch, layer, out, b, s))
        if self.n_experts:
            load = self._add_router_load(load, microbatch, x.device)
        if self.lm_head is None:  # not the last stage
            return (x, load) if self.n_experts else x
        pooled = None
        if self.n_experts:  # every sparse layer saw this rank's x.shape[0] tokens
            pooled = RouterLoad(probs=load[1], counts=load[0], rows=self.n_sparse_layers * x.shape[0])
        return self.head(self.norm(x), self.lm_head.weight, microbatch=microbatch, context=context,
                         router_load=pooled)

    def _add_router_load(self, load: torch.Tensor | None, microbatch: int, device: torch.device) -> torch.Tensor:
        """``load`` (zeros on the first stage) plus this stage's routers' records of
        ``microbatch``'s forward, as a fresh tensor. An activation-checkpoint rerun adds the
        forward's records again (kept per microbatch: the routers record only in a
        forward), so what it recomputes for the loss's backward is the forward's values."""
        if load is None:
            load = torch.zeros(2, self.n_experts, dtype=torch.float32, device=device)
        own = router_load(self.layers)  # None inside a backward
        if own is not None:
            self._router_loads[microbatch] = torch.stack([own.counts, own.probs])
        own = self._router_loads.get(microbatch)
        return load.clone() if own is None else load + own

    def _tap(self, context: PipelineStepContext, microbatch: int, source: int, x: torch.Tensor, b: int,
             s: int) -> None:
        if context.train_draft and source in self.tap_sources:
            self.channel.send(microbatch, source, x.detach().view(b, s, -1))


class LocalPolicy(nn.Module):
    """The policy modules of one PP rank's stages under the whole model's names
    (``embed_tokens``, ``layers.<i>``, ``norm``, ``lm_head``; those of other ranks' stages
    absent), without the draft: what the policy's optimizer, clipping and checkpoint hold,
    so checkpoint keys are the whole model's FQNs. It shares the stages' modules and is
    never called itself."""

    def __init__(self, parts: Sequence[TransformerStage]) -> None:
        super().__init__()
        self.embed_tokens = next((p.embed_tokens for p in parts if p.embed_tokens is not None), None)
        self.layers = nn.ModuleDict({name: layer for p in parts for name, layer in p.layers.items()})
        self.norm = next((p.norm for p in parts if p.norm is not None), None)
        self.lm_head = next((p.lm_head for p in parts if p.lm_head is not None), None)
