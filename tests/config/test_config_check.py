"""``python -m titan_cotrain.config.check``, which ``scripts/train.sh`` runs once before
torchrun starts the ranks: a bad config prints its one message once and exits 2."""

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _check(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "titan_cotrain.config.check", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)


def test_a_bad_key_is_reported_once_with_exit_code_2(tmp_path):
    job = tmp_path / "job.toml"
    job.write_text(f'[job]\nextends = "{REPO / "train_configs" / "debug_cpu.toml"}"\n[rl]\ngroup_sise = 4\n')
    out = _check("--world-size", "2", "--job.config_file", str(job))
    assert out.returncode == 2
    assert out.stderr.count("unknown key rl.group_sise (did you mean 'group_size'?)") == 1, out.stderr
    assert "Traceback" not in out.stderr


def test_the_world_size_is_part_of_the_check():
    assert _check("--world-size", "2").returncode == 0
    out = _check("--world-size", "3")
    assert out.returncode == 2 and "must split evenly over the 3 data-parallel ranks" in out.stderr


def test_train_sh_checks_before_it_launches():
    lines = (REPO / "scripts" / "train.sh").read_text().splitlines()
    check = next(i for i, line in enumerate(lines) if "titan_cotrain.config.check" in line)
    launch = next(i for i, line in enumerate(lines) if "torchrun" in line and not line.startswith("#"))
    assert check < launch and '"${NPROC:-2}"' in lines[check] and "|| exit" in lines[check]
