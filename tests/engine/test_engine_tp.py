"""A tensor-parallel rollout engine (``[rollout] tensor_parallel_degree``): its policy copy is split
over the ranks of an engine group and still generates what the one-rank engine generates, a
mixture of experts' too (every expert split over its width), and over more ranks than the
policy has KV heads (each KV head computed on ``t / n_kv`` ranks from whole ``k/v`` weights)."""

import pytest
import torch
import torch.distributed as dist

from tests.multiprocess import run_on_ranks
from tests.engine.test_rollout import DENSE, MOE, _prompts
from titan_cotrain.models.args import model_args_for
from titan_cotrain.models.draft import DraftArgs
from titan_cotrain.engine.kv_budget import kv_bytes_per_sequence
from titan_cotrain.engine.rollout import RolloutEngine
from titan_cotrain.engine.sampling import SamplingParams


def _models(seed: int, flavor=DENSE):
    """The llama3 debug model (or another ``(name, flavor)``; vocabulary 64) and a draft over
    48 of its ids, random weights at a scale whose logits are O(10), so fp32's reduction order
    moves log-probs by ~1e-6."""
    from titan_cotrain.models.draft import Draft
    from titan_cotrain.models.draft_vocab import draft_vocab_from_counts
    from titan_cotrain.models.transformer import Transformer

    target = Transformer(model_args_for(*flavor).replace(vocab_size=64))
    target.init_weights(std=0.1, generator=torch.Generator().manual_seed(seed))
    maps = draft_vocab_from_counts(torch.arange(64).float(), 48)
    draft = Draft(DraftArgs.from_target(target.args, n_taps=3, draft_vocab_size=48), *maps)
    draft.init_weights(std=0.1, generator=torch.Generator().manual_seed(seed + 1))
    return target, draft


def _assert_generates_alike(engine, reference, k_max: int, world_size: int) -> None:
    """``engine`` (tensor-parallel) generates ``reference``'s (one rank) tokens, lengths,
    log-probs and acceptance, greedy at k = 0 and ``k_max`` and sampled at ``k_max``, and every
    rank of the group holds the same rollouts."""
    prompts = _prompts([3, 7, 2, 5, 4], 64, seed=1)
    cases = [(SamplingParams(temperature=0, max_new_tokens=16), k) for k in (0, k_max)]
    cases += [(SamplingParams(temperature=1.0, top_k=20, top_p=0.9, max_new_tokens=16), k_max)]
    for params, k in cases:
        seeds = [torch.Generator().manual_seed(11) for _ in range(2)]
        ours = engine.generate(prompts, params, draft_tokens=k, generator=seeds[0])
        theirs = reference.generate(prompts, params, draft_tokens=k, generator=seeds[1])
        what = f"temperature {params.temperature}, k {k}"
        assert torch.equal(ours.tokens, theirs.tokens), what
        assert torch.equal(ours.response_lens, theirs.response_lens), what
        torch.testing.assert_close(ours.logprobs, theirs.logprobs, rtol=0, atol=1e-5, msg=what)
        if k:  # the rounds drafted, and accepted what the one-rank engine's did
            assert ours.stats.rounds.live[:, 2:].sum() > 0, what
            assert ours.stats.acceptance_length == pytest.approx(theirs.stats.acceptance_length, abs=1e-9), what
        # The ranks of the engine group hold the very same rollouts (bitwise), as they must.
        every = [None] * world_size
        dist.all_gather_object(every, (ours.tokens, ours.logprobs))
        assert all(torch.equal(tokens, ours.tokens) and torch.equal(logprobs, ours.logprobs)
                   for tokens, logprobs in every), what


