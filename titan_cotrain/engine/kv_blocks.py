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

Admission goes by the blocks a sequence uses, not by its worst case (vLLM's scheduler is
the model). A group enters when rows are free and the pool has the blocks of its first
round: the prompt's, each sample's own, and what the running rows take in the next round.
A sequence then takes blocks as it grows. When a round needs a block and the pool has
none, the most recently admitted sequence is *preempted*: its blocks are freed (a shared
prompt block with its last reader) and it waits, ahead of every new group, to be
*recomputed*: one prefill of its prompt and its committed tokens rebuilds its target KV and
draft trunk exactly as decoding had left them, and it goes on from where it was (no token
is drawn again, so results do not change). The oldest sequence is never preempted by a
younger one and a sequence at its longest fits the pool alone, so every call finishes.
A group too big for the rows waits as several smaller ones, each prefilled on its own.
``waves = True`` admits only into an empty batch (the static engine's schedule, one block
a row: it never preempts).
"""

from __future__ import annotations

import bisect
import heapq
from collections import deque
from dataclasses import dataclass, field

from titan_cotrain.models.kv_cache import SCRATCH_BLOCK

__all__ = ["Admitted", "BlockAllocator", "Resumed", "Scheduler"]


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


class BlockAllocator:
    """Free list and reference counts of a pool's ``n_blocks`` blocks, the lowest free block
    first. With ``scratch``, block ``SCRATCH_BLOCK`` is never handed out (a paged pool);
    without, every block is (the static layout, whose rows are blocks ``0 ..`` in order).
    ``peak`` is the most blocks in use at once."""

    def __init__(self, n_blocks: int, scratch: bool = True) -> None:
        self.free = [b for b in range(n_blocks) if not (scratch and b == SCRATCH_BLOCK)]  # a heap
        self.n_blocks = len(self.free)  # the blocks it hands out
        self.refs = [0] * n_blocks
        self.peak = 0

    @property
    def in_use(self) -> int:
        return self.n_blocks - len(self.free)

    def available(self) -> int:
        return len(self.free)

    def take(self) -> int:
        """One free block, referenced once."""
        if not self.free:
            raise RuntimeError("take() from an empty pool")
        block = heapq.heappop(self.free)
        self.refs[block] = 1
        self.peak = max(self.peak, self.in_use)
        return block

    def share(self, block: int) -> None:
        self.refs[block] += 1

    def release(self, blocks: list[int]) -> None:
        """Drop one reference to each of ``blocks``; a block nobody reads is free again."""
        for block in blocks:
            self.refs[block] -= 1
            if self.refs[block] == 0:
                heapq.heappush(self.free, block)


@dataclass
class _Row:
    prompt: int
    seq: int  # output row of the sequence, prompt * G + sample
    blocks: list[int]
    length: int  # committed tokens, as the host last knew
    order: int  # admission order: the highest is preempted first


@dataclass
class Resumed:
    """A preempted sequence back in a row: output row ``seq`` of prompt ``prompt`` with
    ``length`` committed tokens, whose positions ``0 .. length - 2`` the engine recomputes
    into ``blocks`` (row ``slot``)."""

    seq: int
    prompt: int
    length: int
    slot: int
    blocks: list[int]


@dataclass
class Admitted:
    """What enters the batch this round. Groups: ``prompts`` (indices into the call's
    prompts) with ``lengths``, each prefilled into ``prompt_blocks`` (its block table,
    ``c + 1`` blocks); group ``i`` is samples ``first[i] ..`` of its prompt, in rows
    ``slots[i]``. ``resumed``: preempted sequences to recompute, first."""

    prompts: list[int] = field(default_factory=list)
    lengths: list[int] = field(default_factory=list)
    first: list[int] = field(default_factory=list)
    prompt_blocks: list[list[int]] = field(default_factory=list)
    slots: list[list[int]] = field(default_factory=list)
    resumed: list[Resumed] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.prompts or self.resumed)

    def counts(self) -> list[int]:
        """Samples per group."""
        return [len(slots) for slots in self.slots]


class Scheduler:
    """The running batch's rows, the queue of groups, and every sequence's blocks.

    ``prompt_lens``: the call's prompts (host ints); ``samples``: ``G``; ``max_new_tokens``
    and ``k`` bound a sequence's positions. One call of ``generate`` owns one scheduler.
    ``preemptions`` counts the sequences preempted, ``recomputed`` the positions their
    resumes prefilled again."""

    def __init__(self, allocator: BlockAllocator, block_size: int, n_slots: int, prompt_lens: list[int],
                 samples: int, max_new_tokens: int, k: int, waves: bool = False) -> None:
        self.allocator, self.block_size, self.samples, self.k = allocator, block_size, samples, k
        self.max_new_tokens, self.waves = max_new_tokens, waves
        self.prompt_lens = prompt_lens
        self.rows: list[_Row | None] = [None] * n_slots
        self.waiting: deque[tuple[int, int, int]] = deque()  # (prompt, first sample, samples)
        self.preempted: list[_Row] = []  # waiting to be recomputed, oldest admission first
        self.retired = self.preemptions = self.recomputed = 0
        self._admissions = 0
        for prompt, p in enumerate(prompt_lens):
            if self._sequence_blocks(p) > allocator.n_blocks:
                raise ValueError(f"a prompt of {p} tokens and up to {max_new_tokens} new tokens needs "
                                 f"{self._sequence_blocks(p)} KV blocks of {block_size} positions; the engine has "
                                 f"{allocator.n_blocks}")
            fits = min(samples, n_slots)
            while fits > 1 and self._group_need(p, fits) > allocator.n_blocks:
                fits -= 1
            self.waiting.extend((prompt, first, min(fits, samples - first)) for first in range(0, samples, fits))

    def _sequence_blocks(self, prompt_len: int) -> int:
        """Blocks of a sequence at its longest: ``P + max_new_tokens + k + 1`` positions."""
        return _ceil_div(prompt_len + self.max_new_tokens + self.k + 1, self.block_size)

    def _round_blocks(self, length: int) -> int:
        """Blocks covering the positions a round writes at ``length`` committed tokens
        (``length - 1 .. length - 1 + k``)."""
        return _ceil_div(length + self.k, self.block_size)

    def _shared(self, prompt_len: int) -> int:
        return (prompt_len - 1) // self.block_size

    def _group_need(self, prompt_len: int, samples: int) -> int:
        """Blocks of a group's first round: the shared ones and each sample's own."""
        c = self._shared(prompt_len)
        return c + samples * (self._round_blocks(prompt_len + 1) - c)

    def _growth(self) -> int:
        """Blocks the running rows take in the next round."""
        return sum(max(self._round_blocks(row.length) - len(row.blocks), 0) for row in self.rows if row is not None)

    def busy(self) -> bool:
        return any(row is not None for row in self.rows)

    def done(self) -> bool:
        return not self.waiting and not self.preempted and not self.busy()

    def admit(self) -> Admitted:
        """Fill free rows, in order: preempted sequences first (oldest first), then groups off
        the queue, while the pool holds their first round and the running rows' next one
        (with ``waves``, only into an empty batch). Takes the blocks their prefill writes."""
        out = Admitted()
        if self.waves and self.busy():
            return out
        free = [s for s, row in enumerate(self.rows) if row is None]
        spare = self.allocator.available() - self._growth()
        while self.preempted and free:
            row = self.preempted[0]
            need = self._round_blocks(row.length)
            if need > spare:
                return out
            self.preempted.pop(0)
            spare -= need
            row.blocks = [self.allocator.take() for _ in range(_ceil_div(row.length - 1, self.block_size))]
            slot = free.pop(0)
            self.rows[slot] = row
            self.recomputed += row.length - 1
            out.resumed.append(Resumed(row.seq, row.prompt, row.length, slot, row.blocks))
        while self.waiting and len(free) >= self.waiting[0][2]:
            prompt, first, count = self.waiting[0]
            p = self.prompt_lens[prompt]
            need = self._group_need(p, count)
            if need > spare:
                break
            self.waiting.popleft()
            spare -= need
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
            for g, slot in enumerate(slots):
                for block in shared:
                    if g:
                        self.allocator.share(block)
                own = last
                if g:
                    own = self.allocator.take()
                    src.append(last)
                    dst.append(own)
                self._admissions += 1
                self.rows[slot] = _Row(prompt, prompt * self.samples + first + g, [*shared, own], p + 1,
                                       self._admissions)
        return src, dst

    def grow(self) -> list[int]:
        """Cover the positions the next round writes (``n - 1 .. n - 1 + k``) of every row,
        oldest admission first; when the pool runs dry, preempt the youngest sequence (the
        one growing, if it is the youngest). Returns the preempted rows, now free."""
        preempted = []
        for slot in sorted((s for s, row in enumerate(self.rows) if row is not None), key=lambda s: self.rows[s].order):
            row = self.rows[slot]
            if row is None:  # preempted for an older one
                continue
            need = self._round_blocks(row.length)
            while self.rows[slot] is row and len(row.blocks) < need:
                if self.allocator.available():
                    row.blocks.append(self.allocator.take())
                else:
                    preempted.append(self._preempt())
        return preempted

    def _preempt(self) -> int:
        """Free the row of the youngest sequence, which waits to be recomputed; returns the row."""
        slot = max((s for s, row in enumerate(self.rows) if row is not None), key=lambda s: self.rows[s].order)
        row = self.rows[slot]
        self.allocator.release(row.blocks)
        row.blocks = []
        self.rows[slot] = None
        bisect.insort(self.preempted, row, key=lambda r: r.order)
        self.preemptions += 1
        return slot

    def retire(self, lengths: list[int], active: list[bool]) -> list[int]:
        """After a round: the rows' committed tokens and whether they still decode, read from
        the device. Frees the rows whose sequence finished and returns them."""
        out = []
        for s, row in enumerate(self.rows):
            if row is None:
                continue
            row.length = lengths[s]
            if not active[s]:
                self.allocator.release(row.blocks)
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

    def padded_tables(self, blocks: list[list[int]], width: int) -> list[list[int]]:
        """Block tables ``blocks`` for a prefill over ``width`` positions, padded with the
        scratch block."""
        n = _ceil_div(width, self.block_size)
        return [row + [SCRATCH_BLOCK] * (n - len(row)) for row in blocks]

    def output_rows(self, slots: list[int]) -> list[int]:
        """The output rows of the sequences in rows ``slots``."""
        return [self.rows[s].seq for s in slots]
