"""Pipeline parallelism on 2 gloo ranks reproduces the single-device co-training step.

For every torch schedule (single-stage, looped with 2 virtual stages per rank, zero-bubble,
V-shaped): the policy loss and its metrics, the draft loss and its per-pass metrics, and
the gradient of every policy and draft parameter match ``forward_backward`` on the whole
batch within 1e-5 (fp32, 4 microbatches, second step on the same pipeline); the taps the
draft consumes are bitwise the single-device taps; every step finishes within a bound (a
watchdog kills a hung rank and dumps its stacks). Also: the main job's config path with a
tied-embedding model under activation checkpointing, pp=2 x cp=2 and pp=2 x dp=2 (stages
FSDP-sharded over the data-parallel x CP ranks) on 4 ranks, all three on 8; and what
the trainer builds on the step: several schedule steps accumulated into one update, the
policy loss switched per step, clipping by the global norms, the whole models gathered.
"""

import contextlib
import faulthandler
import functools
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from tests.batches import synthetic_packed_batch
from tests.multiprocess import one_thread, run_on_ranks
from titan_cotrain.cotrain.step import forward_backward
from titan_cotrain.data.batch import PackedBatch
from titan_cotrain.models.args import ModelArgs
from titan_cotrain.models.draft import Draft, DraftArgs
from titan_cotrain.models.draft_vocab import draft_vocab_from_counts
from titan_cotrain.models.transformer import Transformer
from titan_cotrain.parallel.pipeline import layers_per_stage_from_fqns, plan_pipeline
from titan_cotrain.parallel.tap_channel import EMBEDDINGS, TapChannel
from titan_cotrain.rl.grpo import ppo_loss

ARGS = ModelArgs(dim=32, n_layers=8, n_heads=4, n_kv_heads=2, head_dim=8, ffn_dim=64, vocab_size=128)
STEP = dict(ttt_steps=3, pass_decay=0.8, draft_loss_weight=0.5)
DRAFT_VOCAB = 96
ROWS, SEQ = 4, 16  # 4 microbatches of one row
POLICY_LOSS = ppo_loss(0.2, 0.2)
STEP_BOUND_S = 60.0  # a step takes well under a second here; a deadlock takes forever
# fp64 models still produce fp32 logits (the model casts them, on a single device too), and
# the pipeline scales the gradient of the loss *sum* by 1 / N after the step where the single
# device differentiates the mean: the two round differently at fp32's ~1e-7.
TOL_FP64 = dict(rtol=1e-6, atol=1e-8)

# Splits chosen so the taps (layers 1, 3, 4 and the embedding) land everywhere: all on
# other ranks (GPipe), mixed (1F1B), in looped virtual stages, and on the consumer's own
# rank (V schedules put stage 0 and the last stage on rank 0).
SCHEDULES = {
    "GPipe": [5, 3],
    "1F1B": [3, 5],
    "Interleaved1F1B": [2, 2, 2, 2],
    "LoopedBFS": [1, 3, 2, 2],
    "InterleavedZeroBubble": [2, 2, 2, 2],
    "ZBVZeroBubble": [2, 2, 2, 2],
    "DualPipeV": [1, 3, 3, 1],
}




def _models(args: ModelArgs = ARGS, std: float = 0.1) -> tuple[Transformer, Draft]:
    """A policy and a draft over a reduced vocabulary: the draft's token count then depends
    on the policy's logits (anchors whose teacher argmax is out of vocabulary are masked)."""
    policy = Transformer(args)
    policy.init_weights(std=std, generator=torch.Generator().manual_seed(0))
    maps = draft_vocab_from_counts(torch.arange(args.vocab_size).flip(0).float(), DRAFT_VOCAB)
    draft = Draft(DraftArgs.from_target(args, n_taps=3, draft_vocab_size=DRAFT_VOCAB), *maps)
    draft.init_weights(std=0.1, generator=torch.Generator().manual_seed(1))
    return policy, draft


