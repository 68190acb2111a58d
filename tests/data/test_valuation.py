"""`run_valuation` end to end on the tiny model: every output written and consistent with the
rows, bad rows listed by line, prices summing to the budget, proofs verifying the file."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np
import pytest

from leantrain.data.config import ValueConfig
from leantrain.data.merkle import MerkleTree, file_rows, load_proofs, verify_inclusion
from leantrain.data.valuation import run_valuation
from leantrain.errors import LeantrainError
from leantrain.settings import load_settings
from leantrain.tasks import make_task

CONFIGS = Path(__file__).parents[2] / "configs"


def write_rows(path: Path, n: int, answer=None) -> Path:
    """`n` sentiment rows from two sources, plus three bad lines at known places."""
    lines = [
        json.dumps(
            {
                "prompt": ex.prompt,
                "answer": answer(i) if answer else ex.answer,
                "source": f"s{i % 2}",
            }
        )
        for i, ex in enumerate(make_task("sentiment").examples(n, seed=1))
    ]
    lines.insert(2, "{not json")  # line 3
    lines.insert(6, json.dumps({"prompt": "p"}))  # line 7
    lines.insert(9, json.dumps({"prompt": " ", "answer": ""}))  # line 10
    path.write_text("\n".join(lines) + "\n")
    return path


def small_config(tiny_path: Path, data: Path, out: Path, **overrides) -> ValueConfig:
    return load_settings(
        ValueConfig,
        CONFIGS / "value.yaml",
        **{
            "data": data,
            "out": out,
            "model.name": str(tiny_path),
            "device": "cpu",
            "shapley.permutations": 4,
            "shapley.knn_k": 3,
            "tracin.steps": 4,
            "tracin.checkpoint_every": 2,
            "tracin.batch_size": 4,
            **overrides,
        },
    )


@pytest.fixture(scope="module")
def run(tiny_path, tmp_path_factory):
    folder = tmp_path_factory.mktemp("value")
    data = write_rows(folder / "rows.jsonl", 24)
    cfg = small_config(tiny_path, data, folder / "out")
    return cfg, run_valuation(cfg)


def test_every_output_is_written_and_bad_rows_are_listed(run) -> None:
    cfg, summary = run
    names = {
        "scores.csv",
        "scores.json",
        "summary.json",
        "merkle.json",
        "proofs.jsonl",
        "report.html",
    }
    assert names <= {p.name for p in cfg.out.iterdir()}
    assert summary["bad_rows"] == [
        {
            "line": 3,
            "reason": "invalid JSON (Expecting property name enclosed in double "
            "quotes at column 2)",
        },
        {"line": 7, "reason": "missing field 'answer'"},
        {"line": 10, "reason": "empty text (prompt and answer are both blank)"},
    ]
    assert summary["methods"] == ["beta_shapley", "knn_shapley", "loo", "tmc_shapley", "tracin"]
    assert summary["rows"] == 27 and summary["rows_valued"] + summary["rows_validation"] == 24
    assert json.loads((cfg.out / "summary.json").read_text()) == summary
    html = (cfg.out / "report.html").read_text()
    assert summary["merkle_root"] in html and html.count("data:image/png;base64") == 3


def test_scores_cover_every_valid_row_and_prices_sum_to_the_budget(run) -> None:
    cfg, summary = run
    with (cfg.out / "scores.csv").open() as f:
        records = list(csv.DictReader(f))
    assert len(records) == 24
    assert sorted(int(r["line"]) for r in records) == [
        n for n in range(1, 28) if n not in (3, 7, 10)
    ]
    valued = [r for r in records if r["split"] == "value"]
    assert len(valued) == summary["rows_valued"] == 19  # 24 - round(0.2 * 24)
    prices = np.array([float(r["price"]) for r in valued])
    assert prices.sum() == pytest.approx(cfg.pricing.budget)
    assert sum(s["price"] for s in summary["price_by_source"].values()) == pytest.approx(1000.0)
    for method in summary["methods"]:
        assert np.all(np.isfinite([float(r[method]) for r in valued]))
    assert all(r["price"] == "" for r in records if r["split"] == "validation")
    assert all(float(r["mean_surprisal_bits"]) > 0 for r in records)
    tokens = [json.loads(line) for line in (cfg.out / "tokens.jsonl").read_text().splitlines()]
    by_line = {t["line"]: t for t in tokens}
    for r in records:  # the per-token file behind each row's mean
        bits = by_line[int(r["line"])]["surprisal_bits"]
        assert len(bits) == int(r["tokens"])
        assert np.mean(bits) == pytest.approx(float(r["mean_surprisal_bits"]), abs=1e-3)


def test_the_committed_root_and_proofs_match_the_file(run) -> None:
    cfg, summary = run
    rows = file_rows(cfg.data)
    assert summary["merkle_root"] == MerkleTree(rows).root
    proofs = load_proofs(cfg.out / "proofs.jsonl")
    assert sorted(proofs) == list(range(1, 28))  # bad lines are committed too
    assert all(verify_inclusion(rows[n - 1], p, summary["merkle_root"]) for n, p in proofs.items())


def test_free_form_answers_skip_the_label_methods(tiny_path, tmp_path) -> None:
    data = write_rows(tmp_path / "rows.jsonl", 12, answer=lambda i: f"answer number {i}")
    cfg = small_config(tiny_path, data, tmp_path / "out", methods=["knn_shapley"])
    summary = run_valuation(cfg)
    assert summary["methods"] == []
    assert "distinct answers" in summary["skipped"]["knn_shapley"]
    assert set(summary["price_by_source"]) == {"s0", "s1"}


def test_user_errors(tiny_path, tmp_path) -> None:
    with pytest.raises(LeantrainError, match="give --data"):
        run_valuation(ValueConfig(out=tmp_path))
    with pytest.raises(LeantrainError, match=r"tracin\.projection"):
        load_settings(ValueConfig, None, **{"tracin.projection": 0})
    with pytest.raises(LeantrainError, match="methods"):
        load_settings(ValueConfig, None, methods=["shapley"])
    one = tmp_path / "one.jsonl"
    one.write_text('{"prompt": "a", "answer": "b"}\n')
    with pytest.raises(LeantrainError, match="at least 2 valid rows"):
        run_valuation(small_config(tiny_path, one, tmp_path / "o"))


def test_the_shipped_config_loads() -> None:
    cfg = load_settings(ValueConfig, CONFIGS / "value.yaml")
    assert cfg.model.name == "tiny" and sum(cfg.pricing.weights.values()) == pytest.approx(1.0)


def test_a_separate_validation_file_values_every_row(tiny_path, tmp_path) -> None:
    data = write_rows(tmp_path / "rows.jsonl", 12)
    valid = write_rows(tmp_path / "valid.jsonl", 8)
    cfg = small_config(tiny_path, data, tmp_path / "out", valid=valid, methods=["knn_shapley"])
    summary = run_valuation(cfg)
    assert summary["rows_valued"] == 12 and summary["rows_validation"] == 8
    assert [b["line"] for b in summary["bad_validation_rows"]] == [3, 7, 10]
    assert summary["methods"] == ["knn_shapley"]
