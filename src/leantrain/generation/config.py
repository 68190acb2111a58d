"""How to sample one response: the engine's argument and the `sampling` section of a run's
settings (`RLConfig.sampling`), one model for both."""

from __future__ import annotations

from typing import Annotated

from pydantic import ConfigDict, Field

from leantrain.settings import Strict


class SamplingParams(Strict):
    """How to sample one response. Frozen: the engine reads it in its decode loop and a run's
    settings hand the same object to every rollout, so nothing may change it on the way; make a
    variant with `params.model_copy(update={...})`.

    The defaults are a GRPO run's (temperature 0.7, responses up to 320 tokens).
    """

    model_config = ConfigDict(frozen=True, allow_inf_nan=False)

    max_new_tokens: int = Field(
        320,
        ge=1,
        strict=True,
        description="Response cap; longer responses finish with reason `length`.",
    )
    temperature: float = Field(
        0.7,
        ge=0.0,
        description="Sampling temperature; lower is safer, higher explores more; 0 is greedy "
        "(argmax).",
    )
    top_p: float = Field(
        1.0,
        gt=0.0,
        le=1.0,
        description="Nucleus sampling mass: keep the smallest set of top tokens with this much "
        "probability; 1 keeps all.",
    )
    top_k: int = Field(
        0, ge=0, strict=True, description="Keep the k most likely tokens; 0 keeps all."
    )
    stop: tuple[Annotated[str, Field(min_length=1)], ...] = Field(
        (),
        description="Stop strings; a response ends with the token that completes one (finish "
        "reason `stop`).",
    )

    @property
    def greedy(self) -> bool:
        """True when decoding takes the argmax (temperature 0)."""
        return self.temperature == 0
