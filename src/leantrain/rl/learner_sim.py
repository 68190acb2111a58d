"""The learner side of `leantrain simulate`: an analytic model of one optimizer step of an FSDP2
learner with Ulysses sequence parallelism, on GPUs that are not here yet. It predicts the step's
seconds (compute, FSDP traffic, Ulysses traffic, weight sync) and its memory per GPU, so
`rl/simulate.py`'s event model can take `train_s` and `sync_s` from it instead of a guess.

Knows nothing about torch or a real model: a model is its shape (`ModelShape`), a GPU its peak
bf16 FLOP/s, memory and link bandwidths (`Accelerator`), a step its trained tokens. Every figure
is a closed form, written out in `predict_learner`; what it leaves out is said there too.

Layout, as distributed/ builds it: W GPUs; FSDP shards parameters, gradients and Adam state over
all W; Ulysses groups of P consecutive ranks split every packed sequence P ways, so W / P groups
train on their share of the step's tokens and every GPU computes tokens / W of them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from leantrain.errors import LeantrainError

GB = 1e9


@dataclass(frozen=True)
class Accelerator:
    """One GPU and its links.

    Attributes:
        name: what it is called (a preset name or "custom").
        peak_flops: dense bf16 FLOP/s, no sparsity.
        memory_gb: memory of one GPU, GB (1e9 bytes).
        intra_gbps: bandwidth one GPU sends at inside a node (NVLink), GB/s per direction.
        inter_gbps: bandwidth one GPU sends at to other nodes (its InfiniBand NIC), GB/s.
        gpus_per_node: GPUs behind one NVLink domain; a collective over more crosses the network.
    """

    name: str
    peak_flops: float
    memory_gb: float
    intra_gbps: float
    inter_gbps: float
    gpus_per_node: int = 8

    def __post_init__(self) -> None:
        for name in ("peak_flops", "memory_gb", "intra_gbps", "inter_gbps"):
            if not getattr(self, name) > 0:
                raise LeantrainError(f"accelerator {name} must be > 0, got {getattr(self, name)}")
        if self.gpus_per_node < 1:
            raise LeantrainError(
                f"accelerator gpus_per_node must be >= 1, got {self.gpus_per_node}"
            )

    def bandwidth(self, ranks: int) -> float:
        """Bytes/s one rank moves in a ring over `ranks` consecutive GPUs: NVLink inside a node,
        the NIC once the ring leaves it (the slowest hop sets a ring's pace)."""
        return (self.intra_gbps if ranks <= self.gpus_per_node else self.inter_gbps) * GB


# SXM parts, dense bf16 from NVIDIA's data sheets; NVLink is the per-direction half of the quoted
# bidirectional figure (A100 600 GB/s, H100/H200 900 GB/s); one HDR (200 Gb/s) or NDR (400 Gb/s)
# NIC per GPU. Nominal link rates: NCCL's bus bandwidth reaches about 80% of them.
GPUS: dict[str, Accelerator] = {
    "a100": Accelerator("a100", 312e12, 80, 300, 25),
    "h100": Accelerator("h100", 989e12, 80, 450, 50),
    "h200": Accelerator("h200", 989e12, 141, 450, 50),
}


@dataclass(frozen=True)
class ModelShape:
    """What the learner model needs of a decoder-only transformer.

    Attributes:
        params: all parameters (embeddings included), N.
        layers: decoder layers, L.
        hidden: hidden size, h.
        heads: attention (query) heads, H.
        kv_heads: key/value heads (GQA); must divide `heads`.
        vocab: vocabulary size (the logits' width).
    """

    params: float
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    vocab: int

    def __post_init__(self) -> None:
        if not self.params > 0:
            raise LeantrainError(f"model params must be > 0, got {self.params}")
        for name in ("layers", "hidden", "heads", "kv_heads", "vocab"):
            if getattr(self, name) < 1:
                raise LeantrainError(f"model {name} must be >= 1, got {getattr(self, name)}")
        if self.heads % self.kv_heads:
            raise LeantrainError(
                f"model kv_heads ({self.kv_heads}) must divide heads ({self.heads})"
            )


# From the models' Hugging Face config.json (parameter counts include the embeddings).
MODELS: dict[str, ModelShape] = {
    "qwen2.5-0.5b": ModelShape(0.494e9, 24, 896, 14, 2, 151936),
    "qwen2.5-1.5b": ModelShape(1.54e9, 28, 1536, 12, 2, 151936),
    "qwen2.5-7b": ModelShape(7.62e9, 28, 3584, 28, 4, 152064),
    "qwen2.5-32b": ModelShape(32.8e9, 64, 5120, 40, 8, 152064),
    "llama3-8b": ModelShape(8.03e9, 32, 4096, 32, 8, 128256),
    "llama3-70b": ModelShape(70.6e9, 80, 8192, 64, 8, 128256),
}


@dataclass(frozen=True)
class LearnerSetup:
    """One optimizer step of the learner.

    Attributes:
        model: the model's shape.
        gpu: the accelerator every rank runs on.
        gpus: ranks W (the FSDP world).
        tokens: tokens trained in the step (prompt + response, every sequence).
        seq_len: tokens of one sequence (sets the attention FLOPs and what Ulysses splits).
        micro_tokens: tokens one Ulysses group packs into one forward (a micro-batch).
        sequence_parallel: Ulysses size P; divides `gpus` and the model's heads.
        mfu: share of peak FLOP/s the kernels reach (0.3-0.5 is typical for 7B+ with flash
            attention; small models reach less).
        recompute: activation checkpointing per decoder layer (one more forward per step).
        overlap: share of the shorter of compute and FSDP traffic hidden behind the longer one
            (1: FSDP2's prefetch hides it all; 0: they run one after the other).
        sync_gbps: GB/s the new weights travel at to the rollout engines; None: the GPU's
            network bandwidth (rollout servers on other nodes).
    """

    model: ModelShape
    gpu: Accelerator
    gpus: int
    tokens: float
    seq_len: int
    micro_tokens: int = 16384
    sequence_parallel: int = 1
    mfu: float = 0.4
    recompute: bool = True
    overlap: float = 1.0
    sync_gbps: float | None = None

    def __post_init__(self) -> None:
        p = self.sequence_parallel
        if self.gpus < 1:
            raise LeantrainError(f"gpus must be >= 1, got {self.gpus}")
        if not self.tokens > 0:
            raise LeantrainError(f"tokens (per step) must be > 0, got {self.tokens}")
        if self.seq_len < 1 or self.micro_tokens < 1:
            raise LeantrainError(
                f"seq_len and micro_tokens must be >= 1, got {self.seq_len}, {self.micro_tokens}"
            )
        if p < 1 or self.gpus % p:
            raise LeantrainError(
                f"sequence_parallel ({p}) must be >= 1 and divide gpus ({self.gpus})"
            )
        if self.model.heads % p:
            valid = [q for q in range(1, self.model.heads + 1) if self.model.heads % q == 0]
            raise LeantrainError(
                f"sequence_parallel {p} does not divide the model's {self.model.heads} attention "
                f"heads; valid sizes: {valid}"
            )
        if self.micro_tokens < self.seq_len:
            raise LeantrainError(
                f"micro_tokens ({self.micro_tokens}) must hold one sequence (seq_len "
                f"{self.seq_len}): a micro-batch never splits a sequence"
            )
        if not 0 < self.mfu <= 1:
            raise LeantrainError(f"mfu must be in (0, 1], got {self.mfu}")
        if not 0 <= self.overlap <= 1:
            raise LeantrainError(f"overlap must be in [0, 1], got {self.overlap}")
        if self.sync_gbps is not None and not self.sync_gbps > 0:
            raise LeantrainError(f"sync_gbps must be > 0, got {self.sync_gbps}")


@dataclass(frozen=True)
class LearnerPrediction:
    """Seconds of one optimizer step and bytes per GPU, as `predict_learner` computes them."""

    flops: float  # of the whole step, all GPUs
    compute_s: float
    micro_batches: int  # forwards each Ulysses group runs
    fsdp_bytes: float  # each rank sends (and receives) per step
    fsdp_s: float  # that traffic alone
    exposed_fsdp_s: float  # what the overlap leaves on the critical path
    sp_bytes: float  # each rank sends per step through Ulysses all-to-alls
    sp_s: float  # on the critical path: attention waits for its inputs
    train_s: float  # compute + exposed FSDP + Ulysses: the learner's step
    sync_s: float  # gather the weights on rank 0 and send them to the rollout engines
    memory_gb: dict[str, float] = field(default_factory=dict)  # per GPU, by part, and "total"

    @property
    def step_s(self) -> float:
        """Learner step plus weight sync: what `Cluster.train_s + Cluster.sync_s` stands for."""
        return self.train_s + self.sync_s


def predict_learner(setup: LearnerSetup) -> LearnerPrediction:
    """The closed forms, for W GPUs, Ulysses size P, r = 1 with recompute (else 0), T tokens a
    step, s tokens a sequence, bf16 compute (2 bytes) over fp32 master weights:

    - compute: FLOPs = (3 + r) * 2 * (N + L*h*s) * T: a forward costs 2N per token plus causal
      attention's 2*L*h*s (QK^T and AV over on average s/2 earlier tokens); backward is two
      forwards, recompute one more. Seconds = FLOPs / (W * peak * mfu).
    - FSDP: per micro-batch an all-gather of the bf16 weights in forward and again in backward
      (recompute runs inside backward's, so it adds none), and one fp32 reduce-scatter of the
      gradients per step: (W-1)/W * (2 * 2N * M + 4N) bytes per rank, M micro-batches per rank.
      Overlapped with compute: exposed = max(c, f) + (1 - overlap) * min(c, f) - c.
    - Ulysses: per layer 4 all-to-alls in forward (q, k, v in, the output back), each sending
      (P-1)/P of a rank's t = T/W tokens x width x 2 bytes; width h for q and the output, h*Hkv/H
      for k and v (h when P does not divide Hkv: they are repeated first). Backward moves the
      same again, recompute adds a forward's. Not overlapped.
    - memory per GPU: 16N/W bytes of sharded state (fp32 weights, gradients, Adam's two moments),
      two layers' bf16 weights gathered (the one computing and the one prefetched), activations
      of one micro-batch of m = micro_tokens / P tokens: 34*h*L bytes a token without
      recompute (Korthikanti et al. 2022, flash attention), 2*h*L (the layers' inputs) + 34*h
      (the layer being recomputed) with it; fp32 logits 4*V*m.
    - weight sync: rank 0 gathers the full bf16 weights ((W-1)/W * 2N bytes), then sends 2N
      bytes at `sync_gbps`.

    Left out: the optimizer step's memory traffic, the first layer's unhidden all-gather, kernel
    launch gaps, load imbalance between ranks, CUDA context and allocator fragmentation. Raises a
    LeantrainError naming the settings to change when the memory does not fit.
    """
    m, gpu, w, p = setup.model, setup.gpu, setup.gpus, setup.sequence_parallel
    r = 1 if setup.recompute else 0
    n, t = m.params, setup.tokens

    flops = (3 + r) * 2 * (n + m.layers * m.hidden * setup.seq_len) * t
    compute_s = flops / (w * gpu.peak_flops * setup.mfu)

    micro_batches = math.ceil(t / (w // p) / setup.micro_tokens)
    share = (w - 1) / w
    fsdp_bytes = share * (2 * 2 * n * micro_batches + 4 * n)
    fsdp_s = fsdp_bytes / gpu.bandwidth(w)
    longer, shorter = max(compute_s, fsdp_s), min(compute_s, fsdp_s)
    exposed_fsdp_s = longer + (1 - setup.overlap) * shorter - compute_s

    kv_width = m.hidden * m.kv_heads // m.heads if m.kv_heads % p == 0 else m.hidden
    per_layer = (2 * m.hidden + 2 * kv_width) * 2 * (p - 1) / p * (t / w)
    sp_bytes = per_layer * m.layers * (2 + r)
    sp_s = sp_bytes / gpu.bandwidth(p) if p > 1 else 0.0

    sync_bw = setup.sync_gbps * GB if setup.sync_gbps is not None else gpu.inter_gbps * GB
    sync_s = share * 2 * n / gpu.bandwidth(w) + 2 * n / sync_bw

    micro = setup.micro_tokens / p  # tokens of one micro-batch on one GPU
    act_token = (2 * m.hidden * m.layers + 34 * m.hidden) if r else 34 * m.hidden * m.layers
    memory = {
        "states": 16 * n / w / GB,
        "gathered weights": 2 * 2 * n / m.layers / GB,
        "activations": act_token * micro / GB,
        "logits": 4 * m.vocab * micro / GB,
    }
    memory["total"] = sum(memory.values())
    if memory["total"] > gpu.memory_gb:
        parts = ", ".join(f"{k} {v:.1f}" for k, v in memory.items() if k != "total")
        raise LeantrainError(
            f"does not fit: {memory['total']:.1f} GB per GPU ({parts}) on a {gpu.name} of "
            f"{gpu.memory_gb:g} GB; raise gpus (states / W, now {w}), sequence_parallel "
            f"(activations and logits / P, now {p}), turn recompute on, or lower micro_tokens "
            f"(now {setup.micro_tokens})"
        )
    return LearnerPrediction(
        flops=flops,
        compute_s=compute_s,
        micro_batches=micro_batches,
        fsdp_bytes=fsdp_bytes,
        fsdp_s=fsdp_s,
        exposed_fsdp_s=exposed_fsdp_s,
        sp_bytes=sp_bytes,
        sp_s=sp_s,
        train_s=compute_s + exposed_fsdp_s + sp_s,
        sync_s=sync_s,
        memory_gb=memory,
    )


def accelerator(
    name: str,
    *,
    peak_tflops: float | None = None,
    memory_gb: float | None = None,
    intra_gbps: float | None = None,
    inter_gbps: float | None = None,
    gpus_per_node: int | None = None,
) -> Accelerator:
    """A preset of `GPUS` by name, with any figure overridden."""
    key = name.lower()
    if key not in GPUS:
        raise LeantrainError(f"unknown gpu {name!r}; presets: {', '.join(GPUS)}")
    base = GPUS[key]
    return Accelerator(
        name=key,
        peak_flops=peak_tflops * 1e12 if peak_tflops is not None else base.peak_flops,
        memory_gb=memory_gb if memory_gb is not None else base.memory_gb,
        intra_gbps=intra_gbps if intra_gbps is not None else base.intra_gbps,
        inter_gbps=inter_gbps if inter_gbps is not None else base.inter_gbps,
        gpus_per_node=gpus_per_node if gpus_per_node is not None else base.gpus_per_node,
    )


def model_shape(name: str, *, params_b: float | None = None) -> ModelShape:
    """A preset of `MODELS` by name, its parameter count overridable (in billions)."""
    key = name.lower()
    if key not in MODELS:
        raise LeantrainError(f"unknown model {name!r}; presets: {', '.join(MODELS)}")
    base = MODELS[key]
    if params_b is None:
        return base
    return ModelShape(
        params_b * 1e9, base.layers, base.hidden, base.heads, base.kv_heads, base.vocab
    )
