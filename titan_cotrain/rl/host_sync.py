"""Host numbers across ranks, through the device: the trainer's few host syncs.

Every method is a collective where the job is distributed (every rank calls it, in the same
order); the values read back are the ``RealRun``'s (a simulated device answers zeros).
"""

import torch
import torch.distributed as dist

__all__ = ["HostSync"]


class HostSync:
    def __init__(self, device: torch.device, run) -> None:
        self.device, self.run = device, run

    def to_host(self, values: dict[str, torch.Tensor | float]) -> dict[str, float]:
        """Device scalars -> floats in one transfer (``RealRun.host_values``)."""
        return self.run.host_values(values, self.device)

    def all_reduce(self, values: list[float], op=dist.ReduceOp.SUM) -> list[float]:
        """Host numbers summed (or maxed) over every rank, through one device collective."""
        t = torch.tensor(values, dtype=torch.float64).to(self.device)
        if dist.is_initialized():
            dist.all_reduce(t, op=op)
        return list(self.to_host({str(i): v for i, v in enumerate(t)}).values())

    def stop_if_any_rank_failed(self, error: str | None, step: int) -> None:
        """Every rank calls this with its own ``error`` (None: fine). If any rank has one, all
        raise the same ``ValueError`` (``step <step>: rank <r>: <error>; ...``), so no rank is
        left waiting at the next collective for one that has stopped."""
        self.most_or_stop(0, error, step)

    def most_or_stop(self, value: int, error: str | None, step: int) -> int:
        """The largest ``value`` over every rank (at least this rank's own: a simulated device
        reads 0), agreed in the same collective that stops every rank, as
        ``stop_if_any_rank_failed`` does, when any rank has an ``error``."""
        failed, most = (float(error is not None), float(value))
        if dist.is_initialized():
            failed, most = self.all_reduce([failed, most], dist.ReduceOp.MAX)
        if failed:
            errors = [error]
            if dist.is_initialized():
                errors = [None] * dist.get_world_size()
                dist.all_gather_object(errors, error)
            raise ValueError(f"step {step}: " + "; ".join(f"rank {r}: {e}" for r, e in enumerate(errors) if e))
        return max(value, int(most))
