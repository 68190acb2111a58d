"""Multi-turn tool episodes, token-in/token-out: generate, run the tool, append its output as
environment tokens, continue.

Each turn, every live episode's context (prompt, then everything appended so far) goes to the
rollout backend (the native engine or vLLM, through the `Backend` protocol) as ids; a turn ends
on EOS, on the per-turn `max_new_tokens`, or on the task's tool stop string (`</python>`). A
tool call is run by the task (`call_tool`, in the sandbox, several episodes' calls at once on
threads) and its reply is tokenized once and appended with loss mask 0: it is in the context,
never in the loss. Sampled ids are kept exactly as sampled and never decoded and re-encoded on
the way to the trainer.

Limits: `max_turns` model turns, and `episode_tokens` tokens after the prompt (generated plus
environment, over all turns). Why an episode ended is its finish reason: "eos", "stop" (a caller's
stop string), "length" (a turn hit max_new_tokens), "max_turns" (still calling the tool after the
last turn), "budget" (the token budget ran out; tokens sampled past it are dropped, which leaves
the kept ones exactly as sampled).

Chat templates: the environment's reply is a `tool` message. If the template is prefix-preserving
(the conversation rendered with the tool message starts with exactly what the model saw: prompt,
then its own sampled text), the reply's tokens are the template's text between the two, computed
once from a probe conversation. If it is not, the episode forks, as TRL's async worker does: the
row so far is closed and the next turn starts a new row whose prompt is the whole conversation
re-rendered; each row trains only on its own sampled tokens (every row of an episode carries the
episode's reward, so a forked episode weighs more in its group's statistics).

Each turn re-prefills its contexts on the native engine (it keeps no cache between calls).
vLLM's prefix cache may serve the full KV blocks of a context's earlier turns (no weights change
between the turns of a batch), but its blocks are 128 tokens on CPU, longer than the tiny
presets' contexts: there it serves none (docs/backends.md). Images (vision-language models): an
episode's prompt images go with its context to every turn's prefill, since each re-prefill
rebuilds the image features; forking (which re-renders the prompt as text) is not supported
with images.

Knows nothing about rewards or training: it returns `Episode`s; `episode_trajectories` turns one
into trainer rows once it has been scored.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Protocol, runtime_checkable

import torch
from transformers import PreTrainedTokenizerBase

from leantrain.errors import LeantrainError
from leantrain.generation import Backend, Capabilities, Completion, FinishReason, SamplingParams
from leantrain.rl.trajectory import EpisodeEndReason, Trajectory
from leantrain.tasks.rewards import ScoreResult
from leantrain.tasks.tool_arith import ToolCall, reply_text
from leantrain.telemetry.events import SeqTimeline, clock

EpisodeFinishReason = FinishReason | EpisodeEndReason

_TURN_SEED_STRIDE = 1_000_033  # turn t samples with seed + t * stride: no two turns share a seed
_SENTINEL = "\u2063LEANTRAIN_TOOL_OUTPUT\u2063"  # probe content no template rewrites
_MAX_TOOL_THREADS = 8  # sandbox calls run concurrently; each is a child process


@runtime_checkable
class ToolEnvironment(Protocol):
    """What the runner needs from a multi-turn task (e.g. `tasks.tool_arith.ToolArithTask`)."""

    tool_stop: str
    max_turns: int
    episode_tokens: int

    def call_tool(self, turn_text: str) -> ToolCall: ...


def is_multi_turn(task: object) -> bool:
    """Whether rollouts of `task` are tool episodes rather than single completions."""
    return bool(getattr(task, "multi_turn", False)) and isinstance(task, ToolEnvironment)


@dataclass
class Segment:
    """One trainer row of an episode: a context and the tokens appended to it.

    Attributes:
        prompt_ids: the row's context before its first appended token.
        response_ids: sampled and environment tokens in the order they were appended.
        logprobs: behaviour logprob of each sampled token; 0.0 on environment tokens.
        loss_mask: 1 on sampled tokens, 0 on environment tokens.
    """

    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)

    def append(self, ids: Sequence[int], logprobs: Sequence[float] | None) -> None:
        """Append sampled tokens (with their logprobs) or environment tokens (logprobs None)."""
        self.response_ids += ids
        self.logprobs += list(logprobs) if logprobs is not None else [0.0] * len(ids)
        self.loss_mask += [1 if logprobs is not None else 0] * len(ids)


@dataclass
class Episode(Completion):
    """A finished episode. As a `Completion`, `prompt_ids` is the original prompt and
    `response_ids`/`logprobs`/`loss_mask` are all segments' appended tokens in order (one row,
    exactly the model's context, unless the episode forked; the trainer uses `segments`).

    Attributes:
        loss_mask: 1 on sampled tokens, 0 on environment tokens, one per response token.
        segments: the trainer rows (one unless a non-prefix-preserving template forked it).
        tool_calls: every tool call and the environment's reply, in order.
        turns: model turns taken.
        text: the transcript in the task's plain format (model turns and replies), for scoring.
    """

    loss_mask: list[int] = field(default_factory=list)
    segments: list[Segment] = field(default_factory=list)
    tool_calls: list[ToolCall] = field(default_factory=list)
    turns: int = 0
    text: str = ""

    @property
    def env_tokens(self) -> int:
        """Environment tokens in the episode's rows."""
        return sum(s.loss_mask.count(0) for s in self.segments)


