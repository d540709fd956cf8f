"""Flash attention on the accelerator: torch's public varlen API for every forward (the
trunk, the ring's blocks, the engine's paged prefill, decode, verify and draft steps), and the
one private op left, ``aten::_flash_attention_backward``, for the training backward.

Varlen form: packed ``q [T_q, Hq, Dh]`` and ``k, v [T_k, Hkv, Dh]`` cut into segments by
``cu_q, cu_k: int32 [n + 1]`` on the tensors' device; segment ``i`` is the queries
``cu_q[i]:cu_q[i + 1]`` over the keys ``cu_k[i]:cu_k[i + 1]``; ``max_q``, ``max_k`` (host
ints) bound the longest segment of each. ``causal`` is bottom-right aligned: query ``i`` of a
segment of ``n`` queries over ``m`` keys sees keys ``j <= m - n + i``. GQA is native (``Hq`` a
multiple of ``Hkv``; K/V never repeated). Our log-sum-exp is ``[T_q, Hq]`` fp32; the kernel's
is ``[Hq, T_q]``, converted here.

Why the backward stays private. ``torch.nn.attention.varlen.varlen_attn``'s autograd
differentiates against the ``(out, lse)`` its own forward produced and drops any gradient on
the lse. Branch attention and the ring need the opposite: a backward handed the *merged*
``(out, lse)`` of several partial attentions (``titan_cotrain.ops.attention.trunk_backward``),
plus a gradient reaching the merged lse (folded in by ``fold_grad_lse``). ATen's
``_flash_attention_backward`` takes exactly that; its schema is checked on first use against
what this module passes (unchanged from torch 2.5 through 2.13).

Kernel limits handled here: fp16/bf16 only (fp32 raises a ``TypeError`` naming the config
key); head dims up to 256, padded to a multiple of 8 by zero columns (which change no score);
``max_q`` raised to 2 where the kernel would otherwise, for single-query segments with GQA,
swap query heads into the sequence dimension and return its lse in another layout (the bound
is only a launch size, so a larger one is exact). Paged KV (``paged_forward``) reads pages of
a multiple of ``PAGE_MULTIPLE`` positions (FA2's paged path) and needs ``Dh % 8 == 0``
(a pool is never padded: that would copy it).

Kernel hazards closed here: paged calls run with ``num_splits=1`` where ``varlen_attn`` takes
it (torch 2.13 does): FA2's paged path with an automatic split-KV count gives occasional NaN
(torchtitan #3235). The forwards whose backward is ATen's flash backward run on the flash
backend (``_flash_backend``): torch 2.13's ``varlen_attn`` has no backend argument and always
runs FA2, later versions may prefer cuDNN.

Which tensors take this module's kernels is ``takes_flash_path``'s answer, the one place the
attention ops, the ring and the KV cache ask. The kernels are reached through ``varlen_attn``
(with its parameters, ``_VARLEN_PARAMS``, read once from its signature) and ``_flash_ops``:
``tests/gpu`` patches these names and ``takes_flash_path`` with pure-PyTorch stand-ins of
torch 2.11's and 2.13's kernels, to run this module with values on a machine without CUDA.
"""

from __future__ import annotations

import contextlib
import functools
import inspect

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

__all__ = [
    "MAX_HEAD_DIM",
    "PAGE_MULTIPLE",
    "check_flash_schema",
    "has_paged_kernel",
    "kernel_paths",
    "paged_forward",
    "takes_flash_path",
    "varlen_backward",
    "varlen_forward",
]

_KERNEL_DTYPES = (torch.float16, torch.bfloat16)
MAX_HEAD_DIM = 256
PAGE_MULTIPLE = 256

try:  # torch >= 2.10; enable_gqa / seqused_k / block_table from 2.13 (checked by signature below)
    from torch.nn.attention.varlen import AuxRequest, varlen_attn
except ImportError:  # pragma: no cover - torch older than the project supports
    AuxRequest = varlen_attn = None

_VARLEN_PARAMS = frozenset(inspect.signature(varlen_attn).parameters) if varlen_attn is not None else frozenset()

# torch 2.13's varlen_attn always runs FA2 (its cuDNN switch, ``_should_use_cudnn``, answers
# False) and takes no backend argument. Later versions prefer cuDNN where eligible and take the
# choice from ``sdpa_kernel`` (pytorch#193631); a cuDNN forward's lse is not the one ATen's flash
# backward pairs with, so there the forwards whose backward is ours are pinned to flash.
_VARLEN_MAY_CHOOSE_CUDNN = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]) > (2, 13)

