"""Multi-turn tool episodes. Most tests drive the runner with a scripted engine (each episode's
turns are fixed texts, cut at stop strings and max_new_tokens the way the real engine cuts them);
the token-identity, KV-budget and GRPO tests use the real engine on the tiny model."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from transformers import AutoTokenizer

from leantrain.errors import LeantrainError
from leantrain.generation import Completion, Engine, SamplingParams
from leantrain.models import encode_prompt, load_model, resolve_model_path
from leantrain.models.tokenizer import build_byte_tokenizer
from leantrain.rl.config import RLConfig
from leantrain.rl.episodes import (
    ChatToolFormat,
    EpisodeRunner,
    episode_trajectories,
    is_multi_turn,
)
from leantrain.rl.grpo import GRPORun
from leantrain.rl.losses import policy_loss
from leantrain.rl.packing import loss_context, pack, packed_logprobs
from leantrain.settings import load_settings
from leantrain.tasks import Example, make_task
from leantrain.tasks.rewards import ScoreResult
from leantrain.tasks.tool_arith import ToolArithTask, ToolCall

CALL_42 = "<python>\nprint(6*7)\n</python>"
REPLY_42 = "\n<output>\n42\n</output>\n"


class ScriptedEngine:
    """Stands in for `Engine`: each prompt's episode says its turns' texts in order."""

    def __init__(self, tokenizer, scripts: dict[str, list[str]]) -> None:
        self.tokenizer = tokenizer
        self.max_cache_tokens = None
        self.scripts = {
            tuple(encode_prompt(tokenizer, p)): list(turns) for p, turns in scripts.items()
        }
        self.sampled: list[list[int]] = []  # every completion's ids, in call order

    def _ids(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def generate(self, prompts, params: SamplingParams, *, seed=None, progress=False):
        out = []
        for context in prompts:
            key = next(k for k in self.scripts if tuple(context[: len(k)]) == k)
            text = self.scripts[key].pop(0)
            eos = [self.tokenizer.eos_token_id] if text.endswith("<eos>") else []
            ids, reason = [], "length"  # a script that runs out without EOS or a stop: "length"
            for token in self._ids(text.removesuffix("<eos>")) + eos:
                ids.append(token)
                if token == self.tokenizer.eos_token_id:
                    reason = "eos"
                    break
                if any(s in self.tokenizer.decode(ids) for s in params.stop):
                    reason = "stop"
                    break
                if len(ids) == params.max_new_tokens:
                    break
            logprobs = [-0.01 * (i + 1) for i in range(len(ids))]
            self.sampled.append(ids)
            out.append(Completion(list(context), ids, logprobs, reason))
        return out


@pytest.fixture(scope="module")
def byte_tok():
    return build_byte_tokenizer()


def _run(tokenizer, task, scripts, max_new_tokens=64):
    engine = ScriptedEngine(tokenizer, scripts)
    prompts = [encode_prompt(tokenizer, p) for p in scripts]
    episodes = EpisodeRunner(engine, task).generate(
        prompts, SamplingParams(max_new_tokens=max_new_tokens, temperature=1.0), seed=0
    )
    return engine, episodes


def test_an_episode_calls_the_tool_reads_the_output_and_answers(byte_tok):
    task = ToolArithTask()
    _, [ep] = _run(byte_tok, task, {"calc 6*7\n": [CALL_42, "answer: 42<eos>"]})
    assert (ep.finish_reason, ep.turns) == ("eos", 2)
    assert [(c.code, c.outcome) for c in ep.tool_calls] == [("print(6*7)", "ok")]
    assert ep.text == CALL_42 + REPLY_42 + "answer: 42"
    n_call, n_reply = len(byte_tok.encode(CALL_42)), len(byte_tok.encode(REPLY_42))
    n_answer = len(byte_tok.encode("answer: 42")) + 1  # and the EOS
    assert ep.loss_mask == [1] * n_call + [0] * n_reply + [1] * n_answer
    assert ep.env_tokens == n_reply
    assert task.score(Example("calc 6*7\n", "42"), ep.text) == {
        "format": 1.0,
        "answer": 1.0,
        "tool": 1.0,
    }


def test_tool_failures_come_back_as_output_and_are_recorded(byte_tok):
    task = ToolArithTask(timeout_s=1.0)
    scripts = {
        "a\n": ["no code here </python>", "answer: 1<eos>"],
        "b\n": ["<python>\nwhile True: pass\n</python>", "answer: 2<eos>"],
        "c\n": ["<python>\nraise ValueError('boom')\n</python>", "answer: 3<eos>"],
    }
    _, episodes = _run(byte_tok, task, scripts)
    outcomes = [[c.outcome for c in ep.tool_calls] for ep in episodes]
    assert outcomes == [["malformed"], ["timeout"], ["error"]]
    assert all(ep.finish_reason == "eos" and ep.turns == 2 for ep in episodes)
    assert "<error>\nValueError: boom\n</error>" in episodes[2].text


def test_episode_stops_at_max_turns(byte_tok):
    task = ToolArithTask(max_turns=3)
    _, [ep] = _run(byte_tok, task, {"calc 6*7\n": [CALL_42] * 5})
    assert (ep.finish_reason, ep.turns, len(ep.tool_calls)) == ("max_turns", 3, 2)
    # Two replies in the context; the last call is not answered (no turn left to read it).
    assert ep.text == (CALL_42 + REPLY_42) * 2 + CALL_42


@pytest.mark.parametrize("budget", [1, 7, 30, 31, 40, 41, 60, 200])
def test_token_budget_is_never_exceeded(byte_tok, budget):
    """Budgets falling inside a turn, right after it, inside the tool reply and beyond the end."""
    task = ToolArithTask(episode_tokens=budget)
    _, [ep] = _run(byte_tok, task, {"calc 6*7\n": [CALL_42, "answer: 42<eos>"]})
    full = len(byte_tok.encode(CALL_42 + REPLY_42)) + len("answer: 42") + 1
    assert len(ep.response_ids) <= budget
    assert ep.finish_reason == ("eos" if budget >= full else "budget")
    assert len(ep.response_ids) == len(ep.loss_mask) == len(ep.logprobs)
    if budget < full:  # what was kept is a prefix of what the scripted model and env produced
        reference = _run(byte_tok, ToolArithTask(), {"calc 6*7\n": [CALL_42, "answer: 42<eos>"]})
        assert reference[1][0].response_ids[: len(ep.response_ids)] == ep.response_ids


def test_length_finish_when_a_turn_hits_max_new_tokens(byte_tok):
    _, [ep] = _run(byte_tok, ToolArithTask(), {"x\n": ["y" * 100]}, max_new_tokens=10)
    assert (ep.finish_reason, len(ep.response_ids)) == ("length", 10)


def test_is_multi_turn():
    assert is_multi_turn(make_task("tool_arith"))
    assert not is_multi_turn(make_task("code"))
    with pytest.raises(LeantrainError, match="not a multi-turn task"):
        EpisodeRunner(None, make_task("code"))  # type: ignore[arg-type]


# ------------------------------------------------------------------ chat templates


@pytest.fixture(scope="module")
def smollm2_tok():
    return AutoTokenizer.from_pretrained(resolve_model_path("smollm2-135m"))


def test_smollm2_template_is_prefix_preserving_and_wraps_tool_replies(smollm2_tok):
    fmt = ChatToolFormat(smollm2_tok)
    assert fmt.prefix_preserving
    assert fmt.env_text("R") == "<|im_end|>\n<|im_start|>tool\nR<|im_end|>\n<|im_start|>assistant\n"
    _, [ep] = _run(smollm2_tok, ToolArithTask(), {"calc 6*7\n": [CALL_42, "answer: 42<eos>"]})
    assert ep.finish_reason == "eos" and len(ep.segments) == 1
    # The context the model saw for turn 2 is the template's render of the conversation.
    seen = smollm2_tok.decode(ep.prompt_ids + ep.response_ids)
    messages = [
        {"role": "user", "content": "calc 6*7\n"},
        {"role": "assistant", "content": CALL_42},
        {"role": "tool", "content": "<output>\n42\n</output>"},
    ]
    rendered = smollm2_tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert seen.startswith(rendered)


# Renders earlier assistant turns as "[call]": the history changes once a tool message follows.
_REWRITING_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: "
    "{% if m['role'] == 'assistant' and not loop.last %}[call]"
    "{% else %}{{ m['content'] }}{% endif %}"
    "{{ '\\n' }}{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}"
)


def test_non_prefix_preserving_template_forks_the_episode(byte_tok):
    tok = build_byte_tokenizer()
    tok.chat_template = _REWRITING_TEMPLATE
    assert not ChatToolFormat(tok).prefix_preserving
    engine, [ep] = _run(tok, ToolArithTask(), {"calc 6*7\n": [CALL_42, "answer: 42<eos>"]})
    assert ep.finish_reason == "eos" and len(ep.segments) == 2
    first, second = ep.segments
    assert first.prompt_ids == encode_prompt(tok, "calc 6*7\n")
    assert first.response_ids == engine.sampled[0] and first.loss_mask == [1] * len(first.loss_mask)
    expected = "user: calc 6*7\n\nassistant: [call]\ntool: <output>\n42\n</output>\nassistant: "
    assert tok.decode(second.prompt_ids) == expected
    assert second.response_ids == engine.sampled[1]
    rows = episode_trajectories(ep, ScoreResult({"answer": 1.0}, 1.0), version=3, group_id=5)
    assert [(len(r.response_ids), r.group_id, r.reward) for r in rows] == [
        (len(engine.sampled[0]), 5, 1.0),
        (len(engine.sampled[1]), 5, 1.0),
    ]


def test_a_template_without_tool_messages_is_a_clear_error():
    tok = build_byte_tokenizer()
    tok.chat_template = (
        "{% for m in messages %}{% if m['role'] == 'tool' %}"
        "{{ raise_exception('unknown role') }}{% endif %}{{ m['content'] }}{% endfor %}"
    )
    with pytest.raises(LeantrainError, match=r"cannot render a tool conversation.*unknown role"):
        ChatToolFormat(tok)


# ---------------------------------------------------------- real engine, tiny model


@dataclass
class LineTool:
    """A tool environment the tiny model uses without being taught: every line it writes is a
    tool call (stop string "\\n"), run in the sandbox as an expression to print."""

    max_turns: int = 4
    episode_tokens: int = 96
    tool_stop: str = "\n"
    multi_turn: bool = True

    def call_tool(self, turn_text: str) -> ToolCall:
        task = ToolArithTask(timeout_s=1.0)
        return task.call_tool(f"<python>\nprint({turn_text.strip()!r})\n</python>")


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    return load_model("tiny")


class Recording(Engine):
    """The real engine, keeping every completion it returns."""

    def generate(self, prompts, params, **kwargs):
        out = super().generate(prompts, params, **kwargs)
        self.log = [*getattr(self, "log", []), *out]
        return out


def test_trainer_ids_are_the_sampled_ids_and_env_tokens_get_no_loss(tiny):
    model, tok = tiny
    engine = Recording(model, tok, max_batch_size=4)
    env = LineTool()
    prompts = [encode_prompt(tok, f"sum {a} {b}\n") for a, b in [(3, 4), (5, 9), (2, 2), (7, 1)]]
    episodes = EpisodeRunner(engine, env).generate(
        prompts, SamplingParams(max_new_tokens=24, temperature=1.0), seed=1
    )
    assert sum(ep.env_tokens for ep in episodes) > 0
    sampled = {tuple(c.prompt_ids): c.response_ids for c in engine.log}
    for ep in episodes:
        assert len(ep.response_ids) <= env.episode_tokens
        # Walk the row: each model turn's ids are the engine's ids for that context, then the
        # environment's reply ids, exactly as encoded.
        row, at = ep.prompt_ids, 0
        for turn in range(ep.turns):
            ids = sampled[tuple(row + ep.response_ids[:at])]
            kept = ep.response_ids[at : at + len(ids)]
            assert kept == ids[: len(kept)] and ep.loss_mask[at : at + len(kept)] == [1] * len(kept)
            at += len(kept)
            if turn < len(ep.tool_calls):
                reply = tok.encode(f"\n{ep.tool_calls[turn].output}\n", add_special_tokens=False)
                assert ep.response_ids[at : at + len(reply)] == reply
                assert ep.loss_mask[at : at + len(reply)] == [0] * len(reply)
                at += len(reply)
        assert at == len(ep.response_ids)

    rows = [
        t
        for ep in episodes
        for t in episode_trajectories(ep, ScoreResult({"answer": 0.0}, 0.0), version=0, group_id=0)
    ]
    batch = pack(rows, torch.tensor([1.0, -1.0, 0.5, -0.5]))
    assert batch.targets.tolist() == [t for ep in episodes for t in ep.response_ids]
    logp = packed_logprobs(model, batch)
    logp.retain_grad()
    ctx = loss_context([batch])
    loss, _ = policy_loss(
        logp, batch.old_logprobs, batch.advantages, batch.loss_mask, batch.sequence_index, ctx
    )
    loss.backward()
    env = batch.loss_mask == 0
    assert env.any() and (logp.grad[env] == 0).all()
    assert (logp.grad[~env] != 0).all()
    model.zero_grad()


def test_engine_never_exceeds_its_kv_budget_and_greedy_outputs_do_not_change(tiny):
    model, tok = tiny
    prompts = [encode_prompt(tok, f"sum {' '.join('7' * n)}\n") for n in (2, 20, 3, 12, 4, 30)]
    params = SamplingParams(max_new_tokens=40, temperature=0.0)
    free = Engine(model, tok, max_batch_size=6)
    reference = free.generate(prompts, params)
    budget = 2 * (max(len(p) for p in prompts) + params.max_new_tokens)
    assert free.peak_cache_tokens > budget  # without the budget this batch would pass it
    bounded = Engine(model, tok, max_batch_size=6, max_cache_tokens=budget)
    outputs = bounded.generate(prompts, params)
    assert 0 < bounded.peak_cache_tokens <= budget
    assert [c.response_ids for c in outputs] == [c.response_ids for c in reference]
    with pytest.raises(LeantrainError, match="max_cache_tokens"):
        Engine(model, tok, max_cache_tokens=30).generate(prompts, params)
    # Episodes check once, up front, that no context can outgrow the engine's budget.
    runner = EpisodeRunner(Engine(model, tok, max_cache_tokens=100), LineTool(episode_tokens=96))
    with pytest.raises(LeantrainError, match="episode_tokens"):
        runner.generate(prompts[:1], params)


def test_grpo_trains_on_tool_episodes(tiny_path, tmp_path):
    cfg = load_settings(
        RLConfig,
        "configs/tiny-tools.yaml",
        **{
            "model.name": "tiny",  # the tiny-tools preset's build is tested in tests/models
            "steps": 1,
            "out": tmp_path / "run",
            "device": "cpu",
            "task.eval_size": 2,
            "sampling.max_new_tokens": 16,
            "grpo.prompts_per_step": 2,
            "grpo.group_size": 2,
            "max_cache_tokens": 256,
        },
    )
    run = GRPORun(cfg, progress=False)
    assert isinstance(run.source.backend, EpisodeRunner)
    assert (
        run.source.backend.engine.max_cache_tokens == 256
    )  # the config's KV budget reaches the engine
    # The plain tiny model never writes <python>; the line tool makes its episodes multi-turn.
    run.source.backend = EpisodeRunner(run.source.backend.engine, LineTool(episode_tokens=48))
    summary = run.run()
    assert summary["steps"] == 1
    record = run.metrics.read()[-1]
    assert record["env_tokens"] > 0 and record["generated_tokens"] > 0
    assert record["active_tokens"] == record["generated_tokens"]  # env tokens are not trained
    assert record["padding_fraction"] == 0.0 and record["padding_fraction_padded"] > 0.0
    assert 0 < run.source.backend.engine.peak_cache_tokens <= 256