def _batch(vocab: int = ARGS.vocab_size, rows: int = ROWS, seq: int = SEQ) -> PackedBatch:
    g = torch.Generator().manual_seed(3)
    b = synthetic_packed_batch(rows, seq, vocab, g)
    prompt = torch.arange(seq) < seq // 4  # an RL-like loss region: no loss on the first quarter
    return PackedBatch(b.tokens, b.document_ids, ~prompt.expand(rows, seq).clone(),
                       advantages=torch.randn(rows, seq, generator=g),
                       old_logprobs=-4 - torch.rand(rows, seq, generator=g))


def _settings(n_microbatches: int = ROWS, **more):
    """One-row microbatches of ``SEQ`` tokens, ``STEP``'s draft settings, every wait bounded."""
    from titan_cotrain.parallel.pipeline import PipelineSettings

    return PipelineSettings(microbatch_size=1, n_microbatches=n_microbatches, seq_len=SEQ,
                            tap_timeout=timedelta(seconds=STEP_BOUND_S), **STEP, **more)


def _reference(policy: Transformer, draft: Draft, batch: PackedBatch):
    """Single-device metrics, gradients (keyed ``policy.*`` / ``draft.*``) and taps."""
    metrics = forward_backward(policy, draft, batch, POLICY_LOSS, **STEP)
    grads = {f"{prefix}.{n}": p.grad.clone() for prefix, m in (("policy", policy), ("draft", draft))
             for n, p in m.named_parameters()}
    with torch.no_grad():
        out = policy(batch.tokens, document_ids=batch.document_ids, return_taps=True)
    taps = dict(zip(policy.tap_layers, out.taps)) | {EMBEDDINGS: out.embeddings}
    policy.zero_grad()
    draft.zero_grad()
    return metrics, grads, taps


def _reference_name(name: str, tied: bool) -> str:
    if name.startswith("draft."):
        return name
    if tied and name == "lm_head.weight":
        name = "embed_tokens.weight"
    return f"policy.{name}"


def _spy_on_receives(channel: TapChannel) -> dict[int, dict[int, torch.Tensor]]:
    received = {}
    receive = channel.receive

    def spy(microbatch):
        taps = receive(microbatch)
        received[microbatch] = {source: t.clone() for source, t in taps.items()}
        return taps

    channel.receive = spy
    return received


def _bounded_step(pipe, batch, **kwargs):
    from titan_cotrain.parallel.pipeline import pipeline_step

    faulthandler.dump_traceback_later(STEP_BOUND_S, exit=True)
    start = time.perf_counter()
    try:
        metrics = pipeline_step(pipe, batch, **kwargs)
    finally:
        faulthandler.cancel_dump_traceback_later()
    elapsed = time.perf_counter() - start
    assert elapsed < STEP_BOUND_S, f"step took {elapsed:.1f}s"
    return metrics


def _stage_parameters(pipe):
    """``(name, parameter)`` of this rank's stages under the whole model's names, the draft's
    (held by the last stage, a model of its own) as ``draft.*``."""
    for part in pipe.model_parts:
        yield from part.named_parameters()
    if pipe.draft is not None:
        yield from ((f"draft.{n}", p) for n, p in pipe.draft.named_parameters())


def _check_step(pipe, metrics, ref_metrics, ref_grads, ref_taps, received, tied=False):
    """This rank's share of the comparison, plus the coverage of every parameter across ranks."""
    assert metrics.keys() == ref_metrics.keys()
    for key, value in ref_metrics.items():
        torch.testing.assert_close(metrics[key], value, rtol=1e-5, atol=1e-6, msg=lambda m: f"{key}: {m}")
    names = []
    for name, param in _stage_parameters(pipe):
        names.append(_reference_name(name, tied))
        torch.testing.assert_close(param.grad, ref_grads[names[-1]], rtol=1e-5, atol=1e-6,
                                   msg=lambda m: f"{name}: {m}")
    drafts = {id(p) for n, p in _stage_parameters(pipe) if n.startswith("draft.")}
    assert {id(p) for p in pipe.draft_parameters()} == drafts
    assert len(pipe.policy_parameters()) + len(drafts) == len(names)
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, names)
    covered = [n for rank_names in everyone for n in rank_names]
    assert sorted(set(covered)) == sorted(ref_grads)
    assert len(covered) == len(ref_grads) + tied  # each parameter on one rank; a tied one on two
    for m, taps in received.items():
        rows = slice(m * pipe.microbatch_size, (m + 1) * pipe.microbatch_size)
        assert taps.keys() == ref_taps.keys()
        for source, tap in taps.items():
            assert torch.equal(tap, ref_taps[source][rows]), f"tap {source} of microbatch {m} differs"
    assert len(received) == (pipe.n_microbatches if pipe.channel.is_consumer else 0)


