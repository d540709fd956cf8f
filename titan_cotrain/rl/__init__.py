"""RL post-training: GRPO losses, verifiable tasks and rewards, the rollout phase that turns
the engine's (``titan_cotrain.engine``) generations into training rows, the update step and
the trainer's loop."""
