"""Rewards by import path: found and checked at start, called as ``function(record, prompt,
response)`` through the one scoring path the built-in tasks take too (their rewards and details
unchanged), in the rank's process or in worker processes whose hung or dead members are
replaced; failures stop the step naming the record, or are counted under
``reward_on_error = "zero"`` until too many; the metrics average a part over the calls that
returned it and sum the counts."""

import pickle
import random
import time

import pytest

from tests.rl import reward_fixtures
from tests.rl.reward_fixtures import PROMPT_END
from titan_cotrain.config import ConfigError, load_job_config
from titan_cotrain.data.prompts import PromptRecord, PromptSplits
from titan_cotrain.rl.batching import Sample
from titan_cotrain.rl.rewards import RewardError, RewardScorer, RewardSettings, load_reward
from titan_cotrain.rl.rollout_metrics import rollout_metrics
from titan_cotrain.rl.tasks import get_task

FIXTURES = "tests.rl.reward_fixtures"


def _custom(function: str, *records: dict):
    """The custom task over ``records`` (their ``question`` the prompt), scored by the fixture
    ``function``; its training problems are the records in order."""
    splits = PromptSplits([PromptRecord(r["question"], "", "", r) for r in records], [], "test")
    return get_task("custom", splits, reward=f"{FIXTURES}:{function}")


def test_a_reward_is_found_by_its_import_path_and_checked():
    assert load_reward(f"{FIXTURES}:length") is reward_fixtures.length
    for path, problem in [
        (FIXTURES, "expected 'package.module:function'"),
        ("no_such_package.rewards:score", r"cannot import no_such_package.rewards \(ModuleNotFoundError: .*\); "
                                          "is its folder on PYTHONPATH"),
        (f"{FIXTURES}:missing", "tests.rl.reward_fixtures has no 'missing'"),
        (f"{FIXTURES}:not_callable", "tests.rl.reward_fixtures.not_callable is not callable"),
        (f"{FIXTURES}:two_arguments", rf"{FIXTURES}.two_arguments cannot be called as function\(record, prompt, "
                                      r"response\): too many positional arguments"),
    ]:
        with pytest.raises(ValueError, match=f"task.reward = '{path}': {problem}"):
            load_reward(path)


def test_the_config_refuses_a_reward_it_cannot_use(tmp_path):
    data = tmp_path / "records.jsonl"
    data.write_text('{"question": "q"}\n')
    custom = ["--task.name", "custom", "--task.dataset_path", str(data), "--task.sft_steps", "0"]

    def problems(*args: str) -> str:
        with pytest.raises(ConfigError) as error:
            load_job_config(list(args), world_size=2)
        return str(error.value)

    assert load_job_config([*custom, "--task.reward", f"{FIXTURES}:graded"], world_size=2).task.name == "custom"
    assert f"task.reward = '{FIXTURES}:two_arguments': {FIXTURES}.two_arguments cannot be called" in problems(
        *custom, "--task.reward", f"{FIXTURES}:two_arguments")
    assert "task.reward: task 'custom' scores responses with your function" in problems(*custom)
    assert "task.reward = 'x:y' is read by task.name = 'custom' only" in problems("--task.reward", "x:y")
    assert "task.dataset_path: task 'custom' reads its prompts" in problems("--task.name", "custom",
                                                                           "--task.reward", f"{FIXTURES}:graded")
    ranges = problems(*custom, "--task.reward", f"{FIXTURES}:graded", "--task.reward_workers", "-1",
                      "--task.reward_timeout_s", "0", "--task.reward_max_error_fraction", "1.5",
                      "--task.sft_steps", "2")
    for problem in ("task.reward_workers must be >= 0", "task.reward_timeout_s must be > 0",
                    "task.reward_max_error_fraction must be in [0, 1], got 1.5",
                    "task.sft_steps = 2: the custom task's warm start trains on the records' solutions"):
        assert problem in ranges


def test_a_reward_returns_a_float_or_a_dict_of_parts_and_reads_the_whole_record():
    task = _custom("length", {"question": "q"})
    problem = task.train[0]
    assert RewardScorer(task)([problem, problem], ["q", "q"], ["ab", ""]) == ([2.0, 0.0], [{}, {}])
    task = _custom("graded", {"question": "q", "behaviour": "ok", "bonus": 0.5, "id": 7})
    rewards, details = RewardScorer(task)(task.train * 2, ["<bos>user: q\n" + PROMPT_END, "q"], ["abc", ""])
    assert rewards == [0.5 + 0.01 * 3, 0.5]
    assert details == [{"bonus": 0.5, "templated": 1.0}, {"bonus": 0.5, "templated": 0.0}]


