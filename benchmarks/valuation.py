"""Data valuation: which method finds mislabelled samples, and does dropping them help?

The `sentiment` task in prompt form ("sentiment of: the lamp was sturdy, cheap and not loud.")
with 20% of the training labels flipped (fixed seed). Features are the language model's own:
mean-pooled hidden states of its middle layer (`smollm2-135m` by default). Every method values
the same training samples against the same clean validation set:

- KNN-Shapley: exact closed form for a K-nearest-neighbour classifier on the features.
- TMC-Shapley and Beta(16, 1)-Shapley: permutation sampling with truncation; the utility is the
  validation accuracy of a logistic-regression head retrained on the coalition (the same
  permutations, so Beta reuses TMC's utility evaluations).
- Leave-one-out with the same utility.
- TracIn: a linear head on the same features trained with SGD, checkpoints every few steps;
  value = mean TracIn on the validation set, and (negated) self-influence.
- Random values: the floor every method must beat.

Per method: noisy-label detection AUC (low value = flagged) and F1 (2-means on the values, the
lower cluster flagged, as OpenDataVal does), the point-removal curve (held-out test accuracy of
the head retrained after removing the lowest-valued 5%, 10%, 20%, minus its accuracy with all
samples) and run time.

    python benchmarks/valuation.py            # 500 train, 300 valid, 1000 test
    python benchmarks/valuation.py --quick    # 200 train, 200 valid, 400 test: < 120 s, 2 cores

Writes benchmarks/results/valuation.json (keys `best_method`, `best_auc`, `removal_gain_10pct`,
and details). Target: the best method's AUC >= 0.85 and its 10% removal gain > 0.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from rich.console import Console
from rich.table import Table
from sklearn.cluster import KMeans
from sklearn.metrics import f1_score, roc_auc_score
from threadpoolctl import threadpool_limits

from leantrain.data.features import HeadUtility, embed, encode_rows
from leantrain.data.influence import sgd_checkpoints, tracin
from leantrain.data.shapley import (
    CachedUtility,
    knn_shapley,
    leave_one_out,
    permutation_semivalues,
)
from leantrain.models import load_model
from leantrain.tasks import make_task
from leantrain.telemetry.report import write_benchmark_json

RESULTS = Path(__file__).parent / "results" / "valuation.json"
REMOVALS = (0.05, 0.10, 0.20)


def noisy_sentiment(n_train: int, n_valid: int, n_test: int, flip: float, seed: int):
    """Prompts and labels of the three splits, and which training labels were flipped."""
    examples = make_task("sentiment").examples(n_train + n_valid + n_test, seed=seed)
    prompts = [ex.prompt for ex in examples]
    labels = np.array([ex.meta["label"] for ex in examples])
    flipped = np.zeros(n_train, dtype=bool)
    flipped[np.random.default_rng(seed).choice(n_train, int(flip * n_train), replace=False)] = True
    train_labels = np.where(flipped, 1 - labels[:n_train], labels[:n_train])
    return prompts, train_labels, labels[n_train:], flipped


def linear_head_loss(forward: Callable, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """One sample's cross-entropy under a linear head (TracIn's example loss)."""
    return torch.nn.functional.cross_entropy(forward(x[None]), y[None])


def tracin_values(utility: HeadUtility, args: argparse.Namespace) -> dict[str, np.ndarray]:
    """TracIn of a linear head trained by SGD on the utility's (standardised, reduced) features."""
    torch.manual_seed(args.seed)
    x = torch.tensor(utility.train_x, dtype=torch.float32)
    y = torch.tensor(utility.train_y, dtype=torch.long)
    vx = torch.tensor(utility.valid_x, dtype=torch.float32)
    vy = torch.tensor(utility.valid_y, dtype=torch.long)
    head = torch.nn.Linear(x.shape[1], 2)
    names = [n for n, _ in head.named_parameters()]
    checkpoints = sgd_checkpoints(
        head,
        names,
        linear_head_loss,
        (x, y),
        steps=200,
        lr=0.05,
        batch_size=32,
        checkpoint_every=20,
        seed=args.seed,
    )
    scores = tracin(head, checkpoints, linear_head_loss, (x, y), (vx, vy), chunk=256)
    return {"tracin": scores.value, "tracin_self": -scores.self_influence}


def detection(values: np.ndarray, flipped: np.ndarray) -> dict[str, float]:
    """AUC of low value for flipped labels, and F1 of the low cluster of a 2-means on values."""
    auc = roc_auc_score(flipped, -values)
    clusters = KMeans(2, n_init=10, random_state=0).fit(values.reshape(-1, 1))
    low = int(np.argmin(clusters.cluster_centers_[:, 0]))
    return {"auc": float(auc), "f1": float(f1_score(flipped, clusters.labels_ == low))}


def removal_curve(values: np.ndarray, utility: HeadUtility, test_x, test_y) -> dict[str, float]:
    """Test accuracy after dropping the lowest-valued fractions, minus accuracy with all."""
    everyone = np.arange(len(values))
    base = utility.accuracy(everyone, test_x, test_y)
    order = np.argsort(values, kind="stable")
    curve = {"accuracy_all": base}
    for frac in REMOVALS:
        kept = np.sort(order[round(frac * len(values)) :])
        curve[f"gain_{round(frac * 100)}pct"] = utility.accuracy(kept, test_x, test_y) - base
    return curve


