"""End to end on one CPU process: a math dataset in a local JSONL file, prompts rendered by
the chat template of the tokenizer folder, rewards from math-verify, a warm start on the
dataset's solutions and two RL steps; then the evaluation command on the held-out prompts,
from the job's DCP checkpoint and from its exported Hugging Face + EAGLE-3 folders."""

import json
import re
import shutil
from pathlib import Path

import pytest

from tests.test_train import REPO, SHORT, _metrics, _run
from titan_cotrain.eval import main as eval_main
from titan_cotrain.eval import pass_at_k

TEMPLATE = ("{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}assistant: {% endif %}")
FORMAT_REWARD = 0.25


def _dataset(path: Path) -> Path:
    """Twelve sums (answer and worked solution) and one question over the prompt budget."""
    records = [{"question": f"what is {a}+{b}?", "answer": str(a + b), "solution": f"answer: {a + b}"}
               for a, b in [(1, 2), (2, 3), (3, 4), (4, 5), (5, 6), (6, 7), (7, 8), (8, 9), (1, 9), (2, 8), (3, 7),
                            (4, 6)]]
    records.append({"question": "what is " + "1+" * 20 + "1?", "answer": "21", "solution": "answer: 21"})
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_pass_at_k_is_the_unbiased_estimator():
    assert pass_at_k(4, 1, 1) == 0.25
    assert pass_at_k(4, 1, 2) == 0.5  # 1 - C(3, 2) / C(4, 2) = 1 - 3/6
    assert pass_at_k(4, 2, 2) == pytest.approx(5 / 6)  # 1 - C(2, 2) / C(4, 2)
    assert pass_at_k(4, 0, 4) == 0.0 and pass_at_k(4, 1, 4) == 1.0
    with pytest.raises(ValueError, match="1 <= k <= n"):
        pass_at_k(4, 1, 5)


def _chat_tokenizer(folder: Path) -> Path:
    """The project's tokenizer files in ``folder``, with ``TEMPLATE`` as their chat template."""
    shutil.copytree(REPO / "assets" / "tokenizer", folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": TEMPLATE}))
    return folder


@pytest.mark.slow
def test_math_dataset_trains_and_evaluates_end_to_end(tmp_path):
    tokenizer = _chat_tokenizer(tmp_path / "tokenizer")
    dump = tmp_path / "job"
    job = (*SHORT, "--task.name", "math", "--task.dataset_path", str(_dataset(tmp_path / "math.jsonl")),
           "--task.solution_field", "solution", "--task.eval_size", "4", "--task.format_reward", str(FORMAT_REWARD),
           "--model.hf_assets_path", str(tokenizer), "--job.dump_folder", str(dump))
    train = _run(*job, nproc=None)
    assert train.returncode == 0, train.stdout[-3000:] + train.stderr[-3000:]
    # Split first (4 held out by seed), then the 64 - 12 = 52-token budget drops the long question.
    summary = re.search(r"task math: .*math.jsonl: (\d+) training and (\d+) held-out prompts \((\d+) longer",
                        train.stdout)
    n_train, n_held, too_long = map(int, summary.groups())
    assert too_long == 1 and n_train + n_held == 12 and n_held in (3, 4)
    metrics = _metrics(dump)
    assert [m["phase"] for m in metrics] == ["sft", "sft", "rl", "rl"]
    for m in metrics[2:]:
        assert {"task/answer_found", "task/correct", "task/format", "rollout/acceptance_rate_3"} <= m.keys()
        assert m["reward/mean"] == pytest.approx(m["task/correct"] + FORMAT_REWARD * m["task/format"])

    evaluation = _run(*job, "--samples", "4", "--pass_k", "1", "2", "4", nproc=None, module="titan_cotrain.eval")
    assert evaluation.returncode == 0, evaluation.stdout[-3000:] + evaluation.stderr[-3000:]
    result = json.loads((dump / "eval" / "eval_step4.json").read_text())
    assert (result["step"], result["task"], result["prompts"], result["samples_per_prompt"]) == (4, "math", n_held, 4)
    assert 0 <= result["accuracy"] <= 1 and result["pass_at_k"]["1"] == pytest.approx(result["accuracy"])
    assert result["pass_at_k"]["1"] <= result["pass_at_k"]["2"] <= result["pass_at_k"]["4"] <= 1
    assert result["pass_at_k_curve"][1] == result["pass_at_k"]["2"]
    assert result["reward_mean"] == pytest.approx(result["accuracy"] + FORMAT_REWARD * result["format"])
    assert result["draft_tokens"] == 3 and len(result["acceptance_rate"]) == 3
    assert all(0 <= r <= 1 for r in result["acceptance_rate"]) and 1 <= result["acceptance_length"] <= 4
    assert 1 <= result["response_len"] <= 12
    assert Path(result["plot"]).stat().st_size > 0

    # The exported folders hold the same final weights: the same evaluation, number for number.
    export = dump / "export"
    assert eval_main([*job, "--samples", "4", "--pass_k", "1", "2", "4", "--hf_policy", str(export / "policy"),
                      "--eagle3_draft", str(export / "draft")]) == 0
    from_export = json.loads((dump / "eval" / "eval_hf.json").read_text())
    for key in ("prompts", "accuracy", "pass_at_k", "acceptance_length", "acceptance_rate", "response_len"):
        assert from_export[key] == result[key], key
