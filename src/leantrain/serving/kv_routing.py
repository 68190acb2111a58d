"""Stochastic KV routing (arXiv 2604.22782): depth-wise KV-cache sharing that a model learns to
tolerate, so any chosen set of layers can drop its KV cache at deployment without retraining.

Training: each layer after the first, independently per sample and per forward, attends with the
keys/values of the layer below it (its *effective* keys/values, so a run of routed layers all
read the nearest layer that used its own) with probability `route_prob`, else with its own.
Deployment: a sharing pattern names the layers that drop their cache; each reads the cache of the
nearest kept layer below it and never stores its own, so the cache really holds fewer layers.

How: a forward pre-hook on every attention module swaps the cache it receives for a
`_RoutedCache` proxy; Llama/Qwen-style attention only calls `cache.update(k, v, layer_idx)` and
attends with what it returns, so the attention code runs unchanged. The rollout engine needs no
change either: a dropped layer never initialises its layer of the engine's cache (which skips
uninitialised layers when it re-batches rows).

What it does NOT do: skip the key/value projections of a dropped layer (they are computed and
discarded: the saving is memory, not FLOPs), or route across layers of different head counts.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable
from functools import partial
from typing import Any

import torch
from transformers import Cache, PreTrainedModel

from leantrain.errors import LeantrainError

_CACHE_KWARGS = ("cache", "past_key_values", "past_key_value")  # across transformers versions


def sharing_pattern(num_layers: int, drop_fraction: float) -> tuple[int, ...]:
    """Layers that drop their KV cache when `drop_fraction` of `num_layers` caches go.

    Every second layer goes first, from the top down (each then reads its kept predecessor:
    for 4 layers, 25% drops layer 3 and 50% drops layers 3 and 1); beyond half, the remaining
    layers above layer 0 go, also from the top. Layer 0 always keeps its cache: someone must.
    """
    if not 0.0 <= drop_fraction < 1.0:
        raise LeantrainError(f"drop_fraction must be in [0, 1), got {drop_fraction}")
    count = min(round(drop_fraction * num_layers), num_layers - 1)
    odd = list(range(num_layers - 1, 0, -2))
    even = [i for i in range(num_layers - 1, 0, -1) if i not in odd]
    return tuple(sorted((odd + even)[:count]))


def kv_cache_bytes(cache: Cache) -> int:
    """Bytes of the keys and values a cache holds (its live columns, every initialised layer)."""
    return sum(
        layer.keys.nbytes + layer.values.nbytes
        for layer in cache.layers
        if getattr(layer, "is_initialized", False)
    )


class KVRouter:
    """Stochastic KV routing installed on a Llama/Qwen-style HF causal LM (see the module doc).

    Args:
        model: the model; its decoder layers must each have a `self_attn` module.
        route_prob: per layer (>= 1), per sample, the chance in training mode of attending with
            the layer below's keys/values. 0 trains as usual.
        shared: layers that drop their cache outside training mode (see `sharing_pattern`).
        seed: seeds the routing draws; None draws a fresh seed.

    Use `remove()` to restore the plain model.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        *,
        route_prob: float = 0.0,
        shared: Iterable[int] = (),
        seed: int | None = None,
    ) -> None:
        if not 0.0 <= route_prob <= 1.0:
            raise LeantrainError(f"route_prob must be in [0, 1], got {route_prob}")
        layers = getattr(model.get_decoder(), "layers", None)
        if layers is None or not all(hasattr(layer, "self_attn") for layer in layers):
            raise LeantrainError(
                f"KV routing needs decoder layers with a `self_attn` module (Llama/Qwen style); "
                f"{type(model).__name__} has none"
            )
        self.model = model
        self.route_prob = route_prob
        self.num_layers = len(layers)
        self.shared: frozenset[int] = frozenset()
        self.share(shared)
        self._generator = torch.Generator(device=next(model.parameters()).device)
        if seed is None:
            self._generator.seed()
        else:
            self._generator.manual_seed(seed)
        # Effective (keys, values) of each layer in the current forward; layer i reads entry i-1.
        self._effective: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._handles = [
            layer.self_attn.register_forward_pre_hook(
                partial(self._swap_cache, _cache_kwarg(layer.self_attn)), with_kwargs=True
            )
            for layer in layers
        ]
        # Drop the references once the forward is done (they would keep a training graph alive).
        self._handles.append(model.register_forward_hook(lambda *_: self._effective.clear()))

    def share(self, layers: Iterable[int]) -> None:
        """Set the deployment pattern: `layers` drop their cache (read the nearest kept below)."""
        chosen = frozenset(int(i) for i in layers)
        bad = sorted(i for i in chosen if not 1 <= i < self.num_layers)
        if bad:
            raise LeantrainError(
                f"shared layers must be in [1, {self.num_layers}) (layer 0 keeps its cache), "
                f"got {bad}"
            )
        self.shared = chosen

    def remove(self) -> None:
        """Uninstall the hooks: the model attends as it did before."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _swap_cache(
        self,
        name: str,
        module: torch.nn.Module,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """Forward pre-hook: hand the attention module a `_RoutedCache` over its real cache."""
        kwargs[name] = _RoutedCache(self, kwargs.get(name))
        return args, kwargs

    def route(
        self,
        keys: torch.Tensor,
        values: torch.Tensor,
        layer: int,
        cache: Cache | None,
        cache_kwargs: dict[str, Any],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The (B, kv_heads, T, head_dim) keys and values that `layer` attends with."""
        below = self._effective.get(layer - 1)
        own = (keys, values)
        if cache is not None and (self.model.training or layer not in self.shared):
            own = cache.update(keys, values, layer, **cache_kwargs)  # stored: the full history
        if self.model.training:
            if layer == 0 or self.route_prob == 0.0 or below is None:
                chosen = own
            else:
                draw = torch.rand(keys.shape[0], generator=self._generator, device=keys.device)
                routed = (draw < self.route_prob)[:, None, None, None]  # (B, 1, 1, 1)
                chosen = tuple(torch.where(routed, b, o) for b, o in zip(below, own, strict=True))
        elif layer in self.shared:
            if below is None:
                raise LeantrainError(f"layer {layer} shares the cache of a layer that never ran")
            chosen = below  # read the kept layer's cache; store nothing of our own
        else:
            chosen = own
        self._effective[layer] = chosen
        return chosen


def _cache_kwarg(attention: torch.nn.Module) -> str:
    """The name under which `attention.forward` takes its KV cache."""
    accepted = inspect.signature(attention.forward).parameters
    for name in _CACHE_KWARGS:
        if name in accepted:
            return name
    raise LeantrainError(f"{type(attention).__name__}.forward takes no KV-cache argument")


class _RoutedCache:
    """What one attention module sees as its cache: `update` routes, the rest is the real cache."""

    def __init__(self, router: KVRouter, cache: Cache | None) -> None:
        self._router = router
        self._cache = cache

    def update(
        self, keys: torch.Tensor, values: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if args:  # older transformers pass cache_kwargs positionally
            kwargs = {"cache_kwargs": args[0], **kwargs}
        return self._router.route(keys, values, layer_idx, self._cache, kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._cache, name)
