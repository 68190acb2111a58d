"""What ZO fine-tunes on: (prompt ids, completion ids) pairs whose loss is on the completion.

Two sources. A built-in classification task in prompt form (`sentiment`): the completion is the
verbalised label, and held-out accuracy picks the label the model scores highest. Or the user's
own JSONL file (`--data`), one object per line: `{"prompt": ..., "completion": ...}` (loss on the
completion) or `{"text": ...}` (language-modelling loss on every token, long texts cut into
windows of `max_tokens`). Every bad row is reported at once, by line number.

What it does NOT know about: perturbations, estimators, the engine.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from leantrain.errors import LeantrainError
from leantrain.models import encode_prompt
from leantrain.models.finetune import IGNORE
from leantrain.tasks import Example
from leantrain.tasks.jsonl import json_object
from leantrain.training.logprobs import label_logprobs


@dataclass(frozen=True)
class Pair:
    """One training row: the loss is on `completion`, given `prompt` (empty for plain text)."""

    prompt: list[int]
    completion: list[int]


def label_pair(tokenizer: PreTrainedTokenizerBase, prompt: str, label: str) -> Pair:
    """A prompt and one verbalised label, as the model is scored on it."""
    return Pair(encode_prompt(tokenizer, prompt), tokenizer.encode(label, add_special_tokens=False))


def example_pairs(tokenizer: PreTrainedTokenizerBase, examples: Sequence[Example]) -> list[Pair]:
    return [label_pair(tokenizer, ex.prompt, ex.answer) for ex in examples]


def pad_pairs(pairs: Sequence[Pair], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, T) right-padded input ids and labels (IGNORE on prompts and padding), in input order."""
    rows = [p.prompt + p.completion for p in pairs]
    width = max(map(len, rows))
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    labels = torch.full((len(rows), width), IGNORE, dtype=torch.long)
    for i, (pair, row) in enumerate(zip(pairs, rows, strict=True)):
        ids[i, : len(row)] = torch.tensor(row)
        labels[i, len(pair.prompt) : len(row)] = torch.tensor(pair.completion)
    return ids, labels


def sample_batch(pairs: Sequence[Pair], size: int, seed: int) -> list[Pair]:
    """`size` training pairs drawn without replacement (with, if there are fewer), by seed."""
    rng = random.Random(seed)
    if size <= len(pairs):
        return rng.sample(list(pairs), size)
    return rng.choices(list(pairs), k=size)


@torch.inference_mode()
def mean_loss(
    model: PreTrainedModel, pairs: Sequence[Pair], pad_id: int, rows_per_forward: int = 64
) -> float:
    """Token-mean next-token loss over the completions of `pairs` (held-out loss)."""
    total = count = 0.0
    for start in range(0, len(pairs), rows_per_forward):
        ids, labels = pad_pairs(pairs[start : start + rows_per_forward], pad_id)
        logp, n = label_logprobs(model, ids, labels)
        total -= float(logp.sum())
        count += float(n.sum())
    return total / max(count, 1.0)


@torch.inference_mode()
def label_accuracy(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    examples: Sequence[Example],
    labels: Sequence[str],
    rows_per_forward: int = 64,
) -> float:
    """Share of `examples` whose answer is the label with the highest mean per-token logprob
    (MeZO's prompt-based classification), every example x label scored in batched forwards."""
    pairs = [label_pair(tokenizer, ex.prompt, label) for ex in examples for label in labels]
    scores = []
    for start in range(0, len(pairs), rows_per_forward):
        ids, targets = pad_pairs(pairs[start : start + rows_per_forward], tokenizer.pad_token_id)
        logp, n = label_logprobs(model, ids, targets)
        scores.append(logp / n.clamp(min=1))
    per_label = torch.cat(scores).view(len(examples), len(labels))
    picked = per_label.argmax(-1).tolist()
    return sum(labels[i] == ex.answer for i, ex in zip(picked, examples, strict=True)) / len(
        examples
    )


def read_pairs(path: Path, tokenizer: PreTrainedTokenizerBase, max_tokens: int) -> list[Pair]:
    """The user's JSONL file as training pairs; one LeantrainError lists every bad line."""
    try:
        raw_lines = Path(path).read_bytes().splitlines()
    except OSError as exc:
        raise LeantrainError(f"cannot read data file {path}: {exc.strerror or exc}") from exc
    pairs: list[Pair] = []
    bad = []
    for number, raw in enumerate(raw_lines, start=1):
        if not raw.strip():
            continue
        try:
            pairs += _row_pairs(raw, tokenizer, max_tokens)
        except ValueError as exc:
            bad.append(f"line {number}: {exc}")
    if bad:
        raise LeantrainError(f"{path}: {len(bad)} bad row(s): " + "; ".join(bad))
    if not pairs:
        raise LeantrainError(
            f"{path}: no rows; expected one JSON object per line with prompt/completion or text"
        )
    return pairs


def _row_pairs(raw: bytes, tokenizer: PreTrainedTokenizerBase, max_tokens: int) -> list[Pair]:
    """One line as pairs, or a ValueError saying what is wrong with it."""
    obj = json_object(raw)
    kind = ("text",) if "text" in obj else ("prompt", "completion")
    if "text" in obj and ({"prompt", "completion"} & obj.keys()):
        raise ValueError("give either 'text' or 'prompt' and 'completion', not both")
    problems = [f"missing field {key!r}" for key in kind if key not in obj]
    problems += [
        f"field {key!r} must be a non-empty string, got {obj[key]!r:.40}"
        for key in kind
        if key in obj and (not isinstance(obj[key], str) or not obj[key].strip())
    ]
    if problems:
        raise ValueError(", ".join(problems))
    if kind == ("text",):
        ids = tokenizer.encode(obj["text"], add_special_tokens=False)
        if len(ids) < 2:
            raise ValueError("field 'text' must be at least two tokens long")
        # Windows of max_tokens: the first token of each window is context only.
        return [
            Pair([], ids[start : start + max_tokens])
            for start in range(0, len(ids) - 1, max_tokens)
            if len(ids[start : start + max_tokens]) >= 2
        ]
    prompt = encode_prompt(tokenizer, obj["prompt"])
    completion = tokenizer.encode(obj["completion"], add_special_tokens=False)
    if tokenizer.eos_token_id is not None:
        completion.append(tokenizer.eos_token_id)  # learn to stop after the completion
    return [Pair(prompt[-max_tokens:], completion[:max_tokens])]
