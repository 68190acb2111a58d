"""What answers a cache miss: our engine with a local model, or any OpenAI-compatible server.

A backend turns chat messages into (answer text, cost); the cost is the seconds the answer took,
which cost-aware eviction weighs (a slow answer is worth keeping). Knows nothing about caching.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Protocol

from leantrain.errors import LeantrainError
from leantrain.generation import Engine, SamplingParams
from leantrain.models import load_model

Message = dict[str, str]  # {"role": ..., "content": ...}


class ChatBackend(Protocol):
    def complete(self, messages: list[Message], max_tokens: int) -> tuple[str, float]:
        """The answer to `messages` and what it cost (seconds)."""
        ...


class EngineBackend:
    """Greedy answers from a local model through our rollout engine (one request at a time: the
    engine batches within a call, and cache misses arrive one by one)."""

    def __init__(self, model: str = "tiny", device: str = "auto") -> None:
        self.model, self.tokenizer = load_model(model, device=device)
        self.engine = Engine(self.model, self.tokenizer, max_batch_size=1)
        self._lock = threading.Lock()

    def complete(self, messages: list[Message], max_tokens: int) -> tuple[str, float]:
        start = time.perf_counter()
        if getattr(self.tokenizer, "chat_template", None):
            encoded = self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=True
            )
            ids = list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded)
        else:  # a base model: the conversation as plain text
            ids = self.tokenizer.encode("".join(m["content"] for m in messages))
        params = SamplingParams(max_new_tokens=max_tokens, temperature=0.0)
        with self._lock:
            completion = self.engine.generate([ids], params, seed=0)[0]
        text = self.tokenizer.decode(completion.response_ids, skip_special_tokens=True)
        return text, time.perf_counter() - start


class OpenAIBackend:
    """Forward to `{base_url}/chat/completions` of any OpenAI-compatible server."""

    def __init__(
        self,
        base_url: str,
        model: str,
        api_key: str | None = None,
        timeout: float = 60.0,
        transport: Any = None,
    ) -> None:
        """`transport`: an httpx transport to use instead of the network (tests)."""
        import httpx

        if not base_url.startswith(("http://", "https://")):
            raise LeantrainError(f"backend URL must start with http:// or https://: {base_url}")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.model = model
        self._client = httpx.Client(
            base_url=base_url.rstrip("/"), headers=headers, timeout=timeout, transport=transport
        )

    def complete(self, messages: list[Message], max_tokens: int) -> tuple[str, float]:
        import httpx

        start = time.perf_counter()
        body = {"model": self.model, "messages": messages, "max_tokens": max_tokens}
        try:
            response = self._client.post("/chat/completions", json=body)
            response.raise_for_status()
            text = response.json()["choices"][0]["message"]["content"]
        except (httpx.HTTPError, KeyError, IndexError, ValueError) as e:
            raise BackendError(f"backend {self._client.base_url} failed: {e}") from None
        return text, time.perf_counter() - start


class BackendError(RuntimeError):
    """The backend could not answer (the server returns 502)."""
