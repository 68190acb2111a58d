"""Built-in presets, made locally and cached, never downloaded: `tiny` (trained on `arith` worked
solutions), `tiny-tools` (warm-started on tool episodes) and `tiny-vl` (a Llava around
`tiny-tools`), whose default builds ship with the package (`builds/`, copied on first use; each
`ensure_*(rebuild=True)` builds it from its recipe again), and `smollm2-135m` (converted once from
a GGUF a pip package ships).

Preset recipes train on tasks, so this folder sits above `tasks` (DESIGN.md); `models` below it
loads any folder, a preset's included. Every build is deterministic (models/build_cache.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from leantrain.models.presets.smollm2 import ensure_smollm2
from leantrain.models.presets.tiny import ensure_tiny
from leantrain.models.presets.tiny_tools import ensure_tiny_tools
from leantrain.models.presets.tiny_vl import ensure_tiny_vl


class EnsurePreset(Protocol):
    """A preset's cached folder, made first if needed; `rebuild` makes it from its recipe again."""

    def __call__(self, *, rebuild: bool = False) -> Path: ...


PRESETS: dict[str, EnsurePreset] = {
    "tiny": ensure_tiny,
    "tiny-tools": ensure_tiny_tools,
    "tiny-vl": ensure_tiny_vl,
    "smollm2-135m": ensure_smollm2,
}
