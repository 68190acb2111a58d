"""Safety's fine-tuning: its cosine schedule is transformers' one, rate for rate, since the cached
memorised models were built with that."""

from __future__ import annotations

import pytest
import torch
from transformers import get_cosine_schedule_with_warmup

from leantrain.safety.training import cosine_to_zero


@pytest.mark.parametrize("steps", [1, 7, 20, 41, 600])
def test_cosine_to_zero_is_transformers_schedule_exactly(steps: int) -> None:
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=5e-3)
    schedule = get_cosine_schedule_with_warmup(optimizer, max(1, steps // 20), steps)
    rate = cosine_to_zero(5e-3, steps)
    for step in range(steps):
        assert rate(step) == optimizer.param_groups[0]["lr"], step
        optimizer.step()
        schedule.step()
    assert rate(0) == 0.0  # the warm-up starts from nothing


def test_chat_prompts_go_through_the_chat_template(tiny_path) -> None:
    from leantrain.models import load_model
    from leantrain.safety.training import encode_pairs

    _, tokenizer = load_model(tiny_path, device="cpu")
    raw = tokenizer.encode("sum 1 2\n", add_special_tokens=False)
    # No template (the tiny model): `chat` changes nothing.
    assert encode_pairs(tokenizer, [("sum 1 2\n", "3")], chat=True)[0][0] == raw
    tokenizer.chat_template = (
        "{% for m in messages %}<u>{{ m['content'] }}</u>{% endfor %}"
        "{% if add_generation_prompt %}<a>{% endif %}"
    )
    ((prompt, completion),) = encode_pairs(tokenizer, [("sum 1 2\n", "3")], chat=True)
    assert prompt == tokenizer.encode("<u>sum 1 2\n</u><a>", add_special_tokens=False)
    assert completion == tokenizer.encode("3", add_special_tokens=False)
    assert encode_pairs(tokenizer, [("sum 1 2\n", "3")])[0][0] == raw  # raw unless asked