def _check_schedules(mesh, reference):
    from titan_cotrain.parallel.pipeline import make_pipeline

    world_size = mesh.size()
    ref_metrics, ref_grads, ref_taps = reference
    for schedule, split in SCHEDULES.items():
        policy, draft = _models()
        plan = plan_pipeline(ARGS.n_layers, world_size, schedule, layers_per_stage=split)
        pipe = make_pipeline(policy, draft, mesh, plan, _settings(), policy_loss_fn=POLICY_LOSS)
        received = _spy_on_receives(pipe.channel)
        # Two steps on one pipeline: the second runs on reused landing slots and channel state.
        _bounded_step(pipe, _batch())
        for part in pipe.model_parts:
            part.zero_grad()
        if pipe.draft is not None:
            pipe.draft.zero_grad()
        received.clear()
        metrics = _bounded_step(pipe, _batch())
        try:
            _check_step(pipe, metrics, ref_metrics, ref_grads, ref_taps, received)
        except AssertionError as e:
            raise AssertionError(f"schedule {schedule}: {e}") from e


def _config_models():
    """A tied-embedding Qwen-3 policy and its draft, from the main job's config path."""
    from titan_cotrain.config import load_job_config
    from titan_cotrain.models.build import build_draft, build_target

    config = load_job_config([
        "--model.name", "qwen3", "--parallelism.pipeline_parallel_degree", "2",
        "--parallelism.pipeline_parallel_schedule", "1F1B", "--parallelism.pipeline_parallel_microbatch_size", "1",
        "--training.local_batch_size", str(ROWS), "--training.seq_len", str(SEQ), "--rollout.max_new_tokens", "4",
        "--draft.ttt_steps", str(STEP["ttt_steps"]), "--draft.pass_decay", str(STEP["pass_decay"]),
        "--draft.loss_weight", str(STEP["draft_loss_weight"]),
    ], world_size=2)
    policy = build_target(config)
    return config, policy, build_draft(config, policy)


def _unused_loss(logits, rows):
    raise AssertionError("the policy loss given to pipeline_step replaces the one the pipeline was built with")


