"""Shared fixtures of the engine tests."""

import pytest
import torch

from titan_cotrain.models.args import model_args_for
from titan_cotrain.models.draft import Draft, DraftArgs
from titan_cotrain.models.transformer import Transformer


@pytest.fixture(scope="module")
def models(one_intra_op_thread):
    """A debug-sized Llama target over 128 tokens and its EAGLE-3 draft, seeded weights
    (std 0.3 and 0.1: sharp enough that sampling is not uniform)."""
    target = Transformer(model_args_for("llama3", "debugmodel").replace(vocab_size=128))
    target.init_weights(std=0.3, generator=torch.Generator().manual_seed(0))
    draft = Draft(DraftArgs.from_target(target.args, n_taps=3))
    draft.init_weights(std=0.1, generator=torch.Generator().manual_seed(1))
    return target, draft
