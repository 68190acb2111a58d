"""The one rollout path: a step's prompts, sampled on a backend at one policy version, scored into
trajectories. `RolloutSource` runs in-process (the synchronous run, and the trainer when it
generates a batch itself) and inside every rollout worker (thread, process, Ray actor), so the
two can never drift apart: the same prompts, seeds, sampling, KV budget and scoring everywhere.

A step's batch is a function of the config and the step index only (`RolloutSource.batch`), so
any worker rebuilds any step's batch and a re-queued batch is the same batch. What a worker
cannot do (tool episodes, image prompts) is refused once, at set-up, by `refuse_unsupported`.

Knows nothing about training, optimizers or scheduling.
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase, ProcessorMixin

from leantrain.errors import LeantrainError, NotBuiltError
from leantrain.generation import (
    Backend,
    Completion,
    Engine,
    Speculator,
    require,
    weights_snapshot,
)
from leantrain.models import encode_prompt
from leantrain.models.lora import lora_config, split_adapter
from leantrain.models.vision import encode_image_prompt
from leantrain.rl.config import RLConfig
from leantrain.rl.episodes import Episode, EpisodeRunner, episode_trajectories, is_multi_turn
from leantrain.rl.trajectory import Trajectory
from leantrain.speculation.long_tail import LongTail
from leantrain.tasks import Example, Task
from leantrain.tasks.config import RewardWeights
from leantrain.tasks.rewards import score_safely

if TYPE_CHECKING:  # the annotations only: the factories look the classes up when called
    from leantrain.distributed.ray_servers import RayServers
    from leantrain.generation.vllm_backend import VLLMBackend
    from leantrain.generation.vllm_server import VLLMServerBackend

# Seed streams: training prompts and sampling never share a seed (test problems: rl/grpo.py).
_PROMPT_SEED_STRIDE = 100_003
_SAMPLING_SEED_OFFSET = 7_919


def compute_autocast(config: RLConfig, device: torch.device) -> contextlib.AbstractContextManager:
    """Where forward passes run in bf16 (weights stay fp32): on CUDA under dtype `auto`, or
    whenever dtype is `bfloat16`. Rollouts and training use the same, so workers sample as the
    trainer scores."""
    dtype = {
        "auto": torch.bfloat16 if device.type == "cuda" else None,
        "float32": None,
        "bfloat16": torch.bfloat16,
    }[config.model.dtype]
    return contextlib.nullcontext() if dtype is None else torch.autocast(device.type, dtype=dtype)


def example_inputs(
    tokenizer: PreTrainedTokenizerBase, processor: ProcessorMixin | None, example: Example
) -> tuple[list[int], torch.Tensor | None]:
    """`example`'s prompt ids and, when it carries an image (`meta["image"]`: one PIL image or a
    list), their pixel values (n_images, C, H, W) through the VLM's `processor`."""
    image = example.meta.get("image")
    if image is None:
        return encode_prompt(tokenizer, example.prompt), None
    if processor is None:
        raise LeantrainError(
            "the task's examples carry images but the model is text-only: use a vision-language "
            "model (the `tiny-vl` preset or a local VLM folder saved with its processor)"
        )
    return encode_image_prompt(
        processor, example.prompt, image if isinstance(image, list) else [image]
    )


def to_trajectory(
    tokenizer: PreTrainedTokenizerBase,
    task: Task,
    weights: RewardWeights,
    c: Completion,
    example: Example,
    group: int,
    versions: list[int],
) -> Trajectory:
    """Score one completion into a trajectory; `versions` is the policy version of each token."""
    text = tokenizer.decode(c.response_ids, skip_special_tokens=True)
    score = score_safely(task, example, text, weights)
    return Trajectory(
        prompt_ids=c.prompt_ids,
        response_ids=c.response_ids,
        logprobs=c.logprobs,
        versions=versions,
        loss_mask=[1] * len(c.response_ids),
        finish_reason=c.finish_reason,
        rewards=score.parts,
        reward=score.total,
        group_id=group,
        text=text,
        error=score.error,
        timeline=c.timeline,
    )


