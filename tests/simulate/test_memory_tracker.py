"""The simulator's memory accounting on plain tensors: the peak's breakdown names a storage
by its owner, also one made before its owner existed (the trainer's construction), and is
re-taken when a later phase reaches the peak."""

import torch

from titan_cotrain.simulate.memory import MemoryTracker

MIB = 2**20


def _alloc(tracker: MemoryTracker, mib: float) -> torch.Tensor:
    t = torch.empty(int(mib * MIB), dtype=torch.uint8)
    tracker(t)
    return t


def test_a_storage_made_before_its_owner_is_named_by_it():
    owners: dict[int, str] = {}
    tracker = MemoryTracker(owners=lambda: dict(owners))
    tracker.phase("construction")
    weights = _alloc(tracker, 8)  # the peak, while nothing owns it yet
    scratch = _alloc(tracker, 4)
    del scratch
    owners[weights.untyped_storage()._cdata] = "engine weights"  # the trainer now exists
    tracker.phase("rollout")
    assert tracker.peak_phase == "construction"
    assert tracker.peak_by_category == {"engine weights": 8 * MIB, "activations": 4 * MIB}
    assert [(b, c) for b, c, _ in tracker.peak_largest] == [(8 * MIB, "engine weights"), (4 * MIB, "activations")]


def test_the_breakdown_follows_the_peak_into_a_later_phase():
    tracker = MemoryTracker()
    tracker.phase("construction")
    first = _alloc(tracker, 100)
    tracker.phase("refresh")
    del first
    second = _alloc(tracker, 100)
    extra = _alloc(tracker, 0.5)  # a new peak by less than 1%, in another phase
    assert tracker.peak_phase == "refresh" and tracker.peak_bytes == 100.5 * MIB
    assert sorted(b for b, _, _ in tracker.peak_largest) == [0.5 * MIB, 100 * MIB]
    assert second.numel() and extra.numel()
