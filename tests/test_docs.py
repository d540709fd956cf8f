"""The documents point at code that exists: every module path, config file and script named in
``README.md`` and ``docs/DESIGN.md`` is in the repository, and nothing points outside it."""

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = ["README.md", "docs/DESIGN.md"]
# `models/draft.py`, `titan_cotrain/rl/trainer.py`, `parallel/pipeline/`, `train_configs/x.toml`,
# `scripts/bench_pp.py`: code spans that name a file or folder of the project.
PATH = re.compile(r"`((?:[\w.]+/)+[\w.]*\.(?:py|toml|md|json|sh)|(?:[\w]+/)+)`")


def _named_paths(text: str) -> set[str]:
    return {m.group(1) for m in PATH.finditer(text)}


def _exists(name: str) -> bool:
    """Named from the repository root, from the package (``models/draft.py``) or from the
    folder that holds such files (``train_configs/``, ``assets/``)."""
    roots = [REPO, REPO / "titan_cotrain", REPO / "train_configs", REPO / "assets", REPO / "scripts"]
    return any((root / name).exists() for root in roots)


@pytest.mark.parametrize("doc", DOCS)
def test_every_named_path_exists(doc):
    text = (REPO / doc).read_text()
    names = _named_paths(text)
    assert len(names) > 10, names  # the pattern does find the document's paths
    missing = sorted(n for n in names if not n.startswith(("torchtitan/", "outputs/", "/")) and not _exists(n))
    assert not missing, f"{doc} names paths that do not exist: {missing}"


@pytest.mark.parametrize("doc", DOCS)
def test_nothing_points_outside_the_repository(doc):
    assert "../" not in (REPO / doc).read_text()
