"""Pipeline-parallel co-training on CPU: what TapChannel costs, against what it must cost.

Four ways to run the same pipeline step (one policy, one batch, one schedule), per PP degree
and schedule:

* ``tapchannel``: the project's design (``titan_cotrain.parallel.pipeline``): the draft on the
  last stage, the taps (three decoder-layer outputs and the embedding output) sent per
  microbatch over the TapChannel's own process group;
* ``no_transport``: the same pipeline and the same draft step, but the consumer reads
  locally made taps of the same shapes and nothing is sent: the draft's compute without
  the transport. ``tapchannel / no_transport`` is the transport's overhead (goal <= 1.05);
* ``draft_off``: the pipeline without the draft (the policy's step alone);
* ``naive``: the prior alternative: the taps ride in the pipeline's own activations, every
  stage receiving the taps of all the stages before it and passing them on with its own.

Model and batch: a Llama-shaped policy (``MODEL``: 8 layers, H = 128, V = 1024, taps at
layers 1, 3, 4), a D = 3 draft, one packed batch of ``MICROBATCHES`` rows of ``SEQ`` tokens
(documents of random lengths, an RL-like loss region, GRPO's PPO loss), one row per
microbatch; fp32; the stage split is torchtitan's default. Every PP rank is a gloo process
with one intra-op thread.

Time (``step_seconds``): ranks start each step together (a barrier) and the step ends on
every rank with the pipeline's metrics broadcast, so a step's time is the slowest rank's.
Modes take turns step by step, in a rotating order (one warm-up round, then ``--steps``
rounds), and the record keeps the median, so a change in the machine's load hits all four
alike. ``--repeats N`` repeats the whole run (fresh processes, fresh pipelines) N times;
the ``tapchannel / no_transport`` ratio in ``checks`` is the median of the per-round ratios
(the two modes ran back to back in each round) over all rounds of all repeats, with their
quartiles, min/max and each repeat's own median as the spread. On a shared machine wall time still moves by tens of percent from round to round,
more than the transport costs; ``cpu_seconds`` (median over rounds of the CPU time all
ranks' processes used in the step, gloo's threads included) measures the work added and is
far steadier under contention. ``config.load_average_1min`` records the machine's load at
the start and the end of the run.

Memory (``peak_bytes``, ``peak_bytes_per_rank``): the peak, over the first step of a fresh
pipeline, of the bytes the CPU allocator holds beyond what it held when the step began,
from the profiler's allocation events (torch keeps no CPU allocator statistics; see
``peak_allocated_bytes``). Parameters are not in it; everything a step needs is: gradients,
activations, the schedule's per-microbatch receive buffers and the TapChannel's landing slots
(both allocated on the first step), the draft's activations. ``peak_bytes`` is the largest
rank's.

Correctness first: on that first step, every mode is checked against the single-device
``forward_backward`` on the whole batch within 1e-5: ``tapchannel`` and ``naive`` on every
metric and every policy and draft gradient, ``draft_off`` and ``no_transport`` on the policy's
(the draft does not touch them). Each rank also logs the stage actions the schedule runs
(forward, backward, weight per stage and microbatch) and checks that the order is the same in
all four modes: TapChannel leaves the schedule alone. Any failure exits 1 before anything is
written.

    PYTHONPATH=. .venv/bin/python scripts/bench_pp.py            # 3 repeats x 5 rounds: ~7 min on 2 busy cores
    PYTHONPATH=. .venv/bin/python scripts/bench_pp.py --replot   # redraw the PNG from the JSON
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from titan_cotrain.cotrain.step import forward_backward
from titan_cotrain.data.batch import PackedBatch
from titan_cotrain.models.args import ModelArgs
from titan_cotrain.models.draft import Draft, DraftArgs
from titan_cotrain.models.transformer import Transformer
from titan_cotrain.parallel.pipeline import (
    CotrainLoss,
    LocalPolicy,
    MicrobatchIndexedStage,
    Pipeline,
    PipelineSettings,
    TransformerStage,
    build_schedule,
    make_pipeline,
    pipeline_step,
    plan_pipeline,
)
from titan_cotrain.parallel.tap_channel import TapChannel
from titan_cotrain.rl.grpo import ppo_loss

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
from benchtools import command_line, pyplot, save_figure  # noqa: E402

MODEL = ModelArgs(dim=128, n_layers=8, n_heads=8, n_kv_heads=4, head_dim=16, ffn_dim=256, vocab_size=1024)
SEQ, MICROBATCHES = 128, 8
STEP = dict(ttt_steps=3, pass_decay=0.8, draft_loss_weight=0.5)
SETTINGS = PipelineSettings(microbatch_size=1, n_microbatches=MICROBATCHES, seq_len=SEQ, **STEP)
POLICY_LOSS = ppo_loss(0.2, 0.2)
MODES = ("tapchannel", "no_transport", "draft_off", "naive")
TOL = dict(rtol=1e-5, atol=1e-6)
PROFILER_TORCH_VERSIONS = ("2.13",)


# ---- the four pipelines ---------------------------------------------------------------------

def models() -> tuple[Transformer, Draft]:
    policy = Transformer(MODEL)
    policy.init_weights(std=0.02, generator=torch.Generator().manual_seed(0))
    draft = Draft(DraftArgs.from_target(MODEL, n_taps=len(policy.tap_layers)))
    draft.init_weights(std=0.02, generator=torch.Generator().manual_seed(1))
    return policy, draft


def batch() -> PackedBatch:
    from tests.batches import synthetic_packed_batch

    g = torch.Generator().manual_seed(2)
    b = synthetic_packed_batch(MICROBATCHES, SEQ, MODEL.vocab_size, g)
    response = (torch.arange(SEQ) >= SEQ // 4).expand(MICROBATCHES, SEQ).clone()
    return PackedBatch(b.tokens, b.document_ids, response, advantages=torch.randn(MICROBATCHES, SEQ, generator=g),
                       old_logprobs=-7 - torch.rand(MICROBATCHES, SEQ, generator=g))


class LocalTaps:
    """``no_transport``'s stand-in for the TapChannel: producers send nothing, the consumer
    reads fixed taps made once on its own rank (same shapes and dtype)."""

    def __init__(self, channel: TapChannel) -> None:
        self.is_consumer = channel.is_consumer
        g = torch.Generator().manual_seed(3)
        self._taps = {s: torch.randn(channel.shape, generator=g, dtype=channel.dtype) for s in channel.sources}

    def begin_step(self, n_microbatches: int) -> None:
        pass

    def send(self, microbatch: int, source: int, tap: torch.Tensor) -> None:
        pass

    def receive(self, microbatch: int) -> dict[int, torch.Tensor]:
        return self._taps

    def release(self, microbatch: int) -> None:
        pass

    def finish_step(self) -> None:
        pass


class NaiveStage(TransformerStage):
    """``naive``: the taps ride in the activations. A stage takes the taps of the stages
    before it as extra inputs and returns them, with its own appended, beside the hidden
    stream; the last stage hands them all to a rank-local TapChannel for the loss."""

    def forward(self, x, *carried, microbatch, context):
        self._carried = list(carried)
        out = super().forward(x, microbatch=microbatch, context=context)
        if self.lm_head is None:
            return (out, *self._carried)
        for source, tap in zip(self.channel.sources, self._carried):  # produced in ascending source order
            self.channel.send(microbatch, source, tap)
        return out

    def _tap(self, context, microbatch, source, x, b, s):
        if source in self.tap_sources:
            self._carried.append(x.detach().view(b, s, -1))


def naive_pipeline(policy: Transformer, draft: Draft, mesh, plan) -> Pipeline:
    """``make_pipeline``'s construction with ``NaiveStage`` and the taps in each stage's I/O."""
    pp_rank, consumer, last = mesh.get_local_rank(), plan.stage_ranks[-1], plan.num_stages - 1
    owners = plan.tap_owners(policy.tap_layers)
    tap_shape = (1, SEQ, MODEL.dim)
    channel = TapChannel(pp_ranks=mesh.mesh.tolist(), pp_rank=pp_rank, consumer=consumer,
                         owners={s: consumer for s in owners}, shape=tap_shape, dtype=torch.float32, device="cpu")
    loss = CotrainLoss(draft if pp_rank == consumer else None, channel, policy.tap_layers,
                       ttt_steps=STEP["ttt_steps"], pass_decay=STEP["pass_decay"])

    def meta(shape, dtype=torch.float32, grad=False):
        return torch.empty(shape, dtype=dtype, device="meta", requires_grad=grad)

    def taps_before(stage: int) -> int:  # taps produced by stages < stage
        first_layer = plan.layer_ranges[stage].start if stage < plan.num_stages else MODEL.n_layers
        return sum(1 for s in owners if s < first_layer)

    hidden = meta((SEQ, MODEL.dim), grad=True)
    stages, parts = [], []
    for i in plan.stages_of(pp_rank):
        part = NaiveStage(policy, plan.layer_ranges[i], first=i == 0, last=i == last, draft=draft, channel=channel,
                          head=loss.head if i == last else None)
        inputs = (meta((1, SEQ), torch.int64),) if i == 0 else (hidden, *[meta(tap_shape)] * taps_before(i))
        outputs = (meta((), grad=True) if i == last
                   else (hidden, *[meta(tap_shape)] * taps_before(i + 1)))
        stages.append(MicrobatchIndexedStage(part, i, plan.num_stages, torch.device("cpu"), input_args=inputs,
                                             output_args=outputs, group=mesh.get_group()))
        parts.append(part)
    return Pipeline(schedule=build_schedule(plan.schedule, stages, MICROBATCHES, loss), stages=stages,
                    model_parts=parts, local_policy=LocalPolicy(parts), loss=loss, channel=channel, plan=plan,
                    pp_mesh=mesh, pp_group=mesh.get_group(), settings=SETTINGS, policy_loss_fn=POLICY_LOSS,
                    device=torch.device("cpu"))


def build(mode: str, schedule: str, mesh) -> Pipeline:
    policy, draft = models()
    plan = plan_pipeline(MODEL.n_layers, mesh.size(), schedule)
    if mode == "naive":
        return naive_pipeline(policy, draft, mesh, plan)
    pipe = make_pipeline(policy, None if mode == "draft_off" else draft, mesh, plan, SETTINGS,
                         policy_loss_fn=POLICY_LOSS)
    if mode == "no_transport":
        local = LocalTaps(pipe.channel)
        pipe.channel = pipe.loss.channel = local
        for part in pipe.model_parts:
            part.channel = local
    return pipe


# ---- measuring ------------------------------------------------------------------------------

def peak_allocated_bytes(fn):
    """``(peak bytes the CPU allocator held during fn() beyond its level at the start, fn())``.

    From the profiler's ``[memory]`` events (each an allocation or a free with its size),
    read from ``kineto_results``, which torch exposes without documenting it: checked
    against the torch versions this was written for."""
    from torch.profiler import ProfilerActivity, profile

    version = ".".join(torch.__version__.split(".")[:2])
    if version not in PROFILER_TORCH_VERSIONS:
        raise RuntimeError(f"peak_allocated_bytes reads the profiler's kineto_results as torch "
                           f"{PROFILER_TORCH_VERSIONS} has it; check it on torch {torch.__version__}")
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = fn()
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    live = peak = 0
    for e in events:
        live += e.nbytes()
        peak = max(peak, live)
    return peak, out


def log_actions(pipe: Pipeline) -> list[tuple]:
    """Record every stage action the schedule runs on this rank, in order."""
    log = []
    for stage in pipe.stages:
        for kind in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"):
            method = getattr(stage, kind)

            def logged(chunk, *args, _method=method, _kind=kind, _stage=stage.stage_index, **kwargs):
                log.append((_stage, _kind, chunk))
                return _method(chunk, *args, **kwargs)

            setattr(stage, kind, logged)
    return log


def zero_grads(pipe: Pipeline) -> None:
    for part in pipe.model_parts:
        part.zero_grad(set_to_none=True)


def check(mode: str, pipe: Pipeline, metrics, reference) -> None:
    """This rank's share of the comparison with the single-device step (see the docstring)."""
    ref_metrics, ref_grads = reference
    with_draft = mode in ("tapchannel", "naive")
    for key, value in ref_metrics.items():
        if with_draft or not (key.startswith("draft/") or key == "loss/draft"):
            torch.testing.assert_close(metrics[key], value, **TOL, msg=lambda m: f"{mode} {key}: {m}")
    for part in pipe.model_parts:
        for name, param in part.named_parameters():
            if name.startswith("draft.") and not with_draft:
                assert mode == "no_transport" and bool(param.grad.isfinite().all()), f"{mode} {name}"
                continue
            key = name if name.startswith("draft.") else f"policy.{name}"
            torch.testing.assert_close(param.grad, ref_grads[key], **TOL, msg=lambda m: f"{mode} {name}: {m}")


