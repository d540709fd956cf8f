"""Shared fixtures of the engine tests."""

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from titan_cotrain.engine.rollout import RolloutEngine
from titan_cotrain.models.args import model_args_for
from titan_cotrain.models.draft import Draft, DraftArgs
from titan_cotrain.models.transformer import Transformer

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


@pytest.fixture(scope="module")
def models(one_intra_op_thread):
    """A debug-sized Llama target over 128 tokens and its EAGLE-3 draft, seeded weights
    (std 0.3 and 0.1: sharp enough that sampling is not uniform)."""
    target = Transformer(model_args_for("llama3", "debugmodel").replace(vocab_size=128))
    target.init_weights(std=0.3, generator=torch.Generator().manual_seed(0))
    draft = Draft(DraftArgs.from_target(target.args, n_taps=3))
    draft.init_weights(std=0.1, generator=torch.Generator().manual_seed(1))
    return target, draft


def _bench_rollout():
    sys.path.insert(0, str(SCRIPTS))
    spec = importlib.util.spec_from_file_location("bench_rollout", SCRIPTS / "bench_rollout.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_rollout"] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def fitted_pair(one_intra_op_thread):
    """``(target, draft, prompts)``: the rollout benchmark's pair (``scripts/bench_rollout.py``),
    a debug-sized Llama over 128 tokens fitted to a phrase language and a draft fitted to it
    by TTT over 6 passes, so that greedy drafts are mostly accepted; and 8 prompts of 5-14
    tokens (ending inside blocks of 4 and 16)."""
    bench = _bench_rollout()
    g = torch.Generator().manual_seed(0)
    language = bench.PhraseLanguage(128, 16, seed=0)
    target = Transformer(model_args_for("llama3", "debugmodel").replace(vocab_size=128))
    target.init_weights(generator=torch.Generator().manual_seed(0))
    bench.fit_target(target, language, 40, g)
    draft = Draft(DraftArgs.from_target(target.args, n_taps=3))
    draft.init_weights(generator=torch.Generator().manual_seed(1))
    engine = RolloutEngine(target, draft, max_batch_size=64, max_seq_len=bench.TRAIN_NEW_TOKENS + 16,
                           max_draft_tokens=6)
    bench.fit_draft(draft, target, engine, language, 40, 6, g)
    return target.eval(), draft.eval(), language.prompts(8, g, lengths=(5, 14))
