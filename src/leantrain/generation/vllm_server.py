"""vLLM as a rollout `Backend` over HTTP: one or several running `vllm serve` processes, token
ids in and token ids out, weights published to them through a folder they read. The same
contract as the in-process backend (generation/vllm_backend.py), whose conventions it keeps and
whose helpers it uses, so the rollout source and the learner cannot tell the two apart.

It talks to vLLM 0.32's own routes (httpx, imported inside functions, like vllm there):

- `POST /inference/v1/generate` (the token-in/token-out route; `--enable-scale-out`): a prompt's
  token ids and a vLLM `SamplingParams` as JSON in; per choice the sampled token ids, each one's
  logprob (`logprobs: 0`: the sampled token only), the finish and stop reasons and the
  weight-version spans out. Never text: nothing is decoded and re-encoded. The logprobs are of
  the distribution sampled from only when the server runs with `--logprobs-mode
  processed_logprobs` (at T != 1 the default, raw, gives T = 1 logprobs: trl #4159); the
  server does not report its mode, so that flag is the launcher's to pass (`server_command`).
- Seeds: row i of a batch is sampled with seed `base + i`, as in-process. A run of identical
  consecutive prompts (a GRPO group: the rollout batch is prompt-major) is one request with
  `n` = its length and seed `base + first row`: vLLM's front end fans it out into `n` requests
  with seeds `seed + j` (`v1/engine/parallel_sampling.py`), which are rows `first + j`'s seeds.
  One HTTP call per group instead of per row, the group's prompt prefilled once.
- Several servers: groups go to them in turn (group k to server k mod N), all requests at once
  from a thread pool, the server batching what it receives; completions come back in input
  order whatever order the answers arrive in.
- Weights (`VLLM_SERVER_DEV_MODE=1` routes): `load_weights` writes the state dict as one
  safetensors file in a fresh folder `v<version>` under `weights_dir` (written aside, renamed
  into place), then on every server at once `POST /collective_rpc` runs the worker's
  `reload_weights(weights_path=folder)` (vLLM's layerwise in-place reload: the model's own
  `load_weights` fuses q/k/v and gate/up and CPU kernels repack), `POST /reset_prefix_cache`
  drops every KV block the old weights computed, and `POST /update_weight_version` labels the
  new weights, which every token sampled after carries (`Completion.versions`, from the
  spans). The folder must be readable by every server: the same machine, or a filesystem they
  share. The previous version's folder is removed once every server has loaded the new one;
  the last stays. Seconds per publish, all of it: `sync_seconds`.
- Every call has a timeout; a failure raises `VLLMServerError`, naming the URL, the route and
  what to do. The constructor checks each server (`/health`, the dev-mode routes, the generate
  route) under a short timeout, so a wrong URL or a server started without the flags above is
  refused at set-up, not in the middle of a run.
- Weights in the middle of a batch (`load_weights_live`, partial rollouts): the same publish
  inside `POST /pause?mode=keep` (the scheduler stops, the running requests are kept) and
  `POST /resume`, with `POST /reset_prefix_cache?reset_running_requests=true`: a plain reset
  fails while requests hold KV blocks, and those blocks were computed by the old weights; this
  one preempts the kept requests, which drop their KV and, on resume, recompute it from their
  tokens so far on the new weights (the native engine's re-prefill between segments). So each
  token after the update is sampled from the new version alone, the spans say which, and the
  trainer's forward of that version gives its logprob. Measured on the tiny preset (CPU, fp32):
  per-version logprob gaps up to 2.0e-5, 0.08 s per update.

- A LoRA policy (`lora`: the adapter's peft config; models/lora.py): the servers keep the
  base weights they started on and only the adapter moves, as in-process. `load_weights`
  writes the adapter of the state dict it gets as peft's files (`vllm_backend.save_adapter`:
  `adapter_config.json`, `adapter_model.safetensors`) into `weights_dir/v<version>` (written
  aside, renamed into place), then on every server at once `POST /v1/load_lora_adapter
  {"lora_name": "v<version>", "lora_path": folder}`, `POST /v1/unload_lora_adapter` of every
  other adapter it holds (the previous version's: a server serves one version at a time),
  `POST /reset_prefix_cache` (vLLM keys a cached block by adapter name and path, which a
  republished version keeps) and `/update_weight_version`; the previous folder goes. Every
  request then carries `"model": "v<version>"`, the field vLLM picks an adapter by
  (`_maybe_get_adapters`). A name already loaded (the version republished) is unloaded first,
  so vLLM reads the new files under a fresh id. Set-up refuses a server without the adapter
  routes (404) or, through `GET /server_info`, without LoRA on, of a lower `--max-lora-rank`
  than `lora.r`, or wrapping other modules than the adapter's. No `load_weights_live`: vLLM
  fixes a request's adapter when it starts, so a version cannot reach a running request.

`launch_server` starts a server on this machine (bound to 127.0.0.1 unless told otherwise)
with the flags above (`server_command`, `server_env`), and stops it: for tests and docs, and on
each node where Ray places one (distributed/ray_servers.py). The command, on the tiny
preset's folder (CPU, fp32), as `server_command` writes it:

    VLLM_SERVER_DEV_MODE=1 VLLM_CPU_KVCACHE_SPACE=1 VLLM_CPU_OMP_THREADS_BIND=nobind \
    python -m vllm.entrypoints.launchers.api_server.entry --model FOLDER \
        --host 127.0.0.1 --port 8000 --dtype float32 --seed 0 \
        --logprobs-mode processed_logprobs --max-logprobs 0 --enable-scale-out \
        --enable-prefix-caching --generation-config vllm --max-model-len 512 \
        --enforce-eager --no-enable-chunked-prefill

and for a LoRA policy (`lora`: r 8 on every projection) the same with
`VLLM_ALLOW_RUNTIME_LORA_UPDATING=True` in the environment (the adapter routes) and
`--enable-lora --max-lora-rank 8 --max-loras 1 --lora-target-modules down_proj gate_proj
k_proj o_proj q_proj up_proj v_proj` (the rank rounded up to one vLLM's kernels take; LoRA
layers on the adapter's modules only, so lm_head stays unwrapped, as in-process).

What it cannot do (its `capabilities`): hidden states, images, speculation, a KV token budget;
with LoRA, live weights. It knows no tasks, runs or training.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar
from urllib.parse import urlsplit

import torch

from leantrain.errors import LeantrainError
from leantrain.generation.backend import Capabilities, Completion
from leantrain.generation.config import SamplingParams
from leantrain.generation.vllm_backend import (
    INSTALL_HINT,
    adapter_weights,
    as_finish_reason,
    check_sampling,
    lora_engine_args,
    request_params,
    save_adapter,
    token_versions,
    vllm_available,
)

if TYPE_CHECKING:  # the annotations only: httpx and peft are imported where they are used
    import httpx
    from peft import LoraConfig

GENERATE = "/inference/v1/generate"
# How a version's weights reach the servers: a folder they read (any device), or vLLM's
# weight-transfer engines on GPUs: NCCL (a broadcast from the trainer's GPU into servers on
# other GPUs) or CUDA IPC (servers on the trainer's own GPU map its tensors).
WEIGHT_TRANSFERS = ("files", "nccl", "ipc")
GPU_TRANSFERS = ("nccl", "ipc")
LORA_HINT = (
    "a LoRA policy (lora.enabled) needs a server started with --enable-lora --max-lora-rank R "
    "--max-loras K and VLLM_ALLOW_RUNTIME_LORA_UPDATING=True in its environment (its adapter "
    "routes); see server_command / docs/backends.md, 'Server mode'"
)
# What a failing route most likely means, by (route, HTTP status).
_HINTS = {
    (GENERATE, 403): "start the server with --enable-scale-out (its token-in/token-out route)",
    (GENERATE, 404): "the server's vLLM has no token-in/token-out route (vLLM 0.32 has it)",
    ("/weight_info", 404): "start the server with VLLM_SERVER_DEV_MODE=1 (weight routes)",
    ("/collective_rpc", 404): "start the server with VLLM_SERVER_DEV_MODE=1 (weight routes)",
    ("/v1/load_lora_adapter", 404): LORA_HINT,
    ("/v1/unload_lora_adapter", 404): LORA_HINT,
}
_T = TypeVar("_T")


class VLLMServerError(LeantrainError):
    """A `vllm serve` server that cannot be reached, answers with an error, or is started
    without what the backend needs; the message names the URL and what to do."""


def check_url(url: str, field: str = "rollout.vllm_urls") -> str:
    """`url` without a trailing slash, if it is http(s)://host[:port][/path]; else an error
    naming `field`."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise LeantrainError(
            f"{field}: {url!r} is not an http(s) URL of a vllm serve server "
            "(e.g. http://127.0.0.1:8000)"
        )
    return url.rstrip("/")