def sampled_versions(
    completions: Sequence[Completion], version: int, live: bool = False
) -> list[list[int]]:
    """Each completion's per-token policy versions for a batch started on `version`: the
    backend's own record where it keeps one (vLLM's weight-version spans), checked, else
    `version` for every token. Without `live` updates every token must be on `version`: a
    token labelled otherwise means the weights changed under the batch, which `async` mode
    never does. With them (partial mode on a backend with `live_weights`) the record is
    required and must never go back in time nor below `version`. A failed check is an error,
    not data."""
    out: list[list[int]] = []
    for i, c in enumerate(completions):
        if c.versions is None and not live:
            out.append([version] * len(c.response_ids))
            continue
        versions = c.versions or []
        ordered = versions == sorted(versions)
        allowed = (
            (min(versions, default=version) >= version and ordered)
            if live
            else (not set(versions) - {version})
        )
        if len(versions) != len(c.response_ids) or not allowed:
            what = "versions that start at it and never go back" if live else "that version only"
            raise LeantrainError(
                f"completion {i} of a batch started on policy version {version} reports token "
                f"versions {sorted(set(versions))} from its backend "
                f"({len(versions)} for {len(c.response_ids)} tokens); expected {what}"
            )
        out.append(list(versions))
    return out


def rollout_backend(
    config: RLConfig,
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    task: Task,
    speculator: Speculator | None = None,
    worker: int | None = None,
) -> Backend:
    """The run's rollout backend on `model`: the engine with the config's batch size and KV
    budget (and the long tail's `speculator`); or, with `rollout.backend: vllm`, a vLLM engine
    on a folder of the same weights, or with `vllm_server`, the running servers of
    `rollout.vllm_urls` (rollout worker `worker`'s share of them; None: the trainer's, all);
    any inside an `EpisodeRunner` for a tool task. The trainer and every worker build theirs
    here, so no setting reaches one and not the other."""
    if config.rollout.backend in ("vllm", "vllm_server"):
        vllm = (
            vllm_backend(config, model, tokenizer)
            if config.rollout.backend == "vllm"
            else vllm_server_backend(config, model, worker)
        )
        if is_multi_turn(task):
            # Turns go to vLLM as ids and come back as ids; the runner appends the tool's
            # tokens itself, encoded once with the policy's tokenizer (never vLLM's text).
            return EpisodeRunner(vllm, task, tokenizer, max_context=vllm.max_model_len)
        return vllm
    engine = Engine(
        model,
        tokenizer,
        max_batch_size=config.max_batch_size,
        max_cache_tokens=config.max_cache_tokens,
        speculator=speculator,
    )
    return EpisodeRunner(engine, task) if is_multi_turn(task) else engine


def vllm_backend(
    config: RLConfig, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase
) -> VLLMBackend:
    """A `VLLMBackend` on `model`'s folder (`policy_folder`). Its weights match `model`'s at
    set-up; the run publishes each version after that (rl/orchestrator.py)."""
    from leantrain.generation.vllm_backend import INSTALL_HINT, VLLMBackend, vllm_available

    if not vllm_available():
        raise LeantrainError(
            "rollout.backend: vllm needs the vllm package, which is not installed in this "
            f"environment: run `make vllm` ({INSTALL_HINT})"
        )
    lora = config.lora
    cuda = next(model.parameters()).device.type == "cuda"
    dtype = config.model.dtype if config.model.dtype != "auto" else ("auto" if cuda else "float32")
    r = config.rollout
    return VLLMBackend(
        policy_folder(config, model, tokenizer),
        lora=lora_config(lora, lora.targets) if lora.enabled else None,
        adapter_dir=Path(config.out) / "vllm-adapters",
        dtype=dtype,
        max_batch_size=config.max_batch_size,
        max_model_len=r.vllm_max_model_len,
        kv_cache_gib=r.vllm_kv_cache_gib,
        enforce_eager=r.vllm_enforce_eager,
        seed=config.seed,
    )


