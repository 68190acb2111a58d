"""Batched label scoring against a plain full forward."""

from __future__ import annotations

from pathlib import Path

import torch

from leantrain.generation.scoring import label_logprobs
from leantrain.models import load_model
from leantrain.models.finetune import IGNORE


def test_label_logprobs_match_a_full_forward(tiny_path: Path) -> None:
    model, _ = load_model(tiny_path)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 259, (3, 12), generator=gen)
    labels = torch.full_like(ids, IGNORE)
    labels[0, 8:12] = ids[0, 8:12]  # a completion at the end
    labels[1, 5:9] = ids[1, 5:9]  # one in the middle, right padding after it
    labels[1, 9:] = IGNORE
    with torch.inference_mode():
        sums, counts = label_logprobs(model, ids, labels)
        logp = torch.log_softmax(model(input_ids=ids).logits.float(), -1)
    expected = torch.zeros(3)
    for row in range(3):
        for t in range(1, 12):
            if labels[row, t] != IGNORE:
                expected[row] += logp[row, t - 1, labels[row, t]]
    torch.testing.assert_close(sums, expected, rtol=1e-5, atol=1e-5)
    assert counts.tolist() == [4, 4, 0]  # row 2 has nothing to score: 0 and 0
    assert float(sums[2]) == 0.0


def test_nothing_to_score_needs_no_forward(tiny_path: Path) -> None:
    model, _ = load_model(tiny_path)
    ids = torch.ones(2, 5, dtype=torch.long)
    sums, counts = label_logprobs(model, ids, torch.full_like(ids, IGNORE))
    assert sums.tolist() == [0.0, 0.0] and counts.tolist() == [0, 0]
