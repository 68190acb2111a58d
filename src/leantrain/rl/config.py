"""A GRPO run's settings: `leantrain rl --config FILE` loads an `RLConfig` (YAML files such as
`configs/tiny-arith.yaml`); every field carries help text, and a bad value raises a
`LeantrainError` that names the field."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator

from leantrain.distributed.config import DistributedConfig
from leantrain.generation.config import SamplingParams
from leantrain.models.config import LLAMA_PROJECTIONS, LoraSettings, ModelConfig
from leantrain.settings import Strict
from leantrain.speculation.config import SpeculativeConfig
from leantrain.tasks.config import TaskConfig
from leantrain.telemetry.config import TelemetryConfig


class GRPOConfig(Strict):
    prompts_per_step: int = Field(16, ge=1, description="Distinct prompts per optimizer step.")
    group_size: int = Field(
        8, ge=2, description="Responses per prompt; advantages are relative within a group."
    )
    lr: float = Field(
        5e-5,
        gt=0.0,
        description="AdamW learning rate. On the tiny model 5e-5 learns; 3e-4 collapses it "
        "within 20 steps (Adam moves every weight by about lr per step).",
    )
    warmup_steps: int = Field(
        10,
        ge=0,
        description="Linear learning-rate warm-up. Adam's first updates move every weight by "
        "about lr whatever its gradient; warming up keeps those noisy steps small.",
    )
    lr_schedule: Literal["constant", "cosine"] = Field(
        "constant",
        description="Learning rate after the warm-up: `constant`, or `cosine` decay from lr to 0 "
        "over the run's `steps` (a resume with more steps re-spreads the rest of the decay). "
        "With a constant lr the tiny model's test accuracy swings by up to 8 points from "
        "one checkpoint to the next; the decay lets the last steps settle (the demo uses it).",
    )
    weight_decay: float = Field(0.0, ge=0.0, description="AdamW weight decay.")
    loss_type: Literal["grpo", "dr_grpo", "dapo", "bnpo"] = Field(
        "dapo",
        description="Token normalization. grpo: per-sequence mean (length-biased); dr_grpo: "
        "divide by batch x max_new_tokens; dapo: divide by active tokens of the step (default, "
        "no length bias, exact under micro-batching).",
    )
    scale_rewards: Literal["group", "batch", "none"] = Field(
        "batch",
        description="Divide centred rewards by the std of the batch (default), of each group, or "
        "not at all. Group std blows tiny differences (format alone, in a group where no answer "
        "is right) up to unit-size advantages; on the tiny model that stalled learning.",
    )
    epsilon: float = Field(
        0.2, gt=0.0, description="PPO clip range below 1 (and above, by default)."
    )
    epsilon_high: float | None = Field(
        None, gt=0.0, description="Upper clip range; DAPO suggests 0.28. Default: epsilon."
    )
    beta: float = Field(
        0.0, ge=0.0, description="Weight of the k3 KL to the frozen initial policy; 0 skips it."
    )
    num_iterations: int = Field(
        1, ge=1, description="Optimizer passes over each batch (ratios use behaviour logprobs)."
    )
    mask_truncated: bool = Field(
        False, description="Exclude responses cut off at max_new_tokens from the loss."
    )
    max_grad_norm: float = Field(1.0, gt=0.0, description="Gradient-norm clipping threshold.")
    micro_batch_tokens: int = Field(
        512,
        ge=16,
        description="Token budget of one packed forward. On CPU attention over a packed row is "
        "dense (quadratic in its length), so small is fast; with flash-attention on GPUs larger "
        "rows are cheaper.",
    )


class OrchestratorConfig(Strict):
    """How rollouts and training meet (rl/orchestrator.py). The defaults are the synchronous run."""

    mode: Literal["sync", "async", "partial"] = Field(
        "sync",
        description="sync: generate, then train, in turn. async: rollouts of later steps are "
        "generated while the trainer trains, each batch on one policy version it keeps to the "
        "end. partial: like async, but in-flight sequences switch to newly published weights "
        "at segment boundaries (fresher data, mixed versions per trajectory); on every "
        "backend (threads read the trainer's weights, worker processes and Ray actors are "
        "offered each version as it is published).",
    )
    max_staleness: int = Field(
        1,
        ge=0,
        description="k: a batch trained at step s was started on version >= s - k. Larger k "
        "hides more generation time behind training but trains on older data; 0 is sync.",
    )
    backend: Literal["local", "process", "ray"] = Field(
        "local",
        description="local: rollout threads in this process (torch threads split with the "
        "trainer; they share its GIL). process: spawned worker processes on this machine, "
        "weights through shared memory (no GIL shared, no cluster daemons; a script that starts "
        "such a run needs the usual `if __name__ == '__main__':` guard). ray: rollout worker "
        "actors, weights through the object store.",
    )
    ray_address: str | None = Field(
        None,
        description="Ray cluster address (`auto`: the cluster this node joined with `ray "
        "start`); None starts a local Ray on this machine. Also the cluster of the learner "
        "group when distributed.ray_learner_resource is set, and of the vLLM servers of "
        "rollout.vllm_ray_servers.",
    )
    ray_rollout_resource: str | None = Field(
        None,
        description="backend ray: place the rollout worker actors only on nodes that offer this "
        "custom Ray resource (`ray start --resources '{\"rollout\": 1}'`); any amount marks a "
        "node, so one node takes any number of workers. None: anywhere in the cluster. A "
        "resource no node offers is refused when the run starts.",
    )
    rollout_workers: int = Field(
        1,
        ge=1,
        description="Rollout workers (threads, processes or actors), each holding one version.",
    )
    rollout_threads: int | None = Field(
        None,
        ge=1,
        description="Torch threads of each rollout worker. local: torch's count is per process, "
        "so it is the trainer's too; None shares the threads evenly between the trainer and the "
        "workers. process and ray: each worker's (None: 1), taken off the trainer's unless the "
        "actors run on a Ray cluster.",
    )
    off_policy: Literal["none", "decoupled", "tis"] = Field(
        "decoupled",
        description="Correction for stale samples (async/partial only). decoupled: AReaL's "
        "decoupled PPO, clip around the trainer's current policy, times a capped importance "
        "weight to the behaviour policy (one extra no-grad forward). tis: truncated importance "
        "sampling, min(pi/behaviour, cap) times the advantage, no clip, no extra forward. "
        "none: PPO ratio against the behaviour logprobs, as in sync.",
    )
    is_cap: float = Field(
        5.0, gt=0.0, description="Cap on the importance weight (AReaL uses 5; TRL's cap is 3)."
    )
    segment_tokens: int = Field(
        32,
        ge=1,
        description="partial mode: tokens decoded between checks for new weights. Smaller "
        "switches sooner but re-prefills in-flight sequences more often. Not used on "
        "rollout.backend: vllm_server, whose servers take new weights the moment they are "
        "published.",
    )
    timeout_s: float = Field(
        120.0,
        gt=0.0,
        description="Longest wait for anything (a batch, a weight version, an actor call) "
        "before the stalled party is reported and recovered or the run stops.",
    )
    max_restarts: int = Field(
        3, ge=0, description="Rollout workers replaced after a crash or stall before giving up."
    )

    @model_validator(mode="after")
    def _rollout_resource_on_ray(self) -> OrchestratorConfig:
        if self.ray_rollout_resource is not None and self.backend != "ray":
            raise ValueError(
                "ray_rollout_resource places Ray actors: it needs backend: ray "
                f"(got {self.backend!r})"
            )
        return self


class RolloutConfig(Strict):
    """Which engine samples the rollouts and the run's greedy test evaluations (rl/rollout.py).
    The defaults are the native engine's."""

    backend: Literal["native", "vllm", "vllm_server"] = Field(
        "native",
        description="native: leantrain's engine on the trainer's own weights (every capability: "
        "hidden-state capture for the drafter, images, speculation, a KV budget; the fast choice "
        "for the tiny CPU models). vllm: an in-process vLLM engine on a copy of the weights, "
        "synced at every policy version (sampling only, no top-k/top-p, no images; sync mode "
        "(tool episodes too), or async or partial on orchestrator.backend: process or ray, one "
        "engine per worker, partial loading new versions between segments; `make vllm` "
        "installs it); the road to real models on GPUs. vllm_server: running `vllm serve` "
        "servers over HTTP (vllm_urls, or vllm_ray_servers placed on Ray by the run), weights "
        "published to them through vllm_weights_dir (what vllm does; with lora.enabled the "
        "adapter only, to servers started with LoRA on; sync mode, or async or partial (not "
        "with LoRA) on any orchestrator.backend, each "
        "rollout worker on servers of its own, partial loading new versions into them in the "
        "middle of a batch with /pause and /resume; the servers run apart from the trainer, "
        "on other GPUs or machines).",
    )
    vllm_urls: list[str] = Field(
        default_factory=list,
        description="vllm_server: the servers' base URLs (http://host:port), each a `vllm "
        "serve` of the policy's model started as docs/backends.md says; rollout groups go to "
        "them in turn. In async mode rollout worker i of n takes URLs i, i + n, ... (at least "
        "one URL per worker).",
    )
    vllm_weights_dir: Path | None = Field(
        None,
        description="vllm_server: where each policy version is written for the servers to "
        "load, a folder every server reads at the same path (a shared filesystem across "
        "machines); None: vllm-server-weights/ in the run folder. Async rollout worker i "
        "writes into its worker-i/ subfolder.",
    )
    vllm_timeout_s: float = Field(
        600.0,
        gt=0.0,
        description="vllm_server: longest wait for one HTTP call (a prompt group's generation, "
        "a server's weight load) before the run stops with an error naming the server.",
    )
    vllm_weight_transfer: Literal["files", "nccl", "ipc"] = Field(
        "files",
        description="vllm_server: how each version's weights reach the servers. files: "
        "written to vllm_weights_dir, which the servers reload (any device, any machine that "
        "reads the folder; a LoRA adapter always goes this way). nccl: vLLM's NCCL "
        "weight-transfer engine broadcasts them from the trainer's GPU into servers on other "
        "GPUs, no disk. ipc: servers on the trainer's own GPU map its tensors (CUDA IPC), on "
        "this machine only. nccl and ipc: CUDA only, not with lora.enabled, the servers "
        "started with --weight-transfer-config (as vllm_ray_servers start them); not yet run "
        "on a GPU by this project.",
    )
    vllm_ray_servers: int = Field(
        0,
        ge=0,
        description="vllm_server: start this many servers on the Ray cluster "
        "(orchestrator.ray_address; None: a local Ray) when the run starts, and stop them when "
        "it ends, instead of servers started by hand: one Ray actor each, one GPU each where "
        "the nodes have GPUs, on the policy's folder (read at the same path on every node: "
        "one machine or a shared filesystem), their URLs filling vllm_urls. 0: use vllm_urls. "
        "Sized by vllm_kv_cache_gib, vllm_max_model_len and vllm_enforce_eager.",
    )
    vllm_ray_resource: str | None = Field(
        None,
        description="vllm_ray_servers: place the servers only on nodes that offer this custom "
        "Ray resource (`ray start --resources '{\"vllm\": 1}'`; any amount marks a node); "
        "apart from orchestrator.ray_rollout_resource, whose rollout workers only talk HTTP. "
        "None: any node. A resource no node offers is refused when the run starts.",
    )
    vllm_ray_host: Literal["127.0.0.1", "node"] = Field(
        "127.0.0.1",
        description="vllm_ray_servers: the address each server listens on. 127.0.0.1: its own "
        "machine only, so the servers must land on the run's machine (refused by name "
        "otherwise). node: the node's address as Ray knows it, which the URL then uses: for "
        "servers on other machines, on a network trusted with the servers' unauthenticated "
        "routes.",
    )
    vllm_ray_timeout_s: float = Field(
        600.0,
        gt=0.0,
        description="vllm_ray_servers: longest wait for the servers' placement, then for their "
        "start (a tiny model on CPU takes 30-60 s; a large one compiling on GPUs, minutes). A "
        "placement that does not fit, or a server not up in time, stops the run with an error "
        "(a server's with its last log lines).",
    )
    vllm_kv_cache_gib: float = Field(
        1.0,
        gt=0.0,
        description="vllm, and each server of vllm_ray_servers: memory for its KV cache, in "
        "GiB (on CPU `VLLM_CPU_KVCACHE_SPACE` wins when set). Must hold at least one sequence "
        "of vllm_max_model_len tokens.",
    )
    vllm_max_model_len: int | None = Field(
        None,
        ge=16,
        description="vllm, and the servers of vllm_ray_servers: longest prompt plus response "
        "it accepts (None: the model's context length). Smaller needs less KV-cache memory "
        "per sequence.",
    )
    vllm_enforce_eager: bool = Field(
        True,
        description="vllm, and the servers of vllm_ray_servers: run without torch.compile "
        "and CUDA graphs. Starts in seconds; "
        "compiling is faster per token on GPUs but takes a minute or more at start.",
    )

    @field_validator("vllm_urls")
    @classmethod
    def _server_urls(cls, urls: list[str]) -> list[str]:
        from leantrain.generation.vllm_server import check_url

        return [check_url(u) for u in urls]

    @model_validator(mode="after")
    def _servers_given(self) -> RolloutConfig:
        if self.vllm_urls and self.vllm_ray_servers:
            raise ValueError(
                "vllm_urls and vllm_ray_servers are both set: give the URLs of running servers "
                "or the number of servers to place on Ray, not both"
            )
        if self.vllm_ray_servers and self.backend != "vllm_server":
            raise ValueError(
                f"vllm_ray_servers starts servers for backend vllm_server (got {self.backend!r})"
            )
        if self.vllm_weight_transfer != "files" and self.backend != "vllm_server":
            raise ValueError(
                f"vllm_weight_transfer: {self.vllm_weight_transfer} sends weights to servers: "
                f"it needs backend vllm_server (got {self.backend!r})"
            )
        if self.vllm_ray_resource is not None and not self.vllm_ray_servers:
            raise ValueError("vllm_ray_resource places servers: it needs vllm_ray_servers >= 1")
        if self.backend == "vllm_server" and not (self.vllm_urls or self.vllm_ray_servers):
            raise ValueError(
                "vllm_urls is empty: backend vllm_server needs the base URL of at least one "
                "running vllm serve (e.g. [http://127.0.0.1:8000]), or vllm_ray_servers >= 1 "
                "to place them on Ray"
            )
        return self