def policy_folder(
    config: RLConfig, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase
) -> Path:
    """The Hugging Face folder vLLM starts on: the one `model` was loaded from, or, for a
    model made in memory, a copy saved as `vllm-policy/` in the run folder (the base weights
    under a LoRA adapter). vLLM needs the architecture and tokenizer from it; the run publishes
    each version's weights after that."""
    folder = Path(str(model.name_or_path))
    if (folder / "config.json").is_file():
        return folder
    folder = Path(config.out) / "vllm-policy"
    # Written aside and renamed into place: the trainer and async rollout workers (spawned
    # processes) all come here; the first rename wins and the others use its folder (the
    # weights in it are the set-up's: every engine gets each published version anyway).
    # A folder of another model (an earlier run in this folder) is replaced.
    Path(config.out).mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".vllm-policy-", dir=config.out))
    # Under an adapter, vLLM loads the base weights under their own names.
    state = split_adapter(model.state_dict())[0] if config.lora.enabled else None
    model.save_pretrained(staging, state_dict=state)
    tokenizer.save_pretrained(staging)
    same = _same_file(folder / "config.json", staging / "config.json")
    if folder.exists() and not same:
        shutil.rmtree(folder, ignore_errors=True)
    try:
        staging.rename(folder)
    except OSError:  # already there, written by another process of this run
        shutil.rmtree(staging, ignore_errors=True)
    return folder


def place_vllm_servers(
    config: RLConfig, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase
) -> tuple[RLConfig, RayServers]:
    """Start the `rollout.vllm_ray_servers` servers on the Ray cluster
    (distributed/ray_servers.py) on `model`'s folder (`policy_folder`), with the rollout's
    vLLM settings; returns the run's config with their URLs as `rollout.vllm_urls` (and
    `vllm_ray_servers` 0: from there on they are servers like any given ones, so the trainer's
    client and every worker's, built from that config, talk to them), and the servers, which
    the caller stops. Their logs: `vllm-servers/` in the run folder, on each server's node."""
    from leantrain.distributed.ray_servers import place_servers

    r = config.rollout
    out = Path(config.out).resolve()  # read on other nodes too: not relative to this process
    servers = place_servers(
        policy_folder(config, model, tokenizer).resolve(),
        count=r.vllm_ray_servers,
        resource=r.vllm_ray_resource,
        host=r.vllm_ray_host,
        timeout_s=r.vllm_ray_timeout_s,
        log_dir=out / "vllm-servers",
        address=config.orchestrator.ray_address,
        dtype=config.model.dtype,
        max_model_len=r.vllm_max_model_len,
        kv_cache_gib=r.vllm_kv_cache_gib,
        enforce_eager=r.vllm_enforce_eager,
        seed=config.seed,
        lora=lora_config(config.lora, config.lora.targets) if config.lora.enabled else None,
        weight_transfer=r.vllm_weight_transfer,
    )
    rollout = r.model_copy(update={"vllm_urls": servers.urls, "vllm_ray_servers": 0})
    return config.model_copy(update={"rollout": rollout}), servers


def vllm_server_backend(
    config: RLConfig, model: PreTrainedModel, worker: int | None = None
) -> VLLMServerBackend:
    """A `VLLMServerBackend` on the servers of `rollout.vllm_urls`, checked now (up, started
    with the flags it needs). The trainer's client publishes `model`'s weights to them now, as
    version 0: a server holds whatever weights it was started on or last given (another run's,
    even), and the run evaluates before its first step. With `lora.enabled` only the adapter
    is published (the servers keep the base weights they started on, which must be the
    policy's). A worker's client gets each version before its batch (rl/rollout_worker.py), so
    it publishes nothing here.

    Rollout worker `worker` (of `orchestrator.rollout_workers`) gets servers of its own, URLs
    `worker`, `worker + workers`, ...: a server holds one version at a time, so two workers
    publishing into one would change its weights under each other's batches. It writes its
    versions into a folder of its own too (a worker removes its previous version's folder
    once its servers hold the next). None: the trainer's client, on every server, which it
    uses only while no worker runs (rl/orchestrator.py)."""
    from leantrain.generation.vllm_server import VLLMServerBackend

    r = config.rollout
    urls, weights_dir = r.vllm_urls, r.vllm_weights_dir or Path(config.out) / "vllm-server-weights"
    if worker is not None:
        urls = urls[worker :: config.orchestrator.rollout_workers]
        weights_dir = weights_dir / f"worker-{worker}"
    lora = config.lora
    backend = VLLMServerBackend(
        urls,
        weights_dir=weights_dir,
        timeout_s=r.vllm_timeout_s,
        # With an adapter, each version publishes the adapter only, as `vllm_backend`'s engine.
        lora=lora_config(lora, lora.targets) if lora.enabled else None,
        weight_transfer=r.vllm_weight_transfer,
    )
    if worker is None:
        backend.load_weights(weights_snapshot(model), 0)
    return backend


