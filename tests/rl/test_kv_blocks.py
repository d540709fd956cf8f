"""The engine's host bookkeeping (``rl.kv_blocks``) on its own: reservations that always
cover what rows take, shared prompt blocks counted by reference, every block back on the
free list when the call ends, groups split to fit, compaction that keeps each row's
blocks."""

import random

import pytest

from titan_cotrain.models.kv_cache import SCRATCH_BLOCK
from titan_cotrain.rl.kv_blocks import BlockAllocator, Scheduler


def _drive(scheduler: Scheduler, rng: random.Random, max_new: int) -> list[int]:
    """Run the schedule to the end with random progress per round (1 .. k + 1 tokens, a
    random early finish); returns each round's blocks in use."""
    lengths = {}
    in_use = []
    while not scheduler.done():
        admitted = scheduler.admit()
        scheduler.fork(admitted)
        for slots, p in zip(admitted.slots, admitted.lengths):
            for s in slots:
                lengths[s] = p + 1
        scheduler.grow()
        for src, dst in zip(*scheduler.compact()):
            lengths[dst] = lengths.pop(src)
        for s, row in enumerate(scheduler.rows):
            if row is not None:  # what grow() took covers the positions this round writes
                assert len(row.blocks) * scheduler.block_size >= lengths[s] + scheduler.k
                assert SCRATCH_BLOCK not in row.blocks
        in_use.append(scheduler.allocator.in_use)
        assert scheduler.allocator.in_use + scheduler.allocator.reserved <= scheduler.allocator.n_blocks
        active = [False] * len(scheduler.rows)
        length_list = [1] * len(scheduler.rows)
        for s, row in enumerate(scheduler.rows):
            if row is None:
                continue
            p = scheduler.prompt_lens[row.prompt]
            lengths[s] = min(lengths[s] + rng.randint(1, scheduler.k + 1), p + max_new)
            active[s] = lengths[s] < p + max_new and rng.random() > 0.05
            length_list[s] = lengths[s]
        scheduler.retire(length_list, active)
    return in_use


@pytest.mark.parametrize("seed", range(5))
def test_a_schedule_returns_every_block_and_never_overcommits(seed):
    rng = random.Random(seed)
    prompt_lens = [rng.randint(1, 40) for _ in range(12)]
    allocator = BlockAllocator(60)
    scheduler = Scheduler(allocator, block_size=4, n_slots=16, prompt_lens=prompt_lens, samples=4,
                          max_new_tokens=20, k=3)
    in_use = _drive(scheduler, rng, max_new=20)
    assert scheduler.retired == 12 * 4
    assert allocator.in_use == 0 and allocator.reserved == 0 and sorted(allocator.free) == list(range(1, 60))
    assert all(r == 0 for r in allocator.refs) and allocator.peak == max(in_use) <= 59


def test_a_group_splits_to_fit_the_pool_and_shares_its_prompt_blocks():
    # Prompt of 9 tokens, blocks of 4: 2 shared blocks; 9 + 10 + 2 + 1 = 22 positions = 6 blocks
    # a sample, so 4 of its own. Two samples need 2 + 2 x 4 = 10 blocks, three 14: a pool of
    # 12 takes the group of 5 as 2 + 2 + 1.
    scheduler = Scheduler(BlockAllocator(13), block_size=4, n_slots=8, prompt_lens=[9], samples=5,
                          max_new_tokens=10, k=2)
    assert list(scheduler.waiting) == [(0, 0, 2), (0, 2, 2), (0, 4, 1)]
    admitted = scheduler.admit()
    assert admitted.counts() == [2] and scheduler.admit().counts() == []  # the next group waits
    src, dst = scheduler.fork(admitted)
    first, second = (scheduler.rows[s] for s in admitted.slots[0])
    assert first.blocks[:2] == second.blocks[:2] and len(src) == 1 and dst == [second.blocks[2]]
    assert src == [first.blocks[2]] and scheduler.allocator.refs[first.blocks[0]] == 2
    assert [first.seq, second.seq] == [0, 1]
    with pytest.raises(ValueError, match="needs 6 KV blocks of 4 positions; the engine has 5"):
        Scheduler(BlockAllocator(6), block_size=4, n_slots=8, prompt_lens=[9], samples=1, max_new_tokens=10, k=2)


def test_compaction_moves_rows_not_blocks():
    scheduler = Scheduler(BlockAllocator(100), block_size=4, n_slots=8, prompt_lens=[3] * 8, samples=1,
                          max_new_tokens=8, k=1)
    scheduler.fork(scheduler.admit())
    blocks = {row.seq: list(row.blocks) for row in scheduler.rows}
    # All but rows 5 and 6 finish: the two move into rows 0 and 1, a batch of 2.
    scheduler.retire([5] * 8, [s in (5, 6) for s in range(8)])
    assert scheduler.running_rows() == 8
    assert scheduler.compact() == ([5, 6], [0, 1])
    assert scheduler.running_rows() == 2
    assert [(row.seq, row.blocks) for row in scheduler.rows[:2]] == [(5, blocks[5]), (6, blocks[6])]
    assert all(row is None for row in scheduler.rows[2:])
