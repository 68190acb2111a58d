"""The engine's own Llama-family forward against the transformers forward it replaces."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from leantrain.generation.decoder import LlamaDecoder, _packable, compute_dtype, supports
from leantrain.generation.kv_cache import RoomyCache
from leantrain.models import load_model


def _inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Two left-padded prompts of 5 and 3 tokens: ids, mask, positions (2, 5)."""
    ids = torch.tensor([[5, 9, 12, 7, 3], [0, 0, 4, 8, 11]])
    mask = torch.tensor([[1, 1, 1, 1, 1], [0, 0, 1, 1, 1]])
    return ids, mask, (mask.cumsum(-1) - 1).clamp(min=0)


@pytest.mark.parametrize(("dtype", "tolerance"), [("float32", 1e-4), ("bfloat16", 0.1)])
def test_logits_match_the_transformers_forward_and_follow_weight_changes(
    tiny_path: Path, dtype: str, tolerance: float
) -> None:
    model, _ = load_model(tiny_path, dtype=dtype)
    ids, mask, positions = _inputs()
    decoder = LlamaDecoder(model)
    with torch.inference_mode():
        for _ in range(2):  # the second pass after a weight changed in place
            decoder.refresh()
            ours, _ = decoder(ids, mask, positions, RoomyCache(), keep=1)
            theirs = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits
            assert (ours[:, -1].float() - theirs[:, -1].float()).abs().max() < tolerance
            model.model.layers[0].mlp.down_proj.weight.mul_(-1.0)


def test_hooks_in_the_model_keep_the_transformers_forward(tiny_path: Path) -> None:
    model, _ = load_model(tiny_path, dtype="float32")
    assert supports(model)
    handle = model.model.layers[1].self_attn.register_forward_pre_hook(lambda *_: None)
    assert not supports(model)
    handle.remove()
    model.model.layers[0].mlp.up_proj.forward = lambda x: x  # as ZO's grouped LoRA patches
    assert not supports(model)


def test_prefill_runs_and_the_next_decode_step_match_the_transformers_forward(
    tiny_path: Path,
) -> None:
    """A prefill attends per run of equal-length rows (here 4, 2, 4 tokens: three runs, the
    equal lengths not adjacent) with no mask; every real position's logits, and a decode step
    over the cache it wrote, match the transformers forward on the unpadded sequences."""
    model, _ = load_model(tiny_path, dtype="float32")
    prompts = [[5, 9, 12, 7], [4, 8], [3, 14, 6, 2]]
    ids = torch.tensor([[0] * (4 - len(p)) + p for p in prompts])
    mask = (ids != 0).long()
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    decoder, cache = LlamaDecoder(model), RoomyCache()
    with torch.inference_mode():
        decoder.refresh()
        prefill, _ = decoder(ids, mask, positions, cache, keep=4)  # (3, 4, V)
        nxt = torch.tensor([[10], [11], [13]])
        step, _ = decoder(
            nxt, torch.cat([mask, torch.ones(3, 1).long()], 1), positions[:, -1:] + 1, cache, keep=1
        )
        for row, prompt in enumerate(prompts):
            full = model(input_ids=torch.tensor([prompt + nxt[row].tolist()])).logits[0]
            n = len(prompt)
            assert (prefill[row, 4 - n :] - full[:n]).abs().max() < 1e-4
            assert (step[row, -1] - full[n]).abs().max() < 1e-4


def test_fp32_weights_under_bf16_autocast_compute_in_packed_bf16(tiny_path: Path) -> None:
    """A trainer's fp32 master weights under CPU bf16 autocast: where packed bf16 linears pay,
    the decoder computes as a bf16 model from bf16 copies (refreshed after an in-place update,
    as an optimizer step makes), close to the autocast forward; elsewhere it keeps fp32."""
    model, _ = load_model(tiny_path, dtype="float32")
    ids, mask, positions = _inputs()
    with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16):
        dtype = compute_dtype(model)
        if not _packable(torch.device("cpu"), torch.bfloat16):
            assert dtype == torch.float32
            return
        assert dtype == torch.bfloat16
        decoder = LlamaDecoder(model, dtype)
        for _ in range(2):  # the second pass after a weight changed in place
            decoder.refresh()
            ours, _ = decoder(ids, mask, positions, RoomyCache(), keep=1)
            theirs = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits
            assert ours.dtype == torch.bfloat16
            assert (ours[:, -1].float() - theirs[:, -1].float()).abs().max() < 0.1
            model.model.layers[0].mlp.down_proj.weight.mul_(-1.0)
    assert compute_dtype(model) == torch.float32  # no autocast: the weights' own dtype
