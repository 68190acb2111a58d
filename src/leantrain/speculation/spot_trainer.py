"""Online drafter training (TLT's "spot trainer") and the offline warm start.

The rollouts already compute the target's hidden states; `HiddenBuffer` keeps those of the last
few RL steps. `SpotTrainer` trains a private copy of the drafter on them in a background thread
whenever it is told the hardware is idle (the engine is in the long tail, or the RL loop waits
for the policy update), so it never blocks a rollout; every `publish_every` steps it copies the
weights into the live drafter the engine drafts with, as a numbered version, saved with the run.
Drafting with a stale or half-trained drafter costs only acceptance, never correctness:
verification is lossless whatever the drafter proposes. Its optimizer steps are the shared SFT
loop's (`training.sft.SFTLoop`), one at a time online and a whole run in the warm start.

`ensure_drafter` warm-starts a drafter once per model (on the target's own `arith` rollouts) and
caches it under $LEANTRAIN_HOME/drafters, like the tiny model: a file lock, a staging folder
renamed into place.
"""

from __future__ import annotations

import json
import random
import threading
import time
from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from leantrain.errors import LeantrainError
from leantrain.generation import Completion, Engine, weights_snapshot
from leantrain.generation.config import SamplingParams
from leantrain.models import encode_prompt, leantrain_home, resolve_model_path
from leantrain.models.build_cache import build_once, recipe_hash
from leantrain.speculation.drafter import EagleDrafter, drafter_loss
from leantrain.tasks import ArithTask
from leantrain.training.sft import SFTLoop

# Bump when the warm-start recipe changes, so stale cached drafters are rebuilt.
DRAFTER_RECIPE_VERSION = 2
# The warm start's prompts come from their own seed stream, so a benchmark or RL run (seeds
# from 0 up) never times the drafter on the very problems it was trained on.
_WARM_START_SEED_OFFSET = 9_999_991


@dataclass
class Chains:
    """A training batch of drafter chains (shapes as in `drafter_loss`)."""

    features: torch.Tensor
    tokens: torch.Tensor
    targets: torch.Tensor


class HiddenBuffer:
    """The captured (hidden states, response ids) of the last `keep_steps` RL steps.

    Args:
        keep_steps: RL steps kept (TLT trains on the last 2): older hidden states came from an
            older policy, and the drafter should follow the current one.
        max_samples: responses kept in all (oldest dropped first).
    """

    def __init__(self, keep_steps: int = 2, max_samples: int = 4096) -> None:
        self.keep_steps = keep_steps
        self.samples: deque[tuple[int, torch.Tensor, torch.Tensor]] = deque(maxlen=max_samples)
        self.lock = threading.Lock()

    def add(self, step: int, completions: Sequence[Completion]) -> None:
        """Add completions that carry `hidden_states` (others are skipped), drop old steps."""
        with self.lock:
            for c in completions:
                if c.hidden_states is not None and len(c.response_ids) >= 2:
                    ids = torch.tensor(c.response_ids, device=c.hidden_states.device)
                    self.samples.append((step, c.hidden_states.detach(), ids))
            while self.samples and self.samples[0][0] <= step - self.keep_steps:
                self.samples.popleft()

    def __len__(self) -> int:
        return len(self.samples)

    def chains(self, n: int, k: int, rng: random.Random) -> Chains | None:
        """n random chains of length k (None if no response has k + 1 tokens)."""
        with self.lock:
            usable = [(h, ids) for _, h, ids in self.samples if len(ids) > k]
        if not usable:
            return None
        feats, toks, targets = [], [], []
        for _ in range(n):
            hidden, ids = usable[rng.randrange(len(usable))]
            s = rng.randrange(len(ids) - k)
            feats.append(hidden[s])
            toks.append(ids[s : s + k])
            targets.append(hidden[s + 1 : s + k + 1])
        return Chains(torch.stack(feats), torch.stack(toks), torch.stack(targets))


@dataclass(frozen=True)
class DrafterTraining:
    """How the drafter trains, online and in the warm start.

    Attributes:
        lr: AdamW learning rate (TLT uses 1e-6 on 7B-32B targets; a small drafter over a small
            target needs far more).
        chain: draft steps unrolled per training chain (the longest draft it learns to make).
        batch: chains per optimizer step.
        publish_every: optimizer steps between versions published to the live drafter.
    """

    lr: float = 1e-3
    chain: int = 4
    batch: int = 32
    publish_every: int = 20