class VLLMServerBackend:
    """A rollout `Backend` on running `vllm serve` servers.

    Args:
        urls: the servers' base URLs (`http://host:port`), each serving the policy's
            architecture and tokenizer (started on a folder of the same model).
        weights_dir: where `load_weights` writes each version for the servers to read: a
            folder every server can read at the same path.
        timeout_s: longest wait for one call (a group's generation, a server's weight load).
        connect_timeout_s: longest wait for a server to answer its set-up checks.
        max_concurrency: most requests in flight at once, over all servers.
        lora: the peft `LoraConfig` of the policy's adapter, when it trains one: every server
            must run with LoRA on (`server_command(lora=...)`), `load_weights` publishes
            the adapter only, and every request names it. None: whole weights.

    Attributes:
        urls: the servers, as given (trailing slashes dropped).
        max_model_len: the longest prompt plus response every server takes (the least of
            theirs); a request that reaches it stops with finish reason "length".
        version: the policy version of the weights the servers hold (0 until the first
            `load_weights`; set-up labels the servers' weights 0).
        sync_seconds: seconds each `load_weights` took, writing the file included.
        adapter: with `lora`, the name of the adapter the servers serve (`v<version>`), which
            every request carries; None before the first publish (the base weights).
    """

    # No hidden states, images, speculation or KV budget; weights of its own, synced by the run,
    # also in the middle of a batch (`load_weights_live`; not with `lora`: see __init__).
    capabilities = Capabilities(separate_weights=True, live_weights=True)

    def __init__(
        self,
        urls: Sequence[str],
        *,
        weights_dir: str | Path,
        timeout_s: float = 600.0,
        connect_timeout_s: float = 10.0,
        max_concurrency: int = 64,
        lora: LoraConfig | None = None,
        weight_transfer: str = "files",
    ) -> None:
        if weight_transfer not in WEIGHT_TRANSFERS:
            raise LeantrainError(
                f"rollout.vllm_weight_transfer: {weight_transfer!r} is not one of "
                f"{', '.join(WEIGHT_TRANSFERS)}"
            )
        if weight_transfer in GPU_TRANSFERS and lora is not None:
            raise LeantrainError(
                f"rollout.vllm_weight_transfer: {weight_transfer} sends whole weights; a LoRA "
                "policy (lora.enabled) publishes its adapter as files: use files"
            )
        if weight_transfer in GPU_TRANSFERS and not torch.cuda.is_available():
            raise LeantrainError(
                f"rollout.vllm_weight_transfer: {weight_transfer} needs CUDA on the trainer "
                "(vLLM's engine sends from the trainer's GPU); on CPU use files"
            )
        try:
            import httpx
        except ImportError as e:
            raise LeantrainError(
                "rollout.backend: vllm_server needs httpx: pip install 'leantrain[vllm-server]'"
            ) from e
        if not urls:
            raise LeantrainError("rollout.vllm_urls: give at least one vllm serve URL")
        self.urls = [check_url(u) for u in urls]
        self.weights_dir = Path(weights_dir)
        self.timeout_s = timeout_s
        self.max_concurrency = max_concurrency
        self._client = httpx.Client(
            # Room for a live weight update's calls beside a full batch of requests.
            limits=httpx.Limits(max_connections=max_concurrency + len(self.urls)),
            # Servers are called directly, never through a proxy the environment names
            # (HTTP_PROXY): they sit on this machine or the cluster's own network.
            trust_env=False,
        )
        self._folder: Path | None = None  # the published version the servers hold
        self.version = 0
        self.sync_seconds: list[float] = []
        self.lora: LoraConfig | None = lora
        self.adapter: str | None = None
        if lora is not None:
            # A request's adapter is fixed when it starts (vLLM resolves its name once), so a
            # version cannot reach a running request: no weights in the middle of a batch.
            self.capabilities = Capabilities(separate_weights=True)
            self._lora_flags = lora_engine_args(lora)  # what each server must be started with
        self.weight_transfer = weight_transfer
        lengths = self._on_every_server(lambda url: self._check(url, connect_timeout_s))
        self.max_model_len: int = min(lengths)
        self._on_every_server(lambda url: self._label(url, self.version))
        # vLLM's transfer engines, set up with every server now (NCCL: each server's workers
        # wait in the rendezvous until the trainer's end of the group opens).
        self._gpu = None
        if weight_transfer in GPU_TRANSFERS:
            workers = [self._transfer_workers(url, weight_transfer) for url in self.urls]
            self._gpu = GPUWeightSender(self.urls, weight_transfer, workers, timeout_s)

    # ---------------------------------------------------------------- HTTP
    def _request(
        self, method: str, url: str, route: str, body: Any = None, timeout: float | None = None
    ) -> httpx.Response:
        """One call to `url + route` under `timeout` (None: `timeout_s`): its response, or a
        `VLLMServerError` naming the URL and route when there is none."""
        import httpx

        timeout = self.timeout_s if timeout is None else timeout
        where = f"{url}{route}"
        try:
            return self._client.request(method, where, json=body, timeout=timeout)
        except httpx.TimeoutException as e:
            raise VLLMServerError(
                f"{where}: no answer within {timeout:g} s ({type(e).__name__}); the server is "
                "stuck or overloaded: check its log, or raise rollout.vllm_timeout_s"
            ) from e
        except httpx.TransportError as e:
            raise VLLMServerError(
                f"{where}: cannot reach the server ({type(e).__name__}: {e}); start it "
                "(docs/backends.md, 'Server mode') or correct rollout.vllm_urls"
            ) from e

    def _call(
        self, method: str, url: str, route: str, body: Any = None, timeout: float | None = None
    ) -> Any:
        """`_request`'s JSON answer (its text when not JSON; None when empty); an HTTP error
        status is a `VLLMServerError` too, with what it most likely means."""
        answer = self._request(method, url, route, body, timeout)
        if answer.status_code >= 400:
            hint = _HINTS.get((route, answer.status_code), "see the server's log")
            raise VLLMServerError(
                f"{url}{route} answered HTTP {answer.status_code}: {answer.text[:300]}; {hint}"
            )
        if not answer.content:
            return None
        # The adapter routes answer plain text ("Success: ..."), the others JSON.
        json_answer = answer.headers.get("content-type", "").startswith("application/json")
        return answer.json() if json_answer else answer.text

    def _on_every_server(self, call: Callable[[str], _T]) -> list[_T]:
        """`call(url)` on every server at once; the results in `urls` order."""
        if len(self.urls) == 1:
            return [call(self.urls[0])]
        with ThreadPoolExecutor(max_workers=len(self.urls)) as pool:
            return list(pool.map(call, self.urls))

    def _check(self, url: str, timeout: float) -> int:
        """Refuse a server that is down or started without what this backend needs; its
        max_model_len."""
        self._call("GET", url, "/health", timeout=timeout)
        self._call("GET", url, "/weight_info", timeout=timeout)  # a dev-mode route
        # An empty body: the enabled route refuses it (422) without generating; the disabled
        # one answers 403 whatever the body.
        probe = self._request("POST", url, GENERATE, {}, timeout)
        if probe.status_code in (403, 404):
            raise VLLMServerError(
                f"{url}{GENERATE} answered HTTP {probe.status_code}; "
                f"{_HINTS[(GENERATE, probe.status_code)]}"
            )
        (model, *_) = self._call("GET", url, "/v1/models", timeout=timeout)["data"]
        if self.lora is not None:
            self._check_lora(url, timeout)
        return int(model["max_model_len"])

    def _check_lora(self, url: str, timeout: float) -> None:
        """Refuse, for a LoRA policy, a server without the adapter routes or without LoRA on,
        of too low a rank, or wrapping other modules than the adapter's."""
        # An empty body: the route refuses it (400, fields missing) without loading; a server
        # without VLLM_ALLOW_RUNTIME_LORA_UPDATING has no such route (404).
        if self._request("POST", url, "/v1/load_lora_adapter", {}, timeout).status_code == 404:
            raise VLLMServerError(f"{url}/v1/load_lora_adapter answered HTTP 404; {LORA_HINT}")
        # The engine's settings (a dev-mode route). Under the call timeout, not the connect
        # one: its first answer collects the server's environment too, seconds on a busy host.
        info = self._call("GET", url, "/server_info?config_format=json")
        served = (info.get("vllm_config") or {}).get("lora_config")
        if not served:
            raise VLLMServerError(f"{url} serves no LoRA adapters (no --enable-lora); {LORA_HINT}")
        want = self._lora_flags
        if int(served["max_lora_rank"]) < self.lora.r:
            raise VLLMServerError(
                f"{url} serves LoRA ranks up to {served['max_lora_rank']}, below lora.r "
                f"{self.lora.r}; start it with --max-lora-rank {want['max_lora_rank']}"
            )
        targets = served.get("target_modules")
        if targets is not None and set(want.get("lora_target_modules", ())) - set(targets):
            raise VLLMServerError(
                f"{url} wraps LoRA layers around {sorted(targets)} only; the adapter trains "
                f"{want['lora_target_modules']}: start it with --lora-target-modules "
                + " ".join(want["lora_target_modules"])
            )

    def _transfer_workers(self, url: str, transfer: str) -> int:
        """The number of workers `url` runs (tensor x pipeline x data parallel: with NCCL, each
        a rank of its transfer group); refuse a server not started for `transfer`, or, for
        IPC, not on this machine."""
        if transfer == "ipc" and not ipaddress.ip_address(address_towards(url)).is_loopback:
            raise VLLMServerError(
                f"{url}: rollout.vllm_weight_transfer: ipc maps the trainer's GPU memory, so "
                "the server must run on this machine (a loopback URL); use nccl or files"
            )
        config = self._call("GET", url, "/server_info?config_format=json")["vllm_config"]
        served = (config.get("weight_transfer_config") or {}).get("backend")
        if served != transfer:
            raise VLLMServerError(
                f"{url} was started without {transfer} weight transfer (its "
                f"weight_transfer_config backend is {served!r}); start it as "
                f'server_command(weight_transfer="{transfer}") does, or use '
                "rollout.vllm_weight_transfer: files"
            )
        p = config["parallel_config"]
        return (
            int(p["tensor_parallel_size"])
            * int(p["pipeline_parallel_size"])
            * int(p["data_parallel_size"])
        )

    def _label(self, url: str, version: int) -> None:
        """Label `url`'s weights `version` (vLLM's weight-version tracking)."""
        self._call("POST", url, "/update_weight_version", {"new_version": str(version)})

    # ------------------------------------------------------------ generate
    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams,
        *,
        seed: int | None = None,
        **options: Any,
    ) -> list[Completion]:
        """Sample one response per prompt; completions come back in input order.

        Row i of `prompts` is sampled with seed `seed + i` (None: a fresh random base), as on
        the in-process backend. `options` are the native engine's (`return_hidden_states`,
        `images`, `progress`): the capabilities this backend lacks are refused, a progress bar
        is not drawn. Completions carry no timeline: the route reports no per-request times.
        """
        if options.get("return_hidden_states") or options.get("images"):
            raise LeantrainError(
                "VLLMServerBackend returns no hidden states and takes no images; use "
                "rollout.backend: native for the drafter's capture and vision-language models"
            )
        check_sampling(params)
        if any(len(p) == 0 for p in prompts):
            raise LeantrainError("every prompt needs at least one token")
        base = secrets.randbits(31) if seed is None else seed
        fields = request_params(params)
        groups = _groups(prompts)

        def ask(k: int) -> tuple[str, Any]:
            start, n = groups[k]
            url = self.urls[k % len(self.urls)]
            body: dict[str, Any] = {
                "token_ids": list(prompts[start]),
                "sampling_params": {**fields, "n": n, "seed": base + start},
            }
            if self.adapter is not None:  # the served adapter, by name (vLLM's `model` field)
                body["model"] = self.adapter
            return url, self._call("POST", url, GENERATE, body)

        workers = max(1, min(len(groups), self.max_concurrency))
        with ThreadPoolExecutor(max_workers=workers) as pool:
            answers = list(pool.map(ask, range(len(groups))))
        completions: list[Completion] = []
        for (start, n), (url, answer) in zip(groups, answers, strict=True):
            choices = sorted(answer["choices"], key=lambda c: c["index"])
            if [c["index"] for c in choices] != list(range(n)):
                raise VLLMServerError(f"{url}{GENERATE} returned {len(choices)} of {n} choices")
            completions += [_completion(prompts[start], c, url) for c in choices]
        return completions

    # ------------------------------------------------------------- weights
    def load_weights(self, weights: Mapping[str, torch.Tensor], version: int) -> None:
        """Publish a state dict by Hugging Face name (any dtype: vLLM casts as it loads) as
        `version` to every server, between `generate` calls: write it, reload it, reset the
        prefix cache, relabel. With `lora`, only its adapter: see `_publish_adapter`."""
        if self.lora is not None:
            self._publish_adapter(weights, version)
            return
        self._publish(weights, version, live=False)

    def load_weights_live(self, weights: Mapping[str, torch.Tensor], version: int) -> None:
        """Publish `version` as `load_weights` does, while a `generate` runs (partial
        rollouts): each server pauses with its requests kept (`/pause?mode=keep`), reloads,
        resets its prefix cache preempting the kept requests, relabels and resumes. A
        preempted request drops its KV and is recomputed from its tokens so far on the new
        weights when it resumes, so every token sampled after the update is sampled from the
        new version alone (not from new weights over the old ones' KV), as the trainer's
        forward of that version scores it; the spans give each token's version.

        Not with `lora`: a running request keeps the adapter it started with."""
        if self.lora is not None:
            raise LeantrainError(
                "VLLMServerBackend with a LoRA adapter cannot publish in the middle of a batch: "
                "vLLM fixes each request's adapter when it starts; publish between batches "
                "(load_weights: orchestrator.mode sync or async, not partial)"
            )
        self._publish(weights, version, live=True)

    def _publish(self, weights: Mapping[str, torch.Tensor], version: int, live: bool) -> None:
        t0 = time.perf_counter()
        folder = self._write(weights, version) if self._gpu is None else None

        def reload(url: str) -> None:
            self._call(
                "POST",
                url,
                "/collective_rpc",
                {"method": "reload_weights", "kwargs": {"weights_path": str(folder)}},
            )

        def relabel(url: str) -> None:
            self._reset_prefix_cache(url, running=live)
            self._label(url, version)

        if live:  # every server stops scheduling, its running requests kept
            self._on_every_server(lambda url: self._call("POST", url, "/pause?mode=keep"))
        try:
            if self._gpu is not None:
                self._gpu.send(weights)
            else:
                self._on_every_server(reload)
            self._on_every_server(relabel)
        finally:  # a server left paused would hold every request forever
            if live:
                self._on_every_server(lambda url: self._call("POST", url, "/resume"))
        if folder is not None:
            old, self._folder = self._folder, folder
            if old is not None and old != folder:
                shutil.rmtree(old, ignore_errors=True)
        self.version = version
        self.sync_seconds.append(time.perf_counter() - t0)

    def _reset_prefix_cache(self, url: str, running: bool = False) -> None:
        """Drop every KV block the old weights computed. `running`: also the running requests'
        (they are preempted and recompute theirs on resume); without it the reset fails while
        they hold blocks, and they would decode on over the old weights' KV."""
        route = "/reset_prefix_cache" + ("?reset_running_requests=true" if running else "")
        if not self._call("POST", url, route)["success"]:
            raise VLLMServerError(
                f"{url}/reset_prefix_cache failed: KV blocks are still held by running "
                "requests (another client of this server?); the old weights' cached "
                "prefixes would be reused"
            )

    def _publish_adapter(self, weights: Mapping[str, torch.Tensor], version: int) -> None:
        """Publish the adapter of `weights` as `version`: write it as peft does into
        `weights_dir/v<version>`, then on every server at once load it under the name
        `v<version>` (`/v1/load_lora_adapter`), unload every other adapter the server holds
        (the previous version's: a server serves one policy version at a time), reset the
        prefix cache and relabel; every later request names it. The base weights never move."""
        t0 = time.perf_counter()
        adapter = adapter_weights(weights, "VLLMServerBackend")
        folder = self._stage(version, lambda staging: save_adapter(self.lora, adapter, staging))
        name = f"v{version}"

        def swap(url: str) -> None:
            held = self._adapters(url)
            if name in held:
                # The same name again (this version republished, or left by another client of
                # this server): vLLM refuses a loaded name, and reloaded in place it would keep
                # its id, so unloaded first, it is read from the new files under a fresh id.
                self._call("POST", url, "/v1/unload_lora_adapter", {"lora_name": name})
            self._call(
                "POST", url, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(folder)}
            )
            for other in held - {name}:
                self._call("POST", url, "/v1/unload_lora_adapter", {"lora_name": other})
            # The prefix cache keys a block by adapter name and path, which a republished
            # version keeps: its blocks of the old files must go.
            self._reset_prefix_cache(url)
            self._label(url, version)

        self._on_every_server(swap)
        old, self._folder = self._folder, folder
        if old is not None and old != folder:
            shutil.rmtree(old, ignore_errors=True)
        self.adapter = name
        self.version = version
        self.sync_seconds.append(time.perf_counter() - t0)

    def _adapters(self, url: str) -> set[str]:
        """The names of the LoRA adapters `url` holds (its `/v1/models` cards with a parent:
        the base model's card has none)."""
        cards = self._call("GET", url, "/v1/models")["data"]
        return {c["id"] for c in cards if c.get("parent")}

    def _write(self, weights: Mapping[str, torch.Tensor], version: int) -> Path:
        """`weights` as `model.safetensors` in `weights_dir/v<version>`, written aside and
        renamed into place, so a server never reads half a file."""
        from safetensors.torch import save_file

        tensors: dict[str, torch.Tensor] = {}
        storages: set[int] = set()
        for name, tensor in weights.items():
            t = tensor.detach().to("cpu").contiguous()
            # safetensors refuses tensors that share memory (tied embeddings in a plain
            # state_dict): a copy for each storage seen before.
            if t.untyped_storage().data_ptr() in storages:
                t = t.clone()
            storages.add(t.untyped_storage().data_ptr())
            tensors[name] = t
        return self._stage(
            version, lambda staging: save_file(tensors, str(staging / "model.safetensors"))
        )

    def _stage(self, version: int, write: Callable[[Path], None]) -> Path:
        """The folder `weights_dir/v<version>`, filled by `write` in a fresh folder beside it
        and renamed into place, so a server never reads half a file."""
        self.weights_dir.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".v{version}-", dir=self.weights_dir))
        write(staging)
        folder = self.weights_dir / f"v{version}"
        shutil.rmtree(folder, ignore_errors=True)  # the same version published again
        staging.rename(folder)
        return folder

    def close(self) -> None:
        """Close the HTTP connections and transfer engines (the servers keep running)."""
        if self._gpu is not None:
            self._gpu.close()
        self._client.close()


