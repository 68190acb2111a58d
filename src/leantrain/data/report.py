"""The HTML report of a valuation run: one self-contained file (plots embedded as PNG) with the
Merkle root, bad rows, per-source prices and information, score distributions, value against
information density, and the most and least valuable rows."""

from __future__ import annotations

import base64
import html
import io
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

NON_SCORES = {"line", "split", "source", "prompt", "answer", "tokens", "mean_entropy_bits", "price"}


def _png(fig: Any) -> str:
    import matplotlib.pyplot as plt

    buffer = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buffer, format="png", dpi=90)
    plt.close(fig)
    return f'<img src="data:image/png;base64,{base64.b64encode(buffer.getvalue()).decode()}">'


def _plots(summary: dict[str, Any], valued: Sequence[dict[str, Any]]) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")  # headless
    import matplotlib.pyplot as plt

    methods = [m for m in valued[0] if m not in NON_SCORES]
    cols = min(3, len(methods))
    rows = math.ceil(len(methods) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4 * cols, 2.8 * rows), squeeze=False)
    for ax, method in zip(axes.flat, methods, strict=False):
        ax.hist([r[method] for r in valued], bins=30)
        ax.set_title(method, fontsize=9)
    for ax in list(axes.flat)[len(methods) :]:
        ax.axis("off")
    fig.suptitle("score distributions (valued rows)", fontsize=10)
    plots = [_png(fig)]

    by_source = summary["price_by_source"]
    fig, ax = plt.subplots(figsize=(max(4, 0.8 * len(by_source) + 2), 3))
    ax.bar(list(by_source), [v["price"] for v in by_source.values()])
    ax.set_ylabel("price")
    ax.set_title("price per source", fontsize=10)
    ax.tick_params(axis="x", labelrotation=30)
    plots.append(_png(fig))

    fig, ax = plt.subplots(figsize=(5, 3.5))
    ax.scatter([r["mean_surprisal_bits"] for r in valued], [r["utility"] for r in valued], s=8)
    ax.set_xlabel("information density (mean surprisal, bits/token)")
    ax.set_ylabel("utility (weighted percentile)")
    ax.set_title("value vs entropy", fontsize=10)
    plots.append(_png(fig))
    return plots


def _table(rows: Sequence[dict[str, Any]], columns: Sequence[str]) -> str:
    def cell(value: Any) -> str:
        if isinstance(value, float):
            return f"{value:.4g}"
        text = str(value)
        return html.escape(text if len(text) <= 80 else text[:77] + "...")

    head = "".join(f"<th>{html.escape(c)}</th>" for c in columns)
    body = "".join(
        "<tr>" + "".join(f"<td>{cell(r.get(c, ''))}</td>" for c in columns) + "</tr>" for r in rows
    )
    return f"<table><tr>{head}</tr>{body}</table>"


def write_report(summary: dict[str, Any], records: Sequence[dict[str, Any]], path: Path) -> Path:
    """Write the report for `summary` (run_valuation's) and its per-row `records`."""
    valued = [r for r in records if r["split"] == "value"]
    by_utility = sorted(valued, key=lambda r: r["utility"])
    row_cols = ["line", "source", "prompt", "answer", "utility", "price", "mean_surprisal_bits"]
    sources = [
        {"source": s, **v, **summary["information_by_source"].get(s, {})}
        for s, v in summary["price_by_source"].items()
    ]
    skipped = "".join(
        f"<li>{html.escape(m)}: {html.escape(why)}</li>" for m, why in summary["skipped"].items()
    )
    bad = summary["bad_rows"] + summary["bad_validation_rows"]
    prices = np.array([r["price"] for r in valued])
    parts = [
        "<!doctype html><meta charset='utf-8'><title>leantrain value</title>",
        "<style>body{font-family:sans-serif;margin:2em;max-width:1100px}table{border-collapse:"
        "collapse;font-size:13px}td,th{border:1px solid #ccc;padding:3px 6px}code{font-size:"
        "13px}</style>",
        f"<h1>Data valuation: {html.escape(summary['data'])}</h1>",
        f"<p>Merkle root (dataset commitment): <code>{summary['merkle_root']}</code> over "
        f"{summary['rows']} lines. Model <code>{html.escape(summary['model'])}</code>; "
        f"{summary['rows_valued']} rows valued against {summary['rows_validation']} validation "
        f"rows; methods: {', '.join(summary['methods']) or 'none'}; total price "
        f"{prices.sum():.2f}.</p>",
        f"<ul>{skipped}</ul>" if skipped else "",
        f"<h2>Bad rows ({len(bad)}), skipped</h2>",
        _table(bad, ["line", "reason"]) if bad else "<p>none</p>",
        "<h2>Per source</h2>",
        _table(
            sources,
            [
                "source",
                "rows",
                "price",
                "mean_utility",
                "tokens",
                "mean_surprisal_bits",
                "mean_entropy_bits",
            ],
        ),
        "<h2>Plots</h2>",
        *_plots(summary, valued),
        "<h2>Least valuable rows</h2>",
        _table(by_utility[:10], row_cols),
        "<h2>Most valuable rows</h2>",
        _table(by_utility[::-1][:10], row_cols),
    ]
    path.write_text("\n".join(parts) + "\n")
    return path
