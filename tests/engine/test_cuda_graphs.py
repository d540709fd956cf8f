"""CUDA graphs for the compiled engine (docs/DESIGN.md section 14), checked on CPU.

Under ``reduce-overhead`` inductor captures a graph only if every input the graph writes in
place has a static address (a parameter, a buffer, or a tensor marked with
``torch._dynamo.mark_static_address``); otherwise it runs the graph kernel by kernel
("skipping cudagraphs due to mutated inputs"). Here the engine's steps are compiled by an AOT
backend that traces them as inductor does (``keep_inference_input_mutations``: the writes to
inputs stay in the graph as ``copy_`` into them) and applies inductor's own predicate,
``check_for_mutation_ignore_cuda_graph_managed_tensor``, to every graph, before and after a
``release()`` / ``load_weights`` (the storages freed and given back, as between rollouts).

The warning a GPU run gives when torch skips CUDA graphs anyway is fed a skip the way
inductor reports one (its counter and its log line)."""

import functools

import pytest
import torch
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.aot_autograd import make_boxed_func
from torch._inductor.cudagraph_utils import (
    check_for_mutation_ignore_cuda_graph_managed_tensor,
    log_cudagraph_skip_and_bump_counter,
)

from titan_cotrain.engine.rollout import RolloutEngine, _CompiledStep
from titan_cotrain.engine.sampling import SamplingParams

PARAMS = SamplingParams(temperature=1.0, max_new_tokens=6)
PROMPTS = [torch.arange(1, 6), torch.arange(3, 9)]
SKIP = "skipping cudagraphs due to mutated inputs (2 instances)"


@pytest.fixture
def fresh_dynamo():
    """Graphs of other tests' engines neither serve these nor count toward the recompile limit."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


class GraphAudit:
    """Stands in for ``torch.compile``: the engine's steps are compiled by an AOT backend that
    records, per graph, the step's name and inductor's reason to skip CUDA graphs for its
    mutated inputs (None: none written, or every one written is static)."""

    def __init__(self) -> None:
        self.compile = torch.compile
        self.graphs: list[tuple[str, str | None]] = []

    def __call__(self, fn, *, mode=None, **kwargs):
        backend = aot_autograd(fw_compiler=functools.partial(self._audit, fn.__qualname__),
                               keep_inference_input_mutations=True)
        return self.compile(fn, backend=backend, **kwargs)

    def _audit(self, name: str, gm: torch.fx.GraphModule, example_inputs):
        # Inductor's view: the inputs the graph copies into are mutated, and the static ones
        # are AOT's ``static_input_indices`` (parameters, buffers, marked tensors).
        static = torch._guards.TracingContext.get().fw_metadata.static_input_indices
        placeholders = gm.graph.find_nodes(op="placeholder")
        mutated = {placeholders.index(node.args[0])
                   for node in gm.graph.find_nodes(op="call_function", target=torch.ops.aten.copy_.default)
                   if node.args[0] in placeholders}
        names = {placeholders[i].name for i in mutated}
        self.graphs.append((name, check_for_mutation_ignore_cuda_graph_managed_tensor(gm, names, mutated, static)))
        return make_boxed_func(gm.forward)

    def skipped(self) -> list[tuple[str, str]]:
        return [(name, reason) for name, reason in self.graphs if reason is not None]


def _generate(engine: RolloutEngine, k: int):
    return engine.generate(PROMPTS, PARAMS, samples_per_prompt=2, draft_tokens=k,
                           generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("paged", [True, False], ids=["paged", "static"])
def test_compiled_steps_write_only_static_addresses(models, paged, monkeypatch, fresh_dynamo):
    """Every graph of the target's decode and verify, the draft's chain step and its catch-up
    writes only static inputs (the pools, the chains), so CUDA graphs can capture it; a
    release and a weight load (the storages freed and re-allocated) cost no recompile, and
    graphs compiled after them (a ``k`` not run before) are as clean."""
    audit = GraphAudit()
    monkeypatch.setattr(torch, "compile", audit)
    engine = RolloutEngine.from_models(*models, device="cpu", max_batch_size=4, max_seq_len=24, max_draft_tokens=2,
                                       block_size=4, paged=paged, compile=True)
    _generate(engine, k=2)
    _generate(engine, k=0)  # a plain decode step
    assert {name for name, _ in audit.graphs} == {"Transformer.forward_cached", "Draft.chain_step", "Draft.extend"}
    assert audit.skipped() == []
    compiled = len(audit.graphs)

    engine.release()
    engine.load_weights(models[0].state_dict(), models[1].state_dict())
    _generate(engine, k=2)
    _generate(engine, k=0)
    assert len(audit.graphs) == compiled, "a release and a weight load recompiled a step"
    _generate(engine, k=1)  # new verify and catch-up graphs, traced after the restore
    assert len(audit.graphs) > compiled
    assert audit.skipped() == []


def test_a_step_run_without_cuda_graphs_warns_once_naming_itself(monkeypatch):
    """What a GPU run shows when inductor skips CUDA graphs: one warning naming the step and
    giving inductor's reason, kept in ``skipped``."""
    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: fn)
    step = _CompiledStep(lambda: log_cudagraph_skip_and_bump_counter(SKIP), "draft.chain_step", graphs=2,
                         cuda_graphs=True)
    with pytest.warns(UserWarning, match=r"draft\.chain_step .*due to mutated inputs") as warned:
        step()
        step()
    assert len(warned) == 1
    assert step.skipped == SKIP


def test_the_engine_reports_whether_its_steps_run_as_cuda_graphs(models, monkeypatch):
    """``cuda_graphs_captured``: None off CUDA; True when no step was skipped; False, with the
    step and its reason in ``cuda_graph_skips``, once one was. (The steps are told they run
    on CUDA, and one is made to skip as inductor does.)"""
    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: fn)
    engine = RolloutEngine.from_models(*models, device="cpu", max_batch_size=4, max_seq_len=24, max_draft_tokens=2,
                                       block_size=4, compile=True)
    _generate(engine, k=2)
    assert engine.cuda_graphs_captured is None and engine.cuda_graph_skips == {}
    for step in engine.compiled_steps:
        step.cuda_graphs = True
    _generate(engine, k=2)
    assert engine.cuda_graphs_captured is True
    extend = next(step for step in engine.compiled_steps if step.name == "draft.extend")
    run = extend.compiled

    def skipping(*args, **kwargs):
        log_cudagraph_skip_and_bump_counter(SKIP)
        return run(*args, **kwargs)

    extend.compiled = skipping
    with pytest.warns(UserWarning, match=r"draft\.extend"):
        _generate(engine, k=2)
    assert engine.cuda_graphs_captured is False
    assert engine.cuda_graph_skips == {"draft.extend": SKIP}