class SpotTrainer:
    """Trains a copy of `drafter` on `buffer` and publishes versions into `drafter`.

    Drive it synchronously with `train_steps`, or `start()` a background thread that trains
    while `idle(True)` and pauses on `idle(False)`; `stop()` ends it and publishes the last state.

    Args:
        drafter: the live drafter the engine drafts with.
        buffer: captured hidden states.
        recipe: learning rate, chain length, batch size, publishing interval.
        out: folder for versioned checkpoints (`drafter-v00001.safetensors`, ...); None: none.
        seed: seeds which chains are drawn.
    """

    def __init__(
        self,
        drafter: EagleDrafter,
        buffer: HiddenBuffer,
        recipe: DrafterTraining = DrafterTraining(),
        out: Path | None = None,
        seed: int = 0,
    ) -> None:
        self.live = drafter
        self.buffer = buffer
        self.recipe = recipe
        self.out = out
        # The student trains in fp32 whatever dtype the live drafter drafts in.
        self.student = EagleDrafter(drafter.target, drafter.vocab, dtype=torch.float32)
        self.student.load_state_dict(drafter.state_dict())
        self.loop = SFTLoop(self.student, recipe.lr, weight_decay=0.01)
        self.rng = random.Random(seed)
        self.version = 0
        self.losses: deque[float] = deque(maxlen=50)
        self._idle = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def steps(self) -> int:
        """Optimizer steps taken."""
        return self.loop.steps

    @property
    def mean_loss(self) -> float | None:
        """Mean loss of the last (up to 50) steps; None before any."""
        return sum(self.losses) / len(self.losses) if self.losses else None

    def train_steps(self, n: int) -> int:
        """Up to n optimizer steps; returns how many ran (fewer when the buffer is empty)."""
        r = self.recipe
        for done in range(n):
            chains = self.buffer.chains(r.batch, r.chain, self.rng)
            if chains is None:
                return done
            self.losses.append(self.loop.step(partial(self.chain_loss, chains)).loss)
            if self.steps % r.publish_every == 0:
                self.publish()
        return n

    def chain_loss(self, chains: Chains) -> float:
        """Backpropagate the drafter loss on `chains` into the student; returns the loss."""
        self.student.train()
        loss, _ = drafter_loss(self.student, chains.features, chains.tokens, chains.targets)
        loss.backward()
        return float(loss.detach())

    def publish(self) -> int:
        """Publish the trained weights to the live drafter as a new version, the way the policy
        reaches its backends (`weights_snapshot` in, `load_weights` out); returns the version."""
        weights = weights_snapshot(self.student)
        self.version += 1
        self.live.load_weights(weights, self.version)
        if self.out is not None:
            self.out.mkdir(parents=True, exist_ok=True)
            save_file(
                {k: v.contiguous().cpu() for k, v in weights.items()},
                self.out / f"drafter-v{self.version:05d}.safetensors",
                metadata={"version": str(self.version), "steps": str(self.steps)},
            )
        return self.version

    def idle(self, on: bool) -> None:
        """Tell the background thread whether the hardware is idle (train) or busy (pause)."""
        if on:
            self._idle.set()
        else:
            self._idle.clear()

    def start(self) -> None:
        """Start the background thread (paused until `idle(True)`)."""
        if self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._loop, name="spot-trainer", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        """Stop the thread and publish what it trained since the last version."""
        if self._thread is not None:
            self._stop.set()
            self._idle.set()  # wake it so it sees the stop
            self._thread.join()
            self._thread = None
        if self.steps % self.recipe.publish_every:
            self.publish()

    def _loop(self) -> None:
        while not self._stop.is_set():
            if not self._idle.wait(timeout=0.1) or self._stop.is_set():
                continue
            if self.train_steps(1) == 0:
                time.sleep(0.05)  # nothing captured yet


@dataclass(frozen=True)
class WarmStart:
    """The offline warm start: the target's own `arith` rollouts, then drafter training.

    Attributes:
        prompts: arith prompts rolled out (with their hidden states captured).
        max_new_tokens: response cap of those rollouts (RL's 256: the long tail is long).
        temperature: their sampling temperature (RL's default 0.7).
        steps: drafter optimizer steps. On SmolLM2-135M the acceptance rate of the first draft
            token at temperature 0.7 (held-out rollouts) went 0.42 -> 0.54 -> 0.55 at 200, 1000
            and 2000 steps; five times the rollouts added at most 0.02 (docs/benchmarks.md).
        vocab_size: size of the draft vocabulary (the most frequent tokens of those rollouts).
        seed: seeds prompts, sampling and chains.
    """

    prompts: int = 128
    max_new_tokens: int = 256
    temperature: float = 0.7
    steps: int = 2000
    vocab_size: int = 4096
    seed: int = 0


