"""Metrics sink (JSONL), plots, progress bars."""

from leantrain.telemetry.metrics import JsonlSink, plot_metrics

__all__ = ["JsonlSink", "plot_metrics"]
