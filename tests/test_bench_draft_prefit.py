"""``scripts/bench_draft_prefit.py --quick``: the warm start exported, then a run per prefit
length from the exported policy with a fresh draft; its JSON describes each and its checks pass."""

import json
import subprocess
import sys

import pytest

from tests.test_train import REPO


@pytest.mark.slow
def test_the_prefit_benchmark_runs_and_checks_itself(tmp_path):
    run = subprocess.run([sys.executable, "scripts/bench_draft_prefit.py", "--quick", "--out", str(tmp_path)],
                         cwd=REPO, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    result = json.loads((tmp_path / "bench_draft_prefit.json").read_text())
    assert result["checks"] == {"passed": True, "failures": []}
    assert [r["prefit_steps"] for r in result["records"]] == [0, 2]
    for r in result["records"]:
        assert 1.0 <= r["acceptance_rl_step1"] <= 4.0 and r["rollout_s_first2"] > 0
        assert len(r["acceptance_by_rl_step"]) == 2
    assert result["records"][0]["prefit_s"] == 0 and result["records"][1]["prefit_s"] > 0
    assert (tmp_path / "bench_draft_prefit.png").stat().st_size > 0
