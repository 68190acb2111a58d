import math

import pytest
import torch

from leantrain.models.finetune import completion_chunks
from leantrain.safety.training import encode_pairs
from leantrain.safety.unlearn import (
    Batch,
    UnlearnConfig,
    npo_loss,
    rmu_layers,
    rmu_loss,
    token_nll,
    trained_parameters,
    unlearn,
)


def batches(tokenizer, corpus):
    def chunk(split):
        pairs = encode_pairs(tokenizer, [(f.prompt, f.completion) for f in corpus.facts(split)])
        return completion_chunks(pairs[:6], tokenizer.pad_token_id)[0]

    return chunk("forget"), chunk("retain")


def test_npo_at_the_reference_is_two_over_beta_log_two_plus_retain(tiny, corpus):
    # log(pi/pi_ref) = 0, so -(2/beta) log sigmoid(0) = (2/beta) log 2.
    model, tokenizer = tiny
    forget, retain = batches(tokenizer, corpus)
    cfg = UnlearnConfig(method="npo", npo_beta=0.5, retain_weight=0.3)
    loss, stats = npo_loss(model, Batch(forget, retain, model, cfg, {}))
    expected = (2 / 0.5) * math.log(2) + 0.3 * float(token_nll(model, *retain).detach())
    assert float(loss.detach()) == pytest.approx(expected, rel=1e-5)
    assert stats["log_ratio"] == pytest.approx(0.0, abs=1e-6)


def test_rmu_retain_term_is_zero_at_the_reference(tiny, corpus):
    model, tokenizer = tiny
    forget, retain = batches(tokenizer, corpus)
    hidden = model.config.hidden_size
    targets = {2: torch.zeros(hidden)}
    _, stats = rmu_loss(model, Batch(forget, retain, model, UnlearnConfig(method="rmu"), targets))
    assert stats["rmu_retain"] == pytest.approx(0.0, abs=1e-10)
    assert stats["rmu_forget"] > 0  # states are not zero
    assert rmu_layers(UnlearnConfig(method="rmu_multilayer"), 4) == [1, 2, 3, 4]
    assert rmu_layers(UnlearnConfig(method="rmu", rmu_layer=3), 4) == [3]


def test_gradient_ascent_raises_the_forget_loss(tiny, corpus):
    model, tokenizer = tiny
    forget, _ = batches(tokenizer, corpus)
    with torch.no_grad():
        before = float(token_nll(model, *forget))
    cfg = UnlearnConfig(method="ga", steps=3, lr=1e-3, batch_size=8)
    history = unlearn(model, tokenizer, corpus, cfg, progress=False)
    assert [h["step"] for h in history] == [1, 2, 3]
    with torch.no_grad():
        assert float(token_nll(model, *forget)) > before


def test_multilayer_rmu_moves_forget_states_towards_the_target(tiny, corpus):
    model, tokenizer = tiny
    cfg = UnlearnConfig(method="rmu_multilayer", steps=4, lr=1e-3, batch_size=12)
    history = unlearn(model, tokenizer, corpus, cfg, progress=False)
    # batch_size covers the whole forget set, so every step measures the same states.
    assert history[-1]["rmu_forget"] < history[0]["rmu_forget"]


def test_rmu_trains_only_the_blocks_up_to_its_layer(tiny):
    model, _ = tiny
    ids = {id(p) for p in trained_parameters(model, UnlearnConfig(method="rmu", rmu_layer=2))}
    blocks = model.model.layers
    assert ids == {id(p) for b in blocks[:2] for p in b.parameters()}
    assert id(model.model.embed_tokens.weight) not in ids  # tied to the output head
    every_block = trained_parameters(model, UnlearnConfig(method="rmu_multilayer"))
    assert len(every_block) == sum(1 for _ in blocks.parameters())
    assert len(trained_parameters(model, UnlearnConfig(method="npo"))) == len(
        list(model.parameters())
    )
