"""The semantic cache over HTTP: an OpenAI-compatible `/v1/chat/completions` answered from the
cache or by the backend, `/v1/feedback` (was a served answer right?), `/metrics` (Prometheus
text) and `/health`.

Guard rails: request bodies are read up to `max_body_bytes` and refused beyond (413); malformed
JSON is a 400 and a body of the wrong shape a 422, each with a message naming the problem, and
neither reaches the store. With a `token`, every route but /health needs
`Authorization: Bearer <token>` (401). `leantrain cache serve` binds 127.0.0.1 unless told.

Knows nothing about how the cache decides or how the backend answers.
"""

from __future__ import annotations

import hmac
import json
import threading
import time
from collections import deque
from typing import Any, Literal

from fastapi import FastAPI, HTTPException, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse, PlainTextResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from leantrain.errors import LeantrainError
from leantrain.serving.backends import BackendError, ChatBackend
from leantrain.serving.cache import SemanticCache


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant"]
    content: str = Field(max_length=32_000)


class ChatRequest(BaseModel):
    """The part of an OpenAI chat request the cache uses; other fields are accepted and ignored."""

    model_config = ConfigDict(extra="ignore")
    messages: list[ChatMessage] = Field(min_length=1, max_length=64)
    model: str = "leantrain-cache"
    max_tokens: int = Field(128, ge=1, le=4096)
    stream: bool = False


class FeedbackRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    id: str = Field(description="The `id` of a chat completion this server returned.")
    correct: bool


def cache_key(messages: list[ChatMessage]) -> str:
    """What the cache embeds: a lone user message as is, a conversation as `role: content`
    lines (so the same question in another conversation is another request)."""
    if len(messages) == 1 and messages[0].role == "user":
        return messages[0].content
    return "\n".join(f"{m.role}: {m.content}" for m in messages)


class _Latencies:
    """Request seconds: a running count and sum, and the last 10,000 for quantiles."""

    def __init__(self) -> None:
        self.recent: deque[float] = deque(maxlen=10_000)
        self.count = 0
        self.total = 0.0
        self._lock = threading.Lock()

    def add(self, seconds: float) -> None:
        with self._lock:
            self.recent.append(seconds)
            self.count += 1
            self.total += seconds

    def quantile(self, q: float) -> float:
        with self._lock:
            ordered = sorted(self.recent)
        return ordered[min(int(q * len(ordered)), len(ordered) - 1)] if ordered else 0.0


def create_app(
    cache: SemanticCache,
    backend: ChatBackend,
    *,
    token: str | None = None,
    max_body_bytes: int = 64_000,
) -> FastAPI:
    """The HTTP app over `cache`, asking `backend` on misses (see the module doc)."""
    app = FastAPI(title="leantrain semantic cache", docs_url=None, redoc_url=None)
    latencies = _Latencies()

    def authorise(request: Request) -> None:
        if token is None:
            return
        sent = request.headers.get("authorization", "")
        if not hmac.compare_digest(sent.encode(), f"Bearer {token}".encode()):
            raise HTTPException(401, "missing or wrong bearer token")

    async def read_json(request: Request, model: type[BaseModel]) -> Any:
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > max_body_bytes:
            raise HTTPException(413, f"request body over the {max_body_bytes}-byte limit")
        body = bytearray()
        async for chunk in request.stream():  # also bounds bodies sent without a length
            body += chunk
            if len(body) > max_body_bytes:
                raise HTTPException(413, f"request body over the {max_body_bytes}-byte limit")
        try:
            data = json.loads(body)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise HTTPException(400, f"malformed JSON: {e}") from None
        try:
            return model.model_validate(data)
        except ValidationError as e:
            problems = "; ".join(
                f"{'.'.join(map(str, err['loc'])) or 'body'}: {err['msg']}" for err in e.errors()
            )
            raise HTTPException(422, problems) from None

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> JSONResponse:
        start = time.perf_counter()
        authorise(request)
        chat_request = await read_json(request, ChatRequest)
        if chat_request.stream:
            raise HTTPException(400, "stream=true is not supported by the cache server")
        messages = [m.model_dump() for m in chat_request.messages]

        def ask_backend(prompt: str) -> tuple[str, float]:
            return backend.complete(messages, chat_request.max_tokens)

        try:
            result = await run_in_threadpool(
                cache.query, cache_key(chat_request.messages), ask_backend
            )
        except BackendError as e:
            raise HTTPException(502, str(e)) from None
        latencies.add(time.perf_counter() - start)
        body = {
            "id": f"cache-{result.served_id}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": chat_request.model,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": result.answer},
                    "finish_reason": "stop",
                }
            ],
            "cache": {"source": result.source, "similarity": result.similarity},
        }
        return JSONResponse(body, headers={"X-Cache": result.source})

    @app.post("/v1/feedback")
    async def feedback(request: Request) -> dict:
        authorise(request)
        verdict = await read_json(request, FeedbackRequest)
        served = verdict.id.removeprefix("cache-")
        if not served.isdigit():
            raise HTTPException(422, f"id must look like 'cache-<number>', got {verdict.id!r}")
        try:
            await run_in_threadpool(cache.feedback, int(served), verdict.correct)
        except LeantrainError as e:
            raise HTTPException(409 if "already" in str(e) else 404, str(e)) from None
        return {"ok": True}

    @app.get("/metrics", response_class=PlainTextResponse)
    def metrics(request: Request) -> str:
        authorise(request)
        return prometheus_text(cache, latencies)

    @app.get("/health")
    def health() -> dict:
        return {"ok": True}

    return app


def prometheus_text(cache: SemanticCache, latencies: _Latencies) -> str:
    """The cache's counters in the Prometheus text exposition format."""
    c = cache.counters
    requests = max(c.requests, 1)
    feedback = c.feedback[True] + c.feedback[False]
    lines = [
        ("requests_total", "counter", "Requests by result.", [
            ('{result="hit"}', c.hits), ('{result="miss"}', c.misses)]),
        ("explorations_total", "counter", "Misses checked against a cached answer.", [
            ("", c.explorations)]),
        ("entries", "gauge", "Cached answers.", [("", len(cache))]),
        ("error_rate_estimate", "gauge",
         "Expected share of requests served a wrong cached answer, by the policy's predictions.",
         [("", c.expected_wrong_hits / requests)]),
        ("feedback_total", "counter", "Feedback received, by verdict.", [
            ('{correct="true"}', c.feedback[True]), ('{correct="false"}', c.feedback[False])]),
        ("feedback_wrong_rate", "gauge", "Share of feedback saying the answer was wrong.", [
            ("", c.feedback[False] / feedback if feedback else 0.0)]),
        ("request_seconds", "summary", "Latency of chat requests.", [
            *((f'{{quantile="{q}"}}', latencies.quantile(q)) for q in (0.5, 0.9, 0.99)),
            ("_sum", latencies.total), ("_count", latencies.count)]),
    ]  # fmt: skip
    out = []
    for name, kind, help_text, samples in lines:
        full = f"leantrain_cache_{name}"
        out += [f"# HELP {full} {help_text}", f"# TYPE {full} {kind}"]
        for suffix, value in samples:
            out.append(f"{full}{suffix} {value:g}")  # suffix: labels, or _sum/_count
    return "\n".join(out) + "\n"