def run_rank(rank: int, world_size: int, out_dir: str, schedules: list[str], steps: int, reference) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("pp",))
    data = batch()
    results = []
    for schedule in schedules:
        pipes = {mode: build(mode, schedule, mesh) for mode in MODES}
        orders, peaks = {}, {}
        times, cpu_times = {mode: [] for mode in MODES}, {mode: [] for mode in MODES}
        for mode, pipe in pipes.items():
            orders[mode] = log_actions(pipe)
            dist.barrier()
            peaks[mode], metrics = peak_allocated_bytes(lambda: pipeline_step(pipe, data))  # noqa: B023
            check(mode, pipe, metrics, reference)
            zero_grads(pipe)
        for mode in MODES[1:]:
            assert orders[mode] == orders[MODES[0]], f"{schedule}: the schedule ran a different order in {mode}"
        for round_ in range(steps + 1):
            for mode in MODES[round_ % 4:] + MODES[:round_ % 4]:  # rotate: no mode always runs first
                pipe = pipes[mode]
                gc.collect()
                dist.barrier()
                wall, cpu = time.perf_counter(), time.process_time()
                pipeline_step(pipe, data)
                if round_:
                    times[mode].append(time.perf_counter() - wall)
                    cpu_times[mode].append(time.process_time() - cpu)
                zero_grads(pipe)
        results += [{"schedule": schedule, "mode": mode, "peak_bytes": peaks[mode], "step_seconds": times[mode],
                     "cpu_seconds": cpu_times[mode]} for mode in MODES]
        del pipes
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))


