"""The rollout engine: batched generation from paged KV caches, plain or speculative with the
co-trained draft, stepping a round at a time (``rollout``). The KV blocks and scheduler
(``kv_blocks``), the pool's size and layout (``kv_budget``), a call's state and result
(``generation``), what its rounds measured (``round_stats``), sampling and the lossless
acceptance rule (``sampling``), adaptive speculation (``speculation``), the engine's own copies
of the trainer's models (``engine_copy``), and the one module that reads the job config to
build it (``build``). It knows nothing of RL: ``rl`` hands it prompts and sampling parameters
and reads back tokens and log-probs."""
