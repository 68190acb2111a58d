"""SFT step hooks that put the model in float64 (settings offer no float64), shared by the
data-parallel tune tests (on pytest's `pythonpath`; spawned ranks inherit it): in float64 two
runs that sum in another order agree to ~1e-15, so a wrong normalisation cannot hide in fp32's
rounding noise."""

from __future__ import annotations

from transformers import PreTrainedModel, PreTrainedTokenizerBase

from leantrain.distributed import DataParallelHooks
from leantrain.memory.sft import StepHooks


class Float64(StepHooks):
    """One process, its model in float64."""

    def attach(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> None:
        model.double()


class Float64Parallel(DataParallelHooks):
    """Data-parallel hooks with the model in float64 before it is split."""

    def attach(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> None:
        model.double()
        super().attach(model, tokenizer)