def reference_step():
    torch.set_num_threads(1)
    policy, draft = models()
    metrics = forward_backward(policy, draft, batch(), POLICY_LOSS, **STEP)
    grads = {f"policy.{n}": p.grad for n, p in policy.named_parameters()}
    grads |= {f"draft.{n}": p.grad for n, p in draft.named_parameters()}
    return metrics, grads


def merge(pp: int, runs: list[list[list[dict]]]) -> list[dict]:
    """One record per (schedule, mode) from ``runs[repeat][rank]``: per round the slowest rank's
    wall time and all ranks' CPU time, the rounds of all repeats in order, and their medians."""
    records = []
    for i, first in enumerate(runs[0][0]):
        step_max, cpu_sum, peaks = [], [], []
        for per_rank in runs:
            ranks = [r[i] for r in per_rank]
            step_max += [max(ts) for ts in zip(*(r["step_seconds"] for r in ranks))]
            cpu_sum += [sum(ts) for ts in zip(*(r["cpu_seconds"] for r in ranks))]
            peaks.append([r["peak_bytes"] for r in ranks])
        # The peak is the first step's, one per repeat; the largest repeat's is kept.
        per_rank_peak = max(peaks, key=max)
        records.append({
            "pp": pp, "schedule": first["schedule"], "mode": first["mode"],
            "step_seconds": statistics.median(step_max),
            "peak_bytes": max(per_rank_peak),
            "peak_bytes_per_rank": per_rank_peak,
            "cpu_seconds": statistics.median(cpu_sum),
            "step_seconds_all": step_max,
            "cpu_seconds_all": cpu_sum,
            "rounds_per_repeat": len(step_max) // len(runs),
        })
    return records


