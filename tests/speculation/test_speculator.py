"""Speculative decoding is lossless: greedy output is identical token for token, and sampled
output follows the target's distribution exactly (chi-square against the exact joint
distribution of three tokens of a small-vocabulary model), whatever the drafter proposes."""

from __future__ import annotations

import itertools
import random

import pytest
import torch
from scipy.stats import chisquare
from transformers import LlamaConfig, LlamaForCausalLM

from leantrain.errors import LeantrainError
from leantrain.generation import Engine, SamplingParams
from leantrain.generation.sampling import sampling_distribution
from leantrain.generation.speculative import Draft
from leantrain.speculation.bandit import Arm
from leantrain.speculation.config import SpeculativeConfig
from leantrain.speculation.drafter import EagleDrafter
from leantrain.speculation.speculator import BanditSpeculator
from leantrain.speculation.suffix_drafter import SuffixDrafter


class ScriptedDrafter:
    """Drafts the known greedy continuation, corrupted at a random position in half the rows, so
    rows accept different numbers of tokens (and the cache gets holes)."""

    needs_hidden = False

    def __init__(self, references: dict[tuple[int, ...], list[int]], seed: int = 0) -> None:
        self.references = references
        self.rng = random.Random(seed)

    def begin(self, seqs):
        pass

    def end(self):
        pass

    def propose(self, seqs, hidden, k, params, generator):
        tokens = torch.zeros(len(seqs), k, dtype=torch.long)
        for i, s in enumerate(seqs):
            ref = self.references[tuple(s.prompt_ids)]
            done = len(s.response_ids)
            truth = (ref[done : done + k] + [0] * k)[:k]
            if self.rng.random() < 0.5:
                truth[self.rng.randrange(k)] = self.rng.randrange(256)
            tokens[i] = torch.tensor(truth)
        return Draft(tokens, torch.full((len(seqs),), k))


class RandomDrafter:
    """Drafts from a random distribution q (or a random fixed token when deterministic)."""

    needs_hidden = False

    def __init__(self, vocab: int, stochastic: bool) -> None:
        self.vocab, self.stochastic = vocab, stochastic

    def begin(self, seqs):
        pass

    def end(self):
        pass

    def propose(self, seqs, hidden, k, params, generator):
        n = len(seqs)
        if not self.stochastic:
            tokens = torch.randint(self.vocab, (n, k), generator=generator)
            return Draft(tokens, torch.full((n,), k))
        q = (2 * torch.randn(n, k, self.vocab, generator=generator)).softmax(-1)
        tokens = torch.multinomial(q.view(-1, self.vocab), 1, generator=generator).view(n, k)
        return Draft(tokens, torch.full((n,), k), q)


def speculator(drafter, threshold: int, lengths=(1, 3)) -> BanditSpeculator:
    config = SpeculativeConfig(enabled=True, threshold=threshold, draft_lengths=list(lengths))
    return BanditSpeculator(config, {"drafter": drafter})


def staggered_engine(model, tok, spec=None) -> Engine:
    """Batch of 3 with extra EOS ids, so rows finish at different steps, some inside a draft."""
    engine = Engine(model, tok, max_batch_size=3, speculator=spec)
    engine.eos_ids = engine.eos_ids | {101, 104, 111}
    return engine


@pytest.mark.parametrize("kind", ["scripted", "suffix", "eagle"])
def test_greedy_output_identical_with_speculation(model, tok, prompts, kind):
    params = SamplingParams(max_new_tokens=40, temperature=0)
    base = staggered_engine(model, tok).generate(prompts, params, return_hidden_states=True)
    assert len({len(c.response_ids) for c in base}) >= 3, "the test should stagger finishing"
    drafter = {
        "scripted": lambda: ScriptedDrafter({tuple(c.prompt_ids): c.response_ids for c in base}),
        "suffix": lambda: SuffixDrafter(min_match=1),
        "eagle": lambda: EagleDrafter(model),
    }[kind]()
    # Threshold 2 < batch 3: rows decode normally, speculate once two are left, and go back to
    # normal decoding when a queued prompt joins.
    spec = speculator(drafter, threshold=2)
    got = staggered_engine(model, tok, spec).generate(prompts, params, return_hidden_states=True)
    for a, b in zip(base, got, strict=True):
        assert b.response_ids == a.response_ids
        assert b.finish_reason == a.finish_reason
        assert torch.allclose(torch.tensor(b.logprobs), torch.tensor(a.logprobs), atol=1e-4)
        assert (b.hidden_states - a.hidden_states).abs().max() < 1e-4
    assert spec.stats.verify_rows > 0
    if kind == "scripted":  # both branches were taken: partial acceptance and rejection
        assert 0 < spec.stats.accepted < spec.stats.drafted
        assert spec.stats.mean_accept_len > 1.5


