"""Correctness of the rollout engine against Hugging Face `generate` and fresh forward passes.

The model (conftest.py) is a random-init tiny Llama with a wide init (std 0.3) so greedy margins
are not degenerate: `hf_greedy` checks the top two logits differ by > 1e-4 along every reference
path, far above the ~1e-6 that left padding and batching perturb them by.
"""

from __future__ import annotations

import collections
import contextlib

import pytest
import torch
from transformers import LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from leantrain.generation import Completion, Engine, SamplingParams, sample


def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """Reference: HF generate on one unpadded prompt; checks the greedy margins are not ties."""
    out = model.generate(
        torch.tensor([prompt]),
        do_sample=False,
        max_new_tokens=max_new_tokens,
        output_scores=True,
        return_dict_in_generate=True,
    )
    top2 = torch.stack(out.scores)[:, 0].topk(2, dim=-1).values  # (steps, 2)
    assert (top2[:, 0] - top2[:, 1]).min() > 1e-4, "near-tie in greedy path: widen the init"
    return out.sequences[0, len(prompt) :].tolist()


@contextlib.contextmanager
def extra_eos(model, tok, ids: list[int]):
    """Make `ids` end sequences too, so they finish at staggered steps and queued prompts join a
    running batch (continuous batching)."""
    saved = model.generation_config.eos_token_id
    model.generation_config.eos_token_id = [tok.eos_token_id, *ids]
    try:
        yield
    finally:
        model.generation_config.eos_token_id = saved