@pytest.mark.parametrize("name", ["arithmetic", "sort", "gsm8k"])
def test_a_built_in_task_scores_its_reward_with_its_details_as_the_parts(name):
    prompts = PromptSplits([PromptRecord(f"q{i}", str(i)) for i in range(4)], [], "test")
    task = get_task(name, prompts, format_reward=0.25)
    rng = random.Random(0)
    problems = [task.sample(rng) for _ in range(6)]
    responses = [task.demonstration(p, rng) for p in problems[:3]] + ["#### 1", "1,2#", "3+1=4;#4"]
    rewards, details = RewardScorer(task)(problems, [str(p.prompt) for p in problems], responses)
    # Bit for bit what the task's own reward and details say.
    assert rewards == [task.reward(p, r) for p, r in zip(problems, responses)]
    assert details == [task.details(p, r) for p, r in zip(problems, responses)]


def test_a_failing_reward_stops_the_step_naming_the_record_and_the_traceback():
    task = _custom("fails_on_x", {"question": "q", "id": "record-7"})
    problem = task.train[0]
    with pytest.raises(RewardError) as error:
        RewardScorer(task)([problem, problem], ["the prompt"] * 2, ["ok", "x"])
    message = str(error.value)
    assert message.startswith("task 'custom': the reward of record {'question': 'q', 'id': 'record-7'}, prompt "
                              "'the prompt', response 'x' failed: KeyError('boom')\nTraceback")
    assert 'raise KeyError("boom")' in message  # the user's line
    for function, returned in [("not_finite", "returned margin = nan, not a finite number"),
                               ("without_reward", r"returned a dict without 'reward' \(its keys: \['score'\]\)"),
                               ("a_string", "returned reward = '1.0', not a number")]:
        task = _custom(function, {"question": "q"})
        with pytest.raises(RewardError, match=f"response 'a' {returned}"):
            RewardScorer(task)(task.train, ["q"], ["a"])

    class Broken:  # a task whose problems, like the synthetic tasks', have no record: the prompt is named
        name = "broken"

        def score(self, problem, prompt, response):
            raise KeyError("boom")

    problem = get_task("sort").sample(random.Random(0))
    with pytest.raises(RewardError, match=r"task 'broken': the reward of prompt 'sort:.*', response 'x' failed"):
        RewardScorer(Broken())([problem], [problem.prompt], ["x"])


def test_under_on_error_zero_a_failure_scores_zero_and_counts_until_too_many_fail():
    task = _custom("fails_on_x", {"question": "q"})
    scorer = RewardScorer(task, RewardSettings(on_error="zero", max_error_fraction=0.5))
    rewards, details = scorer(task.train * 4, ["q"] * 4, ["a", "x", "b", "x"])  # 2 of 4: not more than half
    assert rewards == [1.0, 0.0, 1.0, 0.0]
    assert details == [{"reward_errors": 0.0}, {"reward_errors": 1.0}, {"reward_errors": 0.0}, {"reward_errors": 1.0}]
    with pytest.raises(RewardError, match=r"task 'custom': 3 of this rank's 4 reward calls of the step failed, more "
                                          r"than task.reward_max_error_fraction = 0.5; the first:\n.*response 'x' "
                                          r"failed: KeyError\('boom'\)"):
        scorer(task.train * 4, ["q"] * 4, ["x", "x", "b", "x"])


def test_workers_count_timeouts_as_zero_and_replace_the_hung_ones():
    task = _custom("sleeps", {"question": "q", "sleep_s": 0.0}, {"question": "q", "sleep_s": 600.0})
    fast, slow = task.train
    scorer = RewardScorer(task, RewardSettings(workers=2, timeout_s=2.0))
    scorer.start()
    try:
        t0 = time.monotonic()
        rewards, details = scorer([fast, slow, fast, slow, fast], ["q"] * 5, ["a"] * 5)
        assert time.monotonic() - t0 < 60  # the sleepers were cut at 2 s, not left for 600
        assert rewards == [1.0, 0.0, 1.0, 0.0, 1.0]
        assert [d["reward_timeouts"] for d in details] == [0.0, 1.0, 0.0, 1.0, 0.0]
        assert all(d.keys() == {"reward_timeouts"} for d in details)  # "raise": no error count to keep
        # The hung workers were killed and replaced: the next step has its two workers.
        assert scorer([fast] * 3, ["q"] * 3, ["a"] * 3)[0] == [1.0] * 3
        processes = [w.process for w in scorer.pool.workers]
        assert len(processes) == 2 and all(p.is_alive() for p in processes)
    finally:
        scorer.close()
    assert not any(p.is_alive() for p in processes)