def ratio_spread(ratios: list[float], per_repeat: int) -> dict:
    """Median, quartiles, min/max of per-round ratios, and each repeat's own median."""
    q1, _, q3 = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else (ratios[0],) * 3
    repeats = [statistics.median(ratios[i:i + per_repeat]) for i in range(0, len(ratios), per_repeat)]
    return {"median": statistics.median(ratios), "q1": q1, "q3": q3, "min": min(ratios), "max": max(ratios),
            "per_repeat_median": repeats, "rounds": len(ratios)}


def transport_ratios(records: list[dict]) -> dict:
    """tapchannel / no_transport per (pp, schedule), wall and CPU, round by round."""
    ratios = {"step_seconds": {}, "cpu_seconds": {}}
    by_key = {(r["pp"], r["schedule"], r["mode"]): r for r in records}
    for (pp, schedule, mode), r in by_key.items():
        if mode == "tapchannel":
            base = by_key[(pp, schedule, "no_transport")]
            for field, values in ratios.items():
                per_round = [t / n for t, n in zip(r[f"{field}_all"], base[f"{field}_all"])]
                values[f"pp={pp} {schedule}"] = ratio_spread(per_round, r["rounds_per_repeat"])
    return ratios


# ---- the plot -------------------------------------------------------------------------------

