"""TLT assembled for a rollout loop: the drafters a `SpeculativeConfig` names, the speculator the
engine calls, and (with `train_drafter`) the hidden-state buffer and the background spot trainer.

    long_tail = LongTail(config.speculative, model, tokenizer, "smollm2-135m", out=run_dir)
    engine = Engine(model, tokenizer, max_batch_size=128, speculator=long_tail.speculator)
    for step in range(steps):
        completions = engine.generate(prompts, params, return_hidden_states=long_tail.capture)
        long_tail.observe(step, completions)   # the drafter's training data
        metrics = long_tail.metrics()          # acceptance length, drafted fraction, drafter loss
        ...                                    # the policy update (long_tail.idle(True) around
                                               # it lets the drafter train while the loop waits)
    long_tail.close()                          # stops the trainer, publishes its last version
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from transformers import PreTrainedModel, PreTrainedTokenizerBase

from leantrain.generation import Completion
from leantrain.speculation.config import SpeculativeConfig
from leantrain.speculation.drafter import EagleDrafter
from leantrain.speculation.speculator import BanditSpeculator, Drafter
from leantrain.speculation.spot_trainer import HiddenBuffer, SpotTrainer, ensure_drafter
from leantrain.speculation.suffix_drafter import SuffixDrafter


class LongTail:
    """Speculation in the long tail plus online drafter training, for one run.

    Args:
        config: the `speculative:` settings.
        model: the policy (the target the drafter drafts for).
        tokenizer: the policy's tokenizer.
        model_name: preset or folder the policy was loaded from (keys the cached warm start).
        out: run folder; drafter versions go to `out/drafter/`.
        seed: seeds the bandit and the trainer's chain sampling.
        progress: show the one-off warm start's progress bar.
    """

    def __init__(
        self,
        config: SpeculativeConfig,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        model_name: str | Path,
        out: Path | None = None,
        seed: int = 0,
        progress: bool = True,
    ) -> None:
        self.config = config
        self.drafter: EagleDrafter | None = None
        self.buffer: HiddenBuffer | None = None
        self.trainer: SpotTrainer | None = None
        drafters: dict[str, Drafter] = {}
        if "suffix" in config.drafters:
            drafters["suffix"] = SuffixDrafter()
        if "eagle" in config.drafters:
            self.drafter = ensure_drafter(model_name, model, tokenizer, progress=progress)
            drafters["eagle"] = self.drafter
            if config.train_drafter:
                self.buffer = HiddenBuffer()
                folder = None if out is None else Path(out) / "drafter"
                self.trainer = SpotTrainer(self.drafter, self.buffer, out=folder, seed=seed)
                self.trainer.start()
        self.speculator = BanditSpeculator(
            config, drafters, seed, on_tail=None if self.trainer is None else self.trainer.idle
        )

    @property
    def capture(self) -> bool:
        """Whether rollouts should return hidden states (the trainer's data)."""
        return self.trainer is not None

    def observe(self, step: int, completions: Sequence[Completion]) -> None:
        """Hand a finished rollout's hidden states to the drafter's buffer."""
        if self.buffer is not None:
            self.buffer.add(step, completions)

    def idle(self, on: bool) -> None:
        """The loop is waiting (e.g. for the policy update): let the drafter train, or stop."""
        if self.trainer is not None:
            self.trainer.idle(on)

    def metrics(self) -> dict[str, float]:
        """Per-step metrics: acceptance length, drafted fraction, tail seconds, drafter loss
        and version."""
        record = self.speculator.stats.as_metrics()
        if self.trainer is not None:
            loss = self.trainer.mean_loss
            record["drafter_loss"] = round(loss, 6) if loss is not None else float("nan")
            record["drafter_version"] = self.trainer.version
        return record

    def close(self) -> None:
        """Stop the trainer; its last weights become the final saved version."""
        if self.trainer is not None:
            self.trainer.stop()
