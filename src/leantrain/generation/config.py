"""Sampling settings of a run (`RLConfig.sampling`): response cap, temperature, top-p, top-k."""

from __future__ import annotations

from pydantic import Field

from leantrain.settings import Strict


class SamplingConfig(Strict):
    max_new_tokens: int = Field(
        320, ge=1, description="Response cap; longer responses finish with reason `length`."
    )
    temperature: float = Field(
        0.7, ge=0.0, description="Sampling temperature; lower is safer, higher explores more."
    )
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling mass.")
    top_k: int = Field(0, ge=0, description="Keep the k most likely tokens; 0 keeps all.")
