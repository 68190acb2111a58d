"""The fine-tuning and read-out loops every safety experiment shares: supervised fine-tuning on
(prompt, completion) text pairs (memorising the corpus, the relearning attack, password locking,
SFT elicitation), greedy answers to many prompts at once, and saving a model folder.

Knows nothing about privacy or sandbagging: it sees text pairs and prompts.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Literal

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from leantrain.errors import LeantrainError
from leantrain.generation import Engine, SamplingParams
from leantrain.models import encode_prompt
from leantrain.models.finetune import backward_token_mean, completion_chunks
from leantrain.training.sft import SFTLoop


def encode_text_prompt(tokenizer: PreTrainedTokenizerBase, prompt: str, chat: bool) -> list[int]:
    """A prompt's ids: the raw text, or (`chat`) as a user turn through the tokenizer's chat
    template, as our GRPO encodes task prompts (the raw text for a tokenizer without one)."""
    if chat:
        return encode_prompt(tokenizer, prompt)
    return tokenizer.encode(prompt, add_special_tokens=False)


def encode_pairs(
    tokenizer: PreTrainedTokenizerBase,
    pairs: Sequence[tuple[str, str]],
    *,
    eos: bool = False,
    chat: bool = False,
) -> list[tuple[list[int], list[int]]]:
    """Text (prompt, completion) pairs as token ids, no special tokens (raw text prompts, or with
    `chat` the prompt through the chat template: `encode_text_prompt`); `eos` ends each
    completion with the EOS token, so generation learns to stop there."""
    end = [tokenizer.eos_token_id] if eos else []
    return [
        (
            encode_text_prompt(tokenizer, p, chat),
            tokenizer.encode(c, add_special_tokens=False) + end,
        )
        for p, c in pairs
    ]


def padded_in_order(
    pairs: Sequence[tuple[Sequence[int], Sequence[int]]], pad_id: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """`completion_chunks` as one (ids, labels) batch whose rows keep the order of `pairs` (it
    sorts them by length), for callers that score each pair."""
    ids, labels = completion_chunks(pairs, pad_id)[0]
    order = sorted(range(len(pairs)), key=lambda i: len(pairs[i][0]) + len(pairs[i][1]))
    rows = torch.empty(len(pairs), dtype=torch.long)
    rows[torch.tensor(order)] = torch.arange(len(pairs))
    return ids[rows], labels[rows]


def sft(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    pairs: Sequence[tuple[str, str]],
    *,
    steps: int,
    lr: float,
    batch_size: int = 32,
    seed: int = 0,
    eos: bool = False,
    chat: bool = False,
    schedule: Literal["constant", "cosine"] = "constant",
    label: str = "fine-tuning",
    progress: bool = True,
) -> list[float]:
    """`steps` AdamW steps on random batches of `pairs` (loss on completions only); returns the
    loss of every step (`eos`, `chat`: see `encode_pairs`). `schedule`: a constant learning rate
    for the short runs (one thing less to tune), or a 5% warm-up then cosine decay to zero, which
    long runs need to settle on exact answers (memorising the private facts: 600 steps at a constant
    5e-3 left the loss at 0.3 and a fifth of the facts exact; with the decay, all of them)."""
    if not pairs:
        raise LeantrainError(f"{label}: no training pairs")
    if steps < 0 or lr <= 0 or batch_size < 1:
        raise LeantrainError(f"{label}: need steps >= 0, lr > 0, batch_size >= 1")
    encoded = encode_pairs(tokenizer, pairs, eos=eos, chat=chat)
    rng = random.Random(seed)

    def backward() -> float:
        batch = rng.sample(encoded, min(batch_size, len(encoded)))
        return backward_token_mean(model, completion_chunks(batch, tokenizer.pad_token_id))

    rate = lr if schedule == "constant" else cosine_to_zero(lr, steps)
    history = SFTLoop(model, rate).run(backward, steps, label=label, progress=progress)
    return [stats.loss for stats in history]


def cosine_to_zero(lr: float, steps: int) -> Callable[[int], float]:
    """The rate of each step: a linear warm-up from 0 over the first 5% of `steps`, then cosine
    decay to 0 at `steps`. Transformers' `get_cosine_schedule_with_warmup`, factor for factor
    (the memorised models are built with it: their cached weights depend on every rounding)."""
    warmup = max(1, steps // 20)

    def rate(step: int) -> float:
        if step < warmup:
            return lr * (step / warmup)
        progress = (step - warmup) / max(1, steps - warmup)
        return lr * max(0.0, 0.5 * (1.0 + math.cos(math.pi * progress)))

    return rate


def greedy_answers(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: Sequence[str],
    *,
    max_new_tokens: int,
    stop: tuple[str, ...] = (),
    chat: bool = False,
) -> list[str]:
    """The greedy continuation of each prompt (`chat`: see `encode_text_prompt`), decoded (stop
    string included if one fired)."""
    engine = Engine(model, tokenizer, max_batch_size=128)
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, stop=stop)
    ids = [encode_text_prompt(tokenizer, p, chat) for p in prompts]
    return [
        tokenizer.decode(c.response_ids, skip_special_tokens=True)
        for c in engine.generate(ids, params)
    ]


def save_model(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, folder: Path) -> Path:
    """Save a Hugging Face model folder (safetensors + tokenizer) that `load_model` reads."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder
