"""Backends: the OpenAI-compatible forwarder (over a mock transport, no network) and our engine."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from leantrain.errors import LeantrainError
from leantrain.serving.backends import BackendError, EngineBackend, OpenAIBackend


def test_openai_backend_sends_the_chat_and_returns_the_answer() -> None:
    seen = []

    def reply(request: httpx.Request) -> httpx.Response:
        seen.append(
            (request.url.path, request.headers["authorization"], json.loads(request.content))
        )
        return httpx.Response(200, json={"choices": [{"message": {"content": "Paris."}}]})

    backend = OpenAIBackend("http://upstream/v1/", "m", "key", transport=httpx.MockTransport(reply))
    messages = [{"role": "user", "content": "capital of France?"}]
    answer, cost = backend.complete(messages, 16)
    assert answer == "Paris." and cost >= 0
    assert seen == [
        (
            "/v1/chat/completions",
            "Bearer key",
            {"model": "m", "messages": messages, "max_tokens": 16},
        )
    ]


def test_openai_backend_failures_are_backend_errors() -> None:
    down = httpx.MockTransport(lambda request: httpx.Response(503, text="busy"))
    with pytest.raises(BackendError, match="503"):
        OpenAIBackend("http://upstream/v1", "m", transport=down).complete([], 8)
    odd = httpx.MockTransport(lambda request: httpx.Response(200, json={"nope": 1}))
    with pytest.raises(BackendError):
        OpenAIBackend("http://upstream/v1", "m", transport=odd).complete([], 8)
    with pytest.raises(LeantrainError, match="http"):
        OpenAIBackend("upstream:8000", "m")


def test_engine_backend_answers_greedily_and_deterministically(tiny_path: Path) -> None:
    backend = EngineBackend(str(tiny_path), device="cpu")
    messages = [{"role": "user", "content": "sum 7 1 5\n"}]
    first, _ = backend.complete(messages, 32)
    assert first == backend.complete(messages, 32)[0]
    assert "answer" in first  # the tiny model writes worked sums ending in "answer: N"
