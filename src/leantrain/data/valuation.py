"""`leantrain value`: score, price and commit to a dataset of prompt/answer rows.

For a JSONL file of rows (`prompt`, `answer`, optional `source`):

1. Provenance: a Merkle root over the file's lines and an inclusion proof for every line.
2. Information: surprisal and predictive entropy of every token under the model.
3. Value against a validation set (`--valid FILE`, else a seeded `valid_fraction` of the rows,
   which are then scored for information only): KNN-, TMC- and Beta-Shapley and leave-one-out
   when the answers are class labels (a head retrained on the model's features is the utility),
   and TracIn over checkpoints of a few SGD steps of the model itself on the rows.
4. Prices from those scores (`leantrain.data.pricing`), per row and per source.

    from leantrain.data.config import ValueConfig
    from leantrain.data.valuation import run_valuation
    summary = run_valuation(ValueConfig(data="rows.jsonl", out="runs/value"))

The order matters: information and features come from the model as loaded, before TracIn's SGD
steps change it.
"""

from __future__ import annotations

import csv
import json
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn
from threadpoolctl import threadpool_limits
from transformers import PreTrainedModel

from leantrain.data.config import ValueConfig
from leantrain.data.entropy import per_source, token_stats
from leantrain.data.features import HeadUtility, embed, encode_rows, padded
from leantrain.data.influence import select_parameters, sgd_checkpoints, tracin
from leantrain.data.merkle import MerkleTree
from leantrain.data.pricing import price
from leantrain.data.report import write_report
from leantrain.data.rows import BadRow, Row, read_rows
from leantrain.data.shapley import (
    CachedUtility,
    knn_shapley,
    leave_one_out,
    permutation_semivalues,
)
from leantrain.errors import LeantrainError
from leantrain.models import load_model
from leantrain.models.finetune import IGNORE

LABEL_METHODS = ("knn_shapley", "tmc_shapley", "beta_shapley", "loo")


