"""Nothing lost to a NaN: detect a non-finite update on every rank alike, skip it, and never
save weights that are not finite.

An update is *non-finite* for the policy when its loss or its gradient norm is NaN or inf,
and likewise for the draft; the two are judged separately (a draft that diverges does not
stop the policy from training, and the reverse). The verdict is maxed over every rank, so
all ranks skip the same optimizer steps and stay in lockstep: one small all-reduce per
update, read on the host together with the update's metrics.
"""

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["NonfiniteStop", "NonfiniteWeights", "all_finite", "nonfinite_flags"]


class NonfiniteStop(RuntimeError):
    """The job stops: too many consecutive steps with a skipped update (every rank raises it)."""


class NonfiniteWeights(NonfiniteStop):
    """Raised instead of writing a checkpoint or an export with non-finite weights."""


def nonfinite_flags(metrics: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    """``{"nonfinite/policy": 0. | 1., "nonfinite/draft": 0. | 1.}`` (device scalars, the same on
    every rank): 1 where ``loss/<part>`` or ``grad_norm/<part>`` in ``metrics`` is not finite on
    any rank. A part a rank has no metric of (no draft, or a PP rank without it) counts as finite there."""
    flags = []
    for part in ("policy", "draft"):
        values = [metrics[key] for key in (f"loss/{part}", f"grad_norm/{part}") if key in metrics]
        bad = torch.zeros((), dtype=torch.bool, device=device)
        for value in values:
            bad = bad | ~torch.isfinite(torch.as_tensor(value, device=device))
        flags.append(bad)
    stacked = torch.stack(flags).float()
    if dist.is_initialized():
        dist.all_reduce(stacked, op=dist.ReduceOp.MAX)
    return {"nonfinite/policy": stacked[0], "nonfinite/draft": stacked[1]}


@torch.no_grad()
def all_finite(modules: Iterable[nn.Module | None], device: torch.device, *, collective: bool = True) -> bool:
    """Whether every parameter and buffer of ``modules`` is finite, on every rank when
    ``collective`` (FSDP shards and PP stages: each rank checks what it holds). One host
    read; ``None`` entries are skipped."""
    ok = torch.ones((), dtype=torch.float32, device=device)
    for module in modules:
        if module is None:
            continue
        for tensor in [*module.parameters(), *module.buffers()]:
            local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
            if local.is_floating_point() and local.numel():
                ok = torch.minimum(ok, torch.isfinite(local).all().float())
    if collective and dist.is_initialized():
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    return bool(ok.item())
