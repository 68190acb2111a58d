"""The KV cache behind continuous batching: a transformers `DynamicCache` whose layers keep spare
room along the time axis and can drop, append and re-align batch rows.

A plain `DynamicLayer` re-concatenates its whole (B, heads, T, head_dim) keys and values on every
decode step, an O(T) copy per layer per token. Here `keys`/`values` are prefix views of larger
buffers, so a decode step writes one column in place and a copy happens only when the room runs
out or when rows leave or join (which copies anyway).
"""

from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer


def _room(columns: int) -> int:
    """Time capacity for `columns` used: 25% spare (at least 64), so regrowth is rare."""
    return columns + max(64, columns // 4)


def _stack_right_aligned(parts: list[torch.Tensor], width: int) -> torch.Tensor:
    """Stack (B_i, H, T_i, D) tensors along batch into a buffer of time capacity `_room(width)`,
    each right-aligned at column `width`; the left padding is zeroed (masked keys and values
    must be finite: a masked weight is exactly 0, and 0 * nan is nan)."""
    first = parts[0]
    rows = sum(p.shape[0] for p in parts)
    buf = first.new_empty(rows, first.shape[1], _room(width), first.shape[3])
    row = 0
    for p in parts:
        block = buf[row : row + p.shape[0]]
        block[:, :, : width - p.shape[2]].zero_()
        block[:, :, width - p.shape[2] : width] = p
        row += p.shape[0]
    return buf


class RoomyLayer(DynamicLayer):
    """A `DynamicLayer` whose keys/values (B, heads, T, head_dim) are views of roomier buffers."""

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append (B, heads, n, head_dim) states along time; return the full keys and values."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
            self._set(key_states, value_states)  # a prefill: exact size, no room yet
            return self.keys, self.values
        used, new = self.keys.shape[2], key_states.shape[2]
        if used + new > self._k.shape[2]:
            k, v = (_stack_right_aligned([x], used) for x in (self.keys, self.values))
            self._set(k, v, used)
        self._k[:, :, used : used + new] = key_states
        self._v[:, :, used : used + new] = value_states
        self._set(self._k, self._v, used + new)
        return self.keys, self.values

    def _set(self, k: torch.Tensor, v: torch.Tensor, used: int | None = None) -> None:
        """Adopt buffers `k`, `v` whose first `used` columns (default: all) are live."""
        used = k.shape[2] if used is None else used
        self._k, self._v = k, v
        self.keys, self.values = k[:, :, :used], v[:, :, :used]

    def select(self, index: torch.Tensor, start: int) -> None:
        """Keep batch rows `index` and drop the first `start` time columns."""
        used = self.keys.shape[2] - start
        self._set(self._k[index, :, start:], self._v[index, :, start:], used)

    def fill_holes(self, holes: torch.Tensor, movers: torch.Tensor, rows: int, start: int) -> None:
        """Keep the first `rows` rows after copying rows `movers` into rows `holes` (index
        tensors of equal length), and drop the first `start` time columns. Only the movers
        are copied; the rest stay where they are (views of the same buffers)."""
        if len(holes):
            self._k[holes] = self._k[movers]
            self._v[holes] = self._v[movers]
        used = self.keys.shape[2] - start
        self._set(self._k[:rows, :, start:], self._v[:rows, :, start:], used)

    def concat(self, other: RoomyLayer) -> None:
        """Append `other`'s rows, left-padding the shorter side so both end at the same column."""
        width = max(self.keys.shape[2], other.keys.shape[2])
        keys = _stack_right_aligned([self.keys, other.keys], width)
        values = _stack_right_aligned([self.values, other.values], width)
        self._set(keys, values, width)


class RoomyCache(DynamicCache):
    """A `DynamicCache` of full-attention `RoomyLayer`s, created lazily like DynamicCache's own.

    Full attention on every layer (no sliding-window layers, which crop themselves) keeps each
    layer's time axis equal to the engine's attention mask, so rows can be re-aligned.
    """

    def __init__(self) -> None:
        super().__init__()
        self.layer_class_to_replicate = RoomyLayer

    def live_layers(self) -> list[RoomyLayer]:
        """Layers holding states (a model sharing KV between layers leaves some empty)."""
        return [layer for layer in self.layers if layer.is_initialized]
