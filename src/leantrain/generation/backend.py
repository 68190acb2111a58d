"""The rollout backend protocol: what rollouts, evaluation and the RL workers need from a
generator, so the native engine (generation/engine.py) and another engine (vLLM) can stand in
for each other. Token ids in, `Completion`s out, weights loaded by name with their policy
version: a producer publishes `weights_snapshot(model)` and every consumer takes it through
`load_weights(weights, version)` (the policy's backends, the speculator's drafter alike).

Backends differ in what they can do beyond plain sampling; each says so in its `capabilities`,
and a setting that needs one a backend lacks is refused once, at set-up, by `require`, naming
the setting (never a silent fallback in the middle of a run).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any, Literal, Protocol

import torch

from leantrain.errors import LeantrainError
from leantrain.generation.config import SamplingParams
from leantrain.telemetry.events import SeqTimeline

FinishReason = Literal["eos", "stop", "length"]


@dataclass
class Completion:
    """One sampled response.

    Attributes:
        prompt_ids: the prompt, as given.
        response_ids: response tokens exactly as sampled, including the EOS or the token that
            completed a stop string.
        logprobs: behaviour logprob of each response token (see `Engine.generate`).
        finish_reason: "eos", "stop" (a stop string) or "length" (max_new_tokens).
        hidden_states: (len(response_ids), hidden) last-layer hidden states (after the final
            norm, the lm_head input) at the positions whose logits sampled each response token,
            on the model's device and dtype; None unless requested.
        timeline: when the sequence entered each phase in the backend (queue, prefill,
            decode or speculate, done), on `telemetry.events.clock()`; what `events.jsonl`
            is made of. A backend fills what it knows (see `SeqTimeline`); None: nothing.
        versions: the policy version of the weights that sampled each response token, as the
            backend itself recorded it (vLLM's weight-version spans); None where the backend
            keeps no such record (the caller knows which version it loaded).
    """

    prompt_ids: list[int]
    response_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason
    hidden_states: torch.Tensor | None = None
    timeline: SeqTimeline | None = None
    versions: list[int] | None = None


@dataclass(frozen=True)
class Capabilities:
    """What a backend can do beyond sampling token ids.

    Attributes:
        hidden_states: `generate(..., return_hidden_states=True)` fills each completion's
            last-layer hidden states (what the online drafter trains on).
        images: `generate(..., images=...)` takes each prompt's pixel values (VLMs).
        speculation: speculative decoding in the long tail (a speculator).
        kv_budget: a KV-cache token budget (`max_cache_tokens`) that admission keeps to.
        separate_weights: it samples from its own copy of the weights (another engine), not
            the trainer's tensors, so the trainer's updates reach it only through
            `load_weights`: a run publishes every policy version to it.
        live_weights: `load_weights_live(weights, version)` publishes a version while a
            `generate` runs (from another thread): the running sequences go on with the new
            weights, recomputing what they hold, and each completion's `versions` says which
            version sampled each token (partial rollouts without segments).
    """

    hidden_states: bool = False
    images: bool = False
    speculation: bool = False
    kv_budget: bool = False
    separate_weights: bool = False
    live_weights: bool = False


class Backend(Protocol):
    """A rollout generator: the native `Engine`, an `EpisodeRunner` around one, vLLM."""

    capabilities: Capabilities

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams,
        *,
        seed: int | None = None,
        **options: Any,
    ) -> list[Completion]:
        """One completion per prompt, in input order; `options` are capabilities'
        (`return_hidden_states`, `images`)."""
        ...

    def load_weights(self, weights: Mapping[str, torch.Tensor], version: int) -> None:
        """Load the policy's weights (a state dict by name) published as `version`."""
        ...


def weights_snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A detached copy of `model`'s weights, on its device: what `load_weights` takes (a copy,
    since the producer updates its weights in place while consumers still read these)."""
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def require(backend: Backend, capability: str, setting: str) -> None:
    """Refuse `setting` at set-up when `backend` lacks `capability` (a `Capabilities` field)."""
    known = {f.name for f in fields(Capabilities)}
    if capability not in known:
        raise ValueError(f"unknown capability {capability!r}; one of {sorted(known)}")
    if not getattr(backend.capabilities, capability):
        raise LeantrainError(
            f"{setting} needs a rollout backend with {capability.replace('_', ' ')}; "
            f"{type(backend).__name__} has none"
        )
