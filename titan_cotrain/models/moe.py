"""Qwen3-MoE's sparse feed-forward and its load-balancing loss.

The feed-forward is torchtitan's token-choice MoE (``components.titan.build_moe``: softmax
router, top-k, grouped experts). What this module adds is a record of what each router did
in the last forward, from which ``load_balancing_loss`` makes the auxiliary loss exactly as
Hugging Face's Qwen3-MoE defines it (``load_balancing_loss_func``, Switch Transformer eqs.
4-6), pooled over the MoE layers::

    aux = E * sum_e f_e * P_e
    f_e = (top-k assignments to expert e) / N        no gradient; sum_e f_e = top_k
    P_e = (sum over rows of p(e | row)) / N          p: the router's softmax over E experts

where a row is one token at one MoE layer and ``N`` counts the rows of every MoE layer
together. A router that spreads every token evenly scores ``top_k``.

The gradient of ``aux`` reaches the router weights (``router.gate``) and nothing else: ``P``
is recomputed from the router's input detached (an ``[N, dim] x [dim, E]`` matmul, under 1% of
the experts' ``3 top_k`` ``[N, dim] x [dim, moe_inter_dim]`` ones at Qwen3-MoE's sizes), so the
loss moves no expert, attention, norm or embedding weight.

Activation checkpointing reruns each layer's forward inside the backward; the rerun leaves
the forward's record in place. Its own would hold the rerun's router input (``[N, dim]`` per
layer) until the next forward, through the optimizer step.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from titan_cotrain.components.private_torch import in_backward
from titan_cotrain.components.titan import build_moe
from titan_cotrain.models.args import ModelArgs

__all__ = ["RouterLoad", "load_balancing_loss", "pooled_loss", "reset_expert_tallies", "router_load",
           "sparse_feed_forward"]


class RouterLoad(NamedTuple):
    """What one MoE layer's router did in a forward over ``rows`` tokens: ``probs [E]`` (fp32)
    sums each expert's router probability over the rows and is differentiable in the
    router's gate weight only; ``counts [E]`` (fp32) are the top-k assignments per expert."""

    probs: torch.Tensor
    counts: torch.Tensor
    rows: int


def sparse_feed_forward(args: ModelArgs) -> nn.Module:
    """The MoE feed-forward of a sparse layer of ``args`` (``[B, S, dim] -> [B, S, dim]``):
    torchtitan's ``MoE`` whose router keeps a ``RouterLoad`` of every forward run with
    gradients as ``router.router_load`` (None after a forward without)."""
    moe = build_moe(args.dim, args.moe_inter_dim, args.n_experts, args.top_k, route_norm=args.norm_topk_prob)
    moe.router.router_load = None
    moe.router.register_forward_hook(_record_router_load)
    return moe


@torch.no_grad()
def reset_expert_tallies(model: nn.Module) -> None:
    """Zero, in fp32, the running count of assignments per expert that torchtitan's ``MoE``
    keeps in a buffer (``tokens_per_expert [E]``, in no state dict; its aux-loss-free
    balancing reads it, which this project does not use): a copy built on the meta device
    and materialised uninitialised holds garbage there, in the dtype it was cast to."""
    for module in model.modules():
        tally = getattr(module, "tokens_per_expert", None)
        if isinstance(tally, torch.Tensor):
            module.tokens_per_expert = torch.zeros(tally.shape, dtype=torch.float32, device=tally.device)


def _record_router_load(router: nn.Module, inputs: tuple, outputs: tuple) -> None:
    """Forward hook of torchtitan's ``TokenChoiceTopKRouter``: ``x [N, dim]`` in; (top
    scores, expert ids, assignments per expert ``[E]``) out."""
    if not torch.is_grad_enabled():
        router.router_load = None  # nothing to train; hold no activations
        return
    x, counts = inputs[0], outputs[2]
    probs = F.softmax(router.gate(x.detach()).float(), dim=-1)
    # Activation checkpointing's rerun must redo these ops (it matches what they save), but
    # keeps the forward's record.
    if not in_backward():
        router.router_load = RouterLoad(probs.sum(dim=0), counts.detach().float(), x.shape[0])


def load_balancing_loss(model: nn.Module) -> torch.Tensor | None:
    """The auxiliary load-balancing loss (module docstring) of the MoE layers in ``model`` (a
    ``Transformer``, any module holding routers) over their last forward run with gradients;
    a 0-dim fp32 tensor, or None when ``model`` has no router that recorded one (a dense
    model; a forward under ``no_grad``).

    Each router's record holds its ``[N, E]`` probabilities and its input until the next
    forward, or until this loss's backward has run: backpropagate it (weighted by ``[model]
    moe_aux_loss_weight``) with the policy loss of the same forward, or drop both."""
    load = router_load(model)
    return None if load is None else pooled_loss(load)


def router_load(module: nn.Module) -> RouterLoad | None:
    """The ``RouterLoad`` of every router in ``module`` together (probabilities and counts
    summed over its routers, rows added) over their last forward run with gradients; None
    when none recorded one, and inside a backward (an activation-checkpoint rerun, whose
    records stay the forward's). A pipeline stage adds its layers' to the total it passes on."""
    if in_backward():
        return None
    loads = [m.router_load for m in module.modules() if getattr(m, "router_load", None) is not None]
    if not loads:
        return None
    return RouterLoad(torch.stack([load.probs for load in loads]).sum(dim=0),
                      torch.stack([load.counts for load in loads]).sum(dim=0), sum(load.rows for load in loads))


def pooled_loss(load: RouterLoad) -> torch.Tensor:
    """``E * sum_e f_e * P_e`` (module docstring) of a ``RouterLoad`` pooled over MoE layers."""
    fraction_routed = load.counts.detach() / load.rows
    mean_prob = load.probs / load.rows
    return len(fraction_routed) * torch.sum(fraction_routed * mean_prob)