class GPUWeightSender:
    """The trainer's end of vLLM's weight-transfer engines (`vllm.distributed.weight_transfer`:
    its own trainer engines and HTTP client), one engine per server, rank 0 the sender:

    - `nccl`: a transfer group per server, the trainer rank 0 and the server's workers ranks
      1.., met over a TCP rendezvous at this machine's address towards the server; each
      version is broadcast from this GPU (`update_weights` runs beside the broadcast). The
      server must be on other GPUs: NCCL refuses two ranks on one device.
    - `ipc`: the server maps this GPU's tensors through CUDA IPC handles sent over HTTP
      (pickled: the server runs with `VLLM_ALLOW_INSECURE_SERIALIZATION=1`, on this machine,
      bound to 127.0.0.1); for a server sharing the trainer's GPU.

    Either way vLLM's `start_weight_update`, the transfer, `finish_weight_update` (the model's
    own `load_weights`, layer by layer). The servers run with `--weight-transfer-config
    '{"backend": "nccl" | "ipc"}'` (`server_command`). GPUs only: it has not run on this
    project's CPU machines (benchmarks/gpu_check.py checks it on a GPU)."""

    def __init__(
        self, urls: Sequence[str], transfer: str, workers: Sequence[int], timeout_s: float
    ) -> None:
        from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource
        from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
        from vllm.distributed.weight_transfer.ipc_engine import (
            IPCTrainerInitInfo,
            IPCTrainerWeightTransferEngine,
        )
        from vllm.distributed.weight_transfer.nccl_engine import (
            NCCLTrainerInitInfo,
            NCCLTrainerWeightTransferEngine,
        )

        class StateSource(WeightSource):
            """The state dict being sent (`send` sets it): its names, dtypes and shapes, then
            its tensors, in one order."""

            def __init__(self) -> None:
                self.weights: Mapping[str, torch.Tensor] = {}

            def metadata(self) -> list[ParamMeta]:
                return [ParamMeta(k, v.dtype, tuple(v.shape)) for k, v in self.weights.items()]

            def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
                return iter(self.weights.items())

        self.source = StateSource()
        self.engines = []
        for url, world in zip(urls, workers, strict=True):
            client = HTTPVLLMWeightSyncClient(url, timeout=timeout_s)
            if transfer == "nccl":
                address = address_towards(url)
                info = NCCLTrainerInitInfo(
                    master_address=address,
                    master_port=free_port(address),
                    world_size=1 + world,
                    rank=0,  # the sender: this process publishes for the whole run
                )
                engine = NCCLTrainerWeightTransferEngine.trainer_init(
                    info, client=client, source=self.source
                )
            else:
                engine = IPCTrainerWeightTransferEngine.trainer_init(
                    IPCTrainerInitInfo(rank=0), client=client, source=self.source
                )
            self.engines.append(engine)

    def send(self, weights: Mapping[str, torch.Tensor]) -> None:
        """Send `weights` (by Hugging Face name, copied to this GPU) into every server, one
        after the other."""
        self.source.weights = {
            k: v.detach().to("cuda", non_blocking=True).contiguous() for k, v in weights.items()
        }
        try:
            for engine in self.engines:
                engine.send_weights()
        finally:
            self.source.weights = {}  # the GPU copies go with the call

    def close(self) -> None:
        for engine in self.engines:
            engine.shutdown()


