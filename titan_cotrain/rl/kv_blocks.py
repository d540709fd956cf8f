"""Host-side bookkeeping of the rollout engine's paged KV cache and running batch.

The engine decodes a *running batch* of ``n_slots`` rows (fixed, so a decode step has one
shape per ``k`` and block-table width). Prompts wait in a queue as *groups*: one prompt and
its ``G`` samples (a GRPO group). ``Scheduler`` decides, between decoding rounds, which
groups enter the free rows, which blocks of the ``KVPool`` each sequence reads and writes,
and which rows leave. Everything here is plain Python on the host; the engine turns its
decisions into a few index tensors per round.

Blocks and what a group shares, with ``bs`` the block size and a prompt of ``P`` tokens::

    positions   0 ........ c*bs-1 | c*bs .. P-1  P ...           c = (P - 1) // bs
    prompt      shared blocks     | block c: the prompt's last positions
    sample g    the same blocks   | its own copy of block c, then its own blocks

The prompt is prefilled once into ``c + 1`` blocks. At the first response token each
sample takes block ``c`` copy-on-write (sample 0 keeps the original, the others get a
copy): from position ``P - 1`` on, a sample's cache is its own (the draft's key at anchor
``P - 1`` reads the sample's first token). Blocks are counted by reference and return to
the free list with their last reader.

Admission reserves a sequence's worst case (``P + max_new_tokens + k + 1`` positions), so
a running sequence never waits for a block and nothing is ever preempted; blocks are taken
from the reservation as positions are reached and the rest is returned when the sequence
finishes. A group too big for the whole pool (or for the rows) waits as several smaller ones,
each prefilled on its own. ``waves = True`` admits only into an empty batch (the static
engine's schedule).
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass, field

from titan_cotrain.models.kv_cache import SCRATCH_BLOCK

__all__ = ["Admitted", "BlockAllocator", "Scheduler"]


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


class BlockAllocator:
    """Free list, reference counts and reservations of a pool's ``n_blocks`` blocks, the
    lowest free block first. With ``scratch``, block ``SCRATCH_BLOCK`` is never handed out
    (a paged pool); without, every block is (the static layout, whose rows are blocks
    ``0 ..`` in order). ``peak`` is the most blocks in use at once."""

    def __init__(self, n_blocks: int, scratch: bool = True) -> None:
        self.free = [b for b in range(n_blocks) if not (scratch and b == SCRATCH_BLOCK)]  # a heap
        self.n_blocks = len(self.free)  # the blocks it hands out
        self.refs = [0] * n_blocks
        self.reserved = 0
        self.peak = 0

    @property
    def in_use(self) -> int:
        return self.n_blocks - len(self.free)

    def available(self) -> int:
        """Blocks neither taken nor promised."""
        return len(self.free) - self.reserved

    def reserve(self, n: int) -> None:
        if n > self.available():
            raise RuntimeError(f"reserving {n} blocks with {self.available()} available")
        self.reserved += n

    def take(self) -> int:
        """One block out of a reservation, referenced once."""
        if self.reserved < 1:
            raise RuntimeError("take() without a reservation")
        self.reserved -= 1
        block = heapq.heappop(self.free)
        self.refs[block] = 1
        self.peak = max(self.peak, self.in_use)
        return block

    def share(self, block: int) -> None:
        self.refs[block] += 1

    def release(self, blocks: list[int], unreserve: int = 0) -> None:
        """Drop one reference to each of ``blocks`` and return ``unreserve`` promised blocks."""
        for block in blocks:
            self.refs[block] -= 1
            if self.refs[block] == 0:
                heapq.heappush(self.free, block)
        self.reserved -= unreserve


@dataclass
class _Row:
    prompt: int
    seq: int  # output row of the sequence, prompt * G + sample
    blocks: list[int]
    reserved: int  # blocks still promised to it
    length: int  # committed tokens, as the host last knew (an upper bound in a simulated run)


@dataclass
class Admitted:
    """Groups that enter the batch this round: ``prompts`` (indices into the call's prompts)
    with ``lengths``, each prefilled into ``prompt_blocks`` (its block table, ``c + 1``
    blocks); group ``i`` is samples ``first[i] ..`` of its prompt, in rows ``slots[i]``."""

    prompts: list[int] = field(default_factory=list)
    lengths: list[int] = field(default_factory=list)
    first: list[int] = field(default_factory=list)
    prompt_blocks: list[list[int]] = field(default_factory=list)
    slots: list[list[int]] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.prompts)

    def counts(self) -> list[int]:
        """Samples per group."""
        return [len(slots) for slots in self.slots]


class Scheduler:
    """The running batch's rows, the queue of groups, and every sequence's blocks.

    ``prompt_lens``: the call's prompts (host ints); ``samples``: ``G``; ``max_new_tokens``
    and ``k`` bound a sequence's positions. One call of ``generate`` owns one scheduler."""

    def __init__(self, allocator: BlockAllocator, block_size: int, n_slots: int, prompt_lens: list[int],
                 samples: int, max_new_tokens: int, k: int, waves: bool = False) -> None:
        self.allocator, self.block_size, self.samples, self.k = allocator, block_size, samples, k
        self.max_new_tokens, self.waves = max_new_tokens, waves
        self.prompt_lens = prompt_lens
        self.rows: list[_Row | None] = [None] * n_slots
        self.waiting: deque[tuple[int, int, int]] = deque()  # (prompt, first sample, samples)
        self.retired = 0
        for prompt, p in enumerate(prompt_lens):
            fits = min(samples, n_slots)
            while fits and self._group_need(p, fits) > allocator.n_blocks:
                fits -= 1
            if not fits:
                raise ValueError(f"a prompt of {p} tokens and up to {max_new_tokens} new tokens needs "
                                 f"{self._group_need(p, 1)} KV blocks of {block_size} positions; the engine has "
                                 f"{allocator.n_blocks}")
            self.waiting.extend((prompt, first, min(fits, samples - first)) for first in range(0, samples, fits))

    def _sequence_blocks(self, prompt_len: int) -> int:
        return _ceil_div(prompt_len + self.max_new_tokens + self.k + 1, self.block_size)

    def _shared(self, prompt_len: int) -> int:
        return (prompt_len - 1) // self.block_size

    def _group_need(self, prompt_len: int, samples: int) -> int:
        c = self._shared(prompt_len)
        return c + samples * (self._sequence_blocks(prompt_len) - c)

    def busy(self) -> bool:
        return any(row is not None for row in self.rows)

    def done(self) -> bool:
        return not self.waiting and not self.busy()

    def admit(self) -> Admitted:
        """Take groups off the queue, in order, while rows and blocks allow (with ``waves``,
        only into an empty batch); reserve their blocks and take the prompts'."""
        out = Admitted()
        if self.waves and self.busy():
            return out
        free = [s for s, row in enumerate(self.rows) if row is None]
        while self.waiting and len(free) >= self.waiting[0][2]:
            prompt, first, count = self.waiting[0]
            p = self.prompt_lens[prompt]
            need = self._group_need(p, count)
            if need > self.allocator.available():
                break
            self.waiting.popleft()
            self.allocator.reserve(need)
            out.prompts.append(prompt)
            out.lengths.append(p)
            out.first.append(first)
            out.prompt_blocks.append([self.allocator.take() for _ in range(self._shared(p) + 1)])
            out.slots.append(free[:count])
            free = free[count:]
        return out

    def fork(self, admitted: Admitted) -> tuple[list[int], list[int]]:
        """Give each admitted sample its row and block table: the prompt's shared blocks, and
        block ``c`` (sample 0's) or a copy of it. Returns the copies to make, ``(src, dst)``."""
        src, dst = [], []
        for prompt, p, first, blocks, slots in zip(admitted.prompts, admitted.lengths, admitted.first,
                                                   admitted.prompt_blocks, admitted.slots):
            shared, last = blocks[:-1], blocks[-1]
            each = self._sequence_blocks(p) - len(shared)  # reservation per sample, block c included
            for g, slot in enumerate(slots):
                for block in shared:
                    if g:
                        self.allocator.share(block)
                own = last
                if g:
                    own = self.allocator.take()
                    src.append(last)
                    dst.append(own)
                self.rows[slot] = _Row(prompt, prompt * self.samples + first + g, [*shared, own], each - 1, p + 1)
        return src, dst

    def grow(self) -> None:
        """Cover the positions the next round writes (``n - 1 .. n - 1 + k``) of every row."""
        for row in self.rows:
            if row is None:
                continue
            need = min(_ceil_div(row.length + self.k, self.block_size), len(row.blocks) + row.reserved)
            while len(row.blocks) < need:
                row.blocks.append(self.allocator.take())
                row.reserved -= 1

    def assume_longest(self) -> None:
        """A simulated run's stand-in for the lengths it cannot read: every row at its last
        round (``P + max_new_tokens - 1`` committed tokens), so the next ``grow`` takes every
        block it reserved and the tables are as wide as they get: the round of most memory."""
        for row in self.rows:
            if row is not None:
                row.length = self.prompt_lens[row.prompt] + self.max_new_tokens - 1

    def retire(self, lengths: list[int], active: list[bool]) -> list[int]:
        """After a round: the rows' committed tokens and whether they still decode, read from
        the device. Frees the rows whose sequence finished and returns them."""
        out = []
        for s, row in enumerate(self.rows):
            if row is None:
                continue
            row.length = lengths[s]
            if not active[s]:
                self.allocator.release(row.blocks, row.reserved)
                self.rows[s] = None
                out.append(s)
        self.retired += len(out)
        return out

    def compact(self) -> tuple[list[int], list[int]]:
        """Move busy rows past the smallest power of two that holds them all into free rows
        before it, so a draining batch decodes fewer rows (a paged row is its block table:
        moving it moves no KV). Returns the moves ``(src, dst)`` for the device state."""
        busy = sum(row is not None for row in self.rows)
        bound = min(1 << max(busy - 1, 0).bit_length(), len(self.rows))
        free = [s for s in range(bound) if self.rows[s] is None]
        src = [s for s in range(bound, len(self.rows)) if self.rows[s] is not None]
        dst = free[: len(src)]
        for a, b in zip(src, dst):
            self.rows[b], self.rows[a] = self.rows[a], None
        return src, dst

    def live(self) -> int:
        """Sequences in the running batch (every busy row decodes: finished ones retire after
        each round)."""
        return sum(row is not None for row in self.rows)

    def running_rows(self) -> int:
        """How many leading rows the next round decodes: a power of two (a few shapes for
        compiled steps) that covers every busy row. Rows are filled lowest first, so the busy
        ones gather at the front and a batch that drains decodes fewer rows."""
        last = max((s for s, row in enumerate(self.rows) if row is not None), default=0)
        return min(1 << last.bit_length(), len(self.rows))

    def table(self, rows: int | None = None, width: int | None = None) -> list[list[int]]:
        """The block tables of the first ``rows`` rows (default all), padded with the scratch
        block to one width: ``width`` blocks if given, else a power of two of blocks that
        covers every row and ``k + 1`` positions."""
        if width is None:
            widest = max([len(row.blocks) for row in self.rows if row is not None]
                         + [_ceil_div(self.k + 1, self.block_size)])
            width = min(1 << (widest - 1).bit_length(), max(map(self._sequence_blocks, self.prompt_lens)))
        return [row.blocks + [SCRATCH_BLOCK] * (width - len(row.blocks)) if row is not None else [SCRATCH_BLOCK] * width
                for row in self.rows[:rows]]

    def prefill_table(self, admitted: Admitted, width: int) -> list[list[int]]:
        """Block tables of the admitted prompts for a prefill over ``width`` positions."""
        n = _ceil_div(width, self.block_size)
        return [blocks + [SCRATCH_BLOCK] * (n - len(blocks)) for blocks in admitted.prompt_blocks]

    def output_rows(self, slots: list[int]) -> list[int]:
        """The output rows of the sequences in rows ``slots``."""
        return [self.rows[s].seq for s in slots]
