"""``[rollout] kv_cache_gib = "auto"``: the pool is what (1 - margin) of the GPU leaves beside
the training state, the engine's weights and the transient; nothing fitting is refused with
the sum; the optimizer state is counted before it exists; the CPU falls back to the whole
batch; the config takes "auto" with release_between_rollouts only."""

import pytest
import torch

from tests.multiprocess import run_on_ranks
from tests.engine.test_rollout import _models
from titan_cotrain.config import ConfigError, load_job_config
from titan_cotrain.engine.build import kv_cache_setting
from titan_cotrain.engine.kv_budget import (
    KV_MARGIN_FRACTION,
    KVBudget,
    KVPoolLayout,
    kv_bytes_per_position,
    kv_bytes_per_sequence,
    kv_pool_line,
    optimizer_state_bytes,
    transient_bytes,
)
from titan_cotrain.engine.rollout import RolloutEngine

GIB = 2**30


def test_the_pool_is_what_the_margin_leaves_beside_everything_else():
    budget = KVBudget(total=80 * GIB, training_state=12 * GIB, transient=3 * GIB)
    assert KV_MARGIN_FRACTION == 0.10
    pool = budget.pool_bytes(engine_weights=16 * GIB)
    assert pool == 72 * GIB - 31 * GIB
    assert pool + 12 * GIB + 16 * GIB + 3 * GIB == (1 - KV_MARGIN_FRACTION) * 80 * GIB  # the margin is kept
    assert budget.describe(16 * GIB).endswith("= 41.00 GiB")


