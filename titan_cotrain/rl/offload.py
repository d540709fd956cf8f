"""Training state off the device while the engine generates (``[rollout] offload_training_state``).

During a rollout the trainer's own tensors sit idle: the policy's, draft's and KL
reference's fp32 shards, any gradients, and the optimizers' state (11.9 GiB per rank at 8B,
24.5 at 32B, 25.7 at 70B in the shipped configs). ``TrainingStateOffload`` copies each
storage that holds them into a host buffer and frees the device storage (``resize_(0)``, as
FSDP2 frees unsharded parameters), and before the update gives every storage back its size
and its bytes. Storages, not tensors: every view (an FSDP2 shard of its padded flat data, a
tied weight, a DTensor's local tensor) keeps pointing at the same storage object, so nothing
the optimizers, FSDP2 or the checkpointer hold goes stale, and the bytes come back bitwise.

On an accelerator the host buffers are pinned and allocated once (the first offload), and
both directions are non-blocking copies on the current stream: one stream synchronisation
before the device storages are freed (the copies must have read them), none on the way back
(the update's kernels are ordered after the copies on the same stream). On the simulated
device nothing is copied (its values are fake): the storages are freed and re-sized, so the
simulator's memory count sees the rollout without them, and ``host_bytes`` is what the host
would hold.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterable
from typing import ContextManager

import torch
from torch import nn

from titan_cotrain.parallel.storage import FreedStorages, device_storages

__all__ = ["TrainingStateOffload", "offloaded"]


class TrainingStateOffload:
    """The device storages of ``modules``' parameters and gradients and of ``optimizers``'
    state (torch optimizers, or containers with an ``optimizers`` list), which ``away()``
    moves to the host and ``back()`` restores. ``copy = False`` (the simulator) only frees and
    re-sizes them. Tensors off ``device`` (an optimizer's host-side step count) stay.

    In two stages where something between reads the parameters: ``away(weights=False)``
    moves the gradients and the optimizers' state, ``away()`` then the parameters. The RL
    step refreshes the engine (which gathers the policy's shards) between the two, so the
    engine's KV pool, allocated by the refresh, never sits beside the optimizers' state."""

    def __init__(self, modules: Iterable[nn.Module], optimizers: Iterable, device: torch.device, *,
                 copy: bool = True) -> None:
        self.modules, self.device, self.copy = [m for m in modules if m is not None], device, copy
        self.optimizers = []
        for opt in optimizers:
            if opt is not None:
                self.optimizers.extend(getattr(opt, "optimizers", [opt]))
        self.pinned = device.type == "cuda"
        self._host: dict[int, torch.Tensor] = {}  # storage key -> host bytes, kept across steps
        self._freed = FreedStorages()  # what away() moved
        self._weights_away = False
        self.host_bytes = 0  # what the last away() moved
        self.seconds = 0.0  # the wall time of the last away() and back()

    def _tensors(self, weights: bool = True) -> Iterable[torch.Tensor]:
        for module in self.modules:
            for p in module.parameters():
                if weights:
                    yield p
                yield p.grad
        for opt in self.optimizers:
            for state in opt.state.values():
                for value in state.values():
                    if isinstance(value, torch.Tensor):
                        yield value

    def _storages(self, weights: bool = True) -> list[torch.UntypedStorage]:
        """Every distinct non-empty storage on the device, once (the parameters' with ``weights``)."""
        return device_storages(self._tensors(weights), self.device.type)

    @property
    def is_away(self) -> bool:
        return bool(self._freed)

    @torch.no_grad()
    def away(self, weights: bool = True) -> None:
        """Copy the gradients' and optimizers' storages and, with ``weights``, the parameters'
        (those not moved yet) to the host and free them on the device."""
        if self._weights_away or (self._freed and not weights):
            raise RuntimeError("the training state is already off the device")
        t0 = time.perf_counter()
        moved = self._freed.keys()
        if not moved:  # drop the buffers of storages since replaced
            keys = {storage._cdata for storage in self._storages()}
            self._host = {key: host for key, host in self._host.items() if key in keys}
        storages = [storage for storage in self._storages(weights) if storage._cdata not in moved]
        if self.copy:
            for storage in storages:
                host = self._host.get(storage._cdata)
                if host is None or host.numel() != storage.nbytes():
                    host = self._host[storage._cdata] = torch.empty(storage.nbytes(), dtype=torch.uint8,
                                                                    pin_memory=self.pinned)
                host.untyped_storage().copy_(storage, non_blocking=self.pinned)
            if self.device.type == "cuda":
                torch.cuda.current_stream(self.device).synchronize()  # the copies have read the storages
        self._freed.add(storages)
        self._weights_away = weights
        self.host_bytes = self._freed.nbytes
        self.seconds = (self.seconds if moved else 0.0) + time.perf_counter() - t0

    @torch.no_grad()
    def back(self) -> None:
        """Give every storage ``away()`` freed its size and bytes back."""
        t0 = time.perf_counter()
        storages = [storage for storage, _ in self._freed.entries]
        self._freed.restore()
        if self.copy:
            for storage in storages:
                storage.copy_(self._host[storage._cdata].untyped_storage(), non_blocking=self.pinned)
        self._weights_away = False
        self.seconds += time.perf_counter() - t0


@contextlib.contextmanager
def offloaded(offload: TrainingStateOffload | None, phase: Callable[[str], ContextManager] | None = None):
    """``offload``'s training state off the device for the block and back after it, also
    after an error (None: nothing). The gradients and the optimizers' state leave first; the
    block refreshes the engine (which reads the parameters) and then calls the function this
    yields, which moves the parameters too: the KV pool the refresh allocates never sits
    beside the optimizers' state. ``phase`` (the run mode's, ``RealRun.phase``) names the two
    moves ``offload`` and ``restore``."""
    phase = phase or _no_phase
    with phase("offload"):
        if offload is not None:
            offload.away(weights=False)
    try:
        yield offload.away if offload is not None else lambda: None
    finally:
        with phase("restore"):
            if offload is not None:
                offload.back()


def _no_phase(name: str) -> ContextManager:
    return contextlib.nullcontext()
