"""`leantrain cache serve` settings: the cache file, its hit policy, the backend that answers
misses, the embedder and the HTTP server."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field

from leantrain.settings import Strict


class CacheServeConfig(Strict):
    """A cache server: `leantrain cache serve --config FILE` loads one of these."""

    db: Path = Field(
        Path("runs/cache/cache.sqlite"),
        description="SQLite file of the cache; it survives restarts (WAL mode).",
    )
    policy: Literal["verified", "budgeted", "threshold"] = Field(
        "verified",
        description="verified: per-entry learned hits, each request's error probability under "
        "delta; budgeted: the same evidence, delta bounds the error rate over all requests (more "
        "hits, a weaker guarantee, budget restarts with the server); threshold: hit at a fixed "
        "similarity (GPTCache's rule; a reversed question can score 0.99).",
    )
    delta: float = Field(
        0.02,
        gt=0.0,
        lt=1.0,
        description="verified, budgeted: bound on the rate of wrong cached answers.",
    )
    threshold: float = Field(0.9, ge=-1.0, le=1.0, description="threshold: cosine to hit at.")
    backend: str = Field(
        "tiny",
        description="Who answers misses: a model preset or local HF folder (our engine), or the "
        "base URL of an OpenAI-compatible server (http://.../v1).",
    )
    backend_model: str = Field(
        "default", description="Model name sent to an OpenAI-compatible backend."
    )
    embedder: Literal["minilm", "hashing"] = Field(
        "minilm",
        description="minilm: all-MiniLM-L6-v2 (offline package); hashing: word hashes, no "
        "model (fast, blind to meaning).",
    )
    max_entries: int = Field(10_000, ge=1, description="Size bound of the cache.")
    eviction: Literal["lru", "cost"] = Field(
        "lru",
        description="Beyond max_entries evict the least recently used, or the answers that save "
        "the least backend time ((1 + hits) x cost).",
    )
    host: str = Field(
        "127.0.0.1", description="Address to bind; loopback by default (anything else: a token)."
    )
    port: int = Field(8000, ge=1, le=65535, description="TCP port.")
    max_body_bytes: int = Field(
        64_000, ge=1024, description="Larger request bodies are refused with 413."
    )
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="Device of a local model.")
