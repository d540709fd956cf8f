"""TapChannel: the draft's input features travel from the stages that compute them to the
last pipeline stage, on a process group of their own, beside the pipeline schedule.

The draft lives on the last stage, but its inputs (the tapped decoder-layer outputs and the
token-embedding output) are computed on earlier stages. They are forward-only (detached: no
gradient ever crosses back), so they do not need to ride in the pipeline's activations and
the schedule does not need to know about them. Per microbatch ``m``:

    producer rank (owns a tapped layer)            consumer rank (owns the last stage)
    ---------------------------------------        -------------------------------------------
    stage forward computes tap (m, source)         irecv(slot[m % prefetch][source]) posted
      -> isend(tap) on the channel's group            ``prefetch`` microbatches ahead
         (tensor kept alive until it completes)    loss_fn(m): receive(m) waits, the draft runs
                                                    forward + backward, release(m) re-posts

Invariants (docs/DESIGN.md section 5):

* One process group per PP column (same dp / cp coordinates), separate from the pipeline's
  P2P, created and warmed up (one collective, one message per producer) when the channel is
  built, so lazy communicator creation can never interleave with the schedule's handshakes.
* Sends are non-blocking. A blocking send inside a stage forward could wait on a consumer
  that itself waits on the pipeline's P2P from the sender: a deadlock.
* Messages match in order (NCCL matches point-to-point by order, not tag; the channel uses
  one tag so gloo behaves the same and the CPU tests exercise the order). A producer sends
  in *consumption order* — microbatch first, then source — whatever order its stages run
  in: a tap produced early (a V-schedule's first stage runs ahead of its last) waits in a
  queue until every tap before it in that order has left. Each source must produce
  microbatches ``0, 1, 2, ...`` in order, and the consumer must consume them in order; both
  are asserted, so a custom schedule that breaks this fails loudly instead of mismatching.
* A second forward of a microbatch already sent (activation-checkpoint recompute) sends
  nothing.
* Taps produced on the consumer's own rank bypass the group: the tensor is handed over.

Sources are named by decoder-layer index, and the token-embedding output is source
``EMBEDDINGS = -1``: a tap of layer ``k`` is the stream entering layer ``k + 1``, so the
embedding output is "the output of layer -1". Every tap of a step has the same shape
``[mb, S_local, H]`` and dtype (``S_local`` is the rank's sequence shard under CP).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import timedelta

import torch
import torch.distributed as dist

__all__ = ["EMBEDDINGS", "TapChannel"]

EMBEDDINGS = -1

# One tag for every message: order, not tag, matches them (as on NCCL).
_TAG = 0


class TapChannel:
    """Moves the detached taps of each microbatch to the rank of the last pipeline stage.

    Built identically on every rank of a PP column. ``pp_ranks``: the global ranks of the
    column, in pipeline order (``pp_ranks[i]`` holds PP rank ``i``); ``pp_rank``: this
    rank's position; ``consumer``: the PP rank that holds the last stage; ``owners``: the PP
    rank that produces each source. ``shape`` / ``dtype`` / ``device``: of every tap.
    ``prefetch``: how many microbatches of receives are posted ahead (the landing slots
    are ``prefetch x n_remote_sources`` preallocated tensors, reused across steps).
    ``timeout`` bounds every wait (None: the process group's default).

    Per step: ``begin_step``, then ``send`` from the stages (any rank), ``receive`` /
    ``release`` from the last stage's loss (the consumer), then ``finish_step`` everywhere.
    ``sent`` counts the taps this rank put on the group in the current step.
    """

    def __init__(
        self,
        *,
        pp_ranks: Sequence[int],
        pp_rank: int,
        consumer: int,
        owners: Mapping[int, int],
        shape: Sequence[int],
        dtype: torch.dtype,
        device: torch.device | str,
        prefetch: int = 2,
        timeout: timedelta | None = None,
    ) -> None:
        if prefetch < 1:
            raise ValueError(f"prefetch must be >= 1, got {prefetch}")
        self.pp_rank, self.consumer = pp_rank, consumer
        self.sources = tuple(sorted(owners))
        self.owners = dict(owners)
        self.shape, self.dtype, self.device = tuple(shape), dtype, torch.device(device)
        self.prefetch, self.timeout = prefetch, timeout
        self.is_consumer = pp_rank == consumer
        self.remote_sources = tuple(s for s in self.sources if owners[s] != consumer)
        # What this rank produces, in the order it must send (consumption order per microbatch).
        self.local_sources = tuple(s for s in self.sources if owners[s] == pp_rank)
        self.group = None
        if self.remote_sources:
            self.group = dist.new_group(
                list(pp_ranks), timeout=timeout, use_local_synchronization=True, sort_ranks=False,
                group_desc="tap_channel", device_id=self.device if self.device.type == "cuda" else None,
            )
            self._warm_up()
        self._slots: list[dict[int, torch.Tensor]] = []
        self._reset(0)

    # -- setup ---------------------------------------------------------------------------

    def _warm_up(self) -> None:
        """Create the group's communicators now: one collective, then one message from each
        producer to the consumer (NCCL builds point-to-point communicators lazily)."""
        token = torch.ones(1, device=self.device)
        dist.all_reduce(token, group=self.group)
        producers = sorted({self.owners[s] for s in self.remote_sources})
        if self.is_consumer:
            works = [dist.irecv(torch.empty(1, device=self.device), group=self.group, group_src=p, tag=_TAG)
                     for p in producers]
            for work in works:
                work.wait()
        elif self.pp_rank in producers:
            dist.isend(token, group=self.group, group_dst=self.consumer, tag=_TAG).wait()

    def _wait(self, work) -> None:
        if self.timeout is None:
            work.wait()
        else:
            work.wait(self.timeout)

    # -- one step ------------------------------------------------------------------------

    def begin_step(self, n_microbatches: int) -> None:
        """Reset for a step of ``n_microbatches``; the consumer posts its first receives."""
        if self._n_microbatches:
            raise RuntimeError("TapChannel.begin_step: the previous step was not finished (call finish_step)")
        self._reset(n_microbatches)
        if self.is_consumer and self.remote_sources:
            while len(self._slots) < min(self.prefetch, n_microbatches):
                self._slots.append({s: torch.empty(self.shape, dtype=self.dtype, device=self.device)
                                    for s in self.remote_sources})
            for m in range(min(self.prefetch, n_microbatches)):
                self._post_receives(m)

    def _reset(self, n_microbatches: int) -> None:
        self._n_microbatches = n_microbatches
        self._next_produced = {s: 0 for s in self.local_sources}
        self._queued: dict[tuple[int, int], torch.Tensor] = {}
        self.sent = 0  # taps this rank sent over the group this step (also its send-order cursor)
        self._in_flight: list[tuple[dist.Work, torch.Tensor]] = []
        self._local: dict[tuple[int, int], torch.Tensor] = {}
        self._recv_works: dict[int, list[dist.Work]] = {}
        self._next_consumed = 0

    def send(self, microbatch: int, source: int, tap: torch.Tensor) -> None:
        """Hand over the detached tap ``source`` of ``microbatch`` (called by the stage that
        computed it, right after computing it). Never blocks."""
        if source not in self._next_produced:
            raise RuntimeError(f"TapChannel: PP rank {self.pp_rank} does not produce tap source {source}")
        expected = self._next_produced[source]
        if microbatch < expected:
            return  # activation-checkpoint recompute of a microbatch already sent
        if microbatch != expected or microbatch >= self._n_microbatches:
            raise RuntimeError(
                f"TapChannel: tap source {source} produced microbatch {microbatch}, expected {expected} of "
                f"{self._n_microbatches}; the channel requires each stage to run its forwards in microbatch order"
            )
        if tuple(tap.shape) != self.shape or tap.dtype != self.dtype or tap.requires_grad:
            raise RuntimeError(
                f"TapChannel: tap source {source} is {tuple(tap.shape)} {tap.dtype} (requires_grad="
                f"{tap.requires_grad}); the channel was built for detached {self.shape} {self.dtype}"
            )
        self._next_produced[source] = microbatch + 1
        if self.is_consumer:
            self._local[(microbatch, source)] = tap
            return
        self._queued[(microbatch, source)] = tap.contiguous()
        self._flush()

    def _flush(self) -> None:
        """Send every queued tap whose turn has come; drop the sends that completed."""
        n_local = len(self.local_sources)
        while True:
            m, j = divmod(self.sent, n_local)
            tap = self._queued.pop((m, self.local_sources[j]), None)
            if tap is None:
                break
            work = dist.isend(tap, group=self.group, group_dst=self.consumer, tag=_TAG)
            self._in_flight.append((work, tap))  # the tensor must outlive its send
            self.sent += 1
        self._in_flight = [(w, t) for w, t in self._in_flight if not w.is_completed()]

    def _post_receives(self, microbatch: int) -> None:
        # Ascending source order, i.e. each producer's own send order.
        slot = self._slots[microbatch % self.prefetch]
        self._recv_works[microbatch] = [
            dist.irecv(slot[s], group=self.group, group_src=self.owners[s], tag=_TAG) for s in self.remote_sources
        ]

    def receive(self, microbatch: int) -> dict[int, torch.Tensor]:
        """All taps of ``microbatch``, ``{source: [mb, S, H]}`` (consumer only, in microbatch
        order). The tensors stay valid until ``release(microbatch)``."""
        if not self.is_consumer:
            raise RuntimeError(f"TapChannel: PP rank {self.pp_rank} is not the consumer (PP rank {self.consumer})")
        if microbatch != self._next_consumed:
            raise RuntimeError(
                f"TapChannel: the last stage asked for microbatch {microbatch}, expected {self._next_consumed}; "
                "the channel requires the loss to run in microbatch order"
            )
        for work in self._recv_works.pop(microbatch, []):
            self._wait(work)
        taps = dict(self._slots[microbatch % self.prefetch]) if self.remote_sources else {}
        for s in self.sources:
            if s not in self.remote_sources:
                taps[s] = self._local.pop((microbatch, s))
        return taps

    def release(self, microbatch: int) -> None:
        """The taps of ``microbatch`` are consumed: recycle its landing slots."""
        self._next_consumed = microbatch + 1
        ahead = microbatch + self.prefetch
        if self.remote_sources and ahead < self._n_microbatches:
            self._post_receives(ahead)

    def finish_step(self) -> None:
        """Wait for this rank's sends and check that every tap of the step was sent and consumed."""
        n = self._n_microbatches
        unsent = {s: k for s, k in self._next_produced.items() if k != n}
        if unsent or self._queued:
            raise RuntimeError(f"TapChannel: step ended with taps not produced or not sent: {unsent or self._queued}")
        if self.is_consumer and self._next_consumed != n:
            raise RuntimeError(f"TapChannel: step ended after consuming {self._next_consumed} of {n} microbatches")
        for work, _ in self._in_flight:
            self._wait(work)
        self._in_flight.clear()
        self._n_microbatches = 0
