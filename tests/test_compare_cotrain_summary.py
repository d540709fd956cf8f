"""``scripts/compare_cotrain.py``'s summary: the committed JSONs' summaries are what their
curves give, and the last-quarter fields average the steps the by-quarter fields' last quarter does."""

import importlib.util
import json
import statistics

import pytest

from tests.test_train import REPO


def _script():
    spec = importlib.util.spec_from_file_location("compare_cotrain", REPO / "scripts" / "compare_cotrain.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("name", ["compare_cotrain.json", "compare_cotrain_longtail.json"])
def test_the_committed_summaries_are_their_curves(name):
    result = json.loads((REPO / "assets" / name).read_text())
    assert _script().summarize(result) == result["summary"]


def test_the_last_quarter_is_the_same_steps_everywhere():
    script = _script()
    seeds, n = [0, 1], 7  # 7 steps: quarters of 1, 1, 1 and 4
    runs = {str(s): {arm: {"acceptance_length": [1.0 + s + i for i in range(n)], "reward": [0.1 * i for i in range(n)],
                           "draft_tau": [2.0] * n, "rollout_s": [1.0] * n, "drafted": [True] * n,
                           "tokens_per_s": [10.0] * n, "response_len": [5.0] * n} for arm in script.ARMS}
            for s in seeds}
    result = {"steps": list(range(1, n + 1)), "seeds": seeds, "runs": runs}
    summary = script.summarize(result)
    assert summary["last_steps_averaged"] == 4
    for arm in script.ARMS:
        by_seed = summary["acceptance_length_by_quarter"][arm]["per_seed"]
        assert summary["acceptance_length_last_quarter"][arm]["values"] == [q[-1] for q in by_seed]
        assert by_seed[0] == [1.0, 2.0, 3.0, statistics.fmean([4.0, 5.0, 6.0, 7.0])]
