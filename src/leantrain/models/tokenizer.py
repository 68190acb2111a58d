"""The built-in tokenizer: byte-level, no merges, so every digit is its own token and any UTF-8
text round-trips. Built with `tokenizers` and wrapped as a `PreTrainedTokenizerFast`, so it saves
and loads like any Hugging Face tokenizer."""

from __future__ import annotations

from tokenizers import Tokenizer, decoders, pre_tokenizers
from tokenizers.models import BPE
from transformers import PreTrainedTokenizerFast

SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>")


def build_byte_tokenizer() -> PreTrainedTokenizerFast:
    """A 259-token byte-level tokenizer: ids 0-2 are <pad>, <bos>, <eos>; then the 256 bytes."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    vocab.update({ch: len(SPECIAL_TOKENS) + i for i, ch in enumerate(alphabet)})
    core = Tokenizer(BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    core.add_special_tokens(list(SPECIAL_TOKENS))
    return PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>"
    )
