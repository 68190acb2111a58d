"""Turning a task's prompt text into prompt token ids."""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase


def encode_prompt(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    """Prompt ids: through the chat template when the tokenizer has one (instruct models), else
    the raw text (the built-in tiny model, base models)."""
    if getattr(tokenizer, "chat_template", None):
        encoded = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True
        )
        # transformers 5 returns a BatchEncoding here; older versions a plain list.
        return list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded)
    return tokenizer.encode(text, add_special_tokens=False)
