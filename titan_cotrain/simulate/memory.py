"""Live device memory of a simulated rank, by category, from the fake storages themselves.

Every storage a device op creates is counted (its bytes rounded up to 512, the CUDA caching
allocator's granularity) until it is freed; the peak is the maximum of that live total, and
the breakdown at the peak says what was alive. Categories come from who owns a storage when
the peak is taken: the ``owners`` callback of the simulator names the storages of the
trainer's objects (parameters, gradients, optimizer state, engine weights, KV cache,
reference); storages created inside FSDP's collectives are communication buffers; everything
else is activations and temporaries. FSDP frees and re-gathers unsharded parameters by
resizing their storages, so sizes are re-read whenever an op writes into a storage and at
every sweep. Not modelled: fragmentation, the CUDA context, NCCL's
own buffers.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch
from torch.multiprocessing.reductions import StorageWeakRef

__all__ = ["MemoryTracker"]

_ROUND = 512
# Storages created under these files are FSDP's all-gather / reduce-scatter buffers and its
# unsharded parameters.
_COMM_FILES = ("_fsdp_collectives.py", "_fsdp_param.py", "_fsdp_param_group.py")
# A new peak is broken down again only when it exceeds the last broken-down one by 1% (1 MiB at least).
_RESNAPSHOT_FRACTION, _RESNAPSHOT_MIN = 0.01, 2**20


# DTensor's shape inference: its fake tensors are metadata, not memory.
_METADATA_FILES = ("_sharding_prop.py", "_op_schema.py")
# Allocations this big remember where they were made; the report lists the _LARGEST biggest at the peak.
_SITE_BYTES = 256 * 2**20
_LARGEST = 8


def _rounded(nbytes: int) -> int:
    return -(-nbytes // _ROUND) * _ROUND


def code_site(depth: int = 2) -> str:
    """``file:line (function)`` of the innermost frame of the project's or torchtitan's code
    (outside the simulator) that led to the caller's caller (``depth`` frames up)."""
    frame = sys._getframe(depth)
    while frame is not None:
        name = frame.f_code.co_filename
        if ("titan_cotrain" in name or "torchtitan" in name) and "/simulate/" not in name:
            short = name.split("titan_cotrain/")[-1] if "titan_cotrain/" in name else name.split("site-packages/")[-1]
            return f"{short}:{frame.f_lineno} ({frame.f_code.co_name})"
        frame = frame.f_back
    return "?"


def _origin() -> str | None:
    """What the allocation being made is: ``"communication buffers"`` inside FSDP's
    collectives, None inside DTensor's sharding propagation (it runs ops on fake
    global-shape tensors to learn output shapes; on a GPU those allocate nothing), else
    ``"activations"``."""
    frame = sys._getframe(2)
    for _ in range(48):
        if frame is None:
            break
        name = frame.f_code.co_filename
        if name.endswith(_METADATA_FILES):
            return None
        if name.endswith(_COMM_FILES):
            return "communication buffers"
        frame = frame.f_back
    return "activations"


