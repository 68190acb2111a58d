import json

import numpy as np
import pytest

from leantrain.safety.attacks import truth_ratios
from leantrain.safety.audit import audit_model, markdown_table, write_report
from leantrain.safety.config import AuditConfig

ROW = {
    "direct": 0.25,
    "in_context": 0.5,
    "relearn": 0.75,
    "retain_utility": 1.0,
    "forget_quality": 0.0123,
    "truth_ratio_median": 0.9,
    "probe": [0.125, 0.5, 1.0],
}


def test_markdown_table_has_one_row_per_model():
    table = markdown_table({"npo": ROW, "ga": {**ROW, "direct": 0.0}})
    lines = table.strip().splitlines()
    assert lines[0].startswith("| model | direct | in-context | relearn |")
    assert lines[0].endswith("probe L0 | probe L1 | probe L2 |")
    assert lines[2] == "| npo | 25% | 50% | 75% | 100% | 0.0123 | 12% | 50% | 100% |"
    assert lines[3].startswith("| ga | 0% |")


def test_write_report_writes_json_markdown_and_plot(tmp_path):
    paths = write_report({"npo": ROW}, tmp_path / "audit")
    assert json.loads(paths["json"].read_text()) == {"npo": ROW}
    assert paths["markdown"].read_text() == markdown_table({"npo": ROW})
    assert paths["plot"].stat().st_size > 1000


def test_audit_model_runs_every_attack(tiny, corpus):
    model, tokenizer = tiny
    reference = truth_ratios(model, tokenizer, corpus, corpus.facts("forget"))
    result = audit_model(model, tokenizer, corpus, reference, AuditConfig(relearn_steps=2, shots=1))
    assert set(result) == set(ROW)
    # The tiny model never saw the corpus: nothing to extract, and its truth ratios are the
    # reference's own, so forget quality is 1.
    assert result["direct"] == result["in_context"] == result["retain_utility"] == 0.0
    assert result["forget_quality"] == pytest.approx(1.0)
    assert len(result["probe"]) == model.config.num_hidden_layers + 1
    assert np.isfinite(result["truth_ratio_median"])
