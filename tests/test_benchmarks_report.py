"""docs/benchmarks.md's claims table is what `benchmarks/report.py` generates from
benchmarks/results/*.json: a figure changed by a rerun, a claim added or a hand edit of the table
fails CI until `make report` is run and committed."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

ROOT = Path(__file__).parents[1]
spec = importlib.util.spec_from_file_location(
    "benchmarks_report", ROOT / "benchmarks" / "report.py"
)
report = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = report  # dataclasses look their module up there
spec.loader.exec_module(report)


def test_the_committed_claims_table_is_the_generated_one() -> None:
    committed = report.committed_table(report.DOC.read_text())
    assert committed == report.table(), "docs/benchmarks.md's claims table is stale: make report"


def test_every_claim_names_an_existing_file_and_key() -> None:
    for claim in report.CLAIMS:
        data = json.loads((report.RESULTS / claim.results).read_text())
        report.lookup(data, claim.key)  # KeyError names a missing key
        assert claim.compare in report.COMPARE, claim


def test_lookup_reads_dotted_keys_and_differences() -> None:
    data = {"after": 0.75, "before": 0.25, "nested": {"ratio": 0.5}}
    assert report.lookup(data, "nested.ratio") == 0.5
    assert report.lookup(data, "after - before") == 0.5


def test_a_claim_is_met_by_its_comparison(tmp_path: Path, monkeypatch) -> None:
    stamped = {"commit": "abc1234", "date": "2026-12-01T10:00:00+00:00", "machine": "2 CPU cores"}
    (tmp_path / "x.json").write_text(json.dumps({**stamped, "speedup": 1.4}))
    monkeypatch.setattr(report, "RESULTS", tmp_path)
    met = report.row(report.Claim("x", "x.json", "speedup", ">=", 1.3, "{:.2f}x", "issue 0"))
    missed = report.row(report.Claim("x", "x.json", "speedup", ">=", 1.5, "{:.2f}x", "issue 0"))
    assert met == (
        "| x | 1.40x | >= 1.30x | yes | `x.json` `speedup` | abc1234 | 2026-12-01 | 2 CPU cores "
        "| issue 0 |"
    )
    assert "| 1.40x | >= 1.50x | **no** |" in missed


def test_a_null_figure_is_shown_as_none_and_not_met(tmp_path: Path, monkeypatch) -> None:
    stamped = {"commit": "abc1234", "date": "2026-12-01T10:00:00+00:00", "machine": "2 CPU cores"}
    (tmp_path / "x.json").write_text(json.dumps({**stamped, "ratio": None}))
    monkeypatch.setattr(report, "RESULTS", tmp_path)
    line = report.row(report.Claim("x", "x.json", "ratio", ">=", 2.0, "{:.2f}x", "issue 0"))
    assert "| x | none | >= 2.00x | **no** |" in line