def test_an_auto_engine_takes_the_blocks_the_budget_leaves_and_refuses_none():
    target, draft = _models()
    probe = RolloutEngine(target, draft, max_batch_size=8, max_seq_len=40, max_draft_tokens=3, kv_cache_gib=1.0)
    weights, per_block = probe.weight_bytes, 16 * kv_bytes_per_position(target.args, draft.args, torch.float32)
    per_sequence = kv_bytes_per_sequence(target.args, draft.args, 40, 3, torch.float32)
    chains = 8 * (per_sequence - 44 * per_block // 16)
    state, transient = 3 * 2**20, 2**20
    # A GPU whose 90% holds the rest and ten blocks beside the rows' chains.
    total = int((state + transient + weights + chains + 10 * per_block) / (1 - KV_MARGIN_FRACTION)) + 1
    engine = RolloutEngine(target, draft, max_batch_size=8, max_seq_len=40, max_draft_tokens=3,
                           kv_cache_gib=KVBudget(total, state, transient))
    assert engine.target_pool.n_blocks == 10 and engine.kv_pool_bytes <= KVBudget(total, state, transient).pool_bytes(
        weights)
    line = kv_pool_line(engine, KVBudget(total, state, transient))
    assert line.startswith('[rollout] kv_cache_gib = "auto": ') and "9 blocks of 16 positions, 3 sequences" in line
    roomy = RolloutEngine(target, draft, max_batch_size=8, max_seq_len=40, max_draft_tokens=3,
                          kv_cache_gib=KVBudget(100 * GIB, state, transient))
    assert roomy.target_pool.n_blocks == 8 * 3 + 1  # never more than the whole batch at its longest
    with pytest.raises(ValueError, match=r'kv_cache_gib = "auto" leaves no room for one sequence .*: 0\.9 x .* GiB - '
                                         r"training state .* - engine weights .* - transient .* = -"):
        RolloutEngine(target, draft, max_batch_size=8, max_seq_len=40, max_draft_tokens=3,
                      kv_cache_gib=KVBudget(weights, state, transient))


def test_the_pool_layout_is_known_from_the_shapes_and_the_engine_allocates_it():
    """``KVPoolLayout`` needs no model: a budget of 2.5 sequences at their longest (44
    positions) holds 2 static rows, or beside 8 rows' draft chains the paged pool's blocks of 4
    positions; the engine allocates exactly that."""
    target, draft = _models()
    per_position = kv_bytes_per_position(target.args, draft.args, torch.float32)
    per_sequence = kv_bytes_per_sequence(target.args, draft.args, 40, 3, torch.float32)
    gib = 2.5 * per_sequence / GIB
    shapes = dict(engine_weights=0, max_batch_size=8, max_seq_len=40, max_draft_tokens=3, block_size=4)
    static = KVPoolLayout.from_budget(gib, target.args, draft.args, torch.float32, paged=False, **shapes)
    assert (static.max_batch_size, static.n_blocks, static.block_size, static.blocks_per_sequence) == (2, 2, 44, 1)
    paged = KVPoolLayout.from_budget(gib, target.args, draft.args, torch.float32, paged=True, **shapes)
    chains = 8 * (per_sequence - 44 * per_position)
    assert (paged.max_batch_size, paged.blocks_per_sequence, paged.chain_slots) == (8, 11, 2)
    assert paged.n_blocks == (int(gib * GIB) - chains) // (4 * per_position) and paged.block_bytes == 4 * per_position
    engine = RolloutEngine(target, draft, max_batch_size=8, max_seq_len=40, max_draft_tokens=3, block_size=4,
                           kv_cache_gib=gib)
    assert engine.layout == paged and engine.target_pool.n_blocks == engine.draft_pool.n_blocks == paged.n_blocks
    assert engine.kv_pool_bytes == paged.n_blocks * paged.block_bytes + chains


def test_the_optimizer_state_is_counted_before_it_exists():
    target, draft = _models()
    draft.fc.weight.requires_grad_(False)
    trainable = sum(p.numel() for m in (target, draft) for p in m.parameters() if p.requires_grad)
    assert optimizer_state_bytes([target, draft, None], "AdamW") == 2 * 4 * trainable
    # A module listed with its parts (a pipeline's local policy and its stages) counts once.
    assert optimizer_state_bytes([target, *target.layers, draft], "AdamW") == 2 * 4 * trainable
    with pytest.raises(ValueError, match=r"not of \[optimizer\] name = 'SGD': set a size in GiB"):
        optimizer_state_bytes([target], "SGD")


def test_the_transient_is_the_largest_of_prefill_verify_and_refresh():
    target, _ = _models()
    a = target.args
    refresh = 4 * max(a.vocab_size, a.ffn_dim) * a.dim * 2
    assert transient_bytes(a, rows=1, prompts=1, prompt_tokens=1, draft_tokens=0, n_taps=0,
                           dtype=torch.bfloat16) == refresh
    verify = 512 * 5 * a.vocab_size * 4 * 6
    assert transient_bytes(a, rows=512, prompts=1, prompt_tokens=1, draft_tokens=4, n_taps=3,
                           dtype=torch.bfloat16) == max(verify, refresh)


def test_auto_on_the_cpu_is_the_whole_batch():
    config = load_job_config(["--rollout.kv_cache_gib", "auto", "--rollout.release_between_rollouts"], world_size=1)
    target, draft = _models()
    setting = kv_cache_setting(config, [target, draft], torch.device("cpu"), target.args, rows=8, prompts=1,
                               prompt_tokens=8, draft_tokens=3, n_taps=3)
    assert setting == 0.0
    engine = RolloutEngine(target, draft, max_batch_size=8, max_seq_len=40, max_draft_tokens=3, kv_cache_gib=setting)
    assert "no GPU to measure on the CPU: the pool holds the whole batch" in kv_pool_line(engine, setting)
    simulated = kv_cache_setting(config, [target, draft], torch.device("cpu"), target.args, rows=8, prompts=1,
                                 prompt_tokens=8, draft_tokens=3, n_taps=3, simulated_gib=80)
    assert isinstance(simulated, KVBudget) and simulated.total == 80 * GIB


def test_the_config_takes_auto_with_release_between_rollouts_only(tmp_path):
    auto = load_job_config(["--rollout.kv_cache_gib", "auto", "--rollout.release_between_rollouts"], world_size=1)
    assert auto.rollout.kv_cache_gib == "auto"
    with pytest.raises(ConfigError, match=r'rollout.kv_cache_gib = "auto" needs rollout.release_between_rollouts'):
        load_job_config(["--rollout.kv_cache_gib", "auto"], world_size=1)
    with pytest.raises(ConfigError, match=r'rollout.kv_cache_gib must be >= 0 \(0 = the whole batch\) or "auto"'):
        load_job_config(["--rollout.kv_cache_gib", "-1"], world_size=1)
    job = tmp_path / "job.toml"
    job.write_text('[rollout]\nkv_cache_gib = "half"\n')
    with pytest.raises(ConfigError, match=r"rollout.kv_cache_gib must be float \| 'auto', got 'half'"):
        load_job_config(["--job.config_file", str(job)], world_size=1)


def _agree(rank: int, world_size: int) -> None:
    import torch.distributed as dist

    mine = KVBudget(80 * GIB, (rank + 1) * GIB, (world_size - rank) * GIB)
    agreed = mine.agreed(dist.group.WORLD, torch.device("cpu"))
    assert agreed == KVBudget(80 * GIB, world_size * GIB, world_size * GIB)


def test_a_tensor_parallel_engine_group_agrees_on_one_budget():
    """Ranks of one engine group whose training state differs (pipeline stages) size their
    pools alike: the largest state and transient of the group."""
    run_on_ranks(_agree, 2)
