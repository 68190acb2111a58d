"""The rollout engine: batched KV-cache decoding with continuous batching over any Hugging Face
causal LM (Llama, Qwen2, ...), fp32 or bf16, on whatever device the model lives on.

Token ids in, token ids out: each `Completion` carries the response exactly as sampled, the
behaviour logprob of every response token, why it stopped and, on request, the last-layer hidden
state that produced each token (what an EAGLE-style drafter trains on).

Continuous batching: at most `max_batch_size` sequences decode together; a sequence that finishes
leaves the batch (its KV-cache rows are dropped) and queued prompts are prefilled together and
joined to the running batch (left-padded to align with its cache), so a long response never holds
a batch of finished ones hostage. Newcomers are admitted once a quarter of the slots are free:
each admission costs one prefill forward.

What it does NOT know about: tokenization beyond decoding a response's tail to match stop
strings (prompts arrive as ids, chat templates are the caller's), rewards and tasks, training,
policy versions and weight sync, speculative decoding.
"""

from __future__ import annotations

import contextlib
import inspect
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Literal

import torch
import torch.nn.functional as F
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from leantrain.errors import LeantrainError
from leantrain.generation.kv_cache import RoomyCache
from leantrain.generation.sampling import SamplingParams, sample

FinishReason = Literal["eos", "stop", "length"]


@dataclass
class Completion:
    """One sampled response.

    Attributes:
        prompt_ids: the prompt, as given.
        response_ids: response tokens exactly as sampled, including the EOS or the token that
            completed a stop string.
        logprobs: behaviour logprob of each response token (see `Engine.generate`).
        finish_reason: "eos", "stop" (a stop string) or "length" (max_new_tokens).
        hidden_states: (len(response_ids), hidden) last-layer hidden states (after the final
            norm, the lm_head input) at the positions whose logits sampled each response token,
            on the model's device and dtype; None unless requested.
    """

    prompt_ids: list[int]
    response_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason
    hidden_states: torch.Tensor | None = None


@dataclass
class _Seq:
    """Bookkeeping for one sequence while it decodes."""

    index: int  # position in the caller's prompt list
    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    hidden_rows: list[int] = field(default_factory=list)  # rows of the stacked per-step hiddens
    finish_reason: FinishReason | None = None

    @property
    def cached(self) -> int:
        """Tokens in the KV cache: all but the last sampled one, which is fed at the next step."""
        return len(self.prompt_ids) + len(self.response_ids) - 1


@dataclass
class _Batch:
    """The live sequences and their shared KV cache.

    Rows are right-aligned: row i's cached tokens fill the last `seqs[i].cached` columns of the
    cache and of `mask`, with left padding before them. Invariant: mask.shape[1] == cache length.
    """

    seqs: list[_Seq]
    cache: RoomyCache
    mask: torch.Tensor  # (B, T) long, 1 where the cache column holds a real token
    positions: torch.Tensor  # (B,) long, position id of the next token fed to each row

    def extend(self, other: _Batch) -> None:
        """Append `other`'s rows, left-padding whichever side is shorter to align the ends."""
        for mine, theirs in zip(self.cache.live_layers(), other.cache.live_layers(), strict=True):
            mine.concat(theirs)
        width = max(self.mask.shape[1], other.mask.shape[1])
        self.mask = torch.cat([F.pad(m, (width - m.shape[1], 0)) for m in (self.mask, other.mask)])
        self.positions = torch.cat([self.positions, other.positions])
        self.seqs += other.seqs

    def keep(self, rows: list[int]) -> None:
        """Keep only `rows`, then trim leading columns that are padding in every kept row."""
        self.seqs = [self.seqs[i] for i in rows]
        start = self.mask.shape[1] - max(s.cached for s in self.seqs)
        index = torch.tensor(rows, device=self.mask.device)
        for layer in self.cache.live_layers():
            layer.select(index, start)
        self.mask = self.mask[index, start:]
        self.positions = self.positions[index]


