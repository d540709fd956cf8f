"""The README's results tables are exactly what the committed benchmark JSONs give.

Reads ``assets/*.json`` and ``assets/quick/*.json`` only (no benchmark runs): a number in the
README that differs from its JSON, or a JSON changed without ``bench_all.py --write-readme``,
fails here."""

import importlib.util
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _bench_all():
    spec = importlib.util.spec_from_file_location("bench_all", ROOT / "scripts" / "bench_all.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_readme_results_tables_match_the_jsons():
    bench_all = _bench_all()
    readme = (ROOT / "README.md").read_text()
    assert bench_all.replace_in(readme, bench_all.render()) == readme, \
        "README's results tables are stale: run python scripts/bench_all.py --write-readme"


def test_every_claim_has_rows_and_a_changed_number_is_caught():
    bench_all = _bench_all()
    rows = bench_all.results_table(bench_all.ASSETS)
    for name, filename, make_rows in bench_all.SOURCES:
        result = json.loads((bench_all.ASSETS / filename).read_text())
        assert make_rows(result, name), f"{filename} gives no rows"
    assert bench_all.results_table(bench_all.QUICK), "no quick-run JSONs in assets/quick/"
    # The check compares numbers, not just the layout: one altered cell makes it differ.
    readme = (ROOT / "README.md").read_text()
    cell = rows[0].ours
    assert cell in readme
    altered = readme.replace(cell, cell + "0", 1)
    assert bench_all.replace_in(altered, bench_all.render()) != altered
