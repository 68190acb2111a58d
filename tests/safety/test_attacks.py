import numpy as np
import pytest
import torch

from leantrain.safety.attacks import (
    extraction_rate,
    forget_quality,
    in_context_prompts,
    last_token_states,
    probe_accuracy,
    truth_ratios,
)
from leantrain.safety.training import padded_in_order, sft


def test_padded_in_order_keeps_the_callers_order():
    pairs = [([5, 6, 7], [8]), ([5], [9]), ([5, 6], [4, 4])]
    ids, labels = padded_in_order(pairs, pad_id=0)
    assert ids.tolist() == [[5, 6, 7, 8], [5, 9, 0, 0], [5, 6, 4, 4]]
    assert labels.tolist() == [[-100, -100, -100, 8], [-100, 9, -100, -100], [-100, -100, 4, 4]]


def test_last_token_states_match_one_prompt_at_a_time(tiny):
    model, tokenizer = tiny
    prompts = ["city of Ana Lind:", "phone of Bo:", "email of Quin Rowe:"]
    states = last_token_states(model, tokenizer, prompts)
    assert states.shape == (model.config.num_hidden_layers + 1, 3, model.config.hidden_size)
    for i, prompt in enumerate(prompts):
        ids = torch.tensor([tokenizer.encode(prompt, add_special_tokens=False)])
        with torch.no_grad():
            alone = model(input_ids=ids, output_hidden_states=True).hidden_states
        for layer, s in enumerate(alone):
            np.testing.assert_allclose(states[layer, i], s[0, -1].numpy(), atol=1e-4)


def test_memorising_facts_makes_them_extractable(tiny, corpus):
    model, tokenizer = tiny
    facts = corpus.facts("forget_eval", ("city",))
    assert extraction_rate(model, tokenizer, facts) == 0.0  # the tiny model never saw them
    ratios_before = truth_ratios(model, tokenizer, corpus, facts)
    sft(
        model,
        tokenizer,
        [(f.prompt, f.completion) for f in facts],
        steps=40,
        lr=3e-3,
        progress=False,
    )
    assert extraction_rate(model, tokenizer, facts) == 1.0
    ratios_after = truth_ratios(model, tokenizer, corpus, facts)
    # Knowing the answer makes wrong answers relatively far less likely.
    assert np.all(ratios_after < ratios_before)
    assert np.all(ratios_after < 0.5)


def test_cosine_schedule_warms_up_from_zero(tiny):
    # The first step of a warm-up runs at learning rate 0; a constant schedule moves at once.
    model, tokenizer = tiny
    before = [p.detach().clone() for p in model.parameters()]
    pairs = [("city of Ana Lind: ", "Oslo\n")]
    sft(model, tokenizer, pairs, steps=1, lr=1e-2, schedule="cosine", progress=False)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    sft(model, tokenizer, pairs, steps=1, lr=1e-2, progress=False)
    assert not all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


def test_in_context_prompts_use_retain_facts_of_the_same_attribute(corpus):
    facts = corpus.facts("forget_eval")
    prompts = in_context_prompts(corpus, facts, shots=2)
    retain_lines = {f.line for f in corpus.facts("retain")}
    for fact, prompt in zip(facts, prompts, strict=True):
        *shots, question = prompt.split("\n")
        assert question == fact.prompt
        assert len(shots) == 2
        assert all(s + "\n" in retain_lines and s.startswith(fact.attribute) for s in shots)


def test_probe_accuracy_has_one_value_per_layer(tiny, corpus):
    model, tokenizer = tiny
    accuracies = probe_accuracy(model, tokenizer, corpus)
    assert len(accuracies) == model.config.num_hidden_layers + 1
    assert all(0.0 <= a <= 1.0 for a in accuracies)


def test_forget_quality_is_a_ks_p_value():
    rng = np.random.default_rng(0)
    same = rng.uniform(0.9, 1.1, 200)
    assert forget_quality(same, same) == pytest.approx(1.0)
    assert forget_quality(rng.uniform(0.0, 0.1, 50), same) < 1e-10