def _global_norms(grads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {kind: torch.linalg.vector_norm(torch.stack([g.norm() for n, g in grads.items() if n.startswith(kind)]))
            for kind in ("policy", "draft")}


def _clip_step_and_gather(pipe, reference, whole_policy, whole_draft, max_norm=1e-2, tied=False):
    """SGD (lr 1) after ``clip_pipeline_grad_norms``: the norms are the global ones on every
    rank, and ``broadcast_stage_weights`` gives every rank the whole models moved by the
    clipped gradients, which ``broadcast_state_dicts`` streams into an engine copy in order."""
    from titan_cotrain.cotrain.step import step_optimizers
    from titan_cotrain.engine.engine_copy import copy_state
    from titan_cotrain.parallel.pipeline import broadcast_stage_weights, broadcast_state_dicts, clip_pipeline_grad_norms

    _, ref_grads, _ = reference
    policy_opt = torch.optim.SGD(pipe.policy_parameters(), lr=1.0)
    draft_opt = torch.optim.SGD(pipe.draft_parameters(), lr=1.0) if pipe.draft is not None else None
    norms = clip_pipeline_grad_norms(pipe, max_norm, max_norm)
    step_optimizers(policy_opt, draft_opt)
    state = {"policy": dict(broadcast_stage_weights(pipe, whole_policy)),
             "draft": dict(broadcast_stage_weights(pipe, whole_draft, draft=True))}
    for kind, expected in _global_norms(ref_grads).items():
        norm = norms[f"grad_norm/{kind}"]
        torch.testing.assert_close(norm, expected, rtol=1e-5, atol=1e-7, msg=lambda m: f"{kind} norm: {m}")
        coef = min(1.0, max_norm / (float(norm) + 1e-6))
        like = whole_policy if kind == "policy" else whole_draft
        assert state[kind].keys() == like.state_dict().keys()
        for name, p0 in like.named_parameters():
            torch.testing.assert_close(state[kind][name], p0 - coef * ref_grads[f"{kind}.{name}"], rtol=1e-5,
                                       atol=1e-7, msg=lambda m: f"{kind}.{name}: {m}")
    if tied:  # its two copies, on two ranks, moved alike
        assert torch.equal(state["policy"]["lm_head.weight"], state["policy"]["embed_tokens.weight"])
    copy_state(whole_policy, broadcast_state_dicts(pipe, whole_policy)[0])  # the engine's read, in its order
    assert all(torch.equal(t, state["policy"][name]) for name, t in whole_policy.state_dict().items())


def _check_trainer_hooks(mesh, reference):
    """Two schedule steps (2 microbatches of one row) per ``pipeline_step`` over the 4-row
    batch: one update, normalised over all 4 rows; then clipping, the gather, and a step
    with the draft not trained (no taps sent, no draft gradients)."""
    from titan_cotrain.parallel.pipeline import make_pipeline

    ref_metrics, ref_grads, _ = reference
    policy, draft = _models()
    whole_policy, whole_draft = _models()
    plan = plan_pipeline(ARGS.n_layers, 2, "1F1B", layers_per_stage=[3, 5])
    pipe = make_pipeline(policy, draft, mesh, plan, _settings(2), policy_loss_fn=_unused_loss)
    metrics = _bounded_step(pipe, _batch(), policy_loss_fn=POLICY_LOSS)
    for key, value in ref_metrics.items():
        torch.testing.assert_close(metrics[key], value, rtol=1e-5, atol=1e-6, msg=lambda m: f"{key}: {m}")
    for name, param in _stage_parameters(pipe):
        torch.testing.assert_close(param.grad, ref_grads[_reference_name(name, False)], rtol=1e-5, atol=1e-6,
                                   msg=lambda m: f"{name}: {m}")
    assert {f"policy.{n}" for n, _ in pipe.local_policy.named_parameters()} <= ref_grads.keys()
    _clip_step_and_gather(pipe, reference, whole_policy, whole_draft)
    metrics = _bounded_step(pipe, _batch(), policy_loss_fn=POLICY_LOSS, train_draft=False)
    assert metrics.keys() == {k for k in ref_metrics if not k.startswith(("loss/draft", "draft/"))}
    assert all(p.grad is None for p in pipe.draft_parameters())
    with pytest.raises(ValueError, match="positive multiple"):
        _bounded_step(pipe, _batch(rows=3), policy_loss_fn=POLICY_LOSS)


def _check_config_path(mesh, reference):
    """The main job's path, with every stage forward activation-checkpointed (the recompute
    re-runs the tap sends)."""
    from torch.utils.checkpoint import checkpoint

    from titan_cotrain.parallel.pipeline import build_pipeline

    config, policy, draft = _config_models()
    pipe = build_pipeline(policy, draft, config, mesh, policy_loss_fn=POLICY_LOSS)
    assert [len(r) for r in pipe.plan.layer_ranges] == [4, 4]  # torchtitan's default split
    sends = []
    send = pipe.channel.send
    pipe.channel.send = lambda *a: (sends.append(a[:2]), send(*a))
    for part in pipe.model_parts:
        part.forward = functools.partial(checkpoint, part.forward, use_reentrant=False)
    received = _spy_on_receives(pipe.channel)
    metrics = _bounded_step(pipe, _batch(vocab=policy.args.vocab_size))
    _check_step(pipe, metrics, *reference, received, tied=True)
    _, whole_policy, whole_draft = _config_models()
    _clip_step_and_gather(pipe, reference, whole_policy, whole_draft, tied=True)
    if mesh.get_local_rank() == 0:  # the producer: taps recomputed (up to the last a backward needs), sent once
        n_taps = len(pipe.channel.local_sources)
        counts = (n_taps, len(sends), pipe.channel.sent)
        assert n_taps == 3 and len(sends) > ROWS * n_taps and pipe.channel.sent == ROWS * n_taps, counts


def _two_ranks(rank, world_size, schedules_reference, config_reference):
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("pp",))
    _check_schedules(mesh, schedules_reference)
    _check_trainer_hooks(mesh, schedules_reference)
    _check_config_path(mesh, config_reference)


