"""Our attention ops as handlers of torch's context-parallel dispatcher (private torch API).

``torch.distributed.tensor.experimental`` implements CP as a table of DTensor op handlers
(``_context_parallel._attention.custom_ops``) that it installs into DTensor's dispatcher
while CP is on (``_enable_context_parallel_dispatcher()``, which torchtitan calls once when it
applies CP and never undoes; or inside ``context_parallel(...)``). Its table covers the CUDA
SDPA ops only. ``register_cp_handlers`` adds ours, and ``cp_dispatch()`` turns the dispatcher
on for a block (the update's forward-backward) and off after it:

* ``titan_cotrain::varlen_causal_attention`` and ``titan_cotrain::branch_attention``
  (forward and backward ops): ``q, k, v`` DTensors ``Shard(0)`` (packed ``[T, H, Dh]``)
  and ``branch_k, branch_v`` ``Shard(1)`` (``[P, T, Hkv, Dh]``) on a 1-D CP mesh, holding
  the zigzag shard of ``titan_cotrain.parallel.context_parallel``; ``cu_seqlens`` a plain
  host tensor of the *local* documents (the same on every rank). The models keep calling
  ``VarlenAttention`` / ``BranchAttention``; ``apply_context_parallel`` hooks those modules
  so that their inputs arrive as such DTensors, and the handlers below run the ring ops
  (``titan_cotrain::ring_attention`` and its backward, on the local shards, so that a
  compiled block and the scale simulator see the one opaque ring op);
* ``aten._scaled_dot_product_flash_attention_for_cpu`` and its backward, the CPU SDPA ops
  stock torch lacks: ``[B, H, L, E]`` ``Shard(2)``, one document per row, in torch's
  head-tail layout (= our zigzag), or contiguous when ``_cp_options.enable_load_balance``
  is off. With these, ``context_parallel(mesh, buffers=...)`` runs on gloo/CPU too.

This module is the only user of the private names (the same in torch 2.11, 2.12 and 2.13);
it checks the torch version at import.
"""

from __future__ import annotations

import contextlib

import torch

SUPPORTED_TORCH = ("2.11", "2.12", "2.13")


def check_torch_version(version: str = torch.__version__) -> None:
    """Raise unless torch's ``major.minor`` is one whose private CP dispatcher we target."""
    major_minor = ".".join(version.split("+")[0].split(".")[:2])
    if major_minor not in SUPPORTED_TORCH:
        raise RuntimeError(
            f"titan_cotrain.parallel.cp_dispatch hooks torch's private context-parallel dispatcher "
            f"(torch.distributed.tensor.experimental._context_parallel), written against torch "
            f"{', '.join(SUPPORTED_TORCH)}; found torch {version}. Context parallelism needs it: port this module "
            f"(the handler table custom_ops and _enable_context_parallel_dispatcher)."
        )


check_torch_version()

from torch.distributed.tensor import DTensor, Shard  # noqa: E402
from torch.distributed.tensor.experimental._context_parallel import _attention as _torch_cp  # noqa: E402

from titan_cotrain.components.shards import local_shard  # noqa: E402
from titan_cotrain.ops.ring_attention import (  # noqa: E402
    DEFAULT_PIECES,
    RingComm,
    ring_backward,
    ring_forward,
    ring_name,
)

__all__ = ["check_torch_version", "cp_dispatch", "cp_dispatch_is_on", "register_cp_handlers"]

aten = torch.ops.aten


def _bind(op: torch._ops.OpOverload, args: tuple, kwargs: dict) -> dict:
    """The op's arguments by name, defaults filled in."""
    bound = {}
    for i, arg in enumerate(op._schema.arguments):
        if i < len(args):
            bound[arg.name] = args[i]
        elif arg.name in kwargs:
            bound[arg.name] = kwargs[arg.name]
        elif arg.has_default_value():
            bound[arg.name] = arg.default_value
        else:
            raise TypeError(f"{op}: missing argument {arg.name}")
    return bound


def _local(x, dim: int, name: str) -> torch.Tensor:
    """The local shard of a DTensor placed ``Shard(dim)`` on a 1-D mesh."""
    if not isinstance(x, DTensor):
        raise TypeError(f"context-parallel attention: {name} must be a DTensor sharded on dim {dim}, not a tensor")
    if x.device_mesh.ndim != 1 or tuple(x.placements) != (Shard(dim),):
        raise ValueError(
            f"context-parallel attention: {name} must be Shard({dim}) on a 1-D CP mesh, "
            f"got {tuple(x.placements)} on a {x.device_mesh.ndim}-D mesh"
        )
    return x.to_local()


def _shard(x: torch.Tensor, mesh, dim: int) -> DTensor:
    return DTensor.from_local(x.contiguous(), mesh, (Shard(dim),), run_check=False)


def _comm(mesh) -> RingComm:
    return RingComm(mesh.get_group())


def _ring_op(a: dict, with_branch: bool) -> tuple:
    """The ring op's arguments for bound arguments ``a`` of one of our attention ops."""
    mesh = a["q"].device_mesh
    q, k, v = (_local(a[n], 0, n) for n in ("q", "k", "v"))
    branch = tuple(_local(a[n], 1, n) for n in ("branch_k", "branch_v")) if with_branch else (None, None)
    return mesh, (q, k, v, *branch, local_shard(a["cu_seqlens"]), a["scale"], ring_name(mesh.get_group()), "zigzag",
                  DEFAULT_PIECES)


