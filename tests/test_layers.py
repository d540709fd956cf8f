"""The packages import in one direction only: each imports from the layers below it, never
from its own layer's peers or above (function-level imports included), so there is no
import cycle. The package root is the one place that imports upward: it registers the
config checks of ``parallel`` and ``rl`` with ``config``."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "titan_cotrain"
# Lowest first; a package may import any package of a lower layer.
LAYERS = [
    ("components",),
    ("data", "ops"),
    ("models",),
    ("config", "cotrain"),
    ("parallel",),
    ("engine",),
    ("rl",),
    ("simulate",),
    ("train",),
    ("eval",),
    ("export",),
]
LEVEL = {package: i for i, layer in enumerate(LAYERS) for package in layer}


def _imports(path: Path) -> set[str]:
    """The ``titan_cotrain`` packages ``path`` imports, at module or function level."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = ([node.module] if isinstance(node, ast.ImportFrom) and node.module
                 else [a.name for a in node.names] if isinstance(node, ast.Import) else [])
        out |= {name.split(".")[1] for name in names if name.startswith("titan_cotrain.")}
    return out


def test_every_package_is_in_a_layer():
    packages = {p.name if p.is_dir() else p.stem for p in ROOT.iterdir()
                if (p.is_dir() and (p / "__init__.py").exists()) or (p.suffix == ".py" and p.stem != "__init__")}
    assert packages == set(LEVEL)


def test_packages_import_only_from_the_layers_below():
    upward = []
    for path in sorted(ROOT.rglob("*.py")):
        relative = path.relative_to(ROOT)
        if relative == Path("__init__.py"):
            continue
        package = relative.parts[0] if len(relative.parts) > 1 else relative.stem
        for target in _imports(path) - {package}:
            if LEVEL[target] >= LEVEL[package]:
                upward.append(f"{relative} imports titan_cotrain.{target}")
    assert upward == []


def test_the_root_registers_the_config_checks_of_the_packages_above_config():
    import titan_cotrain  # noqa: F401  (registers them)
    from titan_cotrain.config import validate

    modules = {check.__module__ for check in validate._CHECKS}
    assert modules == {"titan_cotrain.parallel.config_checks", "titan_cotrain.rl.config_checks"}
    assert _imports(ROOT / "__init__.py") == {"parallel", "rl"}


# The job config's sections, as a component would read them (``config.rollout.paged``).
SECTIONS = {"job", "model", "training", "parallelism", "optimizer", "lr_scheduler", "checkpoint", "metrics",
            "compile", "activation_checkpoint", "draft", "rl", "rollout", "task", "simulate", "comm", "debug"}


def _config_reads(path: Path) -> list[str]:
    """Where ``path`` takes the job config (an argument named ``config`` or ``job_config``) or
    reads one of its sections (``<name>.rollout``, ``<name>.draft`` ... on a name, or a
    section object passed under its own name: ``ro.paged`` is not caught, ``config.rollout`` is)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names = [a.arg for a in (*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs)]
            found += [f"{path.name}:{node.lineno} {node.name}({n})" for n in names if n in ("config", "job_config")]
        elif (isinstance(node, ast.Attribute) and node.attr in SECTIONS and isinstance(node.value, ast.Name)
              and node.value.id in ("config", "cfg", "job_config")):
            found.append(f"{path.name}:{node.lineno} {node.value.id}.{node.attr}")
    return found


def test_only_builders_read_the_job_config_below_the_trainer():
    """``engine``, ``cotrain``, ``ops`` and ``models`` get settings, not the config: only their
    builders (``build.py``) take the job config or read its sections (docs/DESIGN.md section 1)."""
    reads = [read for package in ("engine", "cotrain", "ops", "models")
             for path in sorted((ROOT / package).rglob("*.py")) if path.name != "build.py"
             for read in _config_reads(path)]
    assert reads == []
    # The check sees what it looks for: the builders do read it.
    assert _config_reads(ROOT / "engine" / "build.py") and _config_reads(ROOT / "models" / "build.py")