def test_every_schedule_and_the_config_path_match_single_device():
    """pp=2, one spawn for all (it keeps this file's run time down): every schedule on a
    reduced-vocabulary draft, the trainer's hooks, then the config path on a tied-embedding
    Qwen-3 policy with activation checkpointing."""
    policy, draft = _models()
    _, tied_policy, tied_draft = _config_models()
    assert tied_policy.lm_head.weight is tied_policy.embed_tokens.weight
    with one_thread():
        schedules_reference = _reference(policy, draft, _batch())
        teacher = policy(_batch().tokens).argmax(-1)
        config_reference = _reference(tied_policy, tied_draft, _batch(vocab=tied_policy.args.vocab_size))
    assert all(g.abs().sum() > 0 for g in schedules_reference[1].values())
    assert 0 < int((~draft.t2d[teacher]).sum()) < teacher.numel()  # the vocabulary masks some anchors
    run_on_ranks(_two_ranks, 2, schedules_reference, config_reference)


CP_ROW_LEN = 32  # every test row's documents, each padded to a multiple of 2 x cp = 4, fit in 32
# Looped: two stages per rank share the ring and the FSDP mesh. (Zero-bubble schedules, whose
# weight passes run after FSDP's reduce-scatter, are refused with FSDP-sharded stages.)
PP_CP_SCHEDULES = {"Interleaved1F1B": [2, 2, 2, 2]}


def _whole(t: torch.Tensor) -> torch.Tensor:
    """A gradient as one tensor (FSDP shards gathered)."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _fsdp_over(mesh, every_microbatch: bool = False):
    """The stages' data-parallel (and CP) sharding: FSDP2 in the models' own fp64; with
    ``every_microbatch``, resharded and reduced after each microbatch's backward."""
    from titan_cotrain.parallel.fsdp import apply_fsdp, reduce_every_microbatch

    def shard(module):
        apply_fsdp(module, mesh, param_dtype=None, reduce_dtype=None)
        if every_microbatch:
            reduce_every_microbatch(module)

    return shard


def _check_grads(pipe, ref_grads, what: str) -> None:
    for name, param in _stage_parameters(pipe):
        torch.testing.assert_close(_whole(param.grad), ref_grads[_reference_name(name, False)], **TOL_FP64,
                                   msg=lambda m: f"{what} {name}: {m}")


