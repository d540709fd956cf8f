"""The recipe benchmark (``scripts/bench_recipes.py``): its word problems are right, its
Qwen3-architecture policy folder loads with tied embeddings and a tokenizer that round-trips
text and renders the chat template, its gates fail on bad runs, and ``--quick`` runs end to
end into a JSON of the expected shape."""

import importlib.util
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors import safe_open

from titan_cotrain.components import titan
from titan_cotrain.data.prompts import ChatTemplate, PromptEncoder
from titan_cotrain.models import load_hf
from titan_cotrain.rl.answers import gsm8k_answer

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = REPO / "scripts"


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, str(SCRIPTS))
    spec = importlib.util.spec_from_file_location("bench_recipes", SCRIPTS / "bench_recipes.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_word_problems_are_distinct_seeded_and_correct(bench):
    records = bench.word_problems(400, seed=3)
    assert len({r["question"] for r in records}) == 400
    assert records[:20] == bench.word_problems(20, seed=3) != bench.word_problems(20, seed=4)
    for r in records:
        answer = bench.checked_answer(r["answer"])
        # The solution works on the question's own numbers, in order, and GSM8K's answer
        # parsing (the task's reward) reads the same integer.
        (a, _, b, first), (_, _, c, _) = bench.EQUATION.findall(r["answer"])
        assert re.findall(r"\d+", r["question"]) == [a, b, c] and int(first) >= 0 and answer >= 0
        assert gsm8k_answer(r["answer"]) == (str(answer), "####")
    assert {op for r in records for _, op, _, _ in bench.EQUATION.findall(r["answer"])} == {"+", "-", "*"}


@pytest.mark.parametrize("wrong", ["7 + 5 = 13. 13 - 3 = 10. #### 10", "7 + 5 = 12. 11 - 3 = 8. #### 8",
                                   "7 + 5 = 12. 12 - 3 = 9. #### 8", "7 + 5 = 12. #### 12"])
def test_the_answer_check_catches_wrong_solutions(bench, wrong):
    assert bench.checked_answer("7 + 5 = 12. 12 - 3 = 9. #### 9") == 9
    with pytest.raises(ValueError):
        bench.checked_answer(wrong)


@pytest.fixture(scope="module")
def policy_folder(bench, tmp_path_factory):
    folder = tmp_path_factory.mktemp("policy")
    return folder, bench.write_policy_folder(folder, bench.word_problems(300, seed=0), vocab_size=512, seed=0)


def test_policy_folder_is_a_tied_qwen3(policy_folder):
    folder, info = policy_folder
    config = json.loads((folder / "config.json").read_text())
    assert config["model_type"] == "qwen3" and config["tie_word_embeddings"] is True
    with safe_open(folder / "model.safetensors", framework="pt") as f:
        assert "lm_head.weight" not in f.keys()
    model = load_hf(folder)
    assert model.args.architecture == "qwen3" and model.args.qk_norm and model.args.tie_embeddings
    assert model.lm_head.weight is model.embed_tokens.weight
    assert model.args.vocab_size == info["vocab_size"] == config["vocab_size"]


def test_tokenizer_round_trips_and_renders_the_chat_template(bench, policy_folder):
    folder, info = policy_folder
    tokenizer = titan.load_tokenizer(str(folder))
    assert tokenizer.vocab_size == info["vocab_size"]
    ids = info["special_token_ids"]
    assert tokenizer.eos_id == ids[bench.IM_END] and tokenizer.bos_id is None
    # Byte level: text the corpus never held (accents, a dash, tabs) comes back exactly.
    for text in ("Ana has 7 pens. She buys 5 more.", "Zoë's 12,345 — ok?\n\tdone", "#### 42"):
        assert tokenizer.decode(tokenizer.encode(text, add_bos=False, add_eos=False)) == text
    digits = tokenizer.encode("1234", add_bos=False, add_eos=False)
    assert [tokenizer.decode([i]) for i in digits] == ["1", "2", "3", "4"]  # Qwen's digits, one by one
    question = "Ben has 3 cards. How many cards does Ben have?"
    prompt = PromptEncoder(tokenizer, ChatTemplate.from_folder(folder))(question)
    expected = f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer.decode(prompt, skip_special_tokens=False) == expected
    assert prompt[0] == ids[bench.IM_START] and prompt.count(ids[bench.IM_END]) == 1


def test_transformers_reads_the_tokenizer_and_template_alike(policy_folder):
    transformers = pytest.importorskip("transformers")
    folder, info = policy_folder
    theirs = transformers.AutoTokenizer.from_pretrained(folder)
    messages = [{"role": "user", "content": "Ben has 3 cards. How many?"}]
    text = theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == ChatTemplate.from_folder(folder).render(messages)
    assert theirs.eos_token == "<|im_end|>" and theirs.eos_token_id == info["special_token_ids"]["<|im_end|>"]
    assert theirs.decode(theirs.encode(text, add_special_tokens=False)) == text


def test_the_gates_fail_on_short_or_non_finite_runs_and_wrong_evaluations(bench):
    steps = [{"phase": "sft"}] + [{"phase": "rl", "task/correct": 0.5, "reward/mean": 0.5,
                                   "rollout/acceptance_length": 2.0, "time/step_s": 1.0} for _ in range(3)]
    curves, failures = bench.curves_and_failures("ok", steps, 3)
    assert failures == [] and curves["correct"] == curves["reward"] == [0.5] * 3
    assert bench.curves_and_failures("short", steps, 4)[1]
    steps[2] = {**steps[2], "reward/mean": math.nan}
    assert bench.curves_and_failures("nan", steps, 3)[1]
    del steps[3]["rollout/acceptance_length"]
    assert len(bench.curves_and_failures("missing", steps, 3)[1]) == 2
    result = {"step": 23, "accuracy": 0.5, "acceptance_length": 2.0, "pass_at_k": {"1": 0.5}}
    assert bench.eval_failures("ok", result, 23) == []
    assert bench.eval_failures("step", result, 24)
    assert bench.eval_failures("nan", {**result, "pass_at_k": {"1": math.inf}}, 23)


def _finite_numbers(value) -> list[float]:
    if isinstance(value, dict):
        return [x for v in value.values() for x in _finite_numbers(v)]
    if isinstance(value, list):
        return [x for v in value for x in _finite_numbers(v)]
    return [value] if isinstance(value, float) else []


@pytest.mark.slow
def test_quick_run_writes_a_complete_json(tmp_path):
    out = subprocess.run([sys.executable, str(SCRIPTS / "bench_recipes.py"), "--quick", "--out", str(tmp_path)],
                         cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    result = json.loads((tmp_path / "bench_recipes.json").read_text())
    assert (tmp_path / "bench_recipes.png").stat().st_size > 0
    assert all(math.isfinite(x) for x in _finite_numbers(result))
    settings = result["settings"]
    assert settings["quick"] and settings["seeds"] == [0] and settings["steps"] == 3
    assert result["command"].startswith("python scripts/bench_recipes.py --quick")
    assert result["policy"]["architecture"] == "qwen3" and result["policy"]["tie_word_embeddings"]
    assert result["checks"]["passed"] and len(result["warm_start"]["sha256"]) == 64
    before = result["warm_start"]["eval"]
    assert before["step"] == 20 and before["prompts"] == 16 and set(before["pass_at_k"]) == {"1", "2"}
    assert list(result["recipes"]) == ["grpo", "gspo"] == [r["recipe"] for r in result["records"]]
    for name, recipe in result["recipes"].items():
        [run] = recipe["runs"]
        assert run["eval"]["step"] == 23 and len(run["correct"]) == len(run["acceptance_length"]) == 3
        assert 0 <= run["eval"]["accuracy"] <= 1 and 1 <= run["acceptance_length_mean"] and run["step_s_median"] > 0
        summary = recipe["summary"]
        assert summary["accuracy"]["values"] == [run["eval"]["accuracy"]]
        assert summary["accuracy_gain"]["mean"] == pytest.approx(run["eval"]["accuracy"] - before["accuracy"])
    for row in result["records"]:
        assert row["accuracy_before"] == before["accuracy"] and set(row["accuracy_after"]) == {"mean", "min", "max"}
        assert set(row["pass_at_k_after"]) == {"1", "2"} and row["config"] == f"train_configs/recipes/{row['recipe']}.toml"
