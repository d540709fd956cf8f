"""The cluster launch scripts' dry runs: the config is checked once for the whole world, and
each node gets the torchrun command its rank needs (c10d rendezvous at the first node)."""

import os
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PYTHON = REPO / ".venv" / "bin" / "python"


def _script(name: str, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    environment = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")} | (env or {})
    return subprocess.run(["bash", str(REPO / "scripts" / "launch" / name), *args], cwd=REPO, env=environment,
                          capture_output=True, text=True, timeout=300)


def test_ssh_dry_run_prints_one_torchrun_per_host():
    out = _script("ssh.sh", "--hosts", "n1,n2", "--gpus-per-node", "1", "--port", "29511", "--dry-run",
                  "--task.system_prompt", "be brief")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith(f"{PYTHON} -m titan_cotrain.config.check --world-size 2 ")
    ssh = [line for line in lines if line.startswith("ssh ")]
    assert [line.split()[1] for line in ssh] == ["n1", "n2"]
    for rank, line in enumerate(ssh):
        assert f"--nnodes 2 --node_rank {rank} --nproc_per_node 1 --rdzv_backend c10d --rdzv_endpoint n1:29511" in line
        assert line.rstrip().endswith("-m titan_cotrain.train --task.system_prompt be\\ brief")
    assert len({line.split("--rdzv_id ")[1].split()[0] for line in ssh}) == 1  # one rendezvous for all


def test_a_dry_run_checks_the_config_for_the_whole_world():
    out = _script("ssh.sh", "--hosts", "n1,n2,n3", "--gpus-per-node", "1", "--dry-run")
    assert out.returncode == 2 and "must split evenly over the 3 data-parallel ranks" in out.stderr
    assert "ssh " not in out.stdout  # nothing launched after a failed check
    out = _script("slurm.sh", "--nodes", "3", "--gpus-per-node", "1", "--dry-run")
    assert out.returncode == 2 and "sbatch" not in out.stdout


def test_slurm_dry_run_submits_itself_then_starts_torchrun_on_every_node():
    out = _script("slurm.sh", "--nodes", "2", "--gpus-per-node", "1", "--time", "1:00:00", "--partition", "gpu",
                  "--dry-run", "--training.steps", "3")
    assert out.returncode == 0, out.stderr
    submit = next(line for line in out.stdout.splitlines() if line.startswith("sbatch "))
    for part in ("--nodes 2", "--gpus-per-node 1", "--time 1:00:00", "--partition gpu",
                 "scripts/launch/slurm.sh --nodes 2 --gpus-per-node 1 --port 29500 --training.steps 3"):
        assert part in submit, part
    inside = _script("slurm.sh", "--nodes", "2", "--gpus-per-node", "1", "--dry-run", "--training.steps", "3",
                     env={"SLURM_JOB_ID": "42", "SLURM_JOB_NODELIST": "gpu[1-2]"})
    assert inside.returncode == 0, inside.stderr
    (launch,) = inside.stdout.splitlines()
    assert launch.startswith("srun --nodes 2 --ntasks-per-node 1 --kill-on-bad-exit=1 ")
    assert "torchrun --nnodes 2 --nproc_per_node 1 --rdzv_backend c10d" in launch and "--rdzv_id 42" in launch
    assert launch.rstrip().endswith("-m titan_cotrain.train --training.steps 3")


def test_slurm_requeues_the_job_on_the_warning_signal(tmp_path):
    """Inside an allocation, with stand-ins for ``scontrol`` and ``srun`` on PATH: the job
    starts torchrun through srun, and SIGUSR1 (Slurm's warning before the time limit or a
    preemption) makes it requeue itself."""
    import signal
    import time

    log = tmp_path / "calls.log"
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text(f'#!/bin/bash\necho "scontrol $*" >> {log}\n'
                                      '[ "$1" = show ] && echo gpu1 && echo gpu2\nexit 0\n')
    (bin_dir / "srun").write_text(f'#!/bin/bash\necho "srun $*" >> {log}\nexec >&- 2>&-\nsleep 30\n')
    for stub in bin_dir.iterdir():
        stub.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env |= {"PATH": f"{bin_dir}:{env['PATH']}", "SLURM_JOB_ID": "42", "SLURM_JOB_NODELIST": "gpu[1-2]"}
    job = subprocess.Popen(["bash", str(REPO / "scripts" / "launch" / "slurm.sh"), "--nodes", "2", "--training.steps",
                            "3"], cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 60
    while not (log.exists() and "srun" in log.read_text()) and time.time() < deadline:
        time.sleep(0.1)
    time.sleep(0.5)  # the script is waiting on srun by now
    job.send_signal(signal.SIGUSR1)
    _, stderr = job.communicate(timeout=60)
    calls = log.read_text().splitlines()
    assert any(c.startswith("srun --nodes 2") and "--rdzv_endpoint gpu1:29500" in c for c in calls), calls
    assert "scontrol requeue 42" in calls and "requeueing job 42" in stderr, (calls, stderr)