def address_towards(url: str) -> str:
    """This machine's address on the route to `url`'s host (its loopback for a server on
    this machine): where the server's workers reach the trainer's end of a transfer group.
    No packet is sent (a UDP socket's connect only picks the route)."""
    parts = urlsplit(url)
    family = socket.AF_INET6 if ":" in (parts.hostname or "") else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect((parts.hostname, parts.port or 80))
        return s.getsockname()[0]


def _groups(prompts: Sequence[Sequence[int]]) -> list[tuple[int, int]]:
    """Runs of identical consecutive prompts as (first row, length)."""
    groups: list[tuple[int, int]] = []
    for i, prompt in enumerate(prompts):
        if groups and list(prompts[groups[-1][0]]) == list(prompt):
            groups[-1] = (groups[-1][0], groups[-1][1] + 1)
        else:
            groups.append((i, 1))
    return groups


def _completion(prompt: Sequence[int], choice: Mapping[str, Any], url: str) -> Completion:
    """One choice of a generate answer as a `Completion`."""
    ids = [int(t) for t in choice["token_ids"]]
    steps = (choice.get("logprobs") or {}).get("content") or []
    if [s["token_id"] for s in steps] != ids:
        raise VLLMServerError(
            f"{url}{GENERATE} returned {len(steps)} logprobs for {len(ids)} tokens; start the "
            "server with --max-logprobs 0 or more"
        )
    spans = choice.get("weight_versions")
    return Completion(
        prompt_ids=list(prompt),
        response_ids=ids,
        logprobs=[float(s["logprob"]) for s in steps],
        finish_reason=as_finish_reason(choice["finish_reason"], choice.get("stop_reason")),
        versions=token_versions(
            None if spans is None else [(s["version"], s["start"], s["end"]) for s in spans],
            len(ids),
        ),
    )


