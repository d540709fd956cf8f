"""A checkpoint taken at one layout resumes at another: the embedded job (``debug_cpu.toml``,
tiny steps, greedy rollouts so the samples do not depend on the ranks' random streams)
checkpointed at FSDP 2 resumes at 1 process and at CP 2, and one checkpointed at PP 2 resumes
at FSDP 2. Each time the state it loads is the state saved (weights, both optimizers, the LR
schedules, the trainer's step and prompt-stream position, the speculation tuner: gathered,
bitwise), and its first step trains on the uninterrupted run's prompts to the same reward and
draft loss within fp32 tolerance. A checkpoint written before the prompt position and the
tuner were saved still loads. Synthetic tasks draw each problem by its global position, so a
step's prompts are the same at any data-parallel degree.

Every job runs in the test's own processes (``tests.multiprocess``), so a resumed job's state
can be read right after it loads; each job runs once per module."""

import json
import pickle
import shutil
from pathlib import Path

import pytest
import torch

from tests.multiprocess import run_on_ranks

REPO = Path(__file__).resolve().parents[1]
SFT_STEPS, SFT_BATCH_SIZE = 2, 4
# Two warm-start steps of 4 demonstrations per data-parallel rank, two RL steps; checkpoints
# after steps 3 and 4. The resumes start from step 3's (an RL step), so the first resumed step
# is RL step 2 (job step 4).
ARGS = ("--task.sft_steps", str(SFT_STEPS), "--training.steps", "2", "--task.sft_batch_size", str(SFT_BATCH_SIZE),
        "--rl.prompts_per_step", "2", "--rl.group_size", "2", "--rollout.max_new_tokens", "12",
        "--training.seq_len", "64", "--checkpoint.interval", "3", "--checkpoint.keep_latest_k", "0",
        "--lr_scheduler.warmup_steps", "1", "--task.sft_warmup_steps", "1", "--metrics.no-enable_tensorboard",
        "--rollout.temperature", "0")
FSDP2 = ("--parallelism.data_parallel_shard_degree", "2")
CP2 = ("--parallelism.data_parallel_shard_degree", "1", "--parallelism.context_parallel_degree", "2")
PP2 = ("--parallelism.data_parallel_shard_degree", "1", "--parallelism.pipeline_parallel_degree", "2")
RESUMED_FROM = 3
# Within fp32 tolerance: another layout reduces in another order.
COMPARED = ("reward/mean", "rollout/response_len", "loss/draft", "grad_norm/draft", "draft/acc_pass1",
            "loss/policy", "grad_norm/policy")
# Functions of the step count alone: equal.
SCHEDULES = ("lr/policy", "lr/draft")


def _job(rank: int, world_size: int, args: tuple[str, ...], folder: str, read_loaded: bool) -> None:
    """The job of ``args`` in ``folder``, recording every RL prompt this rank draws; with
    ``read_loaded``, the state it loads is first saved again (DCP, at this layout) to
    ``folder/loaded``. Writes ``folder/rank<r>.json``: the dp rank, the prompts by step, what
    was loaded and what the checkpointer announced."""
    import torch.distributed.checkpoint as dcp

    from titan_cotrain.config import load_job_config
    from titan_cotrain.rl.trainer import Trainer

    trainer = Trainer(load_job_config([*args, "--job.dump_folder", folder], world_size=world_size), world_size, rank)
    announced, drawn = [], []
    trainer.checkpointer.announce = announced.append
    drawing = trainer.rollouts.prompts

    def recording(step, round_=0):
        problems, prompts = drawing(step, round_)
        drawn.append((step, prompts))
        return problems, prompts

    trainer.rollouts.prompts = recording
    loaded = None
    if read_loaded:
        assert trainer.checkpointer.load()
        states = trainer.checkpointer.states
        state = {key: value for key, value in states.items() if key != "model" and value is not None}
        dcp.save({**state, **states["model"].state_dict()}, checkpoint_id=str(Path(folder) / "loaded"))
        loaded = {"step": trainer.state.step, "warm_start_positions": trainer.state.warm_start_positions}
    trainer.run()
    record = {"dp_rank": trainer.dp_rank, "prompts": drawn, "loaded": loaded, "announced": announced}
    (Path(folder) / f"rank{rank}.json").write_text(json.dumps(record))


