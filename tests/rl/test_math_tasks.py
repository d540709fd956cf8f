"""The math and GSM8K rewards on tricky answers, each with its exact reward (format bonus
0.25 for the task's form), their demonstrations, and a verifier that never stops training:
outside the main thread (no signal-based timeout) and when it raises."""

import random
import threading

import pytest

from titan_cotrain.data.prompts import PromptDatasetError, PromptRecord, PromptSplits
from titan_cotrain.rl.answers import final_answer, last_boxed
from titan_cotrain.rl.rewards import RewardScorer
from titan_cotrain.rl.tasks import get_task

BONUS = 0.25


def test_a_dataset_task_goes_through_its_training_split_in_epochs():
    records = [PromptRecord(f"q{i}", str(i)) for i in range(7)]
    task = get_task("gsm8k", PromptSplits(records, [], "test"), order_seed=3)
    rng = random.Random(0)
    drawn = [task.sample(rng, position).answer for position in range(21)]
    epochs = [drawn[i:i + 7] for i in (0, 7, 14)]
    for epoch in epochs:  # each problem once per epoch
        assert sorted(epoch, key=int) == [str(i) for i in range(7)], epoch
    assert epochs[0] != epochs[1] != epochs[2]  # a fresh order every epoch
    again = get_task("gsm8k", PromptSplits(records, [], "test"), order_seed=3)
    assert [again.sample(rng, position).answer for position in (20, 3, 9)] == [drawn[20], drawn[3], drawn[9]]
    other = get_task("gsm8k", PromptSplits(records, [], "test"), order_seed=4)
    assert [other.sample(rng, position).answer for position in range(7)] != epochs[0]
    with pytest.raises(ValueError, match="position"):
        task.sample(rng, -1)


def test_the_ranks_take_consecutive_parts_of_each_steps_slice_of_the_stream():
    from types import SimpleNamespace

    from titan_cotrain.rl.problems import ProblemStream

    positions = [p for start in (0, 8, 16) for rank in range(2)
                 for p in ProblemStream.positions(SimpleNamespace(dp_degree=2, dp_rank=rank), start, 4)]
    assert positions == list(range(24))


def _task(name: str, answer: str, solution: str = ""):
    task = get_task(name, PromptSplits([PromptRecord("q", answer, solution)], [], "test"), format_reward=BONUS)
    return task, task.train[0]


@pytest.mark.parametrize("gold, response, reward", [
    ("\\frac{1}{2}", "so \\boxed{0.5}", 1 + BONUS),
    ("0.5", "we get \\boxed{\\dfrac{1}{2}}.", 1 + BONUS),
    ("\\frac{\\sqrt{3}}{2}", "\\boxed{\\frac{\\sqrt{3}}{2}}", 1 + BONUS),  # nested braces
    ("(1,2)", "The answer is $\\left(1, 2\\right)$.", 1.0),  # stated, not boxed: no bonus
    ("5", "\\boxed{5 \\text{ cm}}", 1 + BONUS),  # units
    ("5", "The answer is $5$ dollars. Done.", 1.0),
    ("3", "first \\boxed{2}, then corrected: \\boxed{3}", 1 + BONUS),  # the last box counts
    ("2", "first \\boxed{2}, then corrected: \\boxed{3}", BONUS),
    ("-7", "answer: -7", 1.0),  # negative numbers
    ("-7", "answer: 7", 0.0),
    ("1234", "\\boxed{1,234}", 1 + BONUS),
    ("\\frac{1}{2}", "\\boxed{\\frac{1}{3}}", BONUS),
    ("5", "it is 5", 0.0),  # no final answer
    ("5", "\\boxed{5", 0.0),  # truncated: the box never closes
])
def test_math_reward(gold, response, reward):
    task, problem = _task("math", gold)
    assert task.reward(problem, response) == pytest.approx(reward)