# What we pass positionally to the private backward, in order; ``scale`` goes by keyword.
# Names are not checked: torch 2.5 called rng_state/unused philox_seed/offset.
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
    """Raise unless ``schema``, one of the two private flash ops', takes what this module
    passes: our positional arguments in order, ``scale`` by keyword, and at least the outputs we read."""
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
    """The private forward (only where the public API lacks GQA) and backward, schema-checked."""
    forward = torch.ops.aten._flash_attention_forward.default
    backward = torch.ops.aten._flash_attention_backward.default
    for op in (forward, backward):
        check_flash_schema(op._schema)
    return forward, backward


def takes_flash_path(x: torch.Tensor) -> bool:
    """Whether attention on ``x`` runs this module's kernels: on every device but the CPU (a
    GPU, and the simulator's stand-in accelerator, whose kernels give shapes only). The
    attention ops, the ring's segment cache and the KV cache ask here and nowhere else."""
    return x.device.type != "cpu"


def has_paged_kernel() -> bool:
    """Whether this torch's ``varlen_attn`` reads a paged KV pool (``block_table``, ``seqused_k``)."""
    return {"block_table", "seqused_k", "enable_gqa"} <= _VARLEN_PARAMS


def kernel_paths() -> dict[str, str | bool]:
    """Which kernel each attention call takes on an accelerator with this torch (for reports:
    ``scripts/gpu_report.py``): the trunk's forward without and with GQA, the backward, the
    engine's decode over the KV pool, and whether the forwards are pinned to flash."""
    def forward(gqa: bool) -> str:
        return ("varlen_attn" + ("(enable_gqa)" if gqa else "") if _public_options(True, gqa) is not None
                else "aten._flash_attention_forward")

    return {"torch": torch.__version__, "trunk": forward(False), "trunk_gqa": forward(True),
            "backward": "aten._flash_attention_backward",
            "decode": ("varlen_attn(block_table, seqused_k, num_splits=1)" if has_paged_kernel()
                       else "gathered blocks, masked attention (models.kv_cache.cached_attention)"),
            "forward_pinned_to_flash": _VARLEN_MAY_CHOOSE_CUDNN}


def _public_options(causal: bool, gqa: bool) -> dict | None:
    """``varlen_attn``'s keywords for a causal (or full) call, with GQA if asked, in this
    torch's spelling (``window_size`` from 2.11, ``is_causal`` before); None where it cannot
    make the call (no lse output, or no GQA)."""
    if "return_aux" not in _VARLEN_PARAMS or (gqa and "enable_gqa" not in _VARLEN_PARAMS):
        return None
    options = {"enable_gqa": True} if gqa else {}
    if "window_size" in _VARLEN_PARAMS:
        options["window_size"] = (-1, 0) if causal else (-1, -1)
    elif "is_causal" in _VARLEN_PARAMS:
        options["is_causal"] = causal
    else:
        return None
    return options


def _flash_backend() -> contextlib.AbstractContextManager:
    """Where ``varlen_attn`` may choose cuDNN (after torch 2.13), only its flash backend enabled."""
    return sdpa_kernel(SDPBackend.FLASH_ATTENTION) if _VARLEN_MAY_CHOOSE_CUDNN else contextlib.nullcontext()


def _check_inputs(*xs: torch.Tensor) -> None:
    dtypes = {x.dtype for x in xs}
    if len(dtypes) != 1 or not dtypes <= set(_KERNEL_DTYPES):
        raise TypeError(
            f"flash attention on the accelerator takes fp16 or bf16 tensors of one dtype, got "
            f"{', '.join(sorted(map(str, dtypes)))}: run the model in bf16 "
            f'([training] mixed_precision_param = "bfloat16"); the fp32 attention is a CPU reference only'
        )
    if xs[0].shape[-1] > MAX_HEAD_DIM:
        raise ValueError(f"flash attention takes head dims up to {MAX_HEAD_DIM}, got {xs[0].shape[-1]}")


def _pad_head_dim(x: torch.Tensor) -> torch.Tensor:
    """Zero columns up to a multiple of 8: they change no score and only add zero outputs."""
    pad = -x.shape[-1] % 8
    return F.pad(x, (0, pad)) if pad else x


def _launch_max_q(max_q: int, q: torch.Tensor, k_heads: int) -> int:
    """The ``max_q`` to launch with: >= 2 for GQA, so the kernel never swaps its lse layout."""
    return max(max_q, 2) if q.shape[1] != k_heads else max_q