def _run(folder: Path, layout: tuple[str, ...], nproc: int, checkpoint: Path | None = None) -> Path:
    """The job at ``layout`` on ``nproc`` ranks in ``folder``, resumed from ``checkpoint`` (a
    checkpoint folder, copied in) when given."""
    if checkpoint is not None:
        shutil.copytree(checkpoint, folder / "checkpoint" / checkpoint.name)
    run_on_ranks(_job, nproc, (*ARGS, *layout), str(folder), checkpoint is not None)
    return folder


def _records(folder: Path) -> list[dict]:
    return [json.loads(path.read_text()) for path in sorted(folder.glob("rank*.json"))]


def _metrics(folder: Path) -> dict[int, dict]:
    return {m["step"]: m for m in map(json.loads, (folder / "metrics.jsonl").read_text().splitlines())}


def _prompts(folder: Path, step: int) -> list[list[int]]:
    """The job's prompts of ``step`` in stream order: each data-parallel rank's part (one rank
    of its CP or PP peers), in dp-rank order."""
    parts = {}
    for record in _records(folder):
        parts.setdefault(record["dp_rank"], [p for s, prompts in record["prompts"] if s == step for p in prompts])
    return [p for dp_rank in sorted(parts) for p in parts[dp_rank]]


def _gathered(checkpoint: Path, tmp: Path) -> dict:
    """Every value of a DCP checkpoint, whole, under its flattened key."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(checkpoint, tmp / "whole.pt")
    flat = {}

    def walk(prefix: str, value) -> None:
        if isinstance(value, dict):
            for key, inner in value.items():
                walk(f"{prefix}{key}.", inner)
        else:
            flat[prefix[:-1]] = value

    walk("", torch.load(tmp / "whole.pt", weights_only=False))
    flat.pop("dataloader", None)  # torchtitan's slot for a data loader: None here
    return flat


def _assert_loaded_what_was_saved(saved: Path, resumed: Path, tmp: Path) -> None:
    """The state the resumed job loaded, gathered, is the checkpoint's bit for bit."""
    (tmp / "saved").mkdir()
    (tmp / "loaded").mkdir()
    a, b = _gathered(saved, tmp / "saved"), _gathered(resumed / "loaded", tmp / "loaded")
    assert a.keys() == b.keys(), a.keys() ^ b.keys()
    for key in ("embed_tokens.weight", "draft.fc.weight", "optimizer.state.embed_tokens.weight.exp_avg",
                "draft_optimizer.state.fc.weight.exp_avg_sq", "lr_scheduler.last_epoch",
                "draft_lr_scheduler.last_epoch", "trainer.warm_start_positions", "speculation.round_s"):
        assert key in a, key
    for key, value in a.items():
        if isinstance(value, torch.Tensor):
            assert value.dtype == b[key].dtype and value.shape == b[key].shape, key
            # Bitwise; the tuner's unmeasured entries are NaN in both.
            assert torch.equal(value.nan_to_num(), b[key].nan_to_num()) and torch.equal(value.isnan(), b[key].isnan()), key
        else:
            assert value == b[key], key


