"""The run mode: how the trainer meets its device. ``RealRun``, the real job's answers (the default).

The scale simulator runs the same trainer on a device whose values are unknown; it hands the
trainer a ``titan_cotrain.simulate.Simulation`` instead, which answers every question below
for that device. The trainer asks the object and never which of the two it holds.
"""

import contextlib
from collections.abc import Callable, Iterator

import torch

from titan_cotrain.data.prompts import load_prompt_splits
from titan_cotrain.rl.batching import Sample

__all__ = ["RealRun"]


class RealRun:
    """The real job: device values are read back, weights filled, rollouts generated,
    scored and exchanged, outputs written."""

    values_known = True
    """The device's values mean something: weights are filled from their source, generations
    are read back and exchanged, weights and probe forwards are checked before they are saved,
    the tuner learns from measured timings, and the logging rank writes its outputs."""
    gpu_memory_gib: float | None = None
    """The accelerator's memory for the KV budget (``kv_cache_gib = "auto"``); None: measured."""
    tokenizer_fallback: str | None = None
    """The tokenizer folder when the config names none (None: the config must name one)."""
    max_updates: int | None = None
    """The most optimizer updates of a step (None: ``rl.updates_per_step``)."""
    max_microbatches: int | None = None
    """The most microbatches of an update without PP (None: all)."""
    max_schedule_steps: int | None = None
    """The most pipeline schedule steps of an update (None: all)."""

    def __init__(self, on_phase: Callable[[str], None] | None = None) -> None:
        self.on_phase = on_phase

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """The trainer enters phase ``name`` of a step (``Trainer.rl_step`` names them):
        ``on_phase(name)`` is called first, so an observer (the scale simulator's memory
        tracker, a test) sees every phase of the step the trainer takes, in its order."""
        if self.on_phase is not None:
            self.on_phase(name)
        yield

    def prompt_splits(self, task_config, encode, max_prompt_tokens: int):
        """A dataset task's prompts: its file's."""
        return load_prompt_splits(task_config, encode, max_prompt_tokens)

    def host_values(self, values: dict[str, torch.Tensor | float], device: torch.device) -> dict[str, float]:
        """Device scalars -> floats in one transfer (the step's one host sync for metrics)."""
        names = list(values)
        if not names:
            return {}
        flat = torch.stack([torch.full((), values[k], dtype=torch.float32, device=device)
                            if not isinstance(values[k], torch.Tensor) else values[k].float().reshape(())
                            for k in names])
        return dict(zip(names, flat.tolist()))

    def agreed_kv_budget(self, budget, group, device: torch.device):
        """The KV budget (``engine.kv_budget.KVBudget``) every rank of a tensor-parallel
        engine ``group`` can hold: their largest training state and transient (a collective)."""
        return budget.agreed(group, device)

    def generate(self, engine, prompts: list[list[int]], params, *, samples_per_prompt: int,
                 generator: torch.Generator | None = None, progress=None, draft_tokens=None):
        """A rollout of ``prompts`` on ``engine`` (the ``RolloutEngine``; arguments as its
        ``generate``): its ``Rollouts``, or None where the device's values are unknown."""
        return engine.generate(prompts, params, samples_per_prompt=samples_per_prompt, draft_tokens=draft_tokens,
                               generator=generator, progress=progress)

    def rollout_generator(self, seed: int, device: torch.device) -> torch.Generator | None:
        """The generator of a rollout's draws."""
        return torch.Generator(device=device).manual_seed(seed)

    def stand_in_samples(self, prompts: list[list[int]], max_new_tokens: int) -> list[Sample] | None:
        """Samples to train on in place of the scored rollouts (None: the rollouts' own)."""
        return None