class Engine:
    """Rollout engine over a Hugging Face causal LM.

    Args:
        model: any HF causal LM; it runs on its own device and dtype.
        tokenizer: used for `eos_token_id` and to decode response tails for stop strings.
        max_batch_size: most sequences decoding at once.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        max_batch_size: int = 16,
    ) -> None:
        if not isinstance(max_batch_size, int) or max_batch_size < 1:
            raise LeantrainError(
                f"Engine.max_batch_size must be an int >= 1, got {max_batch_size!r}"
            )
        self.model = model
        self.tokenizer = tokenizer
        self.max_batch_size = max_batch_size
        # Admit queued prompts once this many slots are free (or the queue fits): each admission
        # is an extra prefill forward, so refilling slot by slot would nearly double the forwards.
        self.min_admit = max(1, max_batch_size // 4)
        accepted = inspect.signature(model.forward).parameters
        # transformers >= 5.x renamed `past_key_values` to `cache` and deprecates the old name.
        self._cache_kwarg = "cache" if "cache" in accepted else "past_key_values"
        self._keep_last = {"logits_to_keep": 1} if "logits_to_keep" in accepted else {}
        eos = {tokenizer.eos_token_id}
        gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
        eos |= set(gen_eos) if isinstance(gen_eos, (list, tuple)) else {gen_eos}
        self.eos_ids = frozenset(int(t) for t in eos if t is not None)
        self._lm_head_input: torch.Tensor | None = None  # set by a hook when capturing hiddens

    @property
    def device(self) -> torch.device:
        """Where the model, the cache and the sampler live."""
        return next(self.model.parameters()).device

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams,
        *,
        seed: int | None = None,
        return_hidden_states: bool = False,
        progress: bool = False,
    ) -> list[Completion]:
        """Sample one response per prompt; completions come back in input order.

        Logprobs: each is `log_softmax(logits / temperature)` of the sampled token, computed
        BEFORE top-k/top-p filtering (temperature 1 when greedy), in fp32 from the model's logits.
        This is exactly the quantity the trainer recomputes from a fresh forward pass.

        Args:
            prompts: token ids, one non-empty sequence per prompt.
            params: sampling parameters shared by all prompts.
            seed: seeds the sampler; the same seed, prompts, params and max_batch_size give the
                same outputs. None draws a fresh seed.
            return_hidden_states: fill `Completion.hidden_states`.
            progress: show a progress bar counting finished sequences.
        """
        vocab = self.model.get_input_embeddings().num_embeddings
        for i, p in enumerate(prompts):
            if len(p) == 0 or not all(0 <= t < vocab for t in p):
                raise LeantrainError(
                    f"prompts[{i}] must be a non-empty sequence of token ids in [0, {vocab})"
                )
        if not prompts:
            return []
        generator = torch.Generator(device=self.device)
        if seed is None:
            generator.seed()
        else:
            generator.manual_seed(seed)
        seqs = [_Seq(i, [int(t) for t in p]) for i, p in enumerate(prompts)]
        with contextlib.ExitStack() as stack:
            stack.enter_context(torch.inference_mode())
            stack.enter_context(_eval_mode(self.model))
            if return_hidden_states:
                stack.enter_context(self._capture_lm_head_input())
            on_finish = None
            if progress:
                columns = Progress.get_default_columns()[:1]
                bar = stack.enter_context(
                    Progress(*columns, BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
                )
                task = bar.add_task("rollouts", total=len(seqs))
                on_finish = partial(bar.advance, task)
            step_hidden = self._run(seqs, params, generator, on_finish)
        flat = torch.cat(step_hidden) if step_hidden else None  # (total response tokens, H)
        return [
            Completion(
                prompt_ids=s.prompt_ids,
                response_ids=s.response_ids,
                logprobs=s.logprobs,
                finish_reason=s.finish_reason,
                hidden_states=flat[s.hidden_rows] if flat is not None else None,
            )
            for s in seqs
        ]

    def _run(
        self,
        seqs: list[_Seq],
        params: SamplingParams,
        generator: torch.Generator,
        on_finish: Callable[[], object] | None,
    ) -> list[torch.Tensor]:
        """Decode `seqs` to the end, filling them in place; returns the per-step (B, H) hiddens
        (`_Seq.hidden_rows` index their concatenation)."""
        queue = deque(seqs)
        batch: _Batch | None = None
        logits = hidden = None  # (B, V) next-token logits, (B, H) hiddens of the live rows
        step_hidden: list[torch.Tensor] = []
        flat_rows = 0  # rows in step_hidden so far
        stop_window = max((len(s.encode()) for s in params.stop), default=0) + 1
        while True:
            free = self.max_batch_size - (len(batch.seqs) if batch else 0)
            if queue and free >= min(self.min_admit, len(queue)):
                newcomers = [queue.popleft() for _ in range(min(free, len(queue)))]
                new, new_logits, new_hidden = self._prefill(newcomers)
                if batch is None:
                    batch, logits, hidden = new, new_logits, new_hidden
                else:
                    batch.extend(new)
                    logits = torch.cat([logits, new_logits])
                    hidden = None if hidden is None else torch.cat([hidden, new_hidden])
            if batch is None:
                return step_hidden
            tokens, logprobs = sample(logits, params, generator)
            if hidden is not None:
                step_hidden.append(hidden)
            # The one device->host sync per step: tokens and logprobs travel together (fp64 holds
            # every token id exactly).
            host_tokens, host_logprobs = torch.stack([tokens.double(), logprobs.double()]).tolist()
            keep = []
            for i, seq in enumerate(batch.seqs):
                seq.response_ids.append(int(host_tokens[i]))
                seq.logprobs.append(host_logprobs[i])
                seq.hidden_rows.append(flat_rows + i)
                seq.finish_reason = self._finish_reason(seq, params, stop_window)
                if seq.finish_reason is None:
                    keep.append(i)
                elif on_finish is not None:
                    on_finish()
            flat_rows += len(batch.seqs)
            if not keep:
                batch = logits = hidden = None
                continue
            if len(keep) < len(batch.seqs):
                batch.keep(keep)
                tokens = tokens[torch.tensor(keep, device=tokens.device)]
            logits, hidden = self._decode(batch, tokens)

    @contextlib.contextmanager
    def _capture_lm_head_input(self) -> Iterator[None]:
        """While active, keep the lm_head input of each forward in `self._lm_head_input`.

        That input is the last-layer hidden state (after the final norm, HF's
        `hidden_states[-1]`), already cut to the last position by `logits_to_keep=1`; asking the
        model for `output_hidden_states` instead would hold every layer's (B, T, H) states.
        """
        head = self.model.get_output_embeddings()
        if head is None:
            raise LeantrainError(
                "return_hidden_states needs a model with an output embedding (lm_head) module"
            )

        def keep_input(module: torch.nn.Module, args: tuple[torch.Tensor, ...]) -> None:
            self._lm_head_input = args[0]

        handle = head.register_forward_pre_hook(keep_input)
        try:
            yield
        finally:
            handle.remove()
            self._lm_head_input = None

    def _forward(self, **inputs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One model call: last-position logits (B, V) and, when captured, hiddens (B, H)."""
        out = self.model(use_cache=True, **self._keep_last, **inputs)
        hidden = self._lm_head_input
        return out.logits[:, -1], None if hidden is None else hidden[:, -1]

    def _prefill(self, seqs: list[_Seq]) -> tuple[_Batch, torch.Tensor, torch.Tensor | None]:
        """Run the prompts of `seqs` left-padded in one forward into a fresh cache."""
        width = max(len(s.prompt_ids) for s in seqs)
        # Pad id 0 is arbitrary: padded columns are masked out and never attended to.
        ids = torch.tensor([[0] * (width - len(s.prompt_ids)) + s.prompt_ids for s in seqs])
        lengths = torch.tensor([len(s.prompt_ids) for s in seqs])
        mask = (torch.arange(width) >= width - lengths[:, None]).long()  # (n, T), right-aligned
        ids, mask, lengths = ids.to(self.device), mask.to(self.device), lengths.to(self.device)
        position_ids = (mask.cumsum(-1) - 1).clamp(min=0)  # (n, T); pads get 0, they are masked
        cache = RoomyCache()
        logits, hidden = self._forward(
            input_ids=ids,
            attention_mask=mask,
            position_ids=position_ids,
            **{self._cache_kwarg: cache},
        )
        return _Batch(seqs, cache, mask, lengths), logits, hidden

    def _decode(
        self, batch: _Batch, tokens: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Feed each row's last sampled token (B,); the cache and mask grow by one column."""
        batch.mask = F.pad(batch.mask, (0, 1), value=1)  # (B, T + 1)
        logits, hidden = self._forward(
            input_ids=tokens[:, None],
            attention_mask=batch.mask,
            position_ids=batch.positions[:, None],
            **{self._cache_kwarg: batch.cache},
        )
        batch.positions = batch.positions + 1
        return logits, hidden

    def _finish_reason(
        self, seq: _Seq, params: SamplingParams, stop_window: int
    ) -> FinishReason | None:
        """Why `seq` stops after its newest token, or None if it goes on (EOS > stop > length).

        Stop strings are matched in the text of the last `stop_window` tokens, every step, so a
        match was completed by the newest token. Every token decodes to >= 1 byte, so the longest
        stop string's byte count (+1 for tokenizers that drop a leading space at the start of a
        decode) covers any match.
        """
        if seq.response_ids[-1] in self.eos_ids:
            return "eos"
        if params.stop:
            tail = self.tokenizer.decode(seq.response_ids[-stop_window:])
            if any(s in tail for s in params.stop):
                return "stop"
        if len(seq.response_ids) >= params.max_new_tokens:
            return "length"
        return None


@contextlib.contextmanager
def _eval_mode(model: torch.nn.Module) -> Iterator[None]:
    """Sample without dropout, then restore the caller's train/eval mode."""
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)
