"""The engine's host bookkeeping (``engine.kv_blocks``) on its own: admission by the blocks a
sequence uses, blocks taken as rows grow, the youngest sequence preempted when the pool runs
dry and resumed at the length it had, shared prompt blocks counted by reference, every
block back on the free list when the call ends, groups split to fit, compaction that keeps
each row's blocks."""

import random

import pytest

from titan_cotrain.models.kv_cache import SCRATCH_BLOCK
from titan_cotrain.engine.kv_blocks import BlockAllocator, Scheduler


def _drive(scheduler: Scheduler, rng: random.Random, max_new: int) -> list[int]:
    """Run the schedule to the end with random progress per round (1 .. k + 1 tokens, a
    random early finish), as the engine does; returns each round's blocks in use. Checks
    that a resumed sequence comes back at the length it was preempted with and that a
    finished sequence finished once."""
    length = {}  # output row -> committed tokens
    finished = set()
    while not scheduler.done():
        admitted = scheduler.admit()
        assert admitted or scheduler.busy(), "nothing runs and nothing was admitted"
        for r in admitted.resumed:
            assert r.length == length[r.seq] and scheduler.rows[r.slot].seq == r.seq
            assert len(r.blocks) * scheduler.block_size >= r.length - 1  # the recompute's positions
        scheduler.fork(admitted)
        for p, slots in zip(admitted.lengths, admitted.slots):
            for s in slots:
                length[scheduler.rows[s].seq] = p + 1
        preempted = scheduler.grow()
        assert all(scheduler.rows[s] is None for s in preempted)
        scheduler.compact()
        busy = [row for row in scheduler.rows if row is not None]
        for row in busy:  # what grow() took covers the positions this round writes
            assert len(row.blocks) * scheduler.block_size >= length[row.seq] + scheduler.k
            assert SCRATCH_BLOCK not in row.blocks
        assert scheduler.allocator.in_use <= scheduler.allocator.n_blocks
        in_use = sum(scheduler.allocator.refs[b] > 0 for b in range(len(scheduler.allocator.refs)))
        assert in_use == scheduler.allocator.in_use
        active = [False] * len(scheduler.rows)
        lengths = [1] * len(scheduler.rows)
        for s, row in enumerate(scheduler.rows):
            if row is None:
                continue
            end = scheduler.prompt_lens[row.prompt] + max_new
            length[row.seq] = min(length[row.seq] + rng.randint(1, scheduler.k + 1), end)
            active[s] = length[row.seq] < end and rng.random() > 0.05
            lengths[s] = length[row.seq]
            if not active[s]:
                assert row.seq not in finished
                finished.add(row.seq)
        scheduler.retire(lengths, active)
    return sorted(finished)


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("n_blocks", [60, 20])
def test_a_schedule_returns_every_block_and_finishes_every_sequence(seed, n_blocks):
    rng = random.Random(seed)
    prompt_lens = [rng.randint(1, 40) for _ in range(12)]
    allocator = BlockAllocator(n_blocks)
    scheduler = Scheduler(allocator, block_size=4, n_slots=16, prompt_lens=prompt_lens, samples=4,
                          max_new_tokens=20, k=3)
    assert _drive(scheduler, rng, max_new=20) == list(range(12 * 4))
    assert scheduler.retired == 12 * 4
    assert allocator.in_use == 0 and sorted(allocator.free) == list(range(1, n_blocks))
    assert all(r == 0 for r in allocator.refs) and allocator.peak <= n_blocks - 1
    if n_blocks == 20:  # 19 blocks, a sequence needs up to 16 at its longest: the pool runs dry
        assert scheduler.preemptions > 0 and scheduler.recomputed > 0


def test_admission_counts_the_blocks_in_use_not_the_longest():
    # Prompts of 2 tokens, blocks of 4, 20 new tokens, k = 1: 24 positions (6 blocks) at the
    # longest, one block (positions 0 .. 3) in the first round. 8 blocks hold 8 sequences now
    # and 1 at the longest.
    scheduler = Scheduler(BlockAllocator(9), block_size=4, n_slots=8, prompt_lens=[2] * 8, samples=1,
                          max_new_tokens=20, k=1)
    admitted = scheduler.admit()
    assert len(admitted.prompts) == 8 and scheduler.allocator.in_use == 8
    scheduler.fork(admitted)
    assert scheduler.grow() == [] and scheduler.live() == 8


def test_the_youngest_sequence_is_preempted_and_resumed_first():
    # 2 prompts of 3 tokens x 2 samples, blocks of 2, k = 0 (a round writes position n - 1):
    # a prompt's first block is shared, each sample owns its copy of block c = 1. Pool: 7.
    scheduler = Scheduler(BlockAllocator(8), block_size=2, n_slots=4, prompt_lens=[3, 3], samples=2,
                          max_new_tokens=6, k=0)
    admitted = scheduler.admit()
    assert admitted.counts() == [2, 2]
    scheduler.fork(admitted)
    assert scheduler.allocator.in_use == 6 and scheduler.grow() == []  # 4 tokens: positions 0 .. 3
    shared = scheduler.rows[2].blocks[0]
    assert scheduler.allocator.refs[shared] == 2
    # Every sequence reaches 5 tokens: the next round writes position 4, a third block each.
    assert scheduler.retire([5] * 4, [True] * 4) == []
    preempted = scheduler.grow()
    # Row 0 (the oldest) takes the free block; row 1 preempts row 3 (the youngest) and takes
    # the block it frees; row 2, now the youngest, preempts itself.
    assert preempted == [3, 2] and scheduler.preemptions == 2
    assert [len(scheduler.rows[s].blocks) for s in (0, 1)] == [3, 3]
    assert scheduler.allocator.refs[shared] == 0 and scheduler.allocator.in_use == 5  # freed with its last reader
    assert [row.seq for row in scheduler.preempted] == [2, 3]  # resumed oldest first, before new groups
    scheduler.retire([7, 7, 1, 1], [False, False, False, False])  # the first prompt's samples finish
    admitted = scheduler.admit()
    assert [(r.seq, r.length) for r in admitted.resumed] == [(2, 5), (3, 5)] and admitted.prompts == []
    assert all(len(r.blocks) == 2 for r in admitted.resumed) and scheduler.recomputed == 8  # positions 0 .. 3


def test_a_group_splits_to_fit_the_pool_and_shares_its_prompt_blocks():
    # Prompt of 9 tokens, blocks of 4: 2 shared blocks; the first round writes positions
    # 9 .. 11, so a sample holds 3 blocks, one of them its own. Five samples need 2 + 5 = 7
    # blocks at first, more than the 6 of the pool: the group of 5 waits as 4 + 1.
    scheduler = Scheduler(BlockAllocator(7), block_size=4, n_slots=8, prompt_lens=[9], samples=5,
                          max_new_tokens=10, k=2)
    assert list(scheduler.waiting) == [(0, 0, 4), (0, 4, 1)]
    admitted = scheduler.admit()
    assert admitted.counts() == [4]
    src, dst = scheduler.fork(admitted)
    assert scheduler.admit().counts() == []  # the next group waits
    first, second = (scheduler.rows[s] for s in admitted.slots[0][:2])
    assert first.blocks[:2] == second.blocks[:2] and len(src) == 3 and dst[0] == second.blocks[2]
    assert src == [first.blocks[2]] * 3 and scheduler.allocator.refs[first.blocks[0]] == 4
    assert [first.seq, second.seq] == [0, 1]
    # 9 + 10 + 2 + 1 = 22 positions: 6 blocks at its longest, which a pool of 5 cannot hold.
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
