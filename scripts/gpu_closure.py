"""The distributions the GPU scripts' stages import beyond what a torch node has: what
``scripts/gpu_wheels.sh`` downloads for a node with no package index.

``CLOSURE`` is measured, not read from metadata. ``--measure`` runs the stages' own entry
points on this machine's CPU with a ``sitecustomize`` that writes every Python process's
``sys.modules`` when it ends (at exit, or at the ``os._exit`` that ends the torchrun workers;
the workers and the benchmarks' child processes included), maps the top-level modules to
their distributions (``importlib.metadata.packages_distributions()``) and leaves out the
standard library, the project and ``NODE``. The entry points: ``scripts/gpu_check.sh --cpu``,
``scripts/smoke_8gpu.sh --cpu`` (the main job, the benchmarks, the ring check, the report) and
``pytest tests/gpu`` run on the CPU (``TITAN_GPU_TESTS_ON_CPU=1``), which ``--cpu`` mode leaves
out. What only a GPU executes (the CUDA kernels, CUDA graphs, inductor's Triton code) imports
modules of torch and triton, which the node brings. Two are imported only because they are
installed (torch imports dill where it can; pytest loads anyio's plugin): they are kept, being
small. Measured on CPython 3.11; the versions are the project venv's (pyproject's pins where it
pins), which ``tests/test_gpu_scripts.py`` checks.

Two things the stages import are left out, each because its wheels alone would pass the
folder's 32 MiB (for two Pythons): matplotlib (the benchmarks' plots, which they leave out
without it: ``HIDDEN``, hidden from the measured processes as the node will run them), and
what only the pipeline-parallel stages of ``smoke_8gpu.sh`` import (``PIPELINE_ONLY``). Those
processes are told apart by ``PIPELINE_MODULE``: the project's ``pipeline_layer_split`` imports
it, and through torchtitan's ``train_spec`` it imports ``torchtitan.hf_datasets``, ``datasets``,
pyarrow and pandas. ``gpu_check.sh`` imports none of it; on a node without an index those two
stages fail at import unless the folder was filled with ``gpu_wheels.sh DIR --pipeline``.

    python scripts/gpu_closure.py                 # CLOSURE, one "name==version" a line
    python scripts/gpu_closure.py --pipeline      # and PIPELINE_ONLY
    python scripts/gpu_closure.py --measure       # measure it again (about 10 minutes on 2 cores)
    python scripts/gpu_closure.py --measure -- python -c "import titan_cotrain.train"   # one command's

``--measure`` prints the closure found with the installed versions, what only the pipeline
stages add, and how the first differs from ``CLOSURE``; it exits 1 when ``CLOSURE`` lacks one.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Measured with --measure, CPython 3.11, 2026-12-06: 20 wheels, 13.1 MiB, for 3.11 and 3.12.
CLOSURE = {
    "absl_py": "2.5.1", "anyio": "4.16.0", "dill": "0.4.1", "docstring_parser": "0.18.0",
    "huggingface_hub": "2.4.0", "iniconfig": "2.3.1", "packaging": "26.4", "pluggy": "1.7.0",
    "protobuf": "7.36.2", "pygments": "2.21.0", "pytest": "9.2.0", "tensorboard": "2.21.0",
    "tokenizers": "0.23.3", "tomli": "2.5.0", "torchdata": "0.11.0", "torchtitan": "0.2.2", "tqdm": "4.70.1",
    "typeguard": "4.6.1", "tyro": "1.0.17",
}

# Measured with CLOSURE: what only the pipeline stages' processes import besides.
PIPELINE_ONLY = {
    "datasets": "5.2.0", "h11": "0.16.0", "httpcore2": "2.17.0", "httpx2": "2.17.0", "idna": "3.21",
    "multiprocess": "0.70.19", "pandas": "3.1.1", "pyarrow": "26.0.1", "python_dateutil": "4.0.0",
    "pyyaml": "6.0.4", "truststore": "0.10.5", "xxhash": "4.1.0",
}

# What a node with torch installed already has: torch and triton, torch's own requirements,
# and numpy and safetensors, which torch nodes bring (the node's copies are the ones used).
NODE = frozenset({"torch", "triton", "numpy", "safetensors", "filelock", "typing_extensions", "sympy", "mpmath",
                  "networkx", "jinja2", "markupsafe", "fsspec", "setuptools", "pip"})

# Hidden from the measured processes: matplotlib and what it imports (pillow, fonttools,
# kiwisolver, contourpy) are 38 MiB of wheels for two Pythons (benchtools.optional_plot).
HIDDEN = ("matplotlib",)
PIPELINE_MODULE = "torchtitan.distributed.pipeline_parallel"

# Run from the repository root, with the tracer on the path.
STAGES = (
    ["bash", "scripts/gpu_check.sh", "--cpu"],
    ["bash", "scripts/smoke_8gpu.sh", "--cpu"],
    [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/gpu"],
)

TRACER = '''\
"""Each process's imported modules, written when it ends (scripts/gpu_closure.py)."""
import atexit, os, sys


