"""Stochastic KV routing: sharing patterns, training-time routing, and the engine decoding with
fewer cached layers exactly as a cacheless recomputation with the same routing would; on the
tiny model (one key/value head per query head) and on a grouped-query one (SmolLM2's kind)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import LlamaForCausalLM

from leantrain.errors import LeantrainError
from leantrain.generation import Engine, SamplingParams
from leantrain.generation import engine as engine_module
from leantrain.models import load_model
from leantrain.models.finetune import backward_token_mean, completion_chunks
from leantrain.models.tiny_config import tiny_config
from leantrain.serving.kv_routing import KVRouter, kv_cache_bytes, sharing_pattern


@pytest.fixture
def tiny(tiny_path: Path):
    return load_model(tiny_path)


@pytest.fixture
def gqa(tok):
    """A random-init tiny Llama whose 4 query heads share 2 key/value heads (grouped-query
    attention, as SmolLM2-135M's 9 share 3), wide init so greedy margins beat float noise."""
    torch.manual_seed(0)
    config = tiny_config(tok)
    config.num_key_value_heads, config.initializer_range = 2, 0.3
    return LlamaForCausalLM(config).eval(), tok


@pytest.mark.parametrize(
    ("layers", "fraction", "expected"),
    [(4, 0.0, ()), (4, 0.25, (3,)), (4, 0.5, (1, 3)), (4, 0.75, (1, 2, 3)), (6, 0.5, (1, 3, 5))],
)
def test_sharing_pattern_drops_every_second_layer_first(layers, fraction, expected) -> None:
    assert sharing_pattern(layers, fraction) == expected


def test_bad_patterns_are_refused(tiny) -> None:
    model, _ = tiny
    with pytest.raises(LeantrainError, match="layer 0 keeps"):
        KVRouter(model, shared=(0,))
    with pytest.raises(LeantrainError, match="route_prob"):
        KVRouter(model, route_prob=1.5)
    with pytest.raises(LeantrainError, match="drop_fraction"):
        sharing_pattern(4, 1.0)


def _greedy_without_cache(model, prompt: list[int], steps: int) -> list[int]:
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(steps):
            ids.append(int(model(torch.tensor([ids]), use_cache=False).logits[0, -1].argmax()))
    return ids[len(prompt) :]


@pytest.mark.parametrize("which", ["tiny", "gqa"])
def test_engine_decodes_with_a_smaller_cache_exactly_like_recomputation(
    which, request, monkeypatch
) -> None:
    model, tokenizer = request.getfixturevalue(which)
    prompts = [tokenizer.encode(p) for p in ("3 + 4 =", "sum of 1 2 3 is", "7 - 2")]
    caches = []

    class SpyCache(engine_module.RoomyCache):
        def __init__(self) -> None:
            super().__init__()
            caches.append(self)

    monkeypatch.setattr(engine_module, "RoomyCache", SpyCache)
    params = SamplingParams(max_new_tokens=12, temperature=0.0)
    full = Engine(model, tokenizer, 4).generate(prompts, params)
    assert len(caches[-1].live_layers()) == 4
    router = KVRouter(model, shared=(1, 3))
    shared = Engine(model, tokenizer, 4).generate(prompts, params)
    assert len(caches[-1].live_layers()) == 2  # layers 1 and 3 stored nothing
    for prompt, completion in zip(prompts, shared, strict=True):
        steps = len(completion.response_ids)  # up to 12, fewer if it stopped at EOS
        assert completion.response_ids == _greedy_without_cache(model, prompt, steps)
    # Sharing changes what the (unrouted) model computes; removing the router restores it.
    assert [c.response_ids for c in shared] != [c.response_ids for c in full]
    router.remove()
    restored = Engine(model, tokenizer, 4).generate(prompts, params)
    assert [c.response_ids for c in restored] == [c.response_ids for c in full]


@pytest.mark.parametrize(("which", "kv_heads"), [("tiny", 4), ("gqa", 2)])
def test_shared_layers_halve_the_cache_bytes(which, kv_heads, request) -> None:
    model, tokenizer = request.getfixturevalue(which)
    ids = torch.tensor([tokenizer.encode("12 + 30 = 42")] * 3)
    sizes = []
    for shared in ((), (1, 3)):
        router = KVRouter(model, shared=shared)
        cache = engine_module.RoomyCache()
        with torch.no_grad():
            model(input_ids=ids, use_cache=True, **{engine_module.cache_kwarg(model): cache})
        sizes.append(kv_cache_bytes(cache))
        router.remove()
    # 4 layers x keys and values x (3 rows, kv_heads, 12 tokens, 32 dims) x 4 bytes
    one_layer = 2 * 3 * kv_heads * 12 * 32 * 4
    assert sizes == [4 * one_layer, 2 * one_layer]


@pytest.mark.parametrize("which", ["tiny", "gqa"])
def test_training_routing_probability_one_is_full_sharing_and_zero_is_plain(which, request) -> None:
    model, tokenizer = request.getfixturevalue(which)
    ids = torch.tensor([tokenizer.encode("12 + 30 = 42"), tokenizer.encode("5 * 6 = 30.0")])
    with torch.no_grad():
        plain = model(ids).logits
        router = KVRouter(model, shared=(1, 2, 3))
        all_shared = model(ids).logits  # eval mode: the deployment pattern
        router.remove()
        model.train()  # no dropout: train mode only switches routing on
        for prob, expected in ((1.0, all_shared), (0.0, plain)):
            router = KVRouter(model, route_prob=prob, seed=0)
            torch.testing.assert_close(model(ids).logits, expected)
            router.remove()
        model.eval()
    assert not torch.allclose(plain, all_shared)


def test_routing_draws_per_sample_and_trains(tiny) -> None:
    model, tokenizer = tiny
    row = tokenizer.encode("12 + 30 = 42")
    ids = torch.tensor([row] * 32)
    router = KVRouter(model, route_prob=0.5, seed=0)
    model.train()
    with torch.no_grad():
        logits = model(ids).logits[:, -1]  # identical rows differ only by their routing draws
    distinct = {tuple(r.tolist()) for r in logits.round(decimals=4)}
    assert 1 < len(distinct) <= 8  # 3 routable layers: at most 2**3 patterns
    before = [p.detach().clone() for p in model.parameters()]
    chunks = completion_chunks([(row[:6], row[6:])] * 32, tokenizer.pad_token_id)
    backward_token_mean(model, chunks)
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    assert all(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    router.remove()
    model.eval()
