"""The custom task end to end on 2 CPU processes: a reward function imported by path from the
tests folder (``tests/rl/reward_fixtures.py``), records whose prompts are chat messages (rendered
by the tokenizer folder's chat template, ``enable_thinking = false`` reaching it) and whose extra
fields the reward reads, scored by reward worker processes. The reward's parts are logged as
``task/<name>``; a call that sleeps past its timeout scores 0 and is counted while the job
finishes; a call that raises stops the job naming its record, unless ``reward_on_error = "zero"``
counts it instead."""

import json
import shutil
from pathlib import Path

import pytest

from tests.test_train import REPO, SHORT, _metrics, _run

# Renders a prompt ending in reward_fixtures.PROMPT_END when enable_thinking is false.
TEMPLATE = ("{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}assistant{% if enable_thinking is false %} (no thinking){% endif %}: "
            "{% endif %}")


def _records(path: Path, *behaviours: str) -> Path:
    """A record per behaviour (``reward_fixtures.graded``'s ``ok``, ``slow``, ``raise``), its
    prompt chat messages, with the fields the reward reads (``id``, ``behaviour``, ``bonus``)."""
    records = [{"id": f"{behaviour}-{i}", "messages": [{"role": "user", "content": f"{i}+1?"}],
                "solution": str(i + 1), "behaviour": behaviour, "bonus": 0.5} for i, behaviour in enumerate(behaviours)]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _job(tmp_path: Path, dataset: Path, *args: str) -> tuple[str, ...]:
    tokenizer = tmp_path / "tokenizer"
    if not tokenizer.exists():
        shutil.copytree(REPO / "assets" / "tokenizer", tokenizer)
        config = json.loads((tokenizer / "tokenizer_config.json").read_text())
        (tokenizer / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": TEMPLATE}))
    return (*SHORT, "--task.name", "custom", "--task.reward", "tests.rl.reward_fixtures:graded",
            "--task.dataset_path", str(dataset), "--task.prompt_field", "messages",
            "--task.chat_template_kwargs", "enable_thinking", "false", "--model.hf_assets_path", str(tokenizer),
            "--checkpoint.no-enable", "--metrics.no-enable_tensorboard", *args)


@pytest.mark.slow
def test_a_reward_by_import_path_trains_counts_its_timeouts_and_errors_and_stops_on_a_raise(tmp_path):
    # 4 training records, 1 prompt per rank and step, 2 RL steps: every record is drawn once,
    # each with its group of 2 responses.
    dataset = _records(tmp_path / "records.jsonl", "ok", "slow", "raise", "ok")
    dump = tmp_path / "counted"
    result = _run(*_job(tmp_path, dataset, "--task.solution_field", "solution", "--task.sft_steps", "1",
                        "--task.reward_workers", "2", "--task.reward_timeout_s", "3", "--task.reward_on_error", "zero",
                        "--task.reward_max_error_fraction", "1", "--job.dump_folder", str(dump)))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "task custom: " in result.stdout and "4 training and 0 held-out prompts" in result.stdout
    metrics = _metrics(dump)
    assert [m["phase"] for m in metrics] == ["sft", "rl", "rl"]
    rl = metrics[1:]
    # The slow record's 2 calls timed out, the raising one's 2 failed: scored 0, counted, and the job went on.
    assert sum(m["task/reward_timeouts"] for m in rl) == 2 and sum(m["task/reward_errors"] for m in rl) == 2
    parts = [m for m in rl if "task/bonus" in m]  # a step whose every call failed has no parts to average
    assert parts and all(m["task/bonus"] == 0.5 and m["task/templated"] == 1.0 for m in parts)
    # An "ok" response earns 0.5 plus 0.01 per character (12 at most), a failed one 0: a step with a
    # failed pair among its 4 responses averages at most (0.62 + 0.62) / 4.
    assert all(m["reward/mean"] < 0.5 for m in rl if m["task/reward_timeouts"] + m["task/reward_errors"])

    # The same raise with reward_on_error = "raise" (the default) stops the job, naming the record.
    stopped = _run(*_job(tmp_path, _records(tmp_path / "raising.jsonl", "ok", "raise"), "--task.sft_steps", "0",
                         "--training.steps", "1", "--job.dump_folder", str(tmp_path / "stopped")))
    assert stopped.returncode != 0
    assert "reward error: task 'custom': the reward of record {'id': 'raise-1'," in stopped.stderr
    assert "failed: ZeroDivisionError('record raise-1 divides by zero')" in stopped.stderr
    assert 'reward_fixtures.py", line' in stopped.stderr  # the reward's own traceback
