"""The four shipped recipes (``train_configs/recipes/*.toml``) each run a few steps of the
embedded job on 2 processes and log what their settings produce."""

import json
import math
from pathlib import Path

import pytest

from tests.test_train import SHORT, _run

REPO = Path(__file__).resolve().parents[1]
RECIPES = sorted((REPO / "train_configs" / "recipes").glob("*.toml"))


def test_the_four_recipes_ship():
    assert [p.stem for p in RECIPES] == ["dapo", "dr_grpo", "grpo", "gspo"]


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.stem)
def test_a_recipe_trains(recipe, tmp_path):
    # SHORT's budget of 12 new tokens: DAPO's penalty over its last 4.
    extra = ("--rl.overlong_buffer", "4") if recipe.stem == "dapo" else ()
    out = _run("--job.config_file", str(recipe), *SHORT, "--job.dump_folder", str(tmp_path),
               "--checkpoint.no-enable", "--rl.prompts_per_step", "4", "--rl.group_size", "4", *extra)
    assert out.returncode == 0, out.stderr[-3000:]
    steps = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    rl = [m for m in steps if m["phase"] == "rl"]
    assert len(rl) == 2
    for m in rl:
        assert math.isfinite(m["loss/policy"]) and m["rl/entropy"] > 0
        assert 0 <= m["rollout/truncated_share"] <= 1 and 0 <= m["rl/zero_advantage_groups"] <= 1
    if recipe.stem == "dapo":
        for m in rl:
            assert m["rl/kept_groups"] + m["rl/dropped_groups"] >= 4 and m["rl/sampling_rounds"] >= 1
    if recipe.stem == "gspo":  # the sequence ratio's value: near 1 on the step's own rollouts
        assert all(abs(m["rl/ratio"] - 1) < 0.05 for m in rl)
