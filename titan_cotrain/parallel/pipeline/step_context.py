"""What one run of the schedule needs besides the activations, handed to it, never set on it.

``pipeline_step`` builds one ``PipelineStepContext`` per run of the schedule and passes it in
through torch's own channels: as a keyword argument of ``schedule.step``, which the schedule
gives every stage forward, and in ``loss_kwargs``, which it gives the loss. The index of the
microbatch travels with the microbatch: the stage is called with the schedule's own chunk id
(``stage.MicrobatchIndexedStage``), the loss with its target, the microbatch's index.
"""

from __future__ import annotations

from collections.abc import Sequence

from titan_cotrain.cotrain.step import CotrainSums
from titan_cotrain.data.batch import Microbatch, PolicyLossFn

__all__ = ["PipelineStepContext"]


class PipelineStepContext:
    """One run of the schedule, read-only: ``microbatches[i]``, microbatch ``i``'s metadata
    (``cu_seqlens`` on the host, positions on the device, labels; under CP, this rank's shard),
    prepared once for every stage of the rank; ``policy_loss_fn``; ``train_draft``: the stages
    send their taps and the loss runs the draft; ``sums``: where the loss adds the step's sums
    (one ``CotrainSums`` for every run of one ``pipeline_step``, like ``schedule.step``'s
    ``losses`` list); ``anchor_seed``: a block drafter's anchors' (``cotrain.block_loss``).

    A plain class, not a dataclass: FSDP2 walks the dataclasses among a module's inputs and
    casts their floating tensors to its compute dtype (mixed precision), and the labels'
    advantages and log-probabilities must reach the head as they were prepared.
    """

    __slots__ = ("microbatches", "policy_loss_fn", "train_draft", "sums", "anchor_seed")

    def __init__(self, microbatches: Sequence[Microbatch], policy_loss_fn: PolicyLossFn, *, train_draft: bool,
                 sums: CotrainSums, anchor_seed: int = 0) -> None:
        values = (tuple(microbatches), policy_loss_fn, train_draft, sums, anchor_seed)
        for name, value in zip(self.__slots__, values):
            object.__setattr__(self, name, value)

    def __setattr__(self, name: str, value) -> None:
        raise AttributeError(f"PipelineStepContext is read-only: build a new one instead of setting {name!r}")
