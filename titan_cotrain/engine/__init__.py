"""The rollout engine: batched generation from paged KV caches, plain or speculative with the
co-trained draft. The KV blocks and scheduler (``kv_blocks``), the pool's size
(``kv_budget``), the running batch's state (``rollout_state``), sampling and the lossless
acceptance rule (``sampling``), adaptive speculation (``speculation``) and the engine's own
copies of the trainer's models (``engine_copy``). It knows nothing of RL: ``rl`` hands it
prompts and sampling parameters and reads back tokens and log-probs."""
