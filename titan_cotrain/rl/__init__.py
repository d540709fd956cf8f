"""RL post-training: the rollout engine (speculative decoding with the co-trained draft),
sampling, GRPO losses, verifiable tasks."""

from titan_cotrain.rl.rollout import RolloutEngine, Rollouts, RolloutStats
from titan_cotrain.rl.sampling import SamplingParams

__all__ = ["RolloutEngine", "RolloutStats", "Rollouts", "SamplingParams"]