def fresh_forward(model, c: Completion) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits (R, V) and last-layer hiddens (R, H) at the positions that sampled the response."""
    ids = torch.tensor([c.prompt_ids + c.response_ids])
    with torch.no_grad():
        out = model(ids, output_hidden_states=True)
    span = slice(len(c.prompt_ids) - 1, ids.shape[1] - 1)
    return out.logits[0, span], out.hidden_states[-1][0, span]


def test_greedy_matches_hf_generate_with_continuous_batching(model, tok, prompts):
    # The extra EOS: the token that greedy paths first hit at the most different steps.
    free_run = [hf_greedy(model, p, 40) for p in prompts]
    first_steps = collections.defaultdict(set)
    for response in free_run:
        for t in set(response):
            first_steps[t].add(response.index(t))
    stop_id = max(first_steps, key=lambda t: len(first_steps[t]))
    with extra_eos(model, tok, [stop_id]):
        expected = [hf_greedy(model, p, 40) for p in prompts]
        got = Engine(model, tok, max_batch_size=3).generate(
            prompts, SamplingParams(max_new_tokens=40, temperature=0)
        )
    assert len({len(r) for r in expected}) >= 3, "the test should stagger finishing times"
    for c, p, ref in zip(got, prompts, expected, strict=True):
        assert c.prompt_ids == p
        assert c.response_ids == ref
        assert c.finish_reason == ("eos" if ref[-1] == stop_id else "length")


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_new_tokens=24, temperature=0),
        SamplingParams(max_new_tokens=24, temperature=0.7, top_p=0.9),
        SamplingParams(max_new_tokens=24, temperature=1.3, top_k=20),
    ],
    ids=["greedy", "t0.7-p0.9", "t1.3-k20"],
)
def test_logprobs_and_hidden_states_match_fresh_forward(model, tok, prompts, params):
    with extra_eos(model, tok, list(range(100, 120))):
        got = Engine(model, tok, max_batch_size=3).generate(
            prompts, params, seed=0, return_hidden_states=True
        )
    assert len({len(c.response_ids) for c in got}) >= 3, "the test should stagger finishing"
    temperature = params.temperature or 1.0
    for c in got:
        logits, hidden = fresh_forward(model, c)
        ref = (
            (logits / temperature).log_softmax(-1).gather(-1, torch.tensor(c.response_ids)[:, None])
        )
        assert len(c.logprobs) == len(c.response_ids)
        assert (torch.tensor(c.logprobs) - ref.squeeze(-1)).abs().max() < 1e-4
        assert c.hidden_states.shape == (len(c.response_ids), model.config.hidden_size)
        assert (c.hidden_states - hidden).abs().max() < 1e-4


def test_seed_reproducible_and_top_k_1_is_greedy(model, tok, prompts):
    engine = Engine(model, tok, max_batch_size=4)
    params = SamplingParams(max_new_tokens=16, temperature=1.0)
    first = engine.generate(prompts, params, seed=1)
    again = engine.generate(prompts, params, seed=1)
    other = engine.generate(prompts, params, seed=2)
    assert [c.response_ids for c in first] == [c.response_ids for c in again]
    assert [c.logprobs for c in first] == [c.logprobs for c in again]
    assert [c.response_ids for c in first] != [c.response_ids for c in other]

    greedy = engine.generate(prompts, SamplingParams(max_new_tokens=16, temperature=0))
    top1 = engine.generate(
        prompts, SamplingParams(max_new_tokens=16, temperature=1.0, top_k=1), seed=3
    )
    assert [c.response_ids for c in top1] == [c.response_ids for c in greedy]
    for a, b in zip(top1, greedy, strict=True):
        assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5)


def first_stop(response: list[int], tok, stops: tuple[str, ...]) -> int | None:
    """Length of the shortest prefix of `response` whose text contains a stop string."""
    ends = (
        k for k in range(1, len(response) + 1) if any(s in tok.decode(response[:k]) for s in stops)
    )
    return next(ends, None)


def test_stop_strings_truncate_after_the_completing_token(model, tok, prompts):
    engine = Engine(model, tok, max_batch_size=3)
    free = engine.generate(prompts, SamplingParams(max_new_tokens=30, temperature=0))
    # Two-token stop strings cut from the middle of greedy responses (printable ASCII only, so
    # byte-level decoding of the tail is unambiguous).
    stops = []
    for c in free:
        for j in range(5, 28):
            s = tok.decode(c.response_ids[j : j + 2])
            if len(s) == 2 and s.isprintable() and s.isascii():
                stops.append(s)
                break
    params = SamplingParams(max_new_tokens=30, temperature=0, stop=tuple(stops[:3]))
    got = engine.generate(prompts, params)
    for c, f in zip(got, free, strict=True):
        cut = first_stop(f.response_ids, tok, params.stop)
        if cut is None:
            assert c.response_ids == f.response_ids and c.finish_reason == "length"
        else:
            assert c.response_ids == f.response_ids[:cut] and c.finish_reason == "stop"
    assert sum(c.finish_reason == "stop" for c in got) >= 3

    # A stop string at the end of the prompt does not count: only the response is matched.
    prompt = prompts[0] + tok.encode(stops[0])
    greedy = SamplingParams(max_new_tokens=3, temperature=0)
    (free_p,) = engine.generate([prompt], greedy)
    assert first_stop(free_p.response_ids, tok, (stops[0],)) is None
    (c,) = engine.generate(
        [prompt], SamplingParams(max_new_tokens=3, temperature=0, stop=stops[:1])
    )
    assert c.response_ids == free_p.response_ids and c.finish_reason == "length"


def test_eos_and_length(model, tok, prompts):
    params = SamplingParams(max_new_tokens=12, temperature=0)
    engine = Engine(model, tok, max_batch_size=2)
    free = engine.generate(prompts[:1], params)[0]
    assert free.finish_reason == "length" and len(free.response_ids) == 12
    # Make the 5th greedy token an EOS: the response ends with it, inclusive.
    with extra_eos(model, tok, [free.response_ids[4]]):
        c = Engine(model, tok).generate(prompts[:1], params)[0]
    cut = free.response_ids.index(free.response_ids[4]) + 1
    assert c.finish_reason == "eos" and c.response_ids == free.response_ids[:cut]
    (one,) = engine.generate(prompts[:1], SamplingParams(max_new_tokens=1, temperature=1.0))
    assert len(one.response_ids) == 1 and len(one.logprobs) == 1


def test_empty_and_invalid_prompts(model, tok):
    engine = Engine(model, tok)
    assert engine.generate([], SamplingParams()) == []
    with pytest.raises(ValueError, match=r"prompts\[1\]"):
        engine.generate([[5, 6], []], SamplingParams())
    with pytest.raises(ValueError, match=r"prompts\[0\]"):
        engine.generate([[10_000]], SamplingParams())
    with pytest.raises(ValueError, match="max_batch_size"):
        Engine(model, tok, max_batch_size=0)


def test_bf16_and_train_mode_restored(model, tok, prompts):
    bf16 = LlamaForCausalLM(model.config).to(torch.bfloat16)
    bf16.load_state_dict(model.state_dict())
    bf16.train()
    got = Engine(bf16, tok, max_batch_size=4).generate(
        prompts,
        SamplingParams(max_new_tokens=8, temperature=1.0),
        seed=0,
        return_hidden_states=True,
    )
    assert bf16.training
    assert all(len(c.response_ids) == 8 or c.finish_reason == "eos" for c in got)
    assert got[0].hidden_states.dtype == torch.bfloat16


def test_other_architecture_qwen2(tok, prompts):
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        initializer_range=0.3,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    qwen = Qwen2ForCausalLM(config).eval()
    got = Engine(qwen, tok, max_batch_size=3).generate(
        prompts, SamplingParams(max_new_tokens=10, temperature=0)
    )
    for c, p in zip(got, prompts, strict=True):
        assert c.response_ids == hf_greedy(qwen, p, 10)


def test_progress_bar_runs(model, tok, prompts):
    got = Engine(model, tok, max_batch_size=3).generate(
        prompts, SamplingParams(max_new_tokens=4, temperature=1.0), seed=0, progress=True
    )
    assert len(got) == len(prompts)


@pytest.mark.parametrize(
    ("params", "expected"),
    [
        (SamplingParams(temperature=1.0), [0.05, 0.4, 0.0, 0.3, 0.25]),
        (SamplingParams(temperature=1.0, top_k=2), [0.0, 0.4 / 0.7, 0.0, 0.3 / 0.7, 0.0]),
        # mass before the 4th-ranked token (0.05) is 0.95 >= 0.75: it and the rest are cut
        (
            SamplingParams(temperature=1.0, top_p=0.75),
            [0.0, 0.4 / 0.95, 0.0, 0.3 / 0.95, 0.25 / 0.95],
        ),
        (
            SamplingParams(temperature=0.5),
            [x / 0.315 for x in (0.0025, 0.16, 0.0, 0.09, 0.0625)],
        ),
    ],
    ids=["plain", "top_k", "top_p", "temperature"],
)
def test_sampler_frequencies_and_unfiltered_logprobs(params, expected):
    probs = torch.tensor([0.05, 0.4, 1e-9, 0.3, 0.25])
    logits = probs.log().repeat(40_000, 1)
    tokens, logprobs = sample(logits, params, torch.Generator().manual_seed(0))
    freq = torch.bincount(tokens, minlength=5) / len(tokens)
    assert torch.allclose(freq, torch.tensor(expected), atol=0.01)
    # Logprobs are of the temperature-scaled distribution before top-k/top-p filtering.
    behaviour = (logits[0] / params.temperature).log_softmax(-1)
    assert torch.allclose(logprobs, behaviour[tokens], atol=1e-6)