COLORS = dict(zip(MODES, ("tab:blue", "tab:green", "tab:grey", "tab:red")))


def plot(result: dict, path: Path) -> None:
    """Three bar panels (wall time, CPU time, peak memory), one group of four bars per (pp,
    schedule); the time bars carry the interquartile range over rounds."""
    plt = pyplot()
    records = result["records"]
    groups = sorted({(r["pp"], r["schedule"]) for r in records})
    by_key = {(r["pp"], r["schedule"], r["mode"]): r for r in records}
    panels = (("step_seconds", "step seconds, wall (median, slowest rank; bars: IQR over rounds)", 1),
              ("cpu_seconds", "step seconds, CPU (median, all ranks; bars: IQR over rounds)", 1),
              ("peak_bytes", "peak MiB above the step's start (largest rank)", 2**20))
    fig, axes = plt.subplots(len(panels), 1, figsize=(10, 10))
    width = 0.2
    for ax, (field, title, unit) in zip(axes, panels):
        for i, mode in enumerate(MODES):
            xs = [g + (i - 1.5) * width for g in range(len(groups))]
            values = [by_key[(pp, schedule, mode)][field] / unit for pp, schedule in groups]
            errors = None
            if field != "peak_bytes":
                quartiles = [statistics.quantiles(by_key[(pp, schedule, mode)][f"{field}_all"], n=4)
                             for pp, schedule in groups]
                errors = [[v - q[0] for v, q in zip(values, quartiles)], [q[2] - v for v, q in zip(values, quartiles)]]
            ax.bar(xs, values, width, yerr=errors, capsize=2, color=COLORS[mode], label=mode)
        ax.set_xticks(range(len(groups)), [f"pp = {pp}, {schedule}" for pp, schedule in groups])
        ax.set_title(title)
        ax.grid(alpha=0.3, axis="y")
    axes[0].legend(ncol=4, fontsize="small")
    ratios = result["checks"]["tapchannel_over_no_transport"]["step_seconds"]
    fig.suptitle("pipeline co-training on CPU; tapchannel / no_transport wall: " +
                 ", ".join(f"{k.split()[0]} {k.split()[1][:5]} {v['median']:.3f}" for k, v in ratios.items()),
                 fontsize="medium")
    save_figure(fig, path)