def evaluate(
    features: np.ndarray,
    train_y: np.ndarray,
    held_y: np.ndarray,
    flipped: np.ndarray,
    args: argparse.Namespace,
) -> tuple[dict[str, dict[str, float]], int]:
    """Every method's detection scores, removal curve and seconds on these features (train,
    then valid, then test rows), and the head retrainings the Shapley methods cost."""
    n_tr, n_va = args.train, args.valid
    valid_y, test_y = held_y[:n_va], held_y[n_va:]
    utility = HeadUtility(features[:n_tr], train_y, features[n_tr : n_tr + n_va], valid_y)
    test_x = utility.transform(features[n_tr + n_va :])
    cached = CachedUtility(utility)

    def tmc(alpha: float, beta: float) -> np.ndarray:
        return permutation_semivalues(
            cached,
            n_tr,
            alpha=alpha,
            beta=beta,
            truncation=args.truncation,
            max_permutations=args.permutations,
            tolerance=0.05,
            seed=args.seed,
        ).values

    methods: dict[str, Callable[[], np.ndarray | dict[str, np.ndarray]]] = {
        "knn_shapley": lambda: knn_shapley(
            utility.train_x, train_y, utility.valid_x, valid_y, args.knn_k
        ),
        "tmc_shapley": lambda: tmc(1.0, 1.0),
        "beta_shapley_16_1": lambda: tmc(16.0, 1.0),
        "loo": lambda: leave_one_out(cached, n_tr),
        "tracin": lambda: tracin_values(utility, args),
        "random": lambda: np.random.default_rng(args.seed + 1).normal(size=n_tr),
    }
    results: dict[str, dict[str, float]] = {}
    for name, method in methods.items():
        t0 = time.perf_counter()
        out = method()
        seconds = time.perf_counter() - t0
        for key, values in (out if isinstance(out, dict) else {name: out}).items():
            results[key] = {
                **detection(values, flipped),
                **removal_curve(values, utility, test_x, test_y),
                "seconds": seconds,
            }

    return results, cached.evaluations


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m", help="preset or local HF folder")
    parser.add_argument("--quick", action="store_true", help="smaller splits (< 120 s, 2 cores)")
    parser.add_argument("--train", type=int, default=500)
    parser.add_argument("--valid", type=int, default=300)
    parser.add_argument("--test", type=int, default=1000)
    parser.add_argument("--flip", type=float, default=0.2, help="fraction of labels flipped")
    parser.add_argument("--layer", type=int, default=None, help="feature layer (default middle)")
    parser.add_argument("--knn-k", type=int, default=10)
    parser.add_argument("--permutations", type=int, default=100, help="TMC cap")
    parser.add_argument("--truncation", type=float, default=0.02)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    if args.quick:
        args.train, args.valid, args.test, args.permutations = 200, 200, 400, 50
    torch.set_num_threads(args.threads)
    threadpool_limits(1)  # small sklearn fits: BLAS threads only add contention
    started = time.perf_counter()

    prompts, train_y, held_y, flipped = noisy_sentiment(
        args.train, args.valid, args.test, args.flip, args.seed
    )
    model, tokenizer = load_model(args.model)
    seqs = [p for p, _ in encode_rows(tokenizer, prompts, [""] * len(prompts))]
    t0 = time.perf_counter()
    features = embed(model, seqs, tokenizer.pad_token_id, layer=args.layer)
    feature_seconds = time.perf_counter() - t0
    results, evaluations = evaluate(features, train_y, held_y, flipped, args)
    table = Table(
        title=f"noisy-label detection, {args.model}, {args.train} train, {args.flip:.0%} flipped"
    )
    for col in ("method", "AUC", "F1", "-5%", "-10%", "-20%", "seconds"):
        table.add_column(col, justify="right")
    for name, r in results.items():
        table.add_row(
            name,
            f"{r['auc']:.3f}",
            f"{r['f1']:.3f}",
            *(f"{r[f'gain_{round(f * 100)}pct'] * 100:+.1f}" for f in REMOVALS),
            f"{r['seconds']:.1f}",
        )
    console = Console()
    console.print(table)
    best = max((n for n in results if n != "random"), key=lambda n: results[n]["auc"])
    accuracy_all = results[best]["accuracy_all"]
    console.print(
        f"best: {best}, AUC {results[best]['auc']:.3f} (target >= 0.85); removing its lowest 10% "
        f"moves test accuracy {accuracy_all:.1%} by {results[best]['gain_10pct'] * 100:+.1f} "
        f"points (target > 0). Removal columns are test-accuracy points."
    )
    report = {
        "best_method": best,
        "best_auc": results[best]["auc"],
        "removal_gain_10pct": results[best]["gain_10pct"],
        "methods": results,
        "config": {
            **{k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            "features_seconds": feature_seconds,
            "utility_evaluations": evaluations,
            "seconds_total": time.perf_counter() - started,
        },
    }
    write_benchmark_json(args.out, report)
    print(f"wrote {args.out} in {report['config']['seconds_total']:.0f} s")


if __name__ == "__main__":
    main()
