"""The one place that knows which target layers feed the draft.

A *tap* is the output of a decoder layer (0-based index ``k``), i.e. the residual stream
that enters layer ``k + 1``. EAGLE-3 taps three layers, ``(1, L//2 - 1, L - 4)``: the same
activations as the inputs of layers ``2, L//2, L - 3``. The token-embedding output is
always tapped as well (the draft reads the current policy's embeddings).
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["default_tap_layers", "validate_tap_layers", "vllm_aux_layer_ids"]


def default_tap_layers(n_layers: int) -> tuple[int, ...]:
    """EAGLE-3's choice for an ``n_layers`` decoder; needs 3 distinct layers (``n_layers >= 7``)."""
    layers = (1, n_layers // 2 - 1, n_layers - 4)
    validate_tap_layers(layers, n_layers)
    return layers


def validate_tap_layers(layers: Sequence[int], n_layers: int) -> tuple[int, ...]:
    """Check that ``layers`` are distinct, increasing layer indices in ``[0, n_layers)``."""
    layers = tuple(int(x) for x in layers)
    if not layers:
        raise ValueError("tap layers must name at least one decoder layer")
    bad = [x for x in layers if not 0 <= x < n_layers]
    if bad:
        raise ValueError(f"tap layers {bad} are out of range for a {n_layers}-layer model (valid: 0..{n_layers - 1})")
    if list(layers) != sorted(set(layers)):
        raise ValueError(f"tap layers {list(layers)} must be distinct and increasing")
    return layers


def vllm_aux_layer_ids(layers: Sequence[int]) -> list[int]:
    """vLLM's convention names the stream *before* layer k: our output-of-layer index + 1."""
    return [x + 1 for x in layers]
