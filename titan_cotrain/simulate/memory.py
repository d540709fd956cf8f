"""Live device memory of a simulated rank, by category, from the fake storages themselves.

Every storage a device op creates is counted (its bytes rounded up to 512, the CUDA caching
allocator's granularity) until it is freed; the peak is the maximum of that live total, and
the breakdown at the peak says what was alive. Categories come from who owns a storage when
the peak is taken: the ``owners`` callback of the simulator names the storages of the
trainer's objects (parameters, gradients, optimizer state, engine weights, KV cache,
reference); storages created inside FSDP's collectives are communication buffers; everything
else is activations and temporaries. Not modelled: fragmentation, the CUDA context, NCCL's
own buffers.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch
from torch.multiprocessing.reductions import StorageWeakRef

__all__ = ["MemoryTracker", "storage_key"]

_ROUND = 512
# Storages created under these files are FSDP's all-gather / reduce-scatter buffers.
_COMM_FILES = ("_fsdp_collectives.py", "_fsdp_param.py", "_fsdp_param_group.py")
# A new peak is broken down again only when it exceeds the last broken-down one by 1% (1 MiB at least).
_RESNAPSHOT_FRACTION, _RESNAPSHOT_MIN = 0.01, 2**20


def storage_key(t: torch.Tensor) -> int:
    """The identity of ``t``'s storage (shared by all its views)."""
    return t.untyped_storage()._cdata


def _in_fsdp_collective() -> bool:
    frame = sys._getframe(2)
    for _ in range(40):
        if frame is None:
            return False
        if frame.f_code.co_filename.endswith(_COMM_FILES):
            return True
        frame = frame.f_back
    return False


class MemoryTracker:
    """``on_alloc`` for ``SimulatedDevice``; ``owners()`` maps storage keys to categories.

    ``peak_bytes``: the exact peak of live bytes; ``peak_by_category``: the breakdown at
    the peak (re-taken whenever the peak grows by 1%, so within 1% of exact);
    ``phase_peaks``: the peak of every phase named by ``phase(name)``.
    """

    def __init__(self, owners: Callable[[], dict[int, str]] | None = None) -> None:
        self.owners = owners or dict
        self._live: dict[int, tuple[StorageWeakRef, int, str]] = {}
        self._bytes = 0  # live total, counting storages not yet found dead
        self.peak_bytes = 0
        self.peak_by_category: dict[str, int] = {}
        self._snapshot_at = -1
        self.current_phase = "start"
        self.phase_peaks: dict[str, int] = {}
        self.peak_phase = "start"

    def phase(self, name: str) -> None:
        self.current_phase = name
        self.phase_peaks.setdefault(name, 0)

    def __call__(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        key = storage._cdata
        if key in self._live:
            return
        nbytes = -(-storage.nbytes() // _ROUND) * _ROUND
        tag = "communication buffers" if _in_fsdp_collective() else "activations"
        self._live[key] = (StorageWeakRef(storage), nbytes, tag)
        self._bytes += nbytes
        if self._bytes > self.peak_bytes or self._bytes > self.phase_peaks.get(self.current_phase, 0):
            self._sweep()
            self._note_peak()

    def _sweep(self) -> None:
        dead = [key for key, (ref, _, _) in self._live.items() if ref.expired()]
        for key in dead:
            self._bytes -= self._live.pop(key)[1]

    def live_bytes(self) -> int:
        self._sweep()
        return self._bytes

    def breakdown(self) -> dict[str, int]:
        """Live bytes by category right now."""
        self._sweep()
        owners = self.owners()
        out: dict[str, int] = {}
        for key, (_, nbytes, tag) in self._live.items():
            category = owners.get(key, tag)
            out[category] = out.get(category, 0) + nbytes
        return out

    def _note_peak(self) -> None:
        phase = self.current_phase
        self.phase_peaks[phase] = max(self.phase_peaks.get(phase, 0), self._bytes)
        if self._bytes <= self.peak_bytes:
            return
        self.peak_bytes = self._bytes
        self.peak_phase = phase
        threshold = max(_RESNAPSHOT_FRACTION * self._snapshot_at, _RESNAPSHOT_MIN)
        if self._snapshot_at >= 0 and self._bytes - self._snapshot_at < threshold:
            return
        self._snapshot_at = self._bytes
        self.peak_by_category = self.breakdown()