def _lse_rows(lse: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """The kernel's log-sum-exp as ours, ``[T_q, Hq]`` fp32. torch 2.13's ``varlen_attn``
    returns the kernel's ``[Hq, T_q]`` (its docstring says ``[T_q, Hq]``; either is read, and
    the square case is the kernel's). A query without keys gets ``-inf`` (FA2 writes ``+inf``
    there, which would win every merge)."""
    rows = lse.shape == q.shape[:2] and q.shape[0] != q.shape[1]
    lse = (lse if rows else lse.t()).float()
    return lse.masked_fill(lse == float("inf"), float("-inf")).contiguous()


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
    """Attention of every segment. Returns ``out [T_q, Hq, Dh]`` (q's dtype) and
    ``lse [T_q, Hq]`` (fp32)."""
    _check_inputs(q, k, v)
    if q.shape[0] == 0 or k.shape[0] == 0:  # nothing to launch; no keys: out 0, lse -inf
        return q.new_zeros(q.shape), q.new_full(q.shape[:2], float("-inf"), dtype=torch.float32)
    d, gqa = q.shape[-1], q.shape[1] != k.shape[1]
    qp, kp, vp = (_pad_head_dim(x) for x in (q, k, v))
    max_q = _launch_max_q(max_q, q, k.shape[1])
    options = _public_options(causal, gqa)
    if options is not None:
        with _flash_backend():  # the backward is ATen's flash backward (module docstring)
            out, lse = varlen_attn(qp, kp, vp, cu_q, cu_k, max_q, max_k, return_aux=AuxRequest(lse=True),
                                   scale=scale, **options)
    else:  # a torch whose public API lacks what we pass: the private forward, GQA-native
        forward, _ = _flash_ops()
        out, lse, *_ = forward(qp, kp, vp, cu_q, cu_k, max_q, max_k, 0.0, causal, False, scale=scale)
    return out[..., :d].contiguous(), _lse_rows(lse, q)


def paged_forward(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    block_table: torch.Tensor,
    seqused_k: torch.Tensor,
    max_q: int,
    max_k: int,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention of ``B`` rows of ``s = max_q`` queries each, ``q [B * s, Hq, Dh]``,
    against a paged pool ``k_pool, v_pool [n_blocks, block_size, Hkv, Dh]`` read through
    ``block_table: int32 [B, nb]`` (``max_k = nb * block_size``): row ``b`` has
    ``seqused_k[b]`` (int32 ``[B]``, on the device) keys, and its query ``i`` sits at position
    ``seqused_k[b] - s + i`` and sees the keys at or before it. Nothing is gathered and no
    score tensor is materialised. Returns ``out [B * s, Hq, Dh]``, ``lse [B * s, Hq]`` (fp32)."""
    _check_inputs(q, k_pool, v_pool)
    if not has_paged_kernel():
        raise RuntimeError(f"torch {torch.__version__}'s varlen_attn has no paged KV (block_table): "
                           "the engine takes its gather path (titan_cotrain.models.kv_cache)")
    if q.shape[-1] % 8 or k_pool.shape[1] % PAGE_MULTIPLE:
        raise ValueError(f"the paged flash kernel needs head dims that are multiples of 8 (got {q.shape[-1]}) and "
                         f"blocks of a multiple of {PAGE_MULTIPLE} positions (got {k_pool.shape[1]}: "
                         f"[rollout] kv_block_size)")
    b, s = block_table.shape[0], max_q
    device = q.device
    cu_q = torch.arange(0, (b + 1) * s, s, dtype=torch.int32, device=device)
    cu_k = F.pad(seqused_k.cumsum(0, dtype=torch.int32), (1, 0))
    # One split: the paged path with automatic split-KV gives occasional NaN (torchtitan #3235).
    splits = {"num_splits": 1} if "num_splits" in _VARLEN_PARAMS else {}
    out, lse = varlen_attn(q, k_pool, v_pool, cu_q, cu_k, _launch_max_q(s, q, k_pool.shape[2]), max_k,
                           return_aux=AuxRequest(lse=True), scale=scale, window_size=(-1, 0),
                           enable_gqa=q.shape[1] != k_pool.shape[2], seqused_k=seqused_k,
                           block_table=block_table.to(torch.int32), **splits)
    return out, _lse_rows(lse, q)


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
    _check_inputs(grad_out, q, k, v, out)
    if q.shape[0] == 0 or k.shape[0] == 0:
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    _, backward = _flash_ops()
    # Dropout is off, so the kernel never reads the RNG state; it still takes the tensors.
    rng_state = torch.zeros(2, dtype=torch.uint64, device=q.device)
    unused = torch.empty(0, dtype=torch.uint64, device=q.device)
    # Rows without keys carry lse = -inf; the kernel's own convention there is +inf (P = 0).
    lse = lse.masked_fill(lse == float("-inf"), float("inf"))
    dq, dk, dv = backward(
        *(_pad_head_dim(x) for x in (grad_out, q, k, v, out)), lse.t().contiguous(),
        cu_q, cu_k, _launch_max_q(max_q, q, k.shape[1]), max_k, 0.0, causal, rng_state, unused, scale=scale,
    )
    d = q.shape[-1]
    return dq[..., :d].contiguous(), dk[..., :d].contiguous(), dv[..., :d].contiguous()