# ------------------------------------------------------------------ a local server
def server_command(
    model: str | Path,
    *,
    port: int,
    host: str = "127.0.0.1",
    dtype: str = "float32",
    max_model_len: int | None = None,
    seed: int = 0,
    enforce_eager: bool = True,
    lora: LoraConfig | None = None,
    max_loras: int = 1,
    weight_transfer: str = "files",
) -> list[str]:
    """The command that starts a `vllm serve` this backend can use (run it with
    `VLLM_SERVER_DEV_MODE=1` in the environment, and with `lora` also
    `VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`: `server_env`). `python -m` the server's module
    rather than the `vllm` script: vllm-cpu's script fails to start (it asks for the version of
    a package named `vllm`, which vllm-cpu is not); the flags are `vllm serve`'s.

    `lora`: the peft `LoraConfig` of a LoRA policy's adapter: the server serves adapters up to
    its rank (vLLM's next kernel rank), `max_loras` per engine step, with LoRA layers on the
    adapter's modules only (lm_head stays unwrapped), as the in-process backend starts its
    engine (`lora_engine_args`)."""
    cmd = [
        sys.executable, "-m", "vllm.entrypoints.launchers.api_server.entry",
        "--model", str(model), "--host", host, "--port", str(port), "--dtype", dtype,
        "--seed", str(seed),
        "--logprobs-mode", "processed_logprobs",  # the distribution sampled from (module doc)
        "--max-logprobs", "0",  # the sampled token's only
        "--enable-scale-out",  # /inference/v1/generate
        "--enable-prefix-caching",
        "--generation-config", "vllm",  # no sampling defaults from the model's folder
    ]  # fmt: skip
    if max_model_len is not None:
        cmd += ["--max-model-len", str(max_model_len)]
    if lora is not None:
        args = lora_engine_args(lora, max_loras)
        cmd += ["--enable-lora", "--max-lora-rank", str(args["max_lora_rank"])]
        cmd += ["--max-loras", str(args["max_loras"])]
        if "lora_target_modules" in args:
            cmd += ["--lora-target-modules", *args["lora_target_modules"]]
    if weight_transfer in GPU_TRANSFERS:  # vLLM's transfer engine in every worker
        cmd += ["--weight-transfer-config", json.dumps({"backend": weight_transfer})]
    if enforce_eager:
        cmd.append("--enforce-eager")
    if not torch.cuda.is_available():
        # Whole prefills on CPU, as in-process: a seeded request whose prefill is chunked
        # makes vLLM rewind a CPU generator, which refuses (vllm_backend.py).
        cmd.append("--no-enable-chunked-prefill")
    return cmd


