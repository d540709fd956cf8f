"""The memory benchmark's own gates (scripts/bench_branch_memory.py), without measuring anything:
its dense baseline agrees with branch attention, its growth check can fail, and it plots."""

import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_branch_memory.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_branch_memory", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def records(impl, peaks, layout="packed"):
    return [{"impl": impl, "layout": layout, "seq_len": 1024 * 2**i, "peak_bytes": int(p)} for i, p in enumerate(peaks)]


LINEAR = [5e6 + 2e4 * 1024 * 2**i for i in range(6)]  # a constant plus bytes per token
TRUNK = [2e6 + 6e3 * 1024 * 2**i for i in range(6)]
QUADRATIC = [3.5 * (1024 * 2**i) ** 2 for i in range(2)]


def test_dense_baseline_agrees_with_branch_attention(bench):
    errors = bench.check_correctness(branch_sets=6)
    assert set(errors) == {"packed, P=6", "packed, P=0", "one_doc, P=6", "one_doc, P=0"}
    assert max(e for case in errors.values() for e in case.values()) < bench.MAX_ABS_ERROR_FP64, errors


def test_growth_check_passes_linear_and_fails_quadratic(bench):
    linear = records("branch", LINEAR) + records("trunk", TRUNK) + records("naive", QUADRATIC)
    numbers, failures = bench.check_growth(linear, "packed", fit_from=4096)
    assert failures == [] and 0.9 < numbers["branch"]["loglog_slope"] < 1.0
    assert numbers["at_largest_s"]["added_bytes"] == LINEAR[-1] - TRUNK[-1]

    quadratic_trunk = records("branch", LINEAR) + records("trunk", [p * p / 1e7 for p in TRUNK]) + records("naive", QUADRATIC)
    _, failures = bench.check_growth(quadratic_trunk, "packed", 4096)
    assert any("trunk peak grows" in f for f in failures) and any("multiplied the trunk peak" in f for f in failures)

    _, failures = bench.check_growth(records("branch", LINEAR) + records("trunk", TRUNK) + records("naive", LINEAR[:2]),
                                     "packed", 4096)
    assert failures == ["packed: control: the dense baseline's peak did not grow quadratically, so the method is suspect"]


def test_plot_writes_a_png(bench, tmp_path):
    pytest.importorskip("matplotlib")  # the optional bench extra
    recs = [r for layout in bench.LAYOUTS for r in
            records("branch", LINEAR, layout) + records("trunk", TRUNK, layout) + records("naive", QUADRATIC, layout)]
    numbers = {layout: bench.check_growth(recs, layout, 4096)[0] for layout in bench.LAYOUTS}
    bench.plot(recs, numbers, {"ttt_steps": 7, "branch_sets": 6, "doc_len": 1024}, tmp_path / "plot.png")
    assert (tmp_path / "plot.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
