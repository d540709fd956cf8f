"""This rank's storages of (possibly distributed) tensors, and freeing them in place.

Two owners free device memory while the tensors stay (FSDP2's way with unsharded
parameters): the rollout engine between rollouts (``RolloutEngine.release``) and the
training-state offload during a rollout (``rl.offload``). Both shrink storages to nothing
and later give them their size back, so compiled graphs, optimizers and a tensor-parallel
copy's DTensors keep pointing at the same tensors.

A DTensor's storage is read from its local shard itself (``components.shards.local_shard``),
not from ``to_local()``: that makes a view, and under fake tensors (the scale simulator) a view
of a storage shrunk to nothing grows it back to the view's size, so reading a released weight
would allocate it.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from titan_cotrain.components.shards import local_shard

__all__ = ["FreedStorages", "device_storages"]


def device_storages(tensors: Iterable[torch.Tensor | None], device_type: str, *,
                    empty: bool = False) -> list[torch.UntypedStorage]:
    """The distinct storages of ``tensors``' local shards on ``device_type``, each once, in
    order; with ``empty`` also those of no bytes (already freed)."""
    seen, out = set(), []
    for t in tensors:
        if t is None:
            continue
        local = local_shard(t)
        if local.device.type != device_type:
            continue
        storage = local.untyped_storage()
        if storage._cdata not in seen and (empty or storage.nbytes()):
            seen.add(storage._cdata)
            out.append(storage)
    return out


class FreedStorages:
    """Storages shrunk to nothing, with the sizes ``restore()`` gives back (their bytes are
    not kept: whoever frees them copies what it needs first)."""

    def __init__(self, storages: Iterable[torch.UntypedStorage] = ()) -> None:
        self.entries: list[tuple[torch.UntypedStorage, int]] = []
        self.add(storages)

    def add(self, storages: Iterable[torch.UntypedStorage]) -> None:
        for storage in storages:
            self.entries.append((storage, storage.nbytes()))
            storage.resize_(0)

    @property
    def nbytes(self) -> int:
        return sum(nbytes for _, nbytes in self.entries)

    def keys(self) -> set[int]:
        return {storage._cdata for storage, _ in self.entries}

    def restore(self) -> None:
        """Give every storage its size back (its contents uninitialised)."""
        for storage, nbytes in self.entries:
            storage.resize_(nbytes)
        self.entries = []

    def __bool__(self) -> bool:
        return bool(self.entries)
