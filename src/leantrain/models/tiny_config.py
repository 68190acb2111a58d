"""Architecture of the built-in tiny model: a 4-layer Llama of about 0.8 M parameters."""

from __future__ import annotations

from transformers import LlamaConfig, PreTrainedTokenizerBase


def tiny_config(tokenizer: PreTrainedTokenizerBase) -> LlamaConfig:
    """A Llama config sized for a 2-core CPU: hidden 128, 4 layers, 4 heads, MLP 512."""
    return LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=1024,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
