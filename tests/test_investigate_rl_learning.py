"""The RL-learning investigation (``scripts/investigate_rl_learning.py``): the shuffled-advantage
control permutes advantages across groups and keeps their values, the untied copy of a warm
start is untied and otherwise the same, and ``--quick`` runs end to end into a JSON of the
expected shape whose self-checks passed."""

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.test_bench_recipes import _finite_numbers
from titan_cotrain.rl.grpo import group_advantages

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = REPO / "scripts"


def _module(name: str):
    sys.path.insert(0, str(SCRIPTS))
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_control_permutes_the_advantages_across_groups():
    control = _module("shuffled_advantages_job")
    rewards = torch.tensor([1.0, 0, 0, 0, 1, 1, 1, 0, 0, 0, 0, 0])
    real = group_advantages(rewards, 4)
    shuffled = control.shuffled_advantages(rewards, 4)
    assert sorted(shuffled.tolist()) == pytest.approx(sorted(real.tolist()))
    assert not torch.equal(shuffled, real)
    # Advantages left their groups: some group's shuffled values are not its own.
    assert any(sorted(shuffled.view(3, 4)[g].tolist()) != pytest.approx(sorted(real.view(3, 4)[g].tolist()))
               for g in range(3))


@pytest.mark.slow
def test_quick_run_writes_a_checked_json(tmp_path):
    out = subprocess.run([sys.executable, str(SCRIPTS / "investigate_rl_learning.py"), "--quick", "--out", str(tmp_path)],
                         cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    result = json.loads((tmp_path / "investigate_rl_learning.json").read_text())
    assert (tmp_path / "investigate_rl_learning.png").stat().st_size > 0
    assert all(math.isfinite(x) for x in _finite_numbers(result))
    assert result["checks"]["passed"] and result["settings"]["quick"] and len(result["warm_start"]["sha256"]) == 64
    assert list(result["variants"]) == ["grpo_shuffled", "grpo_untied"]
    for name, variant in result["variants"].items():
        assert len(variant["correct"]) == len(variant["grad_norm"]) == 2
        assert [e["rl_step"] for e in variant["evals"]] == [2] and variant["evals"][0]["step"] == 6
        assert set(variant["summary"]) >= {"accuracy_last", "accuracy_gain", "correct_last_quarter"}
    assert result["variants"]["grpo_shuffled"]["shuffled_advantages"]
    assert result["variants"]["grpo_untied"]["untied"]
    # The untied copy: the policy folder says so and carries a head equal to the embedding.
    untied = tmp_path / "work" / "untied"
    assert json.loads((untied / "policy" / "config.json").read_text())["tie_word_embeddings"] is False
    from safetensors.torch import load_file
    weights = load_file(untied / "policy" / "model.safetensors")
    assert torch.equal(weights["lm_head.weight"], weights["model.embed_tokens.weight"])
