"""A control for ``scripts/investigate_rl_learning.py``: the training job
(``titan_cotrain.train``) with each rank's GRPO advantages permuted across all its samples.

``torchrun ... scripts/shuffled_advantages_job.py --job.config_file F [--section.key value]``

The rollout phase scores a rank's groups with ``rl.grpo.group_advantages`` (its import in
``rl.rollout_phase``); here every call's advantages are permuted over the whole call (all the
rank's groups together), so each sample's advantage is some other sample's: the advantages'
distribution and the update's size stay what they were, but which response was right no longer
decides which one is reinforced. If held-out accuracy still rises under this control, the gain
is not RL's credit assignment. The permutation is seeded per rank, so a run repeats.
"""

import os

import torch

import titan_cotrain.rl.rollout_phase as rollout_phase
from titan_cotrain.parallel.process_end import exit_process
from titan_cotrain.train import main

_group_advantages = rollout_phase.group_advantages
_generator = torch.Generator().manual_seed(1000 + int(os.environ.get("RANK", "0")))


def shuffled_advantages(rewards: torch.Tensor, group_size: int, *args, **kwargs) -> torch.Tensor:
    """``group_advantages``' values, permuted across the groups of the call (``[N]``)."""
    advantages = _group_advantages(rewards, group_size, *args, **kwargs)
    return advantages[torch.randperm(advantages.numel(), generator=_generator)]


if __name__ == "__main__":
    rollout_phase.group_advantages = shuffled_advantages
    exit_process(main())
