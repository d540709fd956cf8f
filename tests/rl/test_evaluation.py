"""Evaluation during training (``[eval]``) and after it (``python -m titan_cotrain.eval``):
when it is due, what it refuses, and end to end on 2 processes, where its results must equal
the one-process evaluation command's on the same checkpoint and prompts."""

import json
import shutil
from pathlib import Path

import pytest

from tests.test_eval import _chat_tokenizer, _dataset
from tests.test_train import REPO, SHORT, _metrics, _run
from titan_cotrain.config import ConfigError, load_job_config
from titan_cotrain.rl.evaluation import EvalSettings, eval_metrics

CONFIG = ("--job.config_file", str(REPO / "train_configs" / "debug_cpu.toml"))


def _settings(*flags: str) -> EvalSettings:
    return EvalSettings.from_config(load_job_config([*CONFIG, *flags], world_size=1))


def test_an_evaluation_is_due_before_rl_every_interval_and_never_during_the_warm_start():
    settings = _settings("--task.sft_steps", "3", "--eval.interval", "2")
    assert [s for s in range(12) if settings.due(s)] == [3, 5, 7, 9, 11]
    assert [s for s in range(12) if _settings("--task.sft_steps", "3").due(s)] == [3]  # interval 0: before RL only


def test_the_evaluation_defaults_to_the_rollouts_sampling_and_the_group_size():
    s = _settings("--rl.group_size", "4", "--rollout.temperature", "0.6", "--rollout.top_k", "5")
    assert (s.samples, s.pass_k, s.temperature, s.top_k, s.top_p) == (4, (1, 4), 0.6, 5, 1.0)
    s = _settings("--eval.samples", "6", "--eval.temperature", "0", "--eval.top_k", "0", "--eval.pass_k", "2", "3")
    assert (s.samples, s.pass_k, s.temperature, s.top_k) == (6, (2, 3), 0.0, 0)


@pytest.mark.parametrize("flags, message", [
    (("--eval.enable",), "eval.enable with the synthetic task 'arithmetic': set eval.prompts"),
    (("--eval.enable", "--task.name", "gsm8k", "--task.dataset_path", "tests/conftest.py"),
     "set task.eval_size or task.eval_fraction"),
    (("--eval.pass_k", "1", "9"), "eval.pass_k = [1, 9]: every k must lie in 1..8"),
    (("--eval.max_new_tokens", "65"), "eval.max_new_tokens must be in [0, rollout.max_new_tokens = 64]"),
    (("--eval.task", "math"), "describe eval.path's records: set eval.path"),
    (("--eval.path", "tests/conftest.py"), "is scored by task 'arithmetic', which reads no records"),
    (("--eval.path", "no/such.jsonl", "--eval.task", "gsm8k"), "eval.path = 'no/such.jsonl': no such file"),
])
def test_bad_eval_settings_are_refused_with_the_key(flags, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]").replace(".", r"\.")):
        load_job_config([*CONFIG, *flags], world_size=1)


def test_the_eval_metrics_are_the_results_scalars():
    result = {"prompts": 3, "reward_mean": 0.5, "response_len": 7.0, "truncated_share": 0.0, "acceptance_length": 2.5,
              "tokens_per_s": 10.0, "time_s": 1.0, "accuracy": 0.25, "pass_at_k": {"1": 0.25, "4": 0.5},
              "acceptance_rate": [0.9, float("nan")], "parts": ["correct", "format"], "correct": 0.25, "format": 1.0}
    assert eval_metrics(result) == {
        "eval/prompts": 3, "eval/reward_mean": 0.5, "eval/response_len": 7.0, "eval/truncated_share": 0.0,
        "eval/acceptance_length": 2.5, "eval/tokens_per_s": 10.0, "eval/time_s": 1.0, "eval/accuracy": 0.25,
        "eval/pass@1": 0.25, "eval/pass@4": 0.5, "eval/acceptance_rate_1": 0.9, "eval/format": 1.0}


