"""The HTTP server (FastAPI TestClient, no network): OpenAI-shaped answers, feedback, metrics,
and every malformed request refused with a clear 4xx that leaves the store untouched."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from leantrain.serving.backends import BackendError
from leantrain.serving.cache import SemanticCache
from leantrain.serving.embedding import HashingEmbedder
from leantrain.serving.policy import ThresholdPolicy
from leantrain.serving.server import create_app

AUTH = {"Authorization": "Bearer s3cret"}


class EchoBackend:
    def __init__(self, fail: bool = False) -> None:
        self.fail = fail

    def complete(self, messages: list[dict], max_tokens: int) -> tuple[str, float]:
        if self.fail:
            raise BackendError("backend down")
        return f"answer: {messages[-1]['content']}", 0.5


@pytest.fixture
def served():
    cache = SemanticCache(":memory:", HashingEmbedder(), ThresholdPolicy(0.9))
    client = TestClient(create_app(cache, EchoBackend(), token="s3cret", max_body_bytes=4096))
    return cache, client


def ask(client: TestClient, text: str, **extra):
    body = {"model": "m", "messages": [{"role": "user", "content": text}], **extra}
    return client.post("/v1/chat/completions", json=body, headers=AUTH)


def test_miss_then_hit_in_openai_shape_with_feedback_and_metrics(served) -> None:
    _, client = served
    first, second = (
        ask(client, "how do I reset my password"),
        ask(client, "How do I reset my password?"),
    )
    assert first.status_code == second.status_code == 200
    assert (first.headers["x-cache"], second.headers["x-cache"]) == ("miss", "hit")
    body = second.json()
    assert body["object"] == "chat.completion" and body["model"] == "m"
    assert body["choices"][0]["message"] == {
        "role": "assistant",
        "content": "answer: how do I reset my password",
    }
    verdict = {"id": body["id"], "correct": True}
    assert client.post("/v1/feedback", json=verdict, headers=AUTH).json() == {"ok": True}
    assert client.post("/v1/feedback", json=verdict, headers=AUTH).status_code == 409
    unknown = {"id": "cache-999", "correct": True}
    assert client.post("/v1/feedback", json=unknown, headers=AUTH).status_code == 404
    metrics = client.get("/metrics", headers=AUTH).text
    assert 'leantrain_cache_requests_total{result="hit"} 1' in metrics
    assert 'leantrain_cache_feedback_total{correct="true"} 1' in metrics
    assert "leantrain_cache_request_seconds_count 2" in metrics


@pytest.mark.parametrize(
    ("body", "status", "message"),
    [
        (b"{not json", 400, "malformed JSON"),
        (b'{"messages": []}', 422, "messages"),
        (b'{"messages": [{"role": "robot", "content": "x"}]}', 422, "role"),
        (b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}', 422, "max_tokens"),
        (b'{"messages": [{"role": "user", "content": "x"}], "stream": true}', 400, "stream"),
        (b'{"messages": [{"role": "user", "content": "' + b"x" * 5000 + b'"}]}', 413, "limit"),
    ],
)
def test_bad_requests_get_a_clear_4xx_and_store_nothing(served, body, status, message) -> None:
    cache, client = served
    headers = {**AUTH, "content-type": "application/json"}
    response = client.post("/v1/chat/completions", content=body, headers=headers)
    assert response.status_code == status
    assert message in response.json()["detail"]
    assert len(cache) == 0 and cache.counters.requests == 0


def test_bearer_token_is_required_except_for_health(served) -> None:
    _, client = served
    body = {"messages": [{"role": "user", "content": "hi"}]}
    assert client.post("/v1/chat/completions", json=body).status_code == 401
    wrong = {"Authorization": "Bearer nope"}
    assert client.post("/v1/chat/completions", json=body, headers=wrong).status_code == 401
    assert client.get("/metrics").status_code == 401
    assert client.get("/health").json() == {"ok": True}


def test_a_failing_backend_is_a_502_and_stores_nothing() -> None:
    cache = SemanticCache(":memory:", HashingEmbedder(), ThresholdPolicy(0.9))
    client = TestClient(create_app(cache, EchoBackend(fail=True)))
    response = ask(client, "hello")
    assert response.status_code == 502 and "backend down" in response.json()["detail"]
    assert len(cache) == 0