class _Hidden:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in os.environ["GPU_CLOSURE_HIDDEN"].split():
            raise ModuleNotFoundError(f"No module named {name!r} (hidden by scripts/gpu_closure.py)", name=name)
        return None


def _write():
    with open(os.path.join(os.environ["GPU_CLOSURE_TRACE"], f"{os.getpid()}.txt"), "w") as f:
        f.write("\\n".join(sorted(sys.modules)))


def _exit(status, _exit=os._exit):  # the torchrun workers end with os._exit (parallel/process_end.py)
    _write()
    _exit(status)


sys.meta_path.insert(0, _Hidden())
atexit.register(_write)
os._exit = _exit
'''


def canonical(name: str) -> str:
    """A distribution's name as pip compares them: lower case, ``-`` and ``.`` as ``_``."""
    return name.lower().replace("-", "_").replace(".", "_")


def traced_processes(commands: list[list[str]], scratch: Path) -> list[set[str]]:
    """The modules each Python process the commands start had imported when it ended."""
    site, trace = scratch / "site", scratch / "trace"
    site.mkdir()
    trace.mkdir()
    (site / "sitecustomize.py").write_text(TRACER)
    env = dict(os.environ, GPU_CLOSURE_TRACE=str(trace), GPU_CLOSURE_HIDDEN=" ".join(HIDDEN),
               TITAN_GPU_TESTS_ON_CPU="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")])))
    for command in commands:
        print("measuring:", " ".join(command), file=sys.stderr, flush=True)
        result = subprocess.run(command, cwd=ROOT, env=env, stdout=subprocess.DEVNULL)
        if result.returncode != 0:
            raise SystemExit(f"{command} exited {result.returncode}: its imports are not the stage's")
    return [set(path.read_text().split()) for path in trace.iterdir()]


def distributions(modules: set[str]) -> dict[str, str]:
    """``{distribution: installed version}`` of the third-party modules, ``NODE`` and the project left out."""
    owners = importlib.metadata.packages_distributions()
    found = {}
    for module in {name.partition(".")[0] for name in modules} - set(sys.stdlib_module_names):
        for name in owners.get(module, ()):
            if canonical(name) not in NODE and canonical(name) != "titan_cotrain":
                found[canonical(name)] = importlib.metadata.version(name)
    return dict(sorted(found.items()))


def measure(commands: list[list[str]]) -> tuple[dict[str, str], dict[str, str]]:
    """The closure of the commands' processes, and what only the pipeline stages' add to it."""
    with tempfile.TemporaryDirectory(prefix="gpu_closure_") as scratch:
        processes = traced_processes(commands, Path(scratch))
    closure = distributions(set().union(*(p for p in processes if PIPELINE_MODULE not in p)))
    pipeline = distributions(set().union(*(p for p in processes if PIPELINE_MODULE in p)))
    return closure, {name: version for name, version in pipeline.items() if name not in closure}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--measure", action="store_true", help="run the entry points with imports traced")
    parser.add_argument("--pipeline", action="store_true", help="with CLOSURE, what only the pipeline stages import")
    parser.add_argument("command", nargs="*", help="with --measure: one command to trace instead of the stages")
    args = parser.parse_args()
    if not args.measure:
        pins = CLOSURE | (PIPELINE_ONLY if args.pipeline else {})
        print("\n".join(f"{name}=={version}" for name, version in pins.items()))
        return 0
    closure, pipeline = measure([args.command] if args.command else list(STAGES))
    print("\n".join(f"{name}=={version}" for name, version in closure.items()))
    print("only the pipeline stages:", " ".join(f"{name}=={version}" for name, version in pipeline.items()))
    missing, unused = sorted(set(closure) - set(CLOSURE)), sorted(set(CLOSURE) - set(closure))
    print(f"CLOSURE lacks: {' '.join(missing) or 'nothing'}; not imported here: {' '.join(unused) or 'nothing'}")
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