class ChatToolFormat:
    """How a chat template wraps a tool reply, probed once per tokenizer.

    `prefix_preserving` is True when, over two tool rounds of a probe conversation, rendering
    with the tool message appended starts with exactly what the model saw (the previous render
    plus its own turn's text), and every tool message is wrapped the same way. Then
    `env_text(reply)` is the text to append after a model turn: end of turn, the tool message,
    and the next assistant header.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer
        self.before = self.after = ""
        self.prefix_preserving = self._probe()
        user_render = self.render([{"role": "user", "content": _SENTINEL}])
        self.user_before, _, self.user_after = user_render.partition(_SENTINEL)

    def render(self, messages: list[dict[str, str]]) -> str:
        """The conversation as text, ending with the next assistant header."""
        try:
            return self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=False
            )
        except Exception as exc:  # a template that rejects the conversation: say which and why
            raise LeantrainError(
                f"the chat template cannot render a tool conversation ({type(exc).__name__}: "
                f"{exc}); multi-turn episodes need a template that accepts 'tool' messages"
            ) from None

    def _probe(self) -> bool:
        messages = [{"role": "user", "content": "2+2"}]
        seen = self.render(messages)
        wrappers = set()
        for turn in ("<python>\nprint(2+2)\n</python>", "answer: 4"):
            messages += [
                {"role": "assistant", "content": turn},
                {"role": "tool", "content": _SENTINEL},
            ]
            full = self.render(messages)
            if not full.startswith(seen + turn) or full.count(_SENTINEL) != 1:
                return False
            wrappers.add(tuple(full[len(seen + turn) :].split(_SENTINEL)))
            seen = full.replace(_SENTINEL, "")
            messages[-1]["content"] = ""
        if len(wrappers) != 1:
            return False
        self.before, self.after = wrappers.pop()
        return True

    def env_text(self, reply: str) -> str:
        """Text appended after a model turn for the tool's `reply` (prefix-preserving only)."""
        return self.before + reply + self.after

    def user_content(self, prompt_ids: Sequence[int]) -> str:
        """The user message behind a one-message prompt made by `models.encode_prompt`, for
        re-rendering a forked conversation."""
        text = self.tokenizer.decode(prompt_ids, skip_special_tokens=False)
        if not (text.startswith(self.user_before) and text.endswith(self.user_after)):
            raise LeantrainError(
                "cannot fork a multi-turn episode: its prompt is not one user message rendered "
                "by the chat template (build prompts with leantrain.models.encode_prompt)"
            )
        return text[len(self.user_before) : len(text) - len(self.user_after)]


@dataclass
class _Live:
    """An episode while it runs."""

    segments: list[Segment]
    messages: list[dict[str, str]] | None = None  # the conversation, kept only when forking
    pixel_values: torch.Tensor | None = None  # the prompt's images, for every turn's prefill
    tool_calls: list[ToolCall] = field(default_factory=list)
    text: str = ""
    turn_text: str = ""  # the last model turn, decoded
    turns: int = 0
    used: int = 0  # tokens after the prompt: generated plus environment
    finish: EpisodeFinishReason | None = None
    timeline: SeqTimeline = field(default_factory=SeqTimeline)  # every turn's, and the tools'

    @property
    def row(self) -> Segment:
        return self.segments[-1]

    @property
    def context(self) -> list[int]:
        return self.row.prompt_ids + self.row.response_ids