# ---- main ------------------------------------------------------------------------------------

def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pp", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--schedules", nargs="+", default=["1F1B", "Interleaved1F1B"])
    parser.add_argument("--steps", type=int, default=5, help="timed rounds per repeat (after one warm-up round)")
    parser.add_argument("--repeats", type=int, default=3, help="whole runs, each in fresh processes")
    parser.add_argument("--json", type=Path, default=ROOT / "assets" / "bench_pp.json")
    parser.add_argument("--png", type=Path, default=ROOT / "assets" / "bench_pp.png")
    parser.add_argument("--replot", action="store_true", help="only redraw --png from an existing --json")
    args = parser.parse_args()
    if args.replot:
        plot(json.loads(args.json.read_text()), args.png)
        return 0

    from tests.multiprocess import run_on_ranks

    started, load_start = time.perf_counter(), os.getloadavg()[0]
    reference = reference_step()
    records = []
    for pp in args.pp:
        runs = []
        for repeat in range(args.repeats):
            with tempfile.TemporaryDirectory() as out_dir:
                try:
                    run_on_ranks(run_rank, pp, out_dir, args.schedules, args.steps, reference)
                except AssertionError as e:
                    print(f"bench_pp: pp={pp} failed (a correctness check, or a rank crashed):\n{e}", file=sys.stderr)
                    return 1
                runs.append([json.loads(Path(out_dir, f"rank{r}.json").read_text()) for r in range(pp)])
            print(f"pp={pp} repeat {repeat + 1}/{args.repeats} done ({time.perf_counter() - started:.0f}s)", flush=True)
        records += merge(pp, runs)

    ratios = transport_ratios(records)
    for r in records:
        print(f"pp={r['pp']} {r['schedule']:16s} {r['mode']:13s} {r['step_seconds']:.3f}s wall  "
              f"{r['cpu_seconds']:.3f}s cpu  peak {r['peak_bytes'] / 2**20:6.1f} MiB  per rank "
              f"{[round(b / 2**20, 1) for b in r['peak_bytes_per_rank']]}")
    for key, wall in ratios["step_seconds"].items():
        cpu = ratios["cpu_seconds"][key]
        print(f"{key}: tapchannel / no_transport = {wall['median']:.3f} wall (IQR {wall['q1']:.3f}-{wall['q3']:.3f}), "
              f"{cpu['median']:.3f} cpu (IQR {cpu['q1']:.3f}-{cpu['q3']:.3f}) (goal <= 1.05)")
    out = {
        "description": __doc__.split("\n\n")[0].replace("\n", " "),
        "command": command_line(),
        "records": records,
        "checks": {"tapchannel_over_no_transport": ratios, "goal": 1.05,
                   "correct_vs_single_device": True, "schedule_action_order_unchanged": True},
        "config": {"model": {k: getattr(MODEL, k) for k in ("dim", "n_layers", "n_heads", "n_kv_heads", "head_dim",
                                                             "ffn_dim", "vocab_size")},
                   "seq_len": SEQ, "microbatches": MICROBATCHES, "microbatch_size": 1, **STEP,
                   "timed_rounds": args.steps, "repeats": args.repeats, "threads_per_rank": 1,
                   "device": "cpu (gloo)", "torch": torch.__version__, "seconds": round(time.perf_counter() - started, 1),
                   "cores": os.cpu_count(), "load_average_1min": [load_start, os.getloadavg()[0]]},
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(out, indent=1) + "\n")
    plot(out, args.png)
    print(f"wrote {args.json} and {args.png} ({time.perf_counter() - started:.0f}s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
