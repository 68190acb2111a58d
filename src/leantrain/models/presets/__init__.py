"""Built-in presets, built locally on first use and cached, never downloaded: `tiny` (trained on
`arith` worked solutions), `tiny-tools` (warm-started on tool episodes), `tiny-vl` (a Llava
around `tiny-tools`) and `smollm2-135m` (converted from a GGUF a pip package ships).

Preset recipes train on tasks, so this folder sits above `tasks` (DESIGN.md); `models` below it
loads any folder, a preset's included. Every build is deterministic (models/build_cache.py).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from leantrain.models.presets.smollm2 import ensure_smollm2
from leantrain.models.presets.tiny import ensure_tiny
from leantrain.models.presets.tiny_tools import ensure_tiny_tools
from leantrain.models.presets.tiny_vl import ensure_tiny_vl

PRESETS: dict[str, Callable[[], Path]] = {
    "tiny": ensure_tiny,
    "tiny-tools": ensure_tiny_tools,
    "tiny-vl": ensure_tiny_vl,
    "smollm2-135m": ensure_smollm2,
}