def refuse_unbuilt_vllm(mode: str, backend: str) -> None:
    """Async modes on vLLM not built yet raise `NotBuiltError` (a `NotImplementedError`).

    Built: `async` and `partial` on `process` workers and on `ray` actors (a process each too),
    each holding one engine. In `async` it loads each version between batches; in `partial`
    between segments (rl/rollout_worker.py): each segment is a `generate` of its own on the
    version loaded (the reload resets the prefix cache, so a resumed sequence is re-prefilled
    on the new weights), which needs no sync in the middle of decoding (vLLM 0.32's
    `pause_generation` exists on its `AsyncLLM` only, not on the in-process `LLM`). Not built:
    either mode on `local` threads, whose engine would be a second in-process vLLM engine in the
    trainer's process (they tear each other's process groups down)."""
    if backend == "local":
        raise NotBuiltError(
            f"orchestrator.mode: {mode} on rollout.backend: vllm runs on orchestrator.backend: "
            "process or ray only (got 'local'): a worker thread's vLLM engine cannot share the "
            "trainer's process"
        )


def _same_file(a: Path, b: Path) -> bool:
    return a.is_file() and b.is_file() and a.read_bytes() == b.read_bytes()


def refuse_unsupported(config: RLConfig, task: Task, example: Example) -> None:
    """Refuse, once and at set-up, what rollout workers cannot run: tool episodes and image
    prompts run in the synchronous loop only (speculation is refused by the config itself), and
    in-process vLLM rollouts run async or partial on worker processes or Ray actors only (on vLLM
    servers, every mode on any workers). Image prompts (a
    vision-language model's task, tool episodes included) are refused on vLLM here, before its
    engine starts."""
    backend = config.rollout.backend
    if backend != "native" and "image" in example.meta:
        raise LeantrainError(
            f"task {config.task.name!r} has image prompts: rollout.backend: {backend} takes no "
            "images here; use rollout.backend: native"
        )
    mode = config.orchestrator.mode
    if mode == "sync":
        return
    if config.rollout.backend == "vllm":
        refuse_unbuilt_vllm(mode, config.orchestrator.backend)
    if is_multi_turn(task):
        raise LeantrainError(
            f"task {config.task.name!r} is multi-turn and needs orchestrator.mode: sync "
            f"(got {mode!r}); rollout workers run single-turn tasks only"
        )
    if "image" in example.meta:
        raise LeantrainError(
            f"task {config.task.name!r} has image prompts and needs orchestrator.mode: sync (got "
            f"{mode!r}); rollout workers run text prompts only"
        )