class EpisodeRunner:
    """Runs tool episodes on a rollout backend; a rollout `Backend` itself (`generate` has
    `Engine.generate`'s signature), so a rollout source uses a runner wherever it uses an engine.

    Every turn goes through the backend's `generate` only (token ids in, sampled ids and their
    logprobs out, the tool stop string as a stop string), so any `Backend` runs episodes: the
    native `Engine` or `VLLMBackend`, whose stop strings end a turn exactly as the engine's do.

    Args:
        engine: the rollout backend every turn samples on (the native engine's KV-cache budget
            applies to every turn).
        env: the multi-turn task: tool stop string, `call_tool`, `max_turns`, `episode_tokens`.
        tokenizer: the policy's tokenizer (turns are decoded for the tool, replies encoded with
            it); None: the native engine's own (`Engine.tokenizer`); a backend without one
            (vLLM) needs it given.
        max_context: the longest context (prompt plus episode) the backend takes, e.g. vLLM's
            `max_model_len`; None: the native engine's KV-cache budget (`max_cache_tokens`,
            itself None without one), or no limit for a backend without a budget.
    """

    def __init__(
        self,
        engine: Backend,
        env: ToolEnvironment,
        tokenizer: PreTrainedTokenizerBase | None = None,
        max_context: int | None = None,
    ) -> None:
        if not isinstance(env, ToolEnvironment):
            raise LeantrainError(
                f"{type(env).__name__} is not a multi-turn task: it needs tool_stop, max_turns, "
                "episode_tokens and call_tool"
            )
        self.engine = engine
        self.env = env
        tokenizer = getattr(engine, "tokenizer", None) if tokenizer is None else tokenizer
        if tokenizer is None:
            raise LeantrainError(
                f"EpisodeRunner on {type(engine).__name__} needs the policy's tokenizer: the "
                "backend has none of its own"
            )
        self.tokenizer: PreTrainedTokenizerBase = tokenizer
        # None (no KV budget, no max_context given): contexts are not checked against a limit.
        self.max_context, self._context_setting = (
            (getattr(engine, "max_cache_tokens", None), "max_cache_tokens")
            if max_context is None
            else (max_context, "max_model_len")
        )
        self.chat = ChatToolFormat(self.tokenizer) if self.tokenizer.chat_template else None
        self._stop_window = len(env.tool_stop.encode()) + 1

    @property
    def capabilities(self) -> Capabilities:
        # The engine's, less hidden states: a turn's are never passed on to the episode.
        return replace(self.engine.capabilities, hidden_states=False)

    def load_weights(self, weights: Mapping[str, torch.Tensor], version: int) -> None:
        self.engine.load_weights(weights, version)

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams,
        *,
        seed: int | None = None,
        progress: bool = False,
        images: Sequence[torch.Tensor | None] | None = None,
    ) -> list[Episode]:
        """Run one episode per prompt; episodes come back in input order. `images`: as in
        `Engine.generate`, the pixel values of each prompt's images (or None)."""
        budget, max_turns = self.env.episode_tokens, self.env.max_turns
        if budget < 1 or max_turns < 1:
            raise LeantrainError(
                f"episodes need episode_tokens >= 1 and max_turns >= 1, got {budget}, {max_turns}"
            )
        limit = self.max_context
        longest = max((len(p) for p in prompts), default=0)
        if limit is not None and longest + budget > limit:
            # A context never outgrows prompt + episode_tokens, so this is checked once, here,
            # instead of failing in the engine in the middle of a turn (or, on vLLM, a turn
            # silently cut at max_model_len).
            raise LeantrainError(
                f"a {longest}-token prompt plus episode_tokens ({budget}) exceeds the engine's "
                f"{self._context_setting} ({limit}); lower episode_tokens or raise the budget"
            )
        fork = self.chat is not None and not self.chat.prefix_preserving
        pixels = [None] * len(prompts) if images is None else list(images)
        if len(pixels) != len(prompts):
            raise LeantrainError(
                f"images has {len(pixels)} entries, expected one per prompt ({len(prompts)})"
            )
        if fork and any(pv is not None for pv in pixels):
            raise LeantrainError(
                "this chat template is not prefix-preserving, so episodes would fork into "
                "re-rendered text prompts, which cannot carry images; use a model whose template "
                "keeps the conversation's prefix"
            )
        episodes = [
            _Live(
                [Segment(list(p))],
                [{"role": "user", "content": self.chat.user_content(p)}] if fork else None,
                pixel_values=pv,
            )
            for p, pv in zip(prompts, pixels, strict=True)
        ]
        stop = (*params.stop, self.env.tool_stop)
        live = list(episodes)
        for turn in range(max_turns):
            if not live:
                break
            max_new = min(params.max_new_tokens, max(budget - ep.used for ep in live))
            completions = self.engine.generate(
                [ep.context for ep in live],
                params.model_copy(update={"max_new_tokens": max_new, "stop": stop}),
                seed=None if seed is None else seed + turn * _TURN_SEED_STRIDE,
                progress=progress,
                # Text episodes call the engine exactly as before (any `generate` will do).
                **({} if images is None else {"images": [ep.pixel_values for ep in live]}),
            )
            callers = [
                ep
                for ep, c in zip(live, completions, strict=True)
                if self._take_turn(ep, c, params.max_new_tokens, last=turn == max_turns - 1)
            ]
            self._run_tools(callers)
            live = [ep for ep in live if ep.finish is None]
        return [self._finish(ep) for ep in episodes]

    def _take_turn(self, ep: _Live, c: Completion, turn_cap: int, *, last: bool) -> bool:
        """Append a turn's sampled tokens to `ep`; True when the turn ended in a tool call that
        the environment should answer, else `ep.finish` says why the episode is over."""
        room = self.env.episode_tokens - ep.used
        ids, logprobs = c.response_ids[:room], c.logprobs[:room]
        ep.timeline.then(c.timeline)
        ep.row.append(ids, logprobs)
        ep.used += len(ids)
        ep.turns += 1
        ep.turn_text = self.tokenizer.decode(ids, skip_special_tokens=True)
        ep.text += ep.turn_text
        if ep.messages is not None:
            ep.messages.append({"role": "assistant", "content": ep.turn_text})
        tool_call = c.finish_reason == "stop" and self.env.tool_stop in self.tokenizer.decode(
            ids[-self._stop_window :]
        )
        if len(c.response_ids) > room:
            ep.finish = "budget"
        elif c.finish_reason == "length":
            # The engine's cap was the largest room in the batch; a smaller room is the budget.
            ep.finish = "length" if len(ids) >= turn_cap else "budget"
        elif not tool_call:
            ep.finish = c.finish_reason
        elif last:
            ep.finish = "max_turns"
        elif ep.used == self.env.episode_tokens:
            ep.finish = "budget"
        return ep.finish is None

    def _run_tools(self, callers: list[_Live]) -> None:
        """Answer each caller's tool call (in the sandbox, concurrently) with environment tokens."""
        if not callers:
            return
        now = clock()
        for ep in callers:
            ep.timeline.pause(now, "tool")
        with ThreadPoolExecutor(max_workers=min(_MAX_TOOL_THREADS, len(callers))) as pool:
            calls = list(pool.map(self.env.call_tool, [ep.turn_text for ep in callers]))
        for ep, call in zip(callers, calls, strict=True):
            ep.tool_calls.append(call)
            self._append_reply(ep, call.output)

    def _append_reply(self, ep: _Live, reply: str) -> None:
        """Append the environment's `reply` as masked tokens, or fork the row (see module doc)."""
        room = self.env.episode_tokens - ep.used
        if ep.messages is not None:
            ep.messages.append({"role": "tool", "content": reply})
            prompt = self.tokenizer.encode(self.chat.render(ep.messages), add_special_tokens=False)
            grown = max(0, len(prompt) - len(ep.context))
            if grown > room:
                ep.finish = "budget"
                return
            ep.segments.append(Segment(prompt))
            ep.used += grown
        else:
            text = self.chat.env_text(reply) if self.chat is not None else reply_text(reply)
            ids = self.tokenizer.encode(text, add_special_tokens=False)
            if len(ids) > room:
                ep.finish = "budget"
                return
            ep.row.append(ids, None)
            ep.used += len(ids)
        ep.text += reply_text(reply)
        if ep.used == self.env.episode_tokens:
            ep.finish = "budget"

    def _finish(self, ep: _Live) -> Episode:
        assert ep.finish is not None, "every turn ends in a finish reason or a tool call"
        rows = ep.segments
        return Episode(
            prompt_ids=rows[0].prompt_ids,
            response_ids=[t for s in rows for t in s.response_ids],
            logprobs=[lp for s in rows for lp in s.logprobs],
            finish_reason=ep.finish,
            loss_mask=[m for s in rows for m in s.loss_mask],
            segments=rows,
            tool_calls=ep.tool_calls,
            turns=ep.turns,
            text=ep.text,
            timeline=ep.timeline,
        )


def episode_trajectories(
    episode: Episode,
    score: ScoreResult,
    version: int,
    group_id: int,
    pixel_values: torch.Tensor | None = None,
) -> list[Trajectory]:
    """The trainer rows of a scored episode: one per segment, each with the episode's reward
    (and the prompt's images, `pixel_values`, when it had some: an episode with images never
    forks, so its one row holds their tokens)."""
    return [
        Trajectory(
            prompt_ids=s.prompt_ids,
            response_ids=s.response_ids,
            logprobs=s.logprobs,
            versions=[version] * len(s.response_ids),
            loss_mask=s.loss_mask,
            finish_reason=episode.finish_reason,
            rewards=score.parts,
            reward=score.total,
            group_id=group_id,
            text=episode.text,
            error=score.error,
            pixel_values=pixel_values,
            timeline=episode.timeline if i == 0 else None,  # one sequence, however many rows
        )
        for i, s in enumerate(episode.segments)
    ]
