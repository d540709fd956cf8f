"""ATen's flash-attention kernels for the accelerator, the project's one use of the private
ops ``aten::_flash_attention_forward`` / ``aten::_flash_attention_backward``.

Varlen form: packed ``q [T_q, Hq, Dh]`` and ``k, v [T_k, Hkv, Dh]`` cut into segments by
``cu_q, cu_k: int32 [n + 1]`` on the tensors' device; segment ``i`` is the queries
``cu_q[i]:cu_q[i + 1]`` over the keys ``cu_k[i]:cu_k[i + 1]``; ``max_q``, ``max_k`` (host
ints) are the longest segment of each. GQA is native (``Hq`` a multiple of ``Hkv``, K/V never repeated). The
backward differentiates against the ``(out, lse)`` it is handed, which may be a merged
attention's rather than the kernel's own (see ``titan_cotrain.ops.attention.trunk_backward``).

The ops' varlen log-sum-exp is ``[Hq, T_q]``; ours is ``[T_q, Hq]`` fp32, converted here.
The kernels take fp16/bf16 and head dims that are multiples of 8 (padded here). The op
schemas are checked on first use. Shapes are checked on CPU through the ops' meta kernels;
numerics have not yet been verified on a GPU.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

__all__ = ["check_flash_schema", "varlen_backward", "varlen_forward"]

_KERNEL_DTYPES = (torch.float16, torch.bfloat16)

# What we pass positionally, in order; unchanged since torch 2.5, and ``scale`` goes by
# keyword. Names are not checked: torch 2.5 called rng_state/unused philox_seed/offset.
_PASSED = {
    "aten::_flash_attention_forward": (
        # query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal, return_debug_mask
        ("Tensor",) * 5 + ("int", "int", "float", "bool", "bool"),
        2,  # outputs read: output, softmax_logsumexp
    ),
    "aten::_flash_attention_backward": (
        # grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k,
        # dropout_p, is_causal, rng_state, unused
        ("Tensor",) * 8 + ("int", "int", "float", "bool", "Tensor", "Tensor"),
        3,  # grad_query, grad_key, grad_value
    ),
}
_ACCEPTS = {"Tensor": {"Tensor", "Optional[Tensor]"}, "int": {"int"}, "float": {"float"}, "bool": {"bool"}}


def check_flash_schema(schema: torch._C.FunctionSchema) -> None:
    """Raise unless ``schema``, one of the two flash ops', takes what this module passes: our
    positional arguments in order, ``scale`` by keyword, and at least the outputs we read."""
    passed, n_read = _PASSED[schema.name]
    positional = [a for a in schema.arguments if not a.kwarg_only]
    problems = [
        f"argument {i} ({arg.name}) is {arg.type}, we pass {kind}"
        for i, (arg, kind) in enumerate(zip(positional, passed))
        if str(arg.type) not in _ACCEPTS[kind]
    ]
    if len(positional) < len(passed):
        problems.append(f"{len(positional)} positional arguments, we pass {len(passed)}")
    problems += [f"argument {a.name} is required and we do not pass it"
                 for a in positional[len(passed):] if not a.has_default_value()]
    if not any(a.name == "scale" and a.kwarg_only for a in schema.arguments):
        problems.append("no keyword argument scale")
    if len(schema.returns) < n_read:
        problems.append(f"{len(schema.returns)} outputs, we read {n_read}")
    if problems:
        raise RuntimeError(
            f"titan_cotrain.ops.flash calls {schema.name} as torch 2.5 to 2.13 define it, but torch "
            f"{torch.__version__} has `{schema}`: {'; '.join(problems)}. Port titan_cotrain/ops/flash.py."
        )


@functools.cache
def _flash_ops() -> tuple[torch._ops.OpOverload, torch._ops.OpOverload]:
    forward = torch.ops.aten._flash_attention_forward.default
    backward = torch.ops.aten._flash_attention_backward.default
    for op in (forward, backward):
        check_flash_schema(op._schema)
    return forward, backward


def _check_dtypes(*xs: torch.Tensor) -> None:
    dtypes = {x.dtype for x in xs}
    if len(dtypes) != 1 or not dtypes <= set(_KERNEL_DTYPES):
        raise TypeError(
            f"flash attention on the accelerator takes fp16 or bf16 tensors of one dtype, got "
            f"{', '.join(sorted(map(str, dtypes)))}: run the model in bf16 "
            f'([training] mixed_precision_param = "bfloat16"); the fp32 attention is a CPU reference only'
        )


def _pad_head_dim(x: torch.Tensor) -> torch.Tensor:
    """Zero columns up to a multiple of 8: they change no score and only add zero outputs."""
    pad = -x.shape[-1] % 8
    return F.pad(x, (0, pad)) if pad else x


def varlen_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_q: torch.Tensor,
    cu_k: torch.Tensor,
    max_q: int,
    max_k: int,
    scale: float,
    causal: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of every segment (``causal``: key ``j <= `` query ``i`` within the segment,
    for segments with as many queries as keys). Returns ``out [T_q, Hq, Dh]`` (q's dtype)
    and ``lse [T_q, Hq]`` (fp32)."""
    _check_dtypes(q, k, v)
    if q.shape[0] == 0 or k.shape[0] == 0:  # nothing to launch; no keys: out 0, lse -inf
        return q.new_zeros(q.shape), q.new_full(q.shape[:2], float("-inf"), dtype=torch.float32)
    forward, _ = _flash_ops()
    out, lse, *_ = forward(
        *(_pad_head_dim(x) for x in (q, k, v)), cu_q, cu_k, max_q, max_k, 0.0, causal, False, scale=scale
    )
    return out[..., : q.shape[-1]].contiguous(), lse.t().contiguous()


def varlen_backward(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    cu_q: torch.Tensor,
    cu_k: torch.Tensor,
    max_q: int,
    max_k: int,
    scale: float,
    causal: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)``, shaped and typed like ``q, k, v``, of the attention whose output and
    log-sum-exp are ``out [T_q, Hq, Dh]``, ``lse [T_q, Hq]`` (fp32): with ``P = exp(S - lse)``,
    ``dS = P (dO V^T - rowsum(dO * out))``, over the same segments as ``varlen_forward``."""
    _check_dtypes(grad_out, q, k, v, out)
    if q.shape[0] == 0 or k.shape[0] == 0:
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    _, backward = _flash_ops()
    # Dropout is off, so the kernel never reads the RNG state; it still takes the tensors.
    rng_state = torch.zeros(2, dtype=torch.uint64, device=q.device)
    unused = torch.empty(0, dtype=torch.uint64, device=q.device)
    dq, dk, dv = backward(
        *(_pad_head_dim(x) for x in (grad_out, q, k, v, out)), lse.t().contiguous(),
        cu_q, cu_k, max_q, max_k, 0.0, causal, rng_state, unused, scale=scale,
    )
    d = q.shape[-1]
    return dq[..., :d].contiguous(), dk[..., :d].contiguous(), dv[..., :d].contiguous()