def _assert_continues(uninterrupted: Path, resumed: Path) -> None:
    """The resumed job loaded step 3 and the prompt stream's position (the warm start's
    demonstrations at the uninterrupted job's data-parallel degree), and its first step trained
    on the uninterrupted job's prompts, to its reward and draft loss."""
    dp = len({record["dp_rank"] for record in _records(uninterrupted)})
    for record in _records(resumed):
        assert record["loaded"] == {"step": RESUMED_FROM, "warm_start_positions": SFT_STEPS * dp * SFT_BATCH_SIZE}
    step = RESUMED_FROM + 1
    assert _prompts(resumed, step) == _prompts(uninterrupted, step) != []
    expected, got = _metrics(uninterrupted)[step], _metrics(resumed)
    assert list(got) == [step] and got[step]["phase"] == "rl"
    for key in SCHEDULES:
        assert got[step][key] == expected[key], key
    for key in COMPARED:
        assert abs(got[step][key] - expected[key]) <= 1e-4 * max(1.0, abs(expected[key])), (key, expected[key],
                                                                                            got[step][key])


@pytest.fixture(scope="module")
def jobs(tmp_path_factory, one_intra_op_thread):
    """Folders of the module's jobs, each run once, on first use."""
    root, done = tmp_path_factory.mktemp("resume_layout"), {}
    plans = {
        "fsdp2": lambda: _run(root / "fsdp2", FSDP2, 2),
        "one": lambda: _run(root / "one", (), 1, checkpoint=step("fsdp2")),
        "cp2": lambda: _run(root / "cp2", CP2, 2, checkpoint=step("fsdp2")),
        "pp2": lambda: _run(root / "pp2", PP2, 2),
        "pp2_to_fsdp2": lambda: _run(root / "pp2_to_fsdp2", FSDP2, 2, checkpoint=step("pp2")),
    }

    def step(name: str) -> Path:
        return get(name) / "checkpoint" / f"step-{RESUMED_FROM}"

    def get(name: str) -> Path:
        if name not in done:
            done[name] = plans[name]()
        return done[name]

    return get


@pytest.mark.slow
def test_an_fsdp_checkpoint_resumes_in_one_process(jobs, tmp_path):
    _assert_loaded_what_was_saved(jobs("fsdp2") / "checkpoint" / f"step-{RESUMED_FROM}", jobs("one"), tmp_path)
    _assert_continues(jobs("fsdp2"), jobs("one"))


@pytest.mark.slow
def test_an_fsdp_checkpoint_resumes_with_context_parallelism(jobs, tmp_path):
    _assert_loaded_what_was_saved(jobs("fsdp2") / "checkpoint" / f"step-{RESUMED_FROM}", jobs("cp2"), tmp_path)
    _assert_continues(jobs("fsdp2"), jobs("cp2"))


@pytest.mark.slow
def test_a_pipeline_checkpoint_resumes_with_fsdp(jobs, tmp_path):
    """DCP's keys are the whole model's names at every stage, so a PP checkpoint is an FSDP one."""
    _assert_loaded_what_was_saved(jobs("pp2") / "checkpoint" / f"step-{RESUMED_FROM}", jobs("pp2_to_fsdp2"),
                                  tmp_path)
    _assert_continues(jobs("pp2"), jobs("pp2_to_fsdp2"))


@pytest.mark.slow
def test_a_checkpoint_from_before_the_prompt_position_and_the_tuner_still_loads(jobs, tmp_path):
    """A checkpoint without ``trainer.warm_start_positions`` and the tuner's tables (its
    metadata stripped of them, as one written before they were saved) resumes at its own
    layout: the tuner starts fresh, the position follows from the step, both said; the resumed
    step repeats the uninterrupted one exactly."""
    from torch.distributed.checkpoint import FileSystemReader

    old = tmp_path / "old" / f"step-{RESUMED_FROM}"
    shutil.copytree(jobs("fsdp2") / "checkpoint" / f"step-{RESUMED_FROM}", old)
    metadata = FileSystemReader(str(old)).read_metadata()
    gone = [key for key in metadata.state_dict_metadata
            if key == "trainer.warm_start_positions" or key.startswith("speculation.")]
    assert len(gone) > 1
    for key in gone:
        del metadata.state_dict_metadata[key]
    metadata.storage_data = {index: data for index, data in metadata.storage_data.items() if index.fqn not in gone}
    (old / ".metadata").write_bytes(pickle.dumps(metadata))

    resumed = _run(tmp_path / "resumed", FSDP2, 2, checkpoint=old)
    _assert_continues(jobs("fsdp2"), resumed)
    said = sorted(set(_records(resumed)[0]["announced"]))  # the test's load and run()'s say the same
    assert len(said) == 2 and "no speculation round_s" in said[0] and "the speculation tuner starts fresh" in said[0]
    assert "no trainer warm_start_positions" in said[1] and "at this layout" in said[1]
    expected, got = _metrics(jobs("fsdp2"))[RESUMED_FROM + 1], _metrics(resumed)[RESUMED_FROM + 1]
    for key, value in expected.items():
        if not key.startswith(("time/", "memory/", "rollout/tokens_per_s", "rollout/tail_share", "rollout/live_le")):
            assert got[key] == value, key


