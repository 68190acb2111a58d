"""LM features and token statistics on the tiny model, against direct computations."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from leantrain.data.entropy import per_source, token_stats
from leantrain.data.features import HeadUtility, embed, encode_rows
from leantrain.errors import LeantrainError
from leantrain.models import load_model


@pytest.fixture(scope="module")
def tiny(tiny_path):
    return load_model(tiny_path)


def test_embed_is_the_mean_hidden_state_of_the_chosen_layer(tiny) -> None:
    model, tokenizer = tiny
    seqs = [p + a for p, a in encode_rows(tokenizer, ["12+3=", "7*8 ="], ["15", "56"])]
    got = embed(model, seqs, tokenizer.pad_token_id, layer=2, batch_size=2)
    for row, seq in enumerate(seqs):  # one at a time, no padding
        hidden = model(torch.tensor([seq]), output_hidden_states=True).hidden_states[2]
        np.testing.assert_allclose(got[row], hidden[0].mean(0).detach().numpy(), atol=1e-5)
    with pytest.raises(LeantrainError, match=r"layer must be in 1\.\.4"):
        embed(model, seqs, tokenizer.pad_token_id, layer=5)


def test_token_stats_match_the_full_softmax(tiny) -> None:
    model, tokenizer = tiny
    seqs = [p + a for p, a in encode_rows(tokenizer, ["1+1=", "23+45="], ["2", "68"])]
    stats = token_stats(model, seqs, tokenizer.pad_token_id, batch_size=2)
    for s, seq in zip(stats, seqs, strict=True):
        logp = torch.log_softmax(model(torch.tensor([seq])).logits[0, :-1], -1).detach()
        surprisal = -logp[torch.arange(len(seq) - 1), seq[1:]] / math.log(2)
        entropy = -(logp.exp() * logp).sum(-1) / math.log(2)
        assert s.tokens == len(seq) - 1
        np.testing.assert_allclose(s.surprisal, surprisal.numpy(), atol=1e-4)
        np.testing.assert_allclose(s.entropy, entropy.numpy(), atol=1e-4)
        assert 0 <= s.mean_entropy <= math.log2(model.config.vocab_size)
    summary = per_source(stats, ["a", "a"])["a"]
    assert summary["tokens"] == sum(s.tokens for s in stats)
    all_bits = np.concatenate([s.surprisal for s in stats])
    assert summary["total_bits"] == pytest.approx(all_bits.sum(), rel=1e-6)
    assert summary["mean_surprisal_bits"] == pytest.approx(all_bits.mean(), rel=1e-6)


def test_head_utility_retrains_on_the_subset() -> None:
    rng = np.random.default_rng(0)
    y = rng.integers(0, 2, 80)
    x = rng.normal(size=(80, 6)) + 3.0 * y[:, None]
    utility = HeadUtility(x[:40], y[:40], x[40:], y[40:], components=4)
    assert utility(np.arange(40)) > 0.9
    assert utility(np.array([], dtype=np.int64)) == 0.5  # chance with two classes
    one_class = np.flatnonzero(y[:40] == 1)
    assert utility(one_class) == pytest.approx(np.mean(y[40:] == 1))
    flipped = HeadUtility(x[:40], 1 - y[:40], x[40:], y[40:], components=4)
    assert flipped(np.arange(40)) < 0.1