def test_in_workers_a_dead_worker_is_an_error_and_a_raise_brings_its_traceback():
    task = _custom("dies_on_x", {"question": "q"})
    scorer = RewardScorer(task, RewardSettings(workers=1, on_error="zero", max_error_fraction=1.0))
    try:
        rewards, details = scorer(task.train * 3, ["q"] * 3, ["a", "x", "b"])
    finally:
        scorer.close()
    assert rewards == [1.0, 0.0, 1.0]
    assert details[1] == {"reward_errors": 1.0, "reward_timeouts": 0.0}
    task = _custom("fails_on_x", {"question": "q", "id": 3})
    scorer = RewardScorer(task, RewardSettings(workers=1))
    try:
        with pytest.raises(RewardError) as error:
            scorer(task.train * 2, ["q"] * 2, ["a", "x"])
    finally:
        scorer.close()
    assert "record {'question': 'q', 'id': 3}" in str(error.value)
    assert "KeyError('boom')\nTraceback" in str(error.value) and 'raise KeyError("boom")' in str(error.value)


def test_a_dataset_task_scores_in_workers_as_in_the_rank_without_its_problems():
    task = get_task("math", PromptSplits([PromptRecord("q", "\\frac{1}{2}")] * 3, [], "test"), format_reward=0.25)
    assert pickle.loads(pickle.dumps(task)).train == []  # what a worker receives: the problems stay
    problems, responses = task.train, ["\\boxed{0.5}", "the answer is 1/2", "no idea"]
    in_rank = RewardScorer(task)(problems, ["q"] * 3, responses)
    scorer = RewardScorer(task, RewardSettings(workers=1))
    try:
        rewards, details = scorer(problems, ["q"] * 3, responses)
    finally:
        scorer.close()
    assert rewards == in_rank[0] == [1.25, 1.0, 0.0]
    assert [{k: v for k, v in d.items() if k != "reward_timeouts"} for d in details] == in_rank[1]


def test_task_metrics_average_a_part_over_the_calls_that_returned_it_and_sum_the_counts():
    samples = [Sample([1], [2, 3], [0.0, 0.0], reward) for reward in (1.0, 0.0, 0.5, 0.0)]
    details = [{"bonus": 1.0, "reward_timeouts": 0.0}, {"reward_timeouts": 1.0},
               {"bonus": 0.5, "extra": 2.0, "reward_timeouts": 0.0}, {"reward_timeouts": 1.0}]
    metrics = rollout_metrics(lambda values, op=None: values, samples, details, None, 3, buckets=2, counted=True)
    assert metrics["reward/mean"] == 0.375
    assert (metrics["task/bonus"], metrics["task/extra"], metrics["task/reward_timeouts"]) == (0.75, 2.0, 2.0)


def test_a_rounds_draft_and_verify_seconds_are_summed_over_engines_and_divided_by_the_rounds_the_draft_followed():
    """``time/draft_per_round_s``: two engines' draft seconds over their rounds at any k (plain
    rounds, mode 0, left out: the draft did not run there)."""
    from titan_cotrain.engine.round_stats import RolloutStats, RoundTable

    samples = [Sample([1], [2, 3], [0.0, 0.0], 1.0)]
    per_rank = []
    for rank, (plain, drafted, draft_s, verify_s) in enumerate(((5, 3, 0.6, 1.2), (0, 5, 1.0, 2.0))):
        table = RoundTable.empty(2, 3)
        table.rounds[0, 0], table.rounds[1, 1], table.rounds[1, 4] = plain, 1, drafted - 1
        per_rank.append(RolloutStats(new_tokens=8, target_forwards=plain + drafted, acceptance_length=2.0,
                                     acceptance_rate=[], prefill_s=0.0, draft_s=draft_s, verify_s=verify_s,
                                     total_s=4.0, rounds=table))

    captured = []  # rank 1's list, as the all-reduce would receive it
    rollout_metrics(lambda values, op=None: captured.append(values) or values, samples, [{}], per_rank[1], 3,
                    buckets=2, counted=True)

    def summed(values, op=None):  # the sum of the two ranks' lists (the max of the longest response)
        return values if op is not None else [a + b for a, b in zip(values, captured[0], strict=True)]

    metrics = rollout_metrics(summed, samples, [{}], per_rank[0], 3, buckets=2, counted=True)
    assert metrics["time/draft_per_round_s"] == pytest.approx((0.6 + 1.0) / (3 + 5))
    assert metrics["time/verify_per_round_s"] == pytest.approx((1.2 + 2.0) / (3 + 5))
    alone = rollout_metrics(lambda values, op=None: values, samples, [{}], None, 3, buckets=2, counted=True)
    assert "time/draft_per_round_s" not in alone  # no round the draft followed