@pytest.fixture(scope="module")
def small_vocab_model():
    torch.manual_seed(1)
    config = LlamaConfig(
        vocab_size=6,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        initializer_range=0.5,
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=None,
    )
    return LlamaForCausalLM(config).eval()


class NoEosTokenizer:
    eos_token_id = None


def exact_joint(model, prompt: list[int], params: SamplingParams, n: int) -> torch.Tensor:
    """P(next n tokens) (V^n,) under `sample`'s distribution, from one forward per prefix."""
    vocab = model.config.vocab_size
    joint = torch.ones(1)
    for depth in range(n):
        prefixes = list(itertools.product(range(vocab), repeat=depth))
        ids = torch.tensor([prompt + list(p) for p in prefixes])
        with torch.no_grad():
            logits = model(ids).logits[:, -1]
        probs, _ = sampling_distribution(logits, params)  # (V^depth, V)
        joint = (joint[:, None] * probs).reshape(-1)
    return joint


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_new_tokens=3, temperature=1.0),
        SamplingParams(max_new_tokens=3, temperature=0.7, top_p=0.8),
    ],
    ids=["t1.0", "t0.7-p0.8"],
)
@pytest.mark.parametrize("stochastic", [True, False], ids=["q-random", "q-one-hot"])
def test_sampled_distribution_matches_target(small_vocab_model, params, stochastic):
    model, vocab, draws = small_vocab_model, 6, 6000
    prompt = [1, 4, 2]
    spec = speculator(RandomDrafter(vocab, stochastic), threshold=draws, lengths=(2,))
    engine = Engine(model, NoEosTokenizer(), max_batch_size=draws, speculator=spec)
    got = engine.generate([prompt] * draws, params, seed=0)
    # Token 1 comes from the prefill's logits; tokens 2 and 3 from speculative steps (k = 2),
    # some accepted, some drawn from the residual after a rejection.
    assert spec.stats.verify_rows >= draws and 0 < spec.stats.accepted < spec.stats.drafted
    codes = torch.tensor(
        [(c.response_ids[0] * vocab + c.response_ids[1]) * vocab + c.response_ids[2] for c in got]
    )
    observed = torch.bincount(codes, minlength=vocab**3).double()
    expected = exact_joint(model, prompt, params, 3).double() * draws
    # Cells expected below 5 are pooled, as the chi-square approximation needs.
    small = expected < 5
    obs = torch.cat([observed[~small], observed[small].sum()[None]])
    exp = torch.cat([expected[~small], expected[small].sum()[None]])
    keep = exp > 0
    assert observed[expected == 0].sum() == 0  # never a token the target cannot sample
    _, p_value = chisquare(
        obs[keep].numpy(), exp[keep].numpy() * obs.sum().item() / exp.sum().item()
    )
    assert p_value > 1e-3


def test_engine_reports_every_arm_to_the_bandit(model, tok, prompts):
    # Draft length 0 is the "don't speculate" arm: it must be timed and rewarded like the others.
    spec = speculator(SuffixDrafter(min_match=1), threshold=3, lengths=(0, 2))
    Engine(model, tok, max_batch_size=3, speculator=spec).generate(
        prompts, SamplingParams(max_new_tokens=40, temperature=0)
    )
    rewarded = {arm for (_, arm), rewards in spec.bandit.rewards.items() if rewards}
    assert rewarded == set(spec.bandit.arms) == {Arm("none", 0), Arm("drafter", 2)}
    assert spec.stats.arms["none:0"] > 0 and spec.stats.arms["drafter:2"] > 0


def test_config_rejects_unknown_drafters_and_bad_lengths():
    with pytest.raises(ValueError, match="unknown drafters"):
        SpeculativeConfig(drafters=["medusa"])
    with pytest.raises(ValueError, match="draft_lengths"):
        SpeculativeConfig(draft_lengths=[-1])
    with pytest.raises(LeantrainError, match="at least one drafter"):
        BanditSpeculator(SpeculativeConfig(enabled=True), {})