def test_a_synthetic_task_draws_each_problem_by_its_position_at_any_data_parallel_degree():
    """The positions of a block are the same set at dp 1 and dp 2, each problem and its
    demonstration the same wherever it is drawn."""
    from titan_cotrain.components import titan
    from titan_cotrain.data.prompts import PromptEncoder
    from titan_cotrain.rl.problems import ProblemStream
    from titan_cotrain.rl.tasks import get_task

    tokenizer = titan.load_tokenizer(str(REPO / "assets" / "tokenizer"))
    task, encode = get_task("arithmetic"), PromptEncoder(tokenizer, None)

    def stream(dp_rank: int, dp_degree: int, seed: int = 0) -> ProblemStream:
        return ProblemStream(task, tokenizer, encode, seed, dp_rank, dp_degree, scorer=object())

    one, halves = stream(0, 1), [stream(r, 2) for r in range(2)]
    block = list(one.positions(40, 8))
    assert block == [p for s in halves for p in s.positions(40, 4)] == list(range(40, 48))
    for position in block:
        assert halves[position % 2].problem(position) == one.problem(position)
        assert halves[1].demonstration(position) == one.demonstration(position)
    assert len({one.problem(p).prompt for p in block}) > 4  # positions draw different problems
    assert [stream(0, 1, seed=1).problem(p) for p in block] != [one.problem(p) for p in block]


def test_the_speculation_tuner_round_trips_through_its_state():
    """What the tuner learnt comes back from its ``state_dict``: the same tables, the same
    choices; a state without its tables (a checkpoint from before) leaves a tuner fresh."""
    from titan_cotrain.engine.round_stats import RoundTable
    from titan_cotrain.engine.speculation import SpeculationTuner

    torch.manual_seed(0)
    tuner = SpeculationTuner(3)
    for follows in (True, False, True):
        table = RoundTable.empty(5, 3)
        for name in ("rounds", "seconds", "tokens", "live"):
            getattr(table, name).copy_(torch.randint(1, 9, (5, 5)).double())
        table.judged.copy_(torch.randint(4, 9, (5, 3)).double())
        table.accepted.copy_(table.judged * torch.rand(5, 3))
        if not follows:
            table.rounds[:, 1:] = 0
        tuner.observe(table, prefill_s=0.5, follows=follows)
    again = SpeculationTuner(3)
    again.load_state_dict(tuner.state_dict())
    for name in ("round_s", "live", "volume", "acceptance", "pooled", "prefill_s", "current", "current_call",
                 "follows", "calls"):
        assert getattr(again, name) == getattr(tuner, name), name
    assert [again.choose_round(n) for n in (1, 3, 9)] == [tuner.choose_round(n) for n in (1, 3, 9)]
    assert [again.start_call() for _ in range(9)] == [tuner.start_call() for _ in range(9)]

    fresh = SpeculationTuner(3)
    fresh.load_state_dict({})
    assert fresh.state_dict().keys() == tuner.state_dict().keys() and fresh.round_s == {} and fresh.calls == 0