def _attention(op, args, kwargs):
    """``varlen_causal_attention`` / ``branch_attention`` -> the ring (the branch merged in rank-locally)."""
    a = _bind(op, args, kwargs)
    mesh, ring_args = _ring_op(a, "branch_k" in a)
    out, lse = torch.ops.titan_cotrain.ring_attention(*ring_args)
    return _shard(out, mesh, 0), _shard(lse, mesh, 0)


def _attention_backward(op, args, kwargs):
    a = _bind(op, args, kwargs)
    with_branch = "branch_k" in a
    if a.get("grad_lse") is not None:
        raise NotImplementedError("context-parallel branch attention: the ring's backward takes no gradient of the "
                                  "lse (use branch_attention, whose lse feeds nothing)")
    mesh, (q, k, v, branch_k, branch_v, cu, scale, ring, layout, pieces) = _ring_op(a, with_branch)
    grad_out, out, lse = (_local(a[n], 0, n) for n in ("grad_out", "out", "lse"))
    grads = torch.ops.titan_cotrain.ring_attention_backward(grad_out, q, k, v, branch_k, branch_v, out, lse, cu,
                                                            scale, ring, layout, pieces)
    placed = [_shard(g, mesh, 0) for g in grads[:3]]
    return tuple(placed + [_shard(g, mesh, 1) for g in grads[3:]])


def _sdpa_layout() -> str:
    return "zigzag" if _torch_cp._cp_options.enable_load_balance else "contiguous"


def _packed(x: torch.Tensor) -> torch.Tensor:
    """``[B, H, L, E] -> [B * L, H, E]``."""
    b, h, l, e = x.shape
    return x.transpose(1, 2).reshape(b * l, h, e)


def _unpacked(x: torch.Tensor, b: int) -> torch.Tensor:
    """``[B * L, H, ...] -> [B, H, L, ...]``."""
    return x.unflatten(0, (b, -1)).transpose(1, 2)


def _sdpa_args(op, args, kwargs):
    a = _bind(op, args, kwargs)
    if a["dropout_p"] != 0.0 or a["attn_mask"] is not None:
        raise NotImplementedError("context-parallel CPU SDPA supports no dropout and no attn_mask (is_causal only)")
    mesh = a["query"].device_mesh
    q = _local(a["query"], 2, "query")
    b, _, l, e = q.shape
    scale = e**-0.5 if a["scale"] is None else a["scale"]
    cu = torch.arange(b + 1, dtype=torch.int32, device=q.device) * l
    return a, mesh, q, b, scale, cu


def _sdpa_cpu(op, args, kwargs):
    a, mesh, q, b, scale, cu = _sdpa_args(op, args, kwargs)
    k, v = _local(a["key"], 2, "key"), _local(a["value"], 2, "value")
    out, lse = ring_forward(_packed(q), _packed(k), _packed(v), cu, scale, _comm(mesh), layout=_sdpa_layout(),
                            causal=a["is_causal"])
    return _shard(_unpacked(out, b), mesh, 2), _shard(_unpacked(lse, b).contiguous(), mesh, 2)


def _sdpa_cpu_backward(op, args, kwargs):
    a, mesh, q, b, scale, cu = _sdpa_args(op, args, kwargs)
    grad_out, k, v, out = (_local(a[n], 2, n) for n in ("grad_out", "key", "value", "out"))
    lse = _local(a["logsumexp"], 2, "logsumexp")
    grads = ring_backward(_packed(grad_out), _packed(q), _packed(k), _packed(v), _packed(out),
                          lse.transpose(1, 2).reshape(-1, lse.shape[1]), cu, scale, _comm(mesh),
                          layout=_sdpa_layout(), causal=a["is_causal"])
    return tuple(_shard(_unpacked(g, b), mesh, 2) for g in grads)


def _handlers() -> dict:
    ops = torch.ops.titan_cotrain
    return {
        ops.varlen_causal_attention.default: _attention,
        ops.varlen_causal_attention_backward.default: _attention_backward,
        ops.branch_attention.default: _attention,
        ops.branch_attention_backward.default: _attention_backward,
        aten._scaled_dot_product_flash_attention_for_cpu.default: _sdpa_cpu,
        aten._scaled_dot_product_flash_attention_for_cpu_backward.default: _sdpa_cpu_backward,
    }


def register_cp_handlers() -> None:
    """Add our handlers to torch's CP handler table (idempotent). They take effect while
    torch's CP dispatcher is enabled, including one enabled already."""
    import titan_cotrain.ops  # noqa: F401  (defines the titan_cotrain ops)

    handlers = _handlers()
    _torch_cp.custom_ops.update(handlers)
    if cp_dispatch_is_on():
        DTensor._op_dispatcher._custom_op_handlers.update(handlers)


@contextlib.contextmanager
def cp_dispatch():
    """Torch's CP dispatcher on, with our handlers registered, for the block; off again after
    the outermost block (re-entrant), so the switch never outlives the forward-backward that
    needs it (torchtitan's ``apply_cp_to_attention_module`` turns it on for good). The
    handlers see DTensor inputs only, so attention on plain tensors inside the block (the
    reference model, the rollout engine) is unaffected; outside it, a CP-hooked model's
    forward fails in DTensor's dispatcher instead of running a wrong attention."""
    global _depth
    register_cp_handlers()
    if _depth == 0:
        _torch_cp._enable_context_parallel_dispatcher()
    _depth += 1
    try:
        yield
    finally:
        _depth -= 1
        if _depth == 0:
            _torch_cp._disable_context_parallel_dispatcher()


def cp_dispatch_is_on() -> bool:
    """Whether torch's CP dispatcher is on right now (DTensor runs the CP handler table)."""
    return DTensor._op_dispatcher._custom_op_handlers is not _torch_cp.existing_custom_ops


_depth = 0  # open cp_dispatch blocks