@dataclass
class LocalServer:
    """A `vllm serve` process started by `launch_server`; `close` (or leaving a `with`
    block) stops it and the engine process it started."""

    url: str
    process: subprocess.Popen
    log: Path

    def close(self, timeout_s: float = 30.0) -> None:
        """Stop the server's whole process group and wait until none of it is left (SIGTERM,
        then SIGKILL after `timeout_s`)."""
        # The server leads its own process group (start_new_session), so its engine-core child
        # goes with it, even when the server itself has died. The group's id cannot have been
        # reused: the server's pid is reaped only here, and while any member of its group
        # lives the kernel gives that number to no new process.
        group = self.process.pid
        try:
            os.killpg(group, signal.SIGTERM)
        except ProcessLookupError:  # the whole group is gone already
            self.process.wait()
            return
        # Until the group is gone, not the server alone: its engine process, orphaned when
        # the server exits, may still be shutting down then.
        deadline = time.monotonic() + timeout_s
        while _group_alive(group) and time.monotonic() < deadline:
            self.process.poll()  # reaps the server once it exits (a zombie is still a member)
            time.sleep(0.1)
        with contextlib.suppress(ProcessLookupError):  # gone in time
            os.killpg(group, signal.SIGKILL)
        self.process.wait()

    def log_tail(self, lines: int = 20) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])

    def __enter__(self) -> LocalServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def server_env(lora: bool = False, weight_transfer: str = "files") -> dict[str, str]:
    """The environment variables a server this backend uses needs: the dev-mode weight routes,
    for a LoRA policy the runtime adapter routes (`/v1/load_lora_adapter`), and for IPC weight
    transfer the unpickling of the CUDA IPC handles the trainer sends over HTTP (so only on a
    server bound to 127.0.0.1: `launch_server` refuses another host then)."""
    env = {"VLLM_SERVER_DEV_MODE": "1"}
    if lora:
        env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
    if weight_transfer == "ipc":
        env["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    return env


def _group_alive(group: int) -> bool:
    """Whether any process of process group `group` is left."""
    try:
        os.killpg(group, 0)
    except ProcessLookupError:
        return False
    return True


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` now (the OS picks it)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def launch_server(
    model: str | Path,
    *,
    port: int | None = None,
    host: str = "127.0.0.1",
    dtype: str = "float32",
    max_model_len: int | None = None,
    kv_cache_gib: float = 1.0,
    seed: int = 0,
    enforce_eager: bool = True,
    timeout_s: float = 300.0,
    log: str | Path | None = None,
    lora: LoraConfig | None = None,
    max_loras: int = 1,
    weight_transfer: str = "files",
) -> LocalServer:
    """Start `vllm serve` on the Hugging Face folder `model`, bound to `host` (an address of
    this machine; the default answers this machine only) and `port` (None: a free one), and wait
    until `/health` answers; a `VLLMServerError` with the server's last
    log lines if it exits or is not up within `timeout_s`. Its output goes to `log` (None: a
    temporary file). The KV cache takes `kv_cache_gib` GiB. `lora` (a peft `LoraConfig`):
    a server for a LoRA policy's adapters; `weight_transfer` "nccl": one that takes weights
    over NCCL (`server_command`)."""
    import httpx

    if not vllm_available():
        raise LeantrainError(f"launch_server needs the vllm package; {INSTALL_HINT}")
    port = free_port(host) if port is None else port
    cmd = server_command(
        model, port=port, host=host, dtype=dtype, max_model_len=max_model_len, seed=seed,
        enforce_eager=enforce_eager, lora=lora, max_loras=max_loras,
        weight_transfer=weight_transfer,
    )  # fmt: skip
    if weight_transfer == "ipc" and host != "127.0.0.1":
        raise LeantrainError(
            "weight_transfer ipc: the server unpickles what it is sent, so it binds 127.0.0.1 "
            f"only (got host {host!r}); IPC needs the trainer's machine anyway"
        )
    env = {**os.environ, **server_env(lora is not None, weight_transfer)}
    if torch.cuda.is_available():
        cmd += ["--kv-cache-memory-bytes", str(int(kv_cache_gib * 2**30))]
    else:  # the CPU platform sizes its KV cache from this variable
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, round(kv_cache_gib))))
        # Unbound threads: binding pins them to fixed cores that other processes may keep busy.
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    if log is None:
        fd, name = tempfile.mkstemp(prefix="vllm-serve-", suffix=".log")
        os.close(fd)
        log = name
    log = Path(log)
    with log.open("wb") as out:
        process = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    server = LocalServer(f"http://{f'[{host}]' if ':' in host else host}:{port}", process, log)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            server.close()  # its engine process, if it outlived it
            raise VLLMServerError(
                f"vllm serve on {model} exited with code {process.returncode} before "
                f"{server.url}/health answered; its last lines ({log}):\n{server.log_tail()}"
            )
        try:
            if httpx.get(f"{server.url}/health", timeout=2.0, trust_env=False).is_success:
                return server
        except httpx.TransportError:
            pass  # not listening yet
        time.sleep(0.5)
    server.close()
    raise VLLMServerError(
        f"vllm serve on {model}: {server.url}/health did not answer within {timeout_s:g} s; "
        f"its last lines ({log}):\n{server.log_tail()}"
    )