class MemoryTracker:
    """``on_alloc`` for ``SimulatedDevice``; ``owners()`` maps storage keys to categories.

    ``peak_bytes``: the exact peak of live bytes; ``peak_by_category``: the breakdown at
    the peak (re-taken whenever the peak grows by 1% or is reached in another phase, so
    within 1% of exact); ``phase_peaks``: the peak of every phase named by ``phase(name)``.

    A storage is categorised by its owner at the peak; one that had none then but is still
    alive when the breakdown is read is its owner's now (storages made while the trainer was
    being built have no owner until it exists); otherwise by how it was made.
    """

    def __init__(self, owners: Callable[[], dict[int, str]] | None = None) -> None:
        self.owners = owners or dict
        self._live: dict[int, tuple[StorageWeakRef, int, str, str | None]] = {}
        self._bytes = 0  # live total, counting storages not yet found dead
        self.peak_bytes = 0
        # At the last snapshot of the peak: (storage, key, bytes, owner then, how made, site).
        self._peak_live: list[tuple[StorageWeakRef, int, int, str | None, str, str | None]] = []
        self._snapshot_at, self._snapshot_phase = -1, None
        self.current_phase = "start"
        self.phase_peaks: dict[str, int] = {}
        self.peak_phase = "start"

    def phase(self, name: str) -> None:
        """Start phase ``name``: its peak starts at what is alive now."""
        self.current_phase = name
        self.phase_peaks[name] = max(self.phase_peaks.get(name, 0), self.live_bytes())

    def __call__(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        key = storage._cdata
        nbytes = _rounded(storage.nbytes())
        if key in self._live:
            # FSDP frees and re-allocates unsharded parameters by resizing their storage:
            # an op writing into a storage is where its size is read again.
            ref, old, tag, site = self._live[key]
            if nbytes == old:
                return
            self._live[key] = (ref, nbytes, tag, site)
            self._bytes += nbytes - old
        else:
            tag = _origin()
            if tag is None:
                return
            site = code_site() if nbytes >= _SITE_BYTES else None
            self._live[key] = (StorageWeakRef(storage), nbytes, tag, site)
            self._bytes += nbytes
        if self._bytes > self.peak_bytes or self._bytes > self.phase_peaks.get(self.current_phase, 0):
            self._sweep()
            self._note_peak()

    def _sweep(self) -> None:
        """Drop freed storages and re-read the size of the others (resized ones)."""
        total = 0
        for key, (ref, nbytes, tag, site) in list(self._live.items()):
            if ref.expired():
                del self._live[key]
                continue
            now = _rounded(torch.UntypedStorage._new_with_weak_ptr(ref.cdata).nbytes())
            if now != nbytes:
                self._live[key] = (ref, now, tag, site)
            total += now
        self._bytes = total

    def live_bytes(self) -> int:
        self._sweep()
        return self._bytes

    def breakdown(self) -> dict[str, int]:
        """Live bytes by category right now."""
        self._sweep()
        owners = self.owners()
        out: dict[str, int] = {}
        for key, (_, nbytes, tag, _) in self._live.items():
            category = owners.get(key, tag)
            out[category] = out.get(category, 0) + nbytes
        return out

    def _note_peak(self) -> None:
        """After a sweep: record a new peak and, when it moved enough, what is alive at it."""
        phase = self.current_phase
        self.phase_peaks[phase] = max(self.phase_peaks.get(phase, 0), self._bytes)
        if self._bytes <= self.peak_bytes:
            return
        self.peak_bytes = self._bytes
        self.peak_phase = phase
        threshold = max(_RESNAPSHOT_FRACTION * self._snapshot_at, _RESNAPSHOT_MIN)
        if phase == self._snapshot_phase and self._bytes - self._snapshot_at < threshold:
            return
        self._snapshot_at, self._snapshot_phase = self._bytes, phase
        owners = self.owners()
        self._peak_live = [(ref, key, nbytes, owners.get(key), tag, site)
                           for key, (ref, nbytes, tag, site) in self._live.items()]

    def _at_peak(self) -> list[tuple[int, str, str | None]]:
        """``(bytes, category, site)`` of every storage alive at the peak."""
        owners = self.owners()
        out = []
        for ref, key, nbytes, owner, tag, site in self._peak_live:
            if owner is None and not ref.expired():
                owner = owners.get(key)
            out.append((nbytes, owner or tag, site))
        return out

    @property
    def peak_by_category(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for nbytes, category, _ in self._at_peak():
            out[category] = out.get(category, 0) + nbytes
        return out

    @property
    def peak_largest(self) -> list[tuple[int, str, str]]:
        """The biggest storages alive at the peak: ``(bytes, category, where allocated)``."""
        return [(nbytes, category, site or "?") for nbytes, category, site
                in sorted(self._at_peak(), key=lambda entry: -entry[0])[:_LARGEST]]
