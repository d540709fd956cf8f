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
        failed = bool(self.all_reduce([float(error is not None)], dist.ReduceOp.MAX)[0]) if dist.is_initialized() \
            else error is not None
        errors = [error]
        if failed and dist.is_initialized():
            errors = [None] * dist.get_world_size()
            dist.all_gather_object(errors, error)
        if failed:
            raise ValueError(f"step {step}: " + "; ".join(f"rank {r}: {e}" for r, e in enumerate(errors) if e))
