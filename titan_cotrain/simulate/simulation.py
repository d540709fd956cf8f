"""The simulated accelerator's answers to the trainer (``rl.run_mode.RealRun``'s questions).

Device values are unknown on the fake tensors, so host reads answer zeros and the rank trains
on the worst case (every response ``rollout.max_new_tokens`` long); the work is cut to what
sets the peak memory (a few decoding rounds, one update of a few microbatches or one
schedule step: memory repeats from one to the next); dataset prompts are synthetic and the
tokenizer is the project's own when the config names none.
"""

import os

import torch

from titan_cotrain.data.prompts import synthetic_prompt_splits
from titan_cotrain.rl.batching import Sample
from titan_cotrain.rl.run_mode import RealRun
from titan_cotrain.simulate.rollout_drive import bounded_rollout

__all__ = ["Simulation"]

PROJECT_TOKENIZER = os.path.join(os.path.dirname(__file__), "..", "..", "assets", "tokenizer")


class Simulation(RealRun):
    """The trainer on the simulated accelerator, from the ``[simulate]`` section."""

    values_known = False
    tokenizer_fallback = PROJECT_TOKENIZER  # token ids are needed, not the real vocabulary
    max_updates = 1
    max_schedule_steps = 1

    def __init__(self, simulate_config, on_phase=None) -> None:
        super().__init__(on_phase)
        self.config = simulate_config
        self.gpu_memory_gib = simulate_config.gpu_memory_gib
        self.decode_rounds = simulate_config.decode_rounds
        self.max_microbatches = simulate_config.microbatches

    def prompt_splits(self, task_config, encode, max_prompt_tokens: int):
        """Synthetic prompts of ``[simulate] prompt_tokens`` (the dataset file is not read)."""
        return synthetic_prompt_splits(encode, min(self.config.prompt_tokens, max_prompt_tokens))

    def host_values(self, values: dict[str, torch.Tensor | float], device: torch.device) -> dict[str, float]:
        """Unknown: every value reads 0."""
        return dict.fromkeys(values, 0.0)

    def agreed_kv_budget(self, budget, group, device: torch.device):
        """This rank's own budget: the fake group's ranks hold no values to compare. Each
        simulated role (``[simulate] ranks``) sizes its pool from its own training state, at
        least the group's agreed pool, so its peak is never understated."""
        return budget

    def generate(self, engine, prompts: list[list[int]], params, *, samples_per_prompt: int,
                 generator: torch.Generator | None = None, progress=None, draft_tokens=None) -> None:
        """The bounded rollout (``simulate.rollout_drive``): what fits the empty batch, then
        ``[simulate] decode_rounds`` rounds at their widest; nothing read back, nothing returned
        (``progress`` is never told: nothing finishes)."""
        bounded_rollout(engine, prompts, params, rounds=self.decode_rounds, samples_per_prompt=samples_per_prompt,
                        draft_tokens=draft_tokens, generator=generator)

    def rollout_generator(self, seed: int, device: torch.device) -> None:
        """The simulated device has no generators (and its draws are fake)."""
        return None

    def stand_in_samples(self, prompts: list[list[int]], max_new_tokens: int) -> list[Sample]:
        """Unknown contents: the worst case, every response as long as allowed."""
        return [Sample(prompt, [1] * max_new_tokens, [0.0] * max_new_tokens, 0.0, 0.0) for prompt in prompts]