class PolicyLoraConfig(LoraSettings):
    """Train a LoRA adapter (peft, models/lora.py) on the frozen policy instead of every
    weight. Off by default: on the tiny CPU models full training is cheap and learns more."""

    enabled: bool = Field(
        False,
        description="Train only a LoRA adapter on `targets` (the rest frozen): a fraction of "
        "the optimizer state, and on rollout.backend: vllm or vllm_server the publish sends "
        "the adapter only (one adapter per version) instead of every weight.",
    )
    targets: list[str] = Field(
        default_factory=lambda: list(LLAMA_PROJECTIONS),
        description="Linear layers the adapter adapts (module name endings).",
    )


class RLConfig(Strict):
    """A GRPO run: `leantrain rl --config FILE` loads one of these."""

    model: ModelConfig = Field(default_factory=ModelConfig)
    task: TaskConfig = Field(default_factory=TaskConfig)
    sampling: SamplingParams = Field(default_factory=SamplingParams)
    grpo: GRPOConfig = Field(default_factory=GRPOConfig)
    orchestrator: OrchestratorConfig = Field(default_factory=OrchestratorConfig)
    rollout: RolloutConfig = Field(
        default_factory=RolloutConfig,
        description="The rollout backend: the native engine or vLLM.",
    )
    speculative: SpeculativeConfig = Field(
        default_factory=SpeculativeConfig,
        description="Speculative decoding in the long tail of each rollout (sync mode).",
    )
    lora: PolicyLoraConfig = Field(
        default_factory=PolicyLoraConfig,
        description="Train a LoRA adapter instead of every weight (one rank; sync mode, or "
        "async on rollout.backend: vllm_server).",
    )
    steps: int = Field(120, ge=0, description="Optimizer steps (one rollout batch each).")
    seed: int = Field(0, description="Seeds prompts, sampling and initialization.")
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="auto picks CUDA if present."
    )
    out: Path = Field(Path("runs/rl"), description="Run folder: metrics, plots, checkpoints.")
    threads: int | None = Field(
        None,
        ge=1,
        description="Torch intra-op threads of this process, set when the run starts (None: from "
        "the command line, its share of the usable cores among the leantrain commands running, "
        "followed while it runs; from Python, torch's count). Float sums are split by the "
        "thread count, so a run repeats bit for bit only at the same count.",
    )
    max_batch_size: int = Field(
        128, ge=1, description="Live sequences in the rollout engine at once."
    )
    max_cache_tokens: int | None = Field(
        None,
        ge=1,
        description="KV-cache token budget of the rollout engine: sequences are admitted only "
        "while their prompt plus max new tokens fit (None: unbounded).",
    )
    checkpoint_every: int = Field(10, ge=1, description="Steps between checkpoints.")
    keep_checkpoints: int = Field(2, ge=1, description="Checkpoints kept on disk (newest).")
    log_completions: int = Field(
        2, ge=0, description="Sampled completions appended to completions.jsonl each step."
    )
    telemetry: TelemetryConfig = Field(
        default_factory=TelemetryConfig,
        description="Trackers to report to (TensorBoard, W&B, MLflow, trackio) and the "
        "rollout events of `leantrain view`.",
    )
    distributed: DistributedConfig = Field(
        default_factory=DistributedConfig,
        description="Learner ranks (launched by torchrun or `--nproc-per-node`): their timeout "
        "and how many split each packed row (sequence parallelism) inside data parallelism.",
    )

    @model_validator(mode="after")
    def _speculation_in_sync_mode(self) -> RLConfig:
        # Async rollout workers build their own engines; speculation is wired into the sync loop.
        if self.speculative.enabled and self.orchestrator.mode != "sync":
            raise ValueError(
                "speculative.enabled needs orchestrator.mode: sync "
                f"(got {self.orchestrator.mode!r}); async rollout workers do not speculate yet"
            )
        return self

    @model_validator(mode="after")
    def _lora_in_sync_mode(self) -> RLConfig:
        mode = self.orchestrator.mode
        transfer = self.rollout.vllm_weight_transfer
        if self.lora.enabled and transfer != "files":
            raise ValueError(
                f"lora.enabled with rollout.vllm_weight_transfer: {transfer}: a LoRA policy "
                "publishes its adapter as files (vLLM loads adapters from disk); use "
                "vllm_weight_transfer: files"
            )
        if not self.lora.enabled or mode == "sync":
            return self
        if self.rollout.backend == "vllm_server":
            # A worker's servers get each version's adapter from the published weights (its
            # own policy copy is never sampled from), between batches. Not in the middle of
            # one: vLLM fixes a request's adapter when it starts.
            if mode == "partial":
                raise ValueError(
                    "lora.enabled with orchestrator.mode: partial is not possible on "
                    "rollout.backend: vllm_server: a running request keeps the adapter it "
                    "started with, so a version cannot reach it mid-batch; use "
                    "orchestrator.mode: async or sync"
                )
            return self
        # Other rollout workers build their policy copies from the model name: no adapter.
        raise ValueError(
            f"lora.enabled needs orchestrator.mode: sync (got {mode!r}) on rollout.backend: "
            f"{self.rollout.backend}; rollout workers hold no adapter there yet "
            "(rollout.backend: vllm_server runs it async)"
        )

    @model_validator(mode="after")
    def _vllm_rollouts(self) -> RLConfig:
        backend = self.rollout.backend
        if backend == "native":
            return self
        # What is not built on vLLM yet (thread workers in-process): rl/rollout.py
        # `refuse_unsupported`.
        r, workers = self.rollout, self.orchestrator.rollout_workers
        servers = len(r.vllm_urls) or r.vllm_ray_servers
        if backend == "vllm_server" and self.orchestrator.mode != "sync" and servers < workers:
            # Each worker publishes its versions into servers of its own (rl/rollout.py).
            given = (
                f"rollout.vllm_urls has {servers} URL(s)"
                if r.vllm_urls
                else f"rollout.vllm_ray_servers is {servers}"
            )
            raise ValueError(
                f"orchestrator.rollout_workers is {workers} but {given}: on vllm_server each "
                "async rollout worker needs a server of its own (a server holds one policy "
                "version at a time); give at least as many servers as workers, or fewer workers"
            )
        if self.sampling.top_k > 0 or self.sampling.top_p < 1:
            raise ValueError(
                f"rollout.backend: {backend} samples without truncation (sampling.top_k 0, "
                f"sampling.top_p 1; got {self.sampling.top_k}, {self.sampling.top_p}): vLLM's "
                "logprobs of a truncated distribution are not what the trainer recomputes"
            )
        return self
