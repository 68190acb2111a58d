"""The packed scoring path: a batch as the tree of its distinct prefixes, and the lean Llama
forward over it, which must score what the model's own forward scores over the padded batch."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import GPT2Config, GPT2LMHeadModel, LlamaForCausalLM

from leantrain.models import load_model
from leantrain.tasks import make_task
from leantrain.training.logprobs import label_logprobs
from leantrain.zo.data import Pair, example_pairs, pad_pairs
from leantrain.zo.engine import ZOEngine
from leantrain.zo.estimators import SPSA
from leantrain.zo.lora import add_lora, lora_factors
from leantrain.zo.packed import LeanLlama, PrefixTree, prefix_groups

# Two rows share "5 6 7 8", one is a duplicate, one branches at its third token, one is plain
# text (empty prompt: every token but the first is scored).
PAIRS = [
    Pair([5, 6, 7], [8, 9]),
    Pair([5, 6, 3], [8]),
    Pair([5, 6, 7], [8, 9]),
    Pair([], [4, 5, 6]),
]


def gqa_llama(tiny: LlamaForCausalLM) -> LlamaForCausalLM:
    """The tiny model's shape with grouped-query attention (2 key/value heads for 4), random."""
    config = copy.deepcopy(tiny.config)
    config.num_key_value_heads = 2
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval()


@pytest.fixture(scope="module")
def tiny_and_pairs(tiny_path: Path):
    model, tokenizer = load_model(tiny_path)
    return model, example_pairs(tokenizer, make_task("sentiment").examples(12, 0))


def test_tree_holds_each_distinct_prefix_once() -> None:
    tree = PrefixTree.build(PAIRS)
    # Needed prefixes (a row's last token predicts nothing): 5, 56, 567, 5678 | 563 | 4, 45.
    assert tree.nodes == 7
    assert tree.row_tokens == 5 + 4 + 5 + 3
    rows = [p.prompt + p.completion for p in PAIRS]
    for r, row in enumerate(rows):
        path = tree.paths[r, : len(row) - 1]
        assert tree.tokens[path].tolist() == row[:-1]
        assert tree.positions[path].tolist() == list(range(len(row) - 1))
    # Every node is found again where its owner says.
    assert tree.paths.flatten()[tree.owners].tolist() == list(range(tree.nodes))
    # Scored: 8, 9 (twice), 8 after 5 6 3, and 5, 6 of the text row; the duplicate row shares
    # its predictors with the first.
    assert tree.targets.tolist() == [8, 9, 8, 8, 9, 5, 6]
    assert len(tree.predictors) == 5
    predicted_from = tree.tokens[tree.predictors[tree.picks]].tolist()
    assert predicted_from == [7, 8, 3, 7, 8, 4, 5]


@pytest.mark.parametrize("kind", ["tiny", "gqa"])
def test_lean_forward_scores_like_the_model(tiny_and_pairs, kind: str) -> None:
    tiny, pairs = tiny_and_pairs
    model, pairs = (tiny, pairs) if kind == "tiny" else (gqa_llama(tiny), PAIRS + pairs)
    ids, labels = pad_pairs(pairs, 0)
    with torch.inference_mode():
        expected, count = label_logprobs(model, ids, labels)
        tree = PrefixTree.build(pairs)
        got = LeanLlama(model).logprobs(tree)
    assert tree.nodes < tree.row_tokens  # the shared prefixes were packed
    assert len(tree.targets) == int(count.sum())
    assert got.shape == (1,)
    torch.testing.assert_close(got[0], expected.sum(), rtol=1e-5, atol=1e-5)


def test_stacked_states_score_like_each_state_alone(tiny_and_pairs) -> None:
    base, pairs = tiny_and_pairs
    torch.manual_seed(0)
    model = add_lora(copy.deepcopy(base), r=4, alpha=8, targets=["q_proj", "v_proj", "up_proj"])
    factors = lora_factors(model)
    states = [[torch.randn_like(f.weight) * 0.1 for f in factors] for _ in range(3)]
    stacks = {f: torch.stack([s[i] for s in states]) for i, f in enumerate(factors)}
    ids, labels = pad_pairs(pairs, 0)
    with torch.inference_mode():
        got = LeanLlama(model).logprobs(PrefixTree.build(pairs), stacks)
        expected = []
        for state in states:  # the model's own forward, weights swapped in
            for f, w in zip(factors, state, strict=True):
                f.weight.copy_(w)
            expected.append(label_logprobs(model, ids, labels)[0].sum())
    assert len(set(got.tolist())) == 3  # the states differ, and each scored as itself
    torch.testing.assert_close(got, torch.stack(expected), rtol=1e-5, atol=1e-5)


@pytest.mark.filterwarnings("ignore:Model has `tie_word_embeddings=True`")
@pytest.mark.filterwarnings("ignore::FutureWarning")  # peft calls a deprecated property
def test_unsupported_models_use_their_own_forward(tiny_and_pairs) -> None:
    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=40))
    assert not LeanLlama.supports(gpt2)
    assert ZOEngine(gpt2.requires_grad_(True), SPSA(1e-3), 1e-3, 0, 0).lean is None
    base, _ = tiny_and_pairs
    head_adapted = add_lora(copy.deepcopy(base), r=4, alpha=8, targets=["q_proj", "lm_head"])
    dora = get_peft_model(copy.deepcopy(base), LoraConfig(target_modules=["q_proj"], use_dora=True))
    assert LeanLlama.supports(base)
    assert not LeanLlama.supports(head_adapted) and not LeanLlama.supports(dora)


def test_prefix_groups_cap_the_tree(tiny_and_pairs) -> None:
    _, pairs = tiny_and_pairs
    groups = prefix_groups(pairs, 120)
    assert len(groups) > 1

    def key(p: Pair) -> list[int]:
        return p.prompt + p.completion

    assert sorted((p for g in groups for p in g), key=key) == sorted(pairs, key=key)
    assert all(PrefixTree.build(g).nodes <= 120 for g in groups)
    (whole,) = prefix_groups(pairs, 10_000)
    assert PrefixTree.build(whole).nodes == PrefixTree.build(pairs).nodes