def _responses(path: Path) -> list[tuple]:
    return [(r["prompt"], r["sample"], r["response"], r["correct"])
            for r in map(json.loads, Path(path).read_text().splitlines())]


@pytest.mark.slow
def test_a_two_process_job_evaluates_every_two_rl_steps_as_the_evaluation_command_does(tmp_path):
    tokenizer = _chat_tokenizer(tmp_path / "tokenizer")
    prompts = _dataset(tmp_path / "eval.jsonl")  # a file of its own, scored by the math task
    train_file = _dataset(tmp_path / "train.jsonl")
    dump = tmp_path / "job"
    job = (*SHORT, "--training.steps", "4", "--task.name", "math", "--task.dataset_path", str(train_file),
           "--task.solution_field", "solution", "--model.hf_assets_path", str(tokenizer),
           "--job.dump_folder", str(dump), "--checkpoint.interval", "6")
    evaluation = ("--eval.path", str(prompts), "--eval.task", "math", "--eval.samples", "2", "--eval.pass_k", "1", "2",
                  "--eval.temperature", "0")  # greedy: the responses cannot depend on the ranks' random streams
    train = _run(*job, "--eval.enable", "--eval.interval", "2", *evaluation)
    assert train.returncode == 0, train.stdout[-3000:] + train.stderr[-3000:]

    # Before RL (after the 2 warm-start steps), after RL steps 2 and 4 (the last: at the end).
    evals = [m for m in _metrics(dump) if m["phase"] == "eval"]
    assert [m["step"] for m in evals] == [2, 4, 6]
    for m in evals:
        assert {"eval/accuracy", "eval/pass@1", "eval/pass@2", "eval/acceptance_length", "eval/format"} <= m.keys()
        assert m["eval/prompts"] == 12  # 13 records, one longer than the prompt budget
        assert 0 <= m["eval/accuracy"] <= m["eval/pass@2"] <= 1 and 1 <= m["eval/acceptance_length"] <= 4
    assert [m["step"] for m in _metrics(dump) if m["phase"] != "eval"] == [1, 2, 3, 4, 5, 6]
    during = json.loads((dump / "eval" / "eval_step6.json").read_text())
    assert (during["step"], during["task"], during["source"]) == (6, "math", str(prompts))
    shutil.copytree(dump / "eval", tmp_path / "during")

    # The command, on 1 process, on 2 data-parallel ranks, on 2 CP peers and on 2 pipeline stages
    # (the peers share out their prompts), on the last checkpoint: the weights the job's last
    # evaluation had.
    results = {}
    for name, nproc, layout in (("one", None, ()), ("fsdp2", 2, ()),
                                ("cp2", 2, ("--parallelism.context_parallel_degree", "2")),
                                ("pp2", 2, ("--parallelism.pipeline_parallel_degree", "2"))):
        command = _run(*job, *layout, "--path", str(prompts), "--eval.task", "math", "--samples", "2", "--pass_k", "1",
                       "2", "--eval.temperature", "0", nproc=nproc, module="titan_cotrain.eval")
        assert command.returncode == 0, command.stdout[-3000:] + command.stderr[-3000:]
        results[name] = json.loads((dump / "eval" / "eval_step6.json").read_text())
        results[name]["responses"] = _responses(results[name]["responses"])
    one = results["one"]
    for key in ("step", "prompts", "samples_per_prompt", "accuracy", "pass_at_k", "reward_mean", "format",
                "response_len"):
        for other in (results["fsdp2"], results["cp2"], results["pp2"], during):
            assert other[key] == pytest.approx(one[key]), key
    assert all(results[name]["responses"] == one["responses"] for name in ("fsdp2", "cp2", "pp2"))
    assert one["responses"] == _responses(tmp_path / "during" / "eval_step6.responses.jsonl")
    assert len(one["responses"]) == 12 * 2
    correct = sum(c for *_, c in one["responses"])
    assert one["accuracy"] == pytest.approx(correct / 24)
