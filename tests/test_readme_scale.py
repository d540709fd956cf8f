"""The README's real-scale table is exactly what the committed simulator reports say."""

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_readme_scale_table_matches_the_reports():
    spec = importlib.util.spec_from_file_location("scale_table", ROOT / "scripts" / "scale_table.py")
    scale_table = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(scale_table)
    readme = (ROOT / "README.md").read_text()
    assert scale_table.replace_in(readme, scale_table.render()) == readme, \
        "README's scale table is stale: run python scripts/scale_table.py --write"
    assert len(list((ROOT / "assets" / "scale").glob("*.json"))) >= 1
