"""pyproject.toml's pins against the committed requirements of torch's CUDA wheel
(``scripts/check_requirements.py``, offline: no pip call, no network)."""

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
REPORT = ROOT / "assets" / "install" / "torch-2.13.0-cu-report.json"


def check(pyproject: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "scripts" / "check_requirements.py"),
                           "--report-file", str(REPORT), "--pyproject", str(pyproject)],
                          capture_output=True, text=True, timeout=60)


def mutated(tmp_path: Path, pattern: str, replacement: str) -> Path:
    text, count = re.subn(pattern, replacement, (ROOT / "pyproject.toml").read_text())
    assert count == 1, pattern
    path = tmp_path / "pyproject.toml"
    path.write_text(text)
    return path


def test_the_pins_agree_with_the_committed_cuda_wheel():
    done = check(ROOT / "pyproject.toml")
    assert done.returncode == 0, done.stdout + done.stderr
    assert re.search(r"^triton\s+triton==3\.7\.1\s+triton==3\.7\.1 \[dependencies\]\s+ok$", done.stdout, re.M)


def test_a_triton_pin_the_wheel_contradicts_fails_naming_triton(tmp_path):
    done = check(mutated(tmp_path, r'"triton==[^"]+"', '"triton==3.9.0"'))
    assert done.returncode == 1
    assert "CONTRADICTION: pyproject.toml pins triton==3.9.0" in done.stderr
    assert "requires triton==3.7.1" in done.stderr


def test_a_torch_pin_other_than_the_reports_fails(tmp_path):
    done = check(mutated(tmp_path, r'"torch==[^"]+"', '"torch==2.14.0"'))
    assert done.returncode == 1
    assert "the report is for torch 2.13.0" in done.stderr


def test_pins_the_wheel_does_not_require_are_ignored(tmp_path):
    # numpy: not among the wheel's requirements; pyyaml: only under the wheel's extra "pyyaml".
    pyproject = mutated(tmp_path, r"bench = \[", 'bench = ["numpy==0.1.0", "pyyaml==0.1.0", ')
    done = check(pyproject)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "numpy" not in done.stdout and "pyyaml" not in done.stdout