def run_valuation(cfg: ValueConfig, *, progress: bool = False) -> dict[str, Any]:
    """Run every stage and write the outputs to `cfg.out`; returns the summary."""
    if cfg.data is None:
        raise LeantrainError("value: give --data FILE.jsonl (rows with prompt and answer)")
    started = time.perf_counter()
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    raw, rows, bad = read_rows(cfg.data)
    root = _commit(raw, cfg.data, out)
    train, valid, valid_bad = _split(rows, cfg)
    model, tokenizer = load_model(cfg.model.name, device=cfg.device, dtype=cfg.model.dtype)
    pairs = encode_rows(
        tokenizer, [r.prompt for r in train + valid], [r.answer for r in train + valid]
    )
    pad = tokenizer.pad_token_id
    seconds: dict[str, float] = {}
    scores: dict[str, np.ndarray] = {}
    with _Stages(progress) as stage:
        with stage("information", len(pairs), seconds) as advance:
            stats = token_stats(
                model, [p + a for p, a in pairs], pad, cfg.features.batch_size, advance
            )
        wanted = [m for m in cfg.methods if m in LABEL_METHODS]
        skipped = _unlabelled(train, wanted, cfg.shapley.max_classes)
        if wanted and not skipped:
            scores.update(
                _label_values(model, pairs, pad, train, valid, wanted, cfg, stage, seconds)
            )
        if "tracin" in cfg.methods:
            with stage("tracin", cfg.tracin.steps + 1, seconds) as advance:
                scores["tracin"] = _tracin(model, pairs, len(train), pad, cfg, advance)
    scores["information"] = np.array([s.mean_surprisal for s in stats[: len(train)]])
    # A one-token row predicts nothing: no measured information, the lowest rank.
    scores["information"] = np.nan_to_num(scores["information"], nan=0.0)
    prices = price(
        scores,
        cfg.pricing.weights,
        [r.source for r in train],
        cfg.pricing.budget,
        cfg.pricing.floor,
    )
    records = _records(train, valid, stats, scores, prices.utility, prices.price)
    _write_scores(records, out)
    with (out / "tokens.jsonl").open("w") as f:  # the per-token view behind mean_surprisal_bits
        for row, s in zip(train + valid, stats, strict=True):
            per_token = {
                "surprisal_bits": s.surprisal.round(4).tolist(),
                "entropy_bits": s.entropy.round(4).tolist(),
            }
            f.write(json.dumps({"line": row.line, **per_token}) + "\n")
    summary = {
        "data": str(cfg.data),
        "merkle_root": root,
        "rows": len(raw),
        "rows_valued": len(train),
        "rows_validation": len(valid),
        "bad_rows": [{"line": b.line, "reason": b.reason} for b in bad],
        "bad_validation_rows": [{"line": b.line, "reason": b.reason} for b in valid_bad],
        "methods": sorted(m for m in scores if m != "information"),
        "skipped": skipped,
        "information_by_source": per_source(stats[: len(train)], [r.source for r in train]),
        "price_by_source": prices.by_source,
        "pricing": cfg.pricing.model_dump(),
        "model": cfg.model.name,
        "seconds": {**seconds, "total": time.perf_counter() - started},
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    write_report(summary, records, out / "report.html")
    return summary


def _commit(raw: list[bytes], data: Path, out: Path) -> str:
    """Write merkle.json (root, size, scheme) and proofs.jsonl (one proof per line)."""
    tree = MerkleTree(raw)
    scheme = "RFC 9162 SHA-256: leaf = H(0x00 || line bytes without \\n), node = H(0x01 || l || r)"
    meta = {"root": tree.root, "tree_size": tree.size, "file": str(data), "scheme": scheme}
    (out / "merkle.json").write_text(json.dumps(meta, indent=2) + "\n")
    with (out / "proofs.jsonl").open("w") as f:
        for i in range(tree.size):
            f.write(json.dumps({"line": i + 1, **tree.proof(i).to_json()}) + "\n")
    return tree.root


def _split(rows: list[Row], cfg: ValueConfig) -> tuple[list[Row], list[Row], list[BadRow]]:
    """(rows to value, validation rows, bad rows of the validation file)."""
    if cfg.valid is not None:
        _, valid, bad = read_rows(cfg.valid)
        return rows, valid, bad
    if len(rows) < 2:
        raise LeantrainError("value: need at least 2 valid rows to hold some out (or --valid)")
    order = np.random.default_rng(cfg.seed).permutation(len(rows))
    n_valid = min(max(1, round(cfg.valid_fraction * len(rows))), len(rows) - 1)
    held = set(order[:n_valid].tolist())
    return (
        [r for i, r in enumerate(rows) if i not in held],
        [r for i, r in enumerate(rows) if i in held],
        [],
    )


def _unlabelled(train: list[Row], wanted: list[str], max_classes: int) -> dict[str, str]:
    """Why each label method cannot run ({} when it can): class labels are a few distinct
    answers, each seen twice on average; anything else is free-form text."""
    most = min(max_classes, len(train) // 2)
    classes = len({r.answer for r in train})
    if 2 <= classes <= most:
        return {}
    reason = (
        f"needs 2..{most} distinct answers (class labels, at most max_classes and half the "
        f"rows); the {len(train)} rows to value have {classes}"
    )
    return {m: reason for m in wanted}


def _label_values(
    model: PreTrainedModel,
    pairs: list[tuple[list[int], list[int]]],
    pad: int,
    train: list[Row],
    valid: list[Row],
    wanted: list[str],
    cfg: ValueConfig,
    stage: _Stages,
    seconds: dict[str, float],
) -> dict[str, np.ndarray]:
    """Shapley values and leave-one-out of the training rows, with answers as class labels and
    a head on the model's features (of the prompts) as the utility."""
    with stage("features", len(pairs), seconds) as advance:
        features = embed(
            model,
            [p for p, _ in pairs],
            pad,
            cfg.features.layer,
            cfg.features.batch_size,
            advance,
        )
    classes = sorted({r.answer for r in train})
    # A validation answer no training row has gets -1: no head can predict it.
    y = np.array([classes.index(r.answer) if r.answer in classes else -1 for r in train + valid])
    n = len(train)
    utility = HeadUtility(features[:n], y[:n], features[n:], y[n:], cfg.features.components)
    # Thousands of millisecond head fits: BLAS threads would only add overhead to each.
    with threadpool_limits(1):
        return _shapley(utility, wanted, cfg, stage, seconds)


def _shapley(
    utility: HeadUtility,
    wanted: list[str],
    cfg: ValueConfig,
    stage: _Stages,
    seconds: dict[str, float],
) -> dict[str, np.ndarray]:
    """The Shapley-family values `wanted`, each under its own progress bar and timer."""
    sc = cfg.shapley
    n = len(utility.train_y)
    cached = CachedUtility(utility)
    out = {}
    if "knn_shapley" in wanted:
        with stage("knn_shapley", 1, seconds) as advance:
            out["knn_shapley"] = knn_shapley(
                utility.train_x, utility.train_y, utility.valid_x, utility.valid_y, sc.knn_k
            )
            advance(1)
    # Same seed, same permutations: Beta-Shapley reuses TMC's cached utility evaluations.
    for name, alpha, beta in (
        ("tmc_shapley", 1.0, 1.0),
        ("beta_shapley", sc.beta_alpha, sc.beta_beta),
    ):
        if name in wanted:
            with stage(name, sc.permutations, seconds) as advance:
                out[name] = permutation_semivalues(
                    cached,
                    n,
                    alpha=alpha,
                    beta=beta,
                    truncation=sc.truncation,
                    tolerance=sc.tolerance,
                    min_permutations=min(sc.min_permutations, sc.permutations),
                    max_permutations=sc.permutations,
                    seed=cfg.seed,
                    on_permutation=lambda _: advance(1),
                ).values
    if "loo" in wanted:
        with stage("loo", 1, seconds) as advance:
            out["loo"] = leave_one_out(cached, n)
            advance(1)
    return out


def answer_loss(forward: Callable, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """One row's mean next-token loss on its answer tokens."""
    return forward(input_ids=ids[None], labels=labels[None], use_cache=False).loss


def _tracin(
    model: PreTrainedModel,
    pairs: list[tuple[list[int], list[int]]],
    n_train: int,
    pad: int,
    cfg: ValueConfig,
    advance: Callable[[int], None],
) -> np.ndarray:
    """TracIn value of each training row: SGD on the rows' answers, checkpoints, then TracIn."""
    tc = cfg.tracin
    ids, _ = padded([p + a for p, a in pairs], pad)
    labels = torch.full_like(ids, IGNORE)
    for row, (p, a) in enumerate(pairs):
        labels[row, len(p) : len(p) + len(a)] = ids[row, len(p) : len(p) + len(a)]
    if (labels[:, 1:] == IGNORE).all(dim=1).any():
        raise LeantrainError("tracin: a row has no answer tokens to take a loss on")
    device = next(model.parameters()).device
    ids, labels = ids.to(device), labels.to(device)
    names = select_parameters(model, tc.params)
    train, valid = (ids[:n_train], labels[:n_train]), (ids[n_train:], labels[n_train:])
    checkpoints = sgd_checkpoints(
        model,
        names,
        answer_loss,
        train,
        steps=tc.steps,
        lr=tc.lr,
        batch_size=tc.batch_size,
        checkpoint_every=tc.checkpoint_every,
        seed=cfg.seed,
        on_step=lambda _: advance(1),
    )
    scores = tracin(
        model, checkpoints, answer_loss, train, valid, tc.projection, tc.chunk, cfg.seed
    )
    advance(1)
    return scores.value


def _records(train, valid, stats, scores, utility, prices) -> list[dict[str, Any]]:
    """One flat record per row, valued rows first, then validation rows (no value, no price)."""
    records = []
    for i, row in enumerate(train + valid):
        s = stats[i]
        record = {
            "line": row.line,
            "split": "value" if i < len(train) else "validation",
            "source": row.source,
            "prompt": row.prompt,
            "answer": row.answer,
            "tokens": s.tokens,
            "mean_surprisal_bits": s.mean_surprisal,
            "mean_entropy_bits": s.mean_entropy,
        }
        for method, values in scores.items():
            if method != "information":
                record[method] = float(values[i]) if i < len(train) else None
        record["utility"] = float(utility[i]) if i < len(train) else None
        record["price"] = float(prices[i]) if i < len(train) else None
        records.append(record)
    return records


def _write_scores(records: list[dict[str, Any]], out: Path) -> None:
    (out / "scores.json").write_text(json.dumps(records, indent=1, allow_nan=True) + "\n")
    with (out / "scores.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(records[0]))
        writer.writeheader()
        writer.writerows(records)


class _Stages:
    """One rich progress bar per stage, and each stage's wall time."""

    def __init__(self, enabled: bool) -> None:
        self.progress = Progress(
            "[progress.description]{task.description}",
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            disable=not enabled,
        )

    def __enter__(self) -> _Stages:
        self.progress.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.progress.__exit__(*exc)

    @contextmanager
    def __call__(
        self, name: str, total: int, seconds: dict[str, float]
    ) -> Iterator[Callable[[int], None]]:
        task = self.progress.add_task(name, total=total)
        t0 = time.perf_counter()
        yield lambda n: self.progress.advance(task, n)
        seconds[name] = time.perf_counter() - t0
        self.progress.update(task, completed=total)
