"""Build the policy (target) model a job config asks for."""

import torch

from titan_cotrain.config import resolve_model_args, resolve_tap_layers
from titan_cotrain.models.transformer import Transformer

__all__ = ["build_target"]


def build_target(config, device: torch.device | str = "cpu") -> Transformer:
    """The policy: loaded from ``[model] hf_path``, or ``flavor`` with a seeded random init."""
    args = resolve_model_args(config)
    taps = resolve_tap_layers(config, args.n_layers)
    if config.model.hf_path:
        from titan_cotrain.models.hf import load_hf

        return load_hf(config.model.hf_path, dtype=torch.float32, tap_layers=taps, device=device)
    seed = config.debug.seed if config.debug.seed is not None else 0
    with torch.device(device):
        model = Transformer(args, tap_layers=taps)
    model.init_weights(generator=torch.Generator(device=device).manual_seed(seed))
    return model
