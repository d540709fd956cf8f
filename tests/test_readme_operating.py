"""The README's "Operating a run" commands, run as written on the embedded job, shortened: the
SHORT job's sizes are put in front of each command's own flags (so the command's own win), the
dump folder is a temporary one, and its step and count literals are scaled down (step 700 of
the full job is step 4 of the short one). Train with evaluation, evaluate the checkpoint, export
it, resume on one process, then context-parallel."""

import json
import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.test_train import REPO, SHORT, _metrics

SCALED = {"step-700": "step-4", "--eval.prompts 64": "--eval.prompts 4", "--eval.interval 20": "--eval.interval 1",
          "--training.steps 110": "--training.steps 3", "--training.steps 120": "--training.steps 4"}


def _commands() -> list[str]:
    text = (REPO / "README.md").read_text()
    section = text[text.index("## Operating a run"):]
    section = section[:section.index("\n## ", 1)]
    block = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    return [line for line in block.splitlines() if line.strip() and not line.startswith("#")]


def _shortened(command: str, dump: Path) -> tuple[dict, list[str]]:
    for old, new in SCALED.items():
        command = command.replace(old, new)
    command = command.replace("outputs/debug_cpu", str(dump))
    words = shlex.split(command)
    env = {}
    while "=" in words[0]:
        key, value = words.pop(0).split("=", 1)
        env[key] = value
    entry = words.index("scripts/train.sh") + 1 if "scripts/train.sh" in words else words.index("-m") + 2
    own = set(words[entry:])
    short = [w for i in range(0, len(SHORT), 2) if SHORT[i] not in own for w in SHORT[i:i + 2]]
    extra = [] if "titan_cotrain.export" in words else ["--job.dump_folder", str(dump)]
    return env, [*words[:entry], *short, *extra, *words[entry:]]


@pytest.mark.slow
def test_the_operating_commands_of_the_readme_run_as_written(tmp_path):
    commands = _commands()
    assert len(commands) == 5, commands
    dump = tmp_path / "debug_cpu"
    outputs = []
    for command in commands:
        env, words = _shortened(command, dump)
        words = [str(REPO / ".venv" / "bin" / "python") if w == "python" else w for w in words]
        run = subprocess.run(words, cwd=REPO, capture_output=True, text=True, timeout=900,
                             env={**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", **env})
        assert run.returncode == 0, (command, run.stdout[-3000:], run.stderr[-3000:])
        outputs.append(run.stdout)
        if len(outputs) == 3:  # before the resumes export their own final steps
            shutil.copytree(dump / "export", tmp_path / "job_export")

    # 1: evaluations before RL (after the 2 warm-start steps) and after each RL step.
    train_metrics = _metrics(dump)
    assert [m["step"] for m in train_metrics if m["phase"] == "eval"] == [2, 3, 4]
    # 2: the command evaluated the checkpoint of step 4.
    result = json.loads((dump / "eval" / "eval_step4.json").read_text())
    assert result["step"] == 4 and result["prompts"] == 4 and result["models"].endswith("checkpoint")
    # 3: the export of step 4 (the job's last) is the job's own, byte for byte.
    ours, theirs = dump / "export-step700", tmp_path / "job_export"
    files = sorted(p.relative_to(theirs) for p in theirs.rglob("*") if p.is_file())
    assert files and files == sorted(p.relative_to(ours) for p in ours.rglob("*") if p.is_file())
    assert all((ours / f).read_bytes() == (theirs / f).read_bytes() for f in files)
    # 4 and 5: resumed from the latest checkpoint, on one process, then context-parallel.
    assert "resumed from step 4" in outputs[3] and "resumed from step 5" in outputs[4]
    assert [m["step"] for m in _metrics(dump) if m["phase"] == "rl"][-2:] == [5, 6]
