"""The simulator's rollout model (``simulate.rollout_model``): the engine's own scheduler
over its own pool, with lengths from the stated law, and the roofline arithmetic."""

import pytest
import torch

from titan_cotrain.models.args import model_args_for
from titan_cotrain.models.draft import Draft, DraftArgs
from titan_cotrain.models.transformer import Transformer
from titan_cotrain.engine.kv_budget import kv_bytes_per_position, kv_bytes_per_sequence
from titan_cotrain.engine.rollout import RolloutEngine
from titan_cotrain.simulate.rollout_model import GPU_MODELS, GpuModel, LengthLaw, model_rollout

SEQ_LEN, K = 96, 3


def _engine(sequences: int, draft: bool = True, rows: int = 64) -> RolloutEngine:
    target = Transformer(model_args_for("llama3", "debugmodel").replace(vocab_size=128))
    d = Draft(DraftArgs.from_target(target.args, n_taps=3)) if draft else None
    per_sequence = kv_bytes_per_sequence(target.args, d.args if draft else None, SEQ_LEN, K if draft else 0,
                                         torch.float32)
    return RolloutEngine(target, d, max_batch_size=rows, max_seq_len=SEQ_LEN, max_draft_tokens=K, block_size=4,
                         kv_cache_gib=sequences * per_sequence / 2**30)


def _model(engine: RolloutEngine, k: int = K, gpu=GPU_MODELS[80], **law) -> dict:
    return model_rollout(engine, requested_groups=8, samples=8, prompt_tokens=32, max_new_tokens=64,
                         draft_tokens=k, gpu=gpu, law=LengthLaw(**law))


def test_a_pool_for_every_row_runs_them_all_and_a_small_one_preempts():
    full, small = _model(_engine(64)), _model(_engine(8))
    assert full["concurrent_median"] == full["concurrent_min"] == full["requested_rows"] == 64
    assert full["preemptions"] == 0 and full["concurrent_median_all_rounds"] < 64  # the tail drains
    # Blocks for 8 sequences at their longest (24 positions each, 100 at most): more than 8
    # run at once, fewer than 64, some preempted, and the rollout takes more rounds and time.
    assert 8 < small["concurrent_median"] < 64 and small["preemptions"] > 0 and small["recomputed_tokens"] > 0
    assert small["rounds"] > full["rounds"] and small["modeled_rollout_s"] > full["modeled_rollout_s"]
    assert small["kv_pool_gib"] < full["kv_pool_gib"]


def test_the_length_law_sets_the_tail():
    short, long_ = _model(_engine(64), median_fraction=0.1), _model(_engine(64), median_fraction=0.9)
    assert short["rounds"] < long_["rounds"]
    assert _model(_engine(64), k=0)["rounds"] > _model(_engine(64))["rounds"]  # drafting commits 1 + a a round
    assert _model(_engine(64))["length_law"]["tokens_per_round"] == pytest.approx((1 - 0.7 ** 4) / 0.3)


def test_plain_decoding_at_batch_one_is_bandwidth_bound_by_the_weights_and_kv():
    """One sequence, plain decoding, a GPU whose compute is free: every round reads the
    weights and the KV of the committed positions; the prefill reads the weights and writes
    the prompt's KV."""
    engine = _engine(2, draft=False, rows=1)
    gpu = GpuModel("bandwidth only", 1e9, float("inf"))
    out = model_rollout(engine, requested_groups=1, samples=1, prompt_tokens=5, max_new_tokens=4, draft_tokens=0,
                        gpu=gpu, law=LengthLaw(median_fraction=1.0, sigma=1e-9))
    weights = sum(p.numel() * p.element_size() for p in engine.policy.parameters())
    per_position = kv_bytes_per_position(engine.policy.args, None, torch.float32)
    # Prefill of 5 tokens, then the response's first token drawn from it: 3 rounds at 6, 7, 8
    # committed tokens, each reading that many positions of KV.
    expected = (weights + 5 * per_position) + sum(weights + n * per_position for n in (6, 7, 8))
    assert out["rounds"] == 3 and abs(out["modeled_rollout_s"] - expected / 1e9) < 1e-12


@pytest.mark.parametrize("block", [False, True], ids=["eagle3", "block_drafter"])
def test_a_round_reads_the_draft_once_per_draft_step(block):
    """One sequence, every drafted token rejected (one token a round), a GPU whose compute is
    free: each round reads the policy's weights and KV and the draft's weights and cached KV,
    k + 1 times for an EAGLE-3 draft (k drafts and the catch-up), once for a block drafter
    (one forward drafts the block)."""
    from titan_cotrain.engine.block_rollout import BlockDraftEngine
    from titan_cotrain.models.block_draft import BlockDraftArgs, BlockDrafter

    target = Transformer(model_args_for("llama3", "debugmodel").replace(vocab_size=128))
    if block:
        drafter = BlockDrafter(BlockDraftArgs.from_target(target.args, n_layers=2, block_size=K + 1,
                                                          target_layer_ids=target.tap_layers))
        engine = BlockDraftEngine(target, drafter, max_batch_size=1, max_seq_len=SEQ_LEN, max_draft_tokens=K,
                                  block_size=4, kv_cache_gib=0.01)
    else:
        drafter = Draft(DraftArgs.from_target(target.args, n_taps=3))
        engine = RolloutEngine(target, drafter, max_batch_size=1, max_seq_len=SEQ_LEN, max_draft_tokens=K,
                               block_size=4, kv_cache_gib=0.01)
    out = model_rollout(engine, requested_groups=1, samples=1, prompt_tokens=5, max_new_tokens=4, draft_tokens=K,
                        gpu=GpuModel("bandwidth only", 1e9, float("inf")),
                        law=LengthLaw(median_fraction=1.0, sigma=1e-9, acceptance=0.0))

    def weights(model):
        return sum(p.numel() * p.element_size() for p in model.parameters())

    per_position = kv_bytes_per_position(target.args, None, torch.float32)
    cached = kv_bytes_per_position(target.args, drafter.args, torch.float32) - per_position
    reads = 1 if block else K + 1
    prefill = weights(target) + weights(drafter) + 5 * (per_position + cached)
    rounds = sum(weights(target) + n * per_position + reads * (weights(drafter) + n * cached) for n in (6, 7, 8))
    assert out["rounds"] == 3 and abs(out["modeled_rollout_s"] - (prefill + rounds) / 1e9) < 1e-12