def test_math_details_and_a_reference_from_a_solution():
    # MATH's solution field as the answer field: the reference is its last box.
    task, problem = _task("math", "We add: $1 + \\frac{1}{4} = \\boxed{\\frac{5}{4}}$.")
    assert problem.answer == "\\frac{5}{4}"
    assert task.details(problem, "so \\boxed{1.25}") == {"answer_found": 1.0, "correct": 1.0, "format": 1.0}
    assert task.details(problem, "The answer is 1.25.") == {"answer_found": 1.0, "correct": 1.0, "format": 0.0}
    assert task.details(problem, "no idea") == {"answer_found": 0.0, "correct": 0.0, "format": 0.0}
    rewards, details = RewardScorer(task)([problem, problem], ["q", "q"], ["\\boxed{5/4}", "\\boxed{4/5}"])
    assert rewards == [1 + BONUS, BONUS] and [d["correct"] for d in details] == [1.0, 0.0]


@pytest.mark.parametrize("gold, response, reward", [
    ("She pays 1,000 + 234 = <<1000+234=1234>>1,234.\n#### 1,234", "so #### 1234", 1 + BONUS),
    ("#### 1,234", "The answer is 1,234.", 1.0),
    ("#### 1,234", "\\boxed{1234}", 1.0),  # right, not in GSM8K's form
    ("42", "#### $42", 1 + BONUS),  # a plain number as the reference; a dollar sign
    ("42", "#### 42.0", 1 + BONUS),
    ("42", "#### 42.5", BONUS),  # not an integer: wrong, but in the form
    ("-3", "#### -3", 1 + BONUS),
    ("13", "#### 12\nno wait\n#### 13", 1 + BONUS),  # the last one counts
    ("12", "#### 12\nno wait\n#### 13", BONUS),
    ("18", "The answer is 18 dollars.", 1.0),
    ("18", "I think 18", 0.0),
])
def test_gsm8k_reward(gold, response, reward):
    task, problem = _task("gsm8k", gold)
    assert task.reward(problem, response) == pytest.approx(reward)


def test_gsm8k_reference_must_be_an_integer():
    with pytest.raises(PromptDatasetError, match="'about 3.5' of 'q' is not an integer"):
        _task("gsm8k", "about 3.5")


def test_demonstrations_state_the_answer_in_the_tasks_form():
    rng = random.Random(0)
    task, problem = _task("math", "\\frac{1}{2}")
    assert task.demonstration(problem, rng) == "\\boxed{\\frac{1}{2}}"
    task, problem = _task("math", "\\frac{1}{2}", solution="half of one: \\boxed{\\frac12}")
    assert task.demonstration(problem, rng) == "half of one: \\boxed{\\frac12}"
    assert task.reward(problem, task.demonstration(problem, rng)) == 1 + BONUS
    task, problem = _task("gsm8k", "2 + 3 = 5\n#### 5")
    assert task.demonstration(problem, rng) == "2 + 3 = 5\n#### 5"
    task, problem = _task("gsm8k", "5")
    assert task.demonstration(problem, rng) == "#### 5" and task.reward(problem, "#### 5") == 1 + BONUS


def test_the_verifier_works_off_the_main_thread():
    task, problem = _task("math", "\\frac{2}{3}")  # not parsed before: no cached result
    out = []
    worker = threading.Thread(target=lambda: out.append(task.reward(problem, "\\boxed{\\dfrac{4}{6}}")))
    worker.start()
    worker.join()
    assert out == [1 + BONUS]


def test_a_failing_verifier_scores_zero(monkeypatch):
    import math_verify
    from math_verify.errors import TimeoutException

    task, problem = _task("math", "7")
    for error in (RuntimeError("sympy broke"), TimeoutException()):
        def fail(*args, error=error, **kwargs):
            raise error

        monkeypatch.setattr(math_verify, "verify", fail)
        assert task.details(problem, "\\boxed{7}") == {"answer_found": 1.0, "correct": 0.0, "format": 1.0}


def test_answer_extraction():
    assert last_boxed("\\boxed{a} and \\boxed{\\frac{1}{\\sqrt{2}}} end") == "\\frac{1}{\\sqrt{2}}"
    assert last_boxed("\\boxed{1} then \\boxed{2") == "1"  # an unclosed last box: the one before
    assert final_answer("The final answer is: 0.5. So") == ("0.5", "stated")
    assert final_answer("the answer is \\boxed{3}. The answer is 4") == ("3", "boxed")


def test_a_dataset_task_needs_its_prompts():
    with pytest.raises(ValueError, match="set task.dataset_path"):
        get_task("math")