class RolloutSource:
    """Prompts + backend + task + sampling -> scored trajectories, for any step.

    Args:
        config: the run config (task, sampling, group size, reward weights, seed).
        backend: the rollout backend: the `Engine` or `VLLMBackend`, inside an
            `EpisodeRunner` for tool tasks; what a setting needs of it is checked here, once.
        tokenizer: the policy's tokenizer.
        task: the task that makes prompts and scores responses.
        device: where the policy lives (autocast follows it).
        processor: a VLM's processor (image prompts), else None.
        long_tail: the long-tail speculation, whose drafter trains on the captured rollouts.
    """

    def __init__(
        self,
        config: RLConfig,
        backend: Backend,
        tokenizer: PreTrainedTokenizerBase,
        task: Task,
        device: torch.device,
        processor: ProcessorMixin | None = None,
        long_tail: LongTail | None = None,
    ) -> None:
        if config.max_cache_tokens is not None:
            require(backend, "kv_budget", "max_cache_tokens")
        if processor is not None:
            require(backend, "images", f"model {config.model.name!r} (a vision-language model)")
        if long_tail is not None:
            require(backend, "speculation", "speculative.enabled")
            if long_tail.capture:
                require(backend, "hidden_states", "speculative.train_drafter")
        self.config = config
        self.backend = backend
        self.tokenizer = tokenizer
        self.task = task
        self.device = device
        self.processor = processor
        self.long_tail = long_tail

    def autocast(self) -> contextlib.AbstractContextManager:
        return compute_autocast(self.config, self.device)

    def examples(self, step: int) -> list[Example]:
        """Step `step`'s prompts (`prompts_per_step` of them), from the seed and the step only."""
        n = self.config.grpo.prompts_per_step
        return self.task.examples(n, self.config.seed * _PROMPT_SEED_STRIDE + step)

    def batch(self, step: int) -> tuple[list[Example], list[list[int]], int]:
        """Step `step`'s examples, its prompt-major batch (`group_size` copies of each prompt's
        ids) and its sampling seed. A function of the config and the step only, so any rollout
        worker rebuilds any step's batch, and a re-queued batch is the same batch."""
        examples = self.examples(step)
        prompt_ids = [example_inputs(self.tokenizer, self.processor, ex)[0] for ex in examples]
        batch = [ids for ids in prompt_ids for _ in range(self.config.grpo.group_size)]
        return examples, batch, self.config.seed * _SAMPLING_SEED_OFFSET + step

    def rollout(self, step: int, version: int) -> list[Trajectory]:
        """`group_size` responses to each of step `step`'s prompts, sampled at `version`,
        scored."""
        examples, completions = self.sample(step)
        if all(c.versions is None for c in completions):  # the backend keeps no record
            return self.score(examples, completions, version)
        return self.score(examples, completions, sampled_versions(completions, version))

    def sample(self, step: int) -> tuple[list[Example], list[Completion]]:
        """Step `step`'s prompts and `group_size` sampled completions of each, prompt-major."""
        examples, batch, seed = self.batch(step)
        images = self.image_inputs(examples, self.config.grpo.group_size)
        capture = {} if self.long_tail is None else {"return_hidden_states": self.long_tail.capture}
        with self.autocast():
            completions = self.backend.generate(
                batch, self.config.sampling, seed=seed, **capture, **images
            )
        if self.long_tail is not None:
            self.long_tail.observe(step, completions)  # the drafter's training data
        return examples, completions

    def image_inputs(self, examples: Sequence[Example], repeat: int = 1) -> dict[str, list]:
        """`{"images": pixel values per prompt}` for the engine, each example's `repeat` times
        in a row (prompt-major, as `batch`); {} for text examples."""
        if self.processor is None or "image" not in examples[0].meta:
            return {}
        pixels = [example_inputs(self.tokenizer, self.processor, ex)[1] for ex in examples]
        return {"images": [pv for pv in pixels for _ in range(repeat)]}

    def score(
        self,
        examples: Sequence[Example],
        completions: Sequence[Completion],
        versions: int | Sequence[Sequence[int]],
    ) -> list[Trajectory]:
        """Score completions (from `sample`) into trajectories; a crashing scorer scores 0.
        `versions`: the policy version that sampled them, or each completion's per-token
        versions (partial rollouts). Trajectories of image prompts carry their pixel values for
        the training forward; an episode gives one row per segment."""
        group = self.config.grpo.group_size
        weights = self.config.task.reward_weights
        pixels = self.image_inputs(examples).get("images", [None] * len(examples))
        rows: list[Trajectory] = []
        for i, c in enumerate(completions):
            example, image = examples[i // group], pixels[i // group]
            v = versions if isinstance(versions, int) else list(versions[i])
            if isinstance(c, Episode):
                if not isinstance(v, int):  # tool episodes run in the synchronous loop only
                    raise LeantrainError("an episode is sampled on one policy version")
                score = score_safely(self.task, example, c.text, weights)
                rows += episode_trajectories(c, score, v, i // group, pixel_values=image)
                continue
            token_versions = [v] * len(c.response_ids) if isinstance(v, int) else v
            row = to_trajectory(
                self.tokenizer, self.task, weights, c, example, i // group, token_versions
            )
            row.pixel_values = image
            rows.append(row)
        return rows