def _tp_engine_matches_one_rank(rank: int, world_size: int, flavor) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    from titan_cotrain.parallel.engine_tp import engine_tp_mesh, kv_heads_per_rank

    target, draft = _models(3, flavor)
    reference = RolloutEngine(*_models(3, flavor), max_batch_size=5, max_seq_len=40,
                              max_draft_tokens=3)
    # The trainer's side: FSDP2 shards over the same two ranks.
    mesh = init_device_mesh("cpu", (world_size,))
    for module in (target, draft):
        for layer in getattr(module, "layers", ()):
            fully_shard(layer, mesh=mesh)
        fully_shard(module, mesh=mesh)
    tp = engine_tp_mesh("cpu", [list(range(world_size))])
    engine = RolloutEngine.from_models(target, draft, device="cpu", max_batch_size=5, max_seq_len=40,
                                       max_draft_tokens=3, tp_mesh=tp)
    q_proj = engine.policy.layers[0].self_attn.q_proj.weight
    assert isinstance(q_proj, DTensor) and q_proj.to_local().shape[0] == q_proj.shape[0] // world_size
    n_kv = target.args.n_kv_heads
    assert engine.target_pool.k.shape[3] == kv_heads_per_rank(n_kv, world_size) == max(n_kv // world_size, 1)
    k_proj = engine.policy.layers[0].self_attn.k_proj.weight
    if world_size > n_kv:  # whole on every rank; each rank caches its query heads' one KV head
        assert not isinstance(k_proj, DTensor) and k_proj.shape == target.layers[0].self_attn.k_proj.weight.shape
    else:
        assert k_proj.to_local().shape[0] == k_proj.shape[0] // world_size
    assert engine.policy.lm_head.weight is engine.policy.embed_tokens.weight or not target.args.tie_embeddings
    for layer in engine.policy.layers:
        if layer.sparse:  # each rank holds half of every expert's width; the router whole
            w1, w2 = layer.mlp.experts.w1, layer.mlp.experts.w2
            assert w1.to_local().shape[1] == w1.shape[1] // world_size == target.args.moe_inter_dim // world_size
            assert w2.to_local().shape[2] == w2.shape[2] // world_size
            assert not isinstance(layer.mlp.router.gate.weight, DTensor)

    _assert_generates_alike(engine, reference, 3, world_size)

    # Released and refreshed from other weights, it follows them like a fresh one-rank engine.
    engine.release()
    assert engine.target_pool.k.untyped_storage().nbytes() == 0 and q_proj.to_local().untyped_storage().nbytes() == 0
    new_target, new_draft = _models(8, flavor)
    engine.load_weights(new_target.state_dict(), new_draft.state_dict())
    fresh = RolloutEngine(new_target, new_draft, max_batch_size=5, max_seq_len=40, max_draft_tokens=3)
    params, prompts = SamplingParams(temperature=0, max_new_tokens=16), _prompts([3, 7, 2, 5, 4], 64, seed=1)
    assert torch.equal(engine.generate(prompts, params).tokens, fresh.generate(prompts, params).tokens)


@pytest.mark.parametrize("flavor, world_size", [
    (DENSE, 2), (MOE, 2),
    (DENSE, 4),  # 4 ranks, 2 KV heads: each KV head on 2 ranks
    pytest.param(MOE, 4, marks=pytest.mark.slow),
], ids=["dense", "moe", "dense_kv_heads_replicated", "moe_kv_heads_replicated"])
def test_a_tensor_parallel_engine_generates_what_one_rank_generates(flavor, world_size):
    assert model_args_for(*flavor).n_kv_heads == 2
    run_on_ranks(_tp_engine_matches_one_rank, world_size, flavor)


def _tp_block_engine_matches_one_rank(rank: int, world_size: int) -> None:
    """The block drafter's engine split over the ranks as the EAGLE-3 one is (the drafter
    whole on every rank, reading the split embedding and head through their modules)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    from titan_cotrain.engine.block_rollout import BlockDraftEngine
    from titan_cotrain.models.block_draft import BlockDraftArgs, BlockDrafter
    from titan_cotrain.models.transformer import Transformer
    from titan_cotrain.parallel.engine_tp import engine_tp_mesh

    def pair(seed):
        target = Transformer(model_args_for(*DENSE).replace(vocab_size=64))
        target.init_weights(std=0.1, generator=torch.Generator().manual_seed(seed))
        drafter = BlockDrafter(BlockDraftArgs.from_target(target.args, n_layers=2, block_size=5,
                                                          target_layer_ids=target.tap_layers))
        drafter.init_weights(std=0.1, generator=torch.Generator().manual_seed(seed + 1))
        return target, drafter

    target, drafter = pair(3)
    reference = BlockDraftEngine(*pair(3), max_batch_size=5, max_seq_len=40, max_draft_tokens=4)
    mesh = init_device_mesh("cpu", (world_size,))
    for module in (target, drafter):
        for layer in getattr(module, "layers", ()):
            fully_shard(layer, mesh=mesh)
        fully_shard(module, mesh=mesh)
    engine = BlockDraftEngine.from_models(target, drafter, device="cpu", max_batch_size=5, max_seq_len=40,
                                          max_draft_tokens=4, tp_mesh=engine_tp_mesh("cpu", [list(range(world_size))]))
    head = engine.policy.lm_head.weight
    assert isinstance(head, DTensor) and head.to_local().shape[0] == 64 // world_size
    assert not any(isinstance(p, DTensor) for p in engine.draft.parameters())
    _assert_generates_alike(engine, reference, 4, world_size)


def test_a_tensor_parallel_block_drafting_engine_generates_what_one_rank_generates():
    run_on_ranks(_tp_block_engine_matches_one_rank, 2)


def test_tensor_parallel_kv_bytes_are_a_share_of_the_targets():
    args = model_args_for("llama3", "70B")
    draft = DraftArgs.from_target(args, n_taps=3, draft_vocab_size=16000)
    whole = kv_bytes_per_sequence(args, None, 1024, 4, torch.bfloat16)
    assert kv_bytes_per_sequence(args, None, 1024, 4, torch.bfloat16, tensor_parallel=8) * 8 == whole
    # The draft's cache stays whole on every rank.
    with_draft = kv_bytes_per_sequence(args, draft, 1024, 4, torch.bfloat16, tensor_parallel=8)
    assert with_draft - whole // 8 == kv_bytes_per_sequence(args, draft, 1024, 4, torch.bfloat16) - whole


def test_kv_heads_split_or_replicate():
    from titan_cotrain.parallel.engine_tp import engine_tp_errors

    args = model_args_for("qwen3", "235B-A22B")  # 64 query heads, 4 KV heads
    assert engine_tp_errors(args, 4) == engine_tp_errors(args, 8) == []
    assert engine_tp_errors(args.replace(n_kv_heads=3, n_heads=48), 2) == [
        "rollout.tensor_parallel_degree (2) must divide the policy's kv heads (3) or be a multiple of them (each kv "
        "head then computed on t / kv heads ranks)"]
    # At 8 ranks a KV head's keys are cached on 2 of them: a rank's cache is a 4-way engine's.
    draft = DraftArgs.from_target(args, n_taps=3, draft_vocab_size=32000)
    assert (kv_bytes_per_sequence(args, draft, 1024, 4, torch.bfloat16, tensor_parallel=8)
            == kv_bytes_per_sequence(args, draft, 1024, 4, torch.bfloat16, tensor_parallel=4))


def test_a_mixture_of_experts_splits_by_its_expert_width():
    from titan_cotrain.parallel.engine_tp import engine_tp_errors

    args = model_args_for("qwen3", "30B-A3B")  # every layer sparse: its ffn_dim splits nothing
    assert engine_tp_errors(args.replace(ffn_dim=6143), 4) == []
    assert engine_tp_errors(args.replace(moe_inter_dim=766), 4) == [
        "rollout.tensor_parallel_degree (4) must divide the policy's expert width (766)"]
    debug = model_args_for(*MOE)  # dense layers too
    assert "ffn width" in " ".join(engine_tp_errors(debug.replace(ffn_dim=127), 2))


def _refuses(rank: int, world_size: int) -> None:
    from titan_cotrain.models.transformer import Transformer
    from titan_cotrain.parallel.engine_tp import engine_tp_mesh, tensor_parallel_engine_policy

    args = model_args_for("llama3", "debugmodel")
    with torch.device("meta"):
        policy = Transformer(args.replace(n_kv_heads=1, n_heads=3))
    with pytest.raises(ValueError, match="must divide the policy's heads"):
        tensor_parallel_engine_policy(policy, engine_tp_mesh("cpu", [list(range(world_size))]))


def test_a_degree_that_does_not_divide_the_heads_is_refused():
    run_on_ranks(_refuses, 2)
