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

from titan_cotrain.components.private_torch import check_private_api
from titan_cotrain.components.titan import build_moe
from titan_cotrain.models.args import ModelArgs

__all__ = ["RouterLoad", "load_balancing_loss", "reset_expert_tallies", "sparse_feed_forward"]


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
    if not _in_backward():
        router.router_load = RouterLoad(probs.sum(dim=0), counts.detach().float(), x.shape[0])


def load_balancing_loss(model: nn.Module) -> torch.Tensor | None:
    """The auxiliary load-balancing loss (module docstring) of the MoE layers in ``model`` (a
    ``Transformer``, a pipeline stage, any module holding routers) over their last forward
    run with gradients; a 0-dim fp32 tensor, or None when ``model`` has no router that
    recorded one (a dense model; a forward under ``no_grad``).

    Each router's record holds its ``[N, E]`` probabilities and its input until the next
    forward, or until this loss's backward has run: backpropagate it (weighted by ``[model]
    moe_aux_loss_weight``) with the policy loss of the same forward, or drop both."""
    loads = [m.router_load for m in model.modules() if getattr(m, "router_load", None) is not None]
    if not loads:
        return None
    rows = sum(load.rows for load in loads)
    fraction_routed = torch.stack([load.counts for load in loads]).sum(dim=0) / rows
    mean_prob = torch.stack([load.probs for load in loads]).sum(dim=0) / rows
    return len(fraction_routed) * torch.sum(fraction_routed * mean_prob)


# Whether autograd is running a backward on this thread, which torch answers only privately
# (``torch._C._current_graph_task_id``: -1 outside one; its own checkpointing reads it). The
# same in torch 2.11-2.13, where the project runs; this is our one use of it.
_GRAPH_TASK_TORCH = ("2.11", "2.12", "2.13")


def _in_backward() -> bool:
    check_private_api("torch._C._current_graph_task_id", "titan_cotrain.models.moe", _GRAPH_TASK_TORCH)
    return torch._C._current_graph_task_id() != -1