def _pp_cp_and_pp_dp_ranks(rank, world_size, reference):
    """pp=2 x cp=2: every stage rides the CP ring, the taps stay within their CP rank's
    column. pp=2 x dp=2: each replica of the stages trains half the rows; the step sums the
    gradients over the replicas (the draft's over the last stage's). Either way every rank
    ends with the whole batch's gradients of its stages."""
    from torch.distributed.device_mesh import init_device_mesh

    from titan_cotrain.parallel.pipeline import make_pipeline

    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "cp"))
    cp_group = mesh["cp"].get_group()
    ref_metrics, ref_grads = reference
    for schedule, split in PP_CP_SCHEDULES.items():
        policy, draft = (m.double() for m in _models())
        plan = plan_pipeline(ARGS.n_layers, 2, schedule, layers_per_stage=split)
        pipe = make_pipeline(policy, draft, mesh["pp"], plan, _settings(cp_row_len=CP_ROW_LEN),
                             policy_loss_fn=POLICY_LOSS, loss_group=cp_group, cp_mesh=mesh["cp"],
                             shard=_fsdp_over(mesh["cp"]))
        assert pipe.channel.shape == (1, CP_ROW_LEN // 2, ARGS.dim)  # taps travel CP-sharded
        metrics = _bounded_step(pipe, _batch())
        for key, value in ref_metrics.items():  # forward_backward reports fp32 metrics
            torch.testing.assert_close(metrics[key], value, rtol=1e-6, atol=1e-7,
                                       msg=lambda m: f"{schedule} {key}: {m}")
        _check_grads(pipe, ref_grads, f"pp x cp {schedule}")  # partial per CP rank, reduced by FSDP

    policy, draft = (m.double() for m in _models())
    with pytest.raises(ValueError, match="ZBVZeroBubble runs the weight-gradient passes apart"):
        make_pipeline(policy, draft, mesh["pp"], plan_pipeline(ARGS.n_layers, 2, "ZBVZeroBubble",
                                                               layers_per_stage=[2, 2, 2, 2]),
                      _settings(cp_row_len=CP_ROW_LEN), policy_loss_fn=POLICY_LOSS, loss_group=cp_group,
                      cp_mesh=mesh["cp"], shard=_fsdp_over(mesh["cp"]))

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    reductions = {}
    for every_microbatch in (False, True):
        with _counting_reduce_scatters() as count:
            _check_sharded_stages(mesh, mesh["dp"].get_group(), mesh["dp"], reference,
                                  f"pp x dp, reduced every microbatch: {every_microbatch}", every_microbatch)
        reductions[every_microbatch] = count[0]
    # torch's schedule reduces once per FSDP unit at the end; the option once per microbatch too.
    assert reductions[True] > reductions[False] > 0, reductions


@contextlib.contextmanager
def _counting_reduce_scatters():
    """Count FSDP2's gradient reduce-scatters (the c10d call its collectives make)."""
    name = "reduce_scatter_single" if hasattr(dist, "reduce_scatter_single") else "reduce_scatter_tensor"
    real, count = getattr(dist, name), [0]

    def counting(*args, **kwargs):
        count[0] += 1
        return real(*args, **kwargs)

    setattr(dist, name, counting)
    try:
        yield count
    finally:
        setattr(dist, name, real)


def _check_sharded_stages(mesh, replicas, fsdp_mesh, reference, what: str, every_microbatch: bool = False,
                          cp_mesh=None, cp_row_len=None):
    """pp=2 with the stages FSDP-sharded over ``fsdp_mesh`` (the data-parallel, and CP, ranks
    of a stage; ``replicas`` their group): each data-parallel rank trains half the rows; every
    rank must end with the whole batch's metrics and gradients of its stages."""
    from titan_cotrain.parallel.pipeline import make_pipeline

    ref_metrics, ref_grads = reference
    dp_rank, half = mesh["dp"].get_local_rank(), ROWS // 2
    policy, draft = (m.double() for m in _models())
    plan = plan_pipeline(ARGS.n_layers, 2, "1F1B", layers_per_stage=[3, 5])
    pipe = make_pipeline(policy, draft, mesh["pp"], plan, _settings(half, cp_row_len=cp_row_len),
                         policy_loss_fn=POLICY_LOSS, loss_group=replicas, cp_mesh=cp_mesh,
                         shard=_fsdp_over(fsdp_mesh, every_microbatch))
    metrics = _bounded_step(pipe, _batch().map(lambda t: t[dp_rank * half:(dp_rank + 1) * half]))
    for key, value in ref_metrics.items():
        torch.testing.assert_close(metrics[key], value, rtol=1e-6, atol=1e-7, msg=lambda m: f"{what} {key}: {m}")
    _check_grads(pipe, ref_grads, what)


@pytest.mark.slow
def test_pipeline_composes_with_context_or_data_parallelism():
    """fp64, as the CP tests: the ring sums attention in another order, and fp32 rounding
    through 8 layers would hide a real error of 1e-5 (see ``TOL_FP64``)."""
    policy, draft = (m.double() for m in _models())
    with one_thread():
        metrics, grads, _ = _reference(policy, draft, _batch())
    run_on_ranks(_pp_cp_and_pp_dp_ranks, 4, (metrics, grads))


def _pp_dp_cp_rank(rank, world_size, reference):
    """pp=2 x dp=2 x cp=2 (the shipped Qwen3-32B layout, smaller): each data-parallel
    replica trains half the rows, CP-sharded; FSDP shards the stages over the 4 ranks of a
    stage and reduces their gradients."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("pp", "dp", "cp"))
    replicas = dist.new_group(mesh["dp", "cp"].mesh.flatten().tolist(), use_local_synchronization=True)
    _check_sharded_stages(mesh, replicas, mesh["dp", "cp"], reference, "pp x dp x cp",
                          cp_mesh=mesh["cp"], cp_row_len=CP_ROW_LEN)


@pytest.mark.slow
def test_pipeline_composes_with_data_and_context_parallelism_at_once():
    policy, draft = (m.double() for m in _models())
    with one_thread():
        metrics, grads, _ = _reference(policy, draft, _batch())
    run_on_ranks(_pp_dp_cp_rank, 8, (metrics, grads))


def _placed_mesh_ranks(rank, world_size, reference):
    """pp=2 x dp=2 on torchtitan's own mesh (``build_parallel_dims``), as two nodes of two
    GPUs with an engine TP of 2: ``auto`` puts the data-parallel coordinate outermost (the
    pp_outer engine groups [0, 2] and [1, 3] would span both nodes). In either rank order
    every sub-mesh holds the ranks the layout says, the mesh's data-parallel coordinate is
    the generation group's, and the step's metrics and gradients are the single device's."""
    import os

    from titan_cotrain.components import titan
    from titan_cotrain.config import load_job_config
    from titan_cotrain.parallel.rank_layout import RankLayout, rank_layout
    from titan_cotrain.rl.generation_group import GenerationGroup

    os.environ["LOCAL_WORLD_SIZE"] = "2"
    config = load_job_config(["--parallelism.pipeline_parallel_degree", "2", "--parallelism.data_parallel_shard_degree",
                              "2", "--rollout.tensor_parallel_degree", "2"], world_size=world_size)
    assert rank_layout(config, world_size) == RankLayout(2, 2, 1, "dp_outer")
    for order, pp_groups in (("pp_outer", [[0, 2], [1, 3]]), ("dp_outer", [[0, 1], [2, 3]])):
        layout = RankLayout(2, 2, 1, order)
        dims = titan.build_parallel_dims(config.parallelism, world_size, layout.mesh_ranks())
        dims.build_mesh()
        p, b = dims.get_mesh("pp").get_local_rank(), dims.get_mesh("batch").get_local_rank()
        assert layout.rank(p, b, 0) == rank
        assert dims.get_mesh("pp").mesh.tolist() in pp_groups
        for name, ranks in (("pp", [layout.rank(q, b, 0) for q in range(2)]),
                            ("fsdp", [layout.rank(p, d, 0) for d in range(2)]),
                            ("loss", [layout.rank(p, d, 0) for d in range(2)])):
            assert dims.get_mesh(name).mesh.tolist() == ranks, (order, name)
            assert dist.get_process_group_ranks(dims.get_mesh(name).get_group()) == ranks, (order, name)
        assert GenerationGroup(layout, rank, True, dp_rank=b, communicate=False).ranks == layout.dp_groups()[b]
        _check_sharded_stages({"pp": dims.get_mesh("pp"), "dp": dims.get_mesh("batch")},
                              dims.get_mesh("loss").get_group(), dims.get_mesh("fsdp"), reference, f"pp x dp, {order}")


@pytest.mark.slow
def test_pipeline_on_torchtitans_mesh_in_either_rank_order():
    policy, draft = (m.double() for m in _models())
    with one_thread():
        metrics, grads, _ = _reference(policy, draft, _batch())
    run_on_ranks(_placed_mesh_ranks, 4, (metrics, grads))


def test_plan_places_stages_and_taps():
    plan = plan_pipeline(8, 2, "ZBVZeroBubble", layers_per_stage=[2, 2, 2, 2])
    assert plan.stage_ranks == (0, 1, 1, 0)
    assert plan.tap_owners((1, 3, 4)) == {EMBEDDINGS: 0, 1: 0, 3: 1, 4: 1}
    plan = plan_pipeline(8, 2, "Interleaved1F1B", layers_per_stage=[2, 2, 2, 2])
    assert plan.stage_ranks == (0, 1, 0, 1) and plan.stages_of(1) == [1, 3]
    assert plan_pipeline(12, 4, "DualPipeV", layers_per_stage=[2, 1, 1, 1, 1, 2, 2, 2]).stage_ranks == (
        0, 1, 2, 3, 3, 2, 1, 0)
    with pytest.raises(ValueError, match="one stage per rank"):
        plan_pipeline(8, 2, "1F1B", layers_per_stage=[2, 2, 2, 2])
    with pytest.raises(ValueError, match="at least 2 stages per rank"):
        plan_pipeline(8, 2, "Interleaved1F1B", layers_per_stage=[4, 4])
    with pytest.raises(ValueError, match="add up"):
        plan_pipeline(8, 2, "GPipe", layers_per_stage=[4, 5])
    with pytest.raises(ValueError, match="middle stage"):
        plan_pipeline(8, 2, "Interleaved1F1B", layers_per_stage=[4, 0, 2, 2])
    fqns = [["embed_tokens", "layers.0", "layers.1"], [f"layers.{i}" for i in range(2, 8)] + ["norm", "lm_head"]]
    assert layers_per_stage_from_fqns(fqns, 8) == [2, 6]
    with pytest.raises(ValueError, match="each once, in order"):
        layers_per_stage_from_fqns([["embed_tokens", "layers.1"], ["layers.0", "norm", "lm_head"]], 2)


def test_tap_channel_asserts_the_order_it_relies_on():
    """The channel's checks on one rank that holds every stage (every tap bypasses the group)."""
    channel = TapChannel(pp_ranks=[0], pp_rank=0, consumer=0, owners={EMBEDDINGS: 0, 2: 0}, shape=(1, 4, 8),
                         dtype=torch.float32, device="cpu")
    assert channel.group is None
    tap = torch.zeros(1, 4, 8)
    channel.begin_step(2)
    with pytest.raises(RuntimeError, match="expected 0"):
        channel.send(1, 2, tap)  # a schedule that runs microbatch 1 first fails loudly
    channel.send(0, EMBEDDINGS, tap)
    channel.send(0, 2, tap)
    channel.send(0, 2, tap + 1)  # an activation-checkpoint recompute: ignored
    with pytest.raises(RuntimeError, match="built for detached"):
        channel.send(1, 2, torch.zeros(1, 4, 9))
    with pytest.raises(RuntimeError, match="expected 0"):
        channel.receive(1)
    taps = channel.receive(0)
    assert taps.keys() == {EMBEDDINGS, 2} and taps[2] is tap
    channel.release(0)
    with pytest.raises(RuntimeError, match="not produced or not sent"):
        channel.finish_step()


def test_a_streamed_state_dict_is_read_once_in_order():
    """What the engine's refresh reads the broadcast weights through: its keys without
    advancing the stream, each entry once, in order, and a read out of order fails."""
    from titan_cotrain.parallel.pipeline import StreamedStateDict

    first, second = torch.zeros(2), torch.ones(2)
    state = StreamedStateDict(iter([("a", first), ("b", second)]), ["a", "b"])
    assert list(state) == ["a", "b"] and "b" in state and "c" not in state and len(state) == 2
    assert state["a"] is first
    with pytest.raises(KeyError, match="next entry is 'b'"):
        state["a"]