def draft_vocabulary(
    completions: Sequence[Completion], vocab_size: int, eos_ids: Sequence[int], size: int
) -> torch.Tensor | None:
    """The `size` token ids most frequent in the completions' prompts and responses, EOS ids
    included (None when the whole vocabulary is no bigger)."""
    if vocab_size <= size:
        return None
    counts = Counter(t for c in completions for t in (*c.prompt_ids, *c.response_ids))
    chosen = set(eos_ids) | {t for t, _ in counts.most_common(size - len(eos_ids))}
    return torch.tensor(sorted(chosen))


def warm_start(
    target: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    recipe: WarmStart = WarmStart(),
    training: DrafterTraining = DrafterTraining(),
    progress: bool = True,
) -> tuple[EagleDrafter, list[float]]:
    """A drafter for `target` trained on its own rollouts, and the loss of every step."""
    examples = ArithTask().examples(recipe.prompts, seed=_WARM_START_SEED_OFFSET + recipe.seed)
    prompts = [encode_prompt(tokenizer, ex.prompt) for ex in examples]
    params = SamplingParams(max_new_tokens=recipe.max_new_tokens, temperature=recipe.temperature)
    engine = Engine(target, tokenizer, max_batch_size=32)
    completions = engine.generate(prompts, params, seed=recipe.seed, return_hidden_states=True)
    vocab_size = target.get_output_embeddings().weight.shape[0]
    vocab = draft_vocabulary(completions, vocab_size, sorted(engine.eos_ids), recipe.vocab_size)
    drafter = EagleDrafter(target, vocab)
    buffer = HiddenBuffer(keep_steps=1, max_samples=recipe.prompts)
    buffer.add(0, completions)
    trainer = SpotTrainer(drafter, buffer, training, seed=recipe.seed)

    def backward() -> float:
        chains = buffer.chains(training.batch, training.chain, trainer.rng)
        if chains is None:
            raise LeantrainError(
                f"drafter warm start: no rollout response has the {training.chain + 1} tokens a "
                "training chain needs (raise max_new_tokens)"
            )
        return trainer.chain_loss(chains)

    history = trainer.loop.run(
        backward, recipe.steps, label="warm-starting the drafter (one-off)", progress=progress
    )
    trainer.publish()
    return drafter, [stats.loss for stats in history]


def drafter_dir(model: str | Path, recipe: WarmStart = WarmStart()) -> Path:
    """Cache folder of the drafter `recipe` warm-starts for a preset or local model folder (the
    recipe and the target's folder hashed in)."""
    path = resolve_model_path(model).resolve()
    tag = recipe_hash(recipe, version=DRAFTER_RECIPE_VERSION, target=path.name)
    return leantrain_home() / "drafters" / f"{path.name}-v{DRAFTER_RECIPE_VERSION}-{tag}"


def ensure_drafter(
    model: str | Path,
    target: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    recipe: WarmStart = WarmStart(),
    progress: bool = True,
) -> EagleDrafter:
    """The warm-started drafter of `target` (loaded as `model`), built and cached on first use
    (one builder at a time)."""

    def build(staging: Path) -> None:
        start = time.perf_counter()
        drafter, losses = warm_start(target, tokenizer, recipe, progress=progress)
        staging.mkdir()
        save_file(
            {k: v.contiguous().cpu() for k, v in drafter.state_dict().items()},
            staging / "drafter.safetensors",
        )
        info = {
            "recipe": asdict(recipe),
            "recipe_version": DRAFTER_RECIPE_VERSION,
            "first_loss": round(losses[0], 4),
            "final_loss": round(sum(losses[-10:]) / len(losses[-10:]), 4),
            "train_seconds": round(time.perf_counter() - start, 1),
        }
        (staging / "build.json").write_text(json.dumps(info, indent=2) + "\n")

    folder = build_once(drafter_dir(model, recipe), build)
    state = load_file(folder / "drafter.safetensors", device=str(next(target.parameters()).device))
    drafter = EagleDrafter(target, state.get("vocab"))
    drafter.load_state_dict(state)
    return drafter
