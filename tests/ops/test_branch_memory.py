"""The memory benchmark's own gates (scripts/bench_branch_memory.py), without measuring anything:
its dense baseline agrees with branch attention, its growth check can fail, and its PNG is valid."""

import importlib.util
import struct
import zlib
from argparse import Namespace
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_branch_memory.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_branch_memory", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def records(impl, peaks):
    return [{"impl": impl, "seq_len": 1024 * 2**i, "peak_bytes": int(p)} for i, p in enumerate(peaks)]


LINEAR = [5e6 + 2e4 * 1024 * 2**i for i in range(6)]  # a constant plus bytes per token
QUADRATIC = [3.5 * (1024 * 2**i) ** 2 for i in range(2)]


def test_dense_baseline_agrees_with_branch_attention(bench):
    errors = bench.check_correctness(branch_sets=6)
    assert max(errors.values()) < bench.MAX_ABS_ERROR_FP64, errors


def test_growth_check_passes_linear_and_fails_quadratic(bench):
    numbers, failures = bench.check_growth(records("branch", LINEAR) + records("naive", QUADRATIC), fit_from=4096)
    assert failures == [] and 0.9 < numbers["branch_loglog_slope"] < 1.0

    _, failures = bench.check_growth(records("branch", [p * p / 1e6 for p in LINEAR]) + records("naive", QUADRATIC), 4096)
    assert any("not linearly" in f for f in failures) and any("multiplied the branch peak" in f for f in failures)

    _, failures = bench.check_growth(records("branch", LINEAR) + records("naive", LINEAR[:2]), 4096)
    assert failures == ["control: the dense baseline's peak did not grow quadratically, so the method is suspect"]


def test_plot_is_a_valid_png(bench, tmp_path):
    recs = records("branch", LINEAR) + records("naive", QUADRATIC)
    numbers, _ = bench.check_growth(recs, 4096)
    bench.plot(recs, numbers, Namespace(ttt_steps=7, doc_len=1024)).save(tmp_path / "plot.png")

    data = (tmp_path / "plot.png").read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    chunks, pos = {}, 8
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos:pos + 4])
        tag, body = data[pos + 4:pos + 8], data[pos + 8:pos + 8 + length]
        assert struct.unpack(">I", data[pos + 8 + length:pos + 12 + length])[0] == zlib.crc32(tag + body)
        chunks[tag] = body
        pos += 12 + length
    width, height, depth, color_type = struct.unpack(">IIBB", chunks[b"IHDR"][:10])
    assert (depth, color_type) == (8, 2) and list(chunks) == [b"IHDR", b"IDAT", b"IEND"]
    pixels = zlib.decompress(chunks[b"IDAT"])
    assert len(pixels) == height * (1 + 3 * width)
    assert len(set(pixels)) > 3  # something was drawn
