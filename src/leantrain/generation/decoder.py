"""The engine's own forward for Llama-family decoders (Llama, Qwen2, Mistral without a sliding
window): the arithmetic of the transformers modules, without what a rollout does not need.

Why: on this CPU a rollout step of a small model is mostly work around the matmuls. Profiled on
SmolLM2-135M in bf16 at batch 64 (docs/backends.md, "The native engine's decode step"): the
matmuls were under half the time, the rest went to repeating K/V for every query head (GQA),
RMSNorm's five fp32 ops per call, a 4-D mask built per forward, and Python around 30 layers of
wrapped modules. Here:

- on CPU in bf16 every linear runs through oneDNN on weights packed once (1.3-1.9x a plain bf16
  matmul at decode batch sizes on AMX, bit-identical), q/k/v fused into one matmul, SiLU, the
  gate product and the residual adds in the matmuls' epilogues; packed copies are rebuilt when
  a weight changes in place (a weight sync, an optimizer step). Elsewhere (fp32, GPUs) the
  model's own weights are used as they are, with no copies;
- linear layers, norms and rotary run on the real tokens only (no padding);
- attention is `scaled_dot_product_attention` with `enable_gqa` (no K/V repeat): a prefill
  causal per run of equal-length prompts, with no mask and no padding; decode under one
  additive mask per forward, each group of rows from the first cache column it uses;
- RMSNorm is `F.rms_norm`, in fp32 for bf16 input and cast back, as transformers computes it.

The KV cache is the engine's `RoomyCache`, updated through `cache.update` exactly as the
transformers attention updates it, so the engine's row bookkeeping (admission, eviction,
speculative rollback) is the same on both paths. Models this does not cover (other
architectures, LoRA-wrapped linears, sliding windows, images) keep the transformers forward.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel

from leantrain.generation.kv_cache import RoomyCache

_FAMILIES = ("llama", "qwen2", "mistral")


def supports(model: PreTrainedModel) -> bool:
    """True when `LlamaDecoder` computes what `model` computes: a Llama-family decoder with
    plain linear layers, SiLU gating, full attention on every layer and no tensor-parallel
    split of its weights, and nothing patched into its modules (forward hooks, as KV routing
    installs, or an instance's own `forward`): this forward would bypass them."""
    if any(
        m._forward_hooks or m._forward_pre_hooks or "forward" in vars(m) for m in model.modules()
    ):
        return False
    config = model.config
    if getattr(config, "model_type", None) not in _FAMILIES:
        return False
    if getattr(config, "hidden_act", None) != "silu" or getattr(config, "pretraining_tp", 1) != 1:
        return False
    if any(t != "full_attention" for t in getattr(config, "layer_types", None) or ()):
        return False
    if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
        return False
    body = getattr(model, "model", None)
    if body is None or not hasattr(body, "layers") or model.get_output_embeddings() is None:
        return False
    names = ("q_proj", "k_proj", "v_proj", "o_proj")
    for layer in body.layers:
        linears = [getattr(layer.self_attn, n, None) for n in names]
        linears += [getattr(layer.mlp, n, None) for n in ("gate_proj", "up_proj", "down_proj")]
        if any(type(m) is not torch.nn.Linear for m in linears):
            return False
    return type(model.get_output_embeddings()) is torch.nn.Linear


class _Linear:
    """Linear layers on the same input, applied as one: y = x W^T + b with W (and b) the
    layers' stacked along outputs, optionally with an activation or an elementwise product or
    sum fused after the matmul.

    Packed (CPU, bf16, oneDNN): W is reordered once into oneDNN's blocked layout and the fused
    op runs in the matmul's epilogue (in fp32, rounded once), so SiLU, the gate product and
    the residual add cost no pass over memory of their own; repacked when a weight's or bias's
    in-place version moves. Otherwise the layers' own weights are used, nothing copied.
    """

    def __init__(self, linears: Sequence[torch.nn.Linear], packed: bool) -> None:
        self.linears = list(linears)
        self.packed = packed
        self._stamp: tuple[int, ...] | None = None
        self._weight: torch.Tensor | None = None
        self._bias: torch.Tensor | None = None

    def refresh(self) -> None:
        """Repack if a weight or bias changed since the last packing (no-op when unpacked)."""
        if not self.packed:
            return
        params = [p for m in self.linears for p in (m.weight, m.bias) if p is not None]
        stamp = tuple(x for p in params for x in (p.data_ptr(), p._version))
        if stamp == self._stamp:
            return
        with torch.no_grad():
            # bf16 copies of fp32 master weights when the engine runs under bf16 autocast.
            weight = torch.cat([m.weight for m in self.linears]).to(torch.bfloat16)
            # The batch-size hint only picks the blocking; 16 rows matches decode batches.
            self._weight = torch.ops.mkldnn._reorder_linear_weight(weight, 16)
            biases = [m.bias for m in self.linears]
            self._bias = None if biases[0] is None else torch.cat(biases).to(torch.bfloat16)
        self._stamp = stamp

    def __call__(self, x: torch.Tensor, silu: bool = False) -> torch.Tensor:
        """(N, in) -> (N, sum of outs); SiLU applied when `silu`."""
        if self.packed:
            act = "swish" if silu else "none"  # oneDNN's swish is SiLU
            return torch.ops.mkldnn._linear_pointwise(x, self._weight, self._bias, act, [], "")
        outs = [F.linear(x, m.weight, m.bias) for m in self.linears]
        y = outs[0] if len(outs) == 1 else torch.cat(outs, -1)
        return F.silu(y) if silu else y

    def add(self, x: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
        """other + linear(x): the residual connection."""
        if self.packed:
            return torch.ops.mkldnn._linear_pointwise.binary(
                x, other, self._weight, self._bias, "add"
            )
        return other + self(x)

    def mul(self, x: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
        """linear(x) * other: the gated MLP's product."""
        if self.packed:
            return torch.ops.mkldnn._linear_pointwise.binary(
                x, other, self._weight, self._bias, "mul"
            )
        return self(x) * other


def compute_dtype(model: PreTrainedModel) -> torch.dtype:
    """The dtype `LlamaDecoder` computes in for `model` now: its weights' dtype, or bf16 for
    fp32 weights under CPU bf16 autocast (a trainer's master weights) where packed linears
    pay; the decoder then holds bf16 packed copies, as vLLM holds bf16 copies of a trainer's
    weights, and computes as a bf16 model does (its norms and embeddings cast to bf16)."""
    param = next(model.parameters())
    autocast_bf16 = (
        param.dtype == torch.float32
        and torch.is_autocast_enabled(param.device.type)
        and torch.get_autocast_dtype(param.device.type) == torch.bfloat16
    )
    packable = _packable(param.device, torch.bfloat16)
    return torch.bfloat16 if autocast_bf16 and packable else param.dtype


def _packable(device: torch.device, dtype: torch.dtype) -> bool:
    """oneDNN-packed bf16 linears: bf16 on a CPU with native bf16 (AMX or AVX-512 BF16);
    elsewhere oneDNN would emulate bf16 and lose to the plain matmul."""
    return (
        device.type == "cpu"
        and dtype == torch.bfloat16
        and torch.backends.mkldnn.is_available()
        and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    )


class LlamaDecoder:
    """The forward the engine calls in place of `model(...)` for a supported model.

    Args:
        model: a model for which `supports(model)` holds; read live (norms, embeddings and, when
            unpacked, linears), so weight updates are seen.
        dtype: what to compute in (`compute_dtype(model)`); bf16 for fp32 weights runs with
            autocast off and packed bf16 copies of the linears.
    """

    def __init__(self, model: PreTrainedModel, dtype: torch.dtype | None = None) -> None:
        if not supports(model):
            raise ValueError(f"{type(model).__name__} is not a supported Llama-family decoder")
        config = model.config
        self.model = model
        self.body = model.model
        param = next(model.parameters())
        self.dtype = param.dtype if dtype is None else dtype
        packed = _packable(param.device, self.dtype)
        if self.dtype != param.dtype and not packed:
            raise ValueError(f"{param.dtype} weights in {self.dtype} need packed linears")
        self._own_casts = self.dtype != param.dtype
        self._device_type = param.device.type
        self.qkv, self.out, self.gate, self.up, self.down = [], [], [], [], []
        for layer in self.body.layers:
            attn, mlp = layer.self_attn, layer.mlp
            self.qkv.append(_Linear([attn.q_proj, attn.k_proj, attn.v_proj], packed))
            self.out.append(_Linear([attn.o_proj], packed))
            self.gate.append(_Linear([mlp.gate_proj], packed))
            self.up.append(_Linear([mlp.up_proj], packed))
            self.down.append(_Linear([mlp.down_proj], packed))
        self.head = _Linear([model.get_output_embeddings()], packed)
        self.heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.heads
        self.eps = config.rms_norm_eps
        self.qk_width = (self.heads + self.kv_heads) * self.head_dim

    def refresh(self) -> None:
        """Repack any packed weight that changed since the last call (once per `generate`)."""
        for linear in (*self.qkv, *self.out, *self.gate, *self.up, *self.down, self.head):
            linear.refresh()

    def __call__(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor,
        cache: RoomyCache,
        keep: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Feed (B, n) `input_ids` after each row's cache.

        Args:
            attention_mask: (B, T) long over cache columns plus the n new ones (1 = real token).
            position_ids: (B, n) positions of the new tokens.
            cache: the batch's KV cache; grows by n columns.
            keep: how many last positions get logits.

        Returns:
            logits (B, keep, V) and the final-norm hidden states (B, keep, H) that produced them.
        """
        return self.feed([Feed(input_ids, attention_mask, position_ids, cache, keep)])[0]

    def feed(self, feeds: Sequence[Feed]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Run several batches, each with its own cache, through one pass of the weights: what
        `__call__` returns for each feed, in order.

        The engine admits prompts this way: the running batch's decode step and the newcomers'
        prefill share one forward, so a small batch, whose step is bound by reading the
        weights, reads them once for both (as vLLM schedules prefill and decode together).
        """
        # Casting the weights ourselves, autocast must not cast again (nor upcast the norms).
        off = torch.autocast(self._device_type, enabled=False)
        with off if self._own_casts else contextlib.nullcontext():
            return self._feed(feeds)

    def _feed(self, feeds: Sequence[Feed]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """`feed`, in `self.dtype`."""
        # Token-major: the linear layers, norms and rotary run on the real tokens only, (N, H),
        # the feeds' tokens one after another; attention and the caches see each feed's (B, n)
        # grid. A prefill of left-padded prompts of uneven length skips its padding this way.
        grids = [_Grid(f.attention_mask[:, -f.input_ids.shape[1] :].bool()) for f in feeds]
        ids = torch.cat([g.tokens(f.input_ids) for g, f in zip(grids, feeds, strict=True)])
        positions = torch.cat([g.tokens(f.position_ids) for g, f in zip(grids, feeds, strict=True)])
        x = self.body.embed_tokens(ids).to(self.dtype)  # (N, H)
        cos, sin = self.body.rotary_emb(x, positions[None])  # (1, N, head_dim)
        cos, sin = cos[0, :, None], sin[0, :, None]  # (N, 1, head_dim): broadcast over heads
        sin = torch.cat([-sin[..., : self.head_dim // 2], sin[..., self.head_dim // 2 :]], -1)
        # A feed into an empty cache (a prefill) needs no mask: its rows attend causally to
        # their own tokens, in runs of rows of one length; any other feed gets a mask and runs
        # of rows that each start at the first cache column one of them uses.
        prefills = [f.attention_mask.shape[1] == f.input_ids.shape[1] for f in feeds]
        masks = [
            None if fresh else _attention_mask(f.attention_mask, f.input_ids.shape[1], x.dtype)
            for f, fresh in zip(feeds, prefills, strict=True)
        ]
        spans = [
            _length_runs(f.attention_mask) if fresh else _row_spans(f.attention_mask)
            for f, fresh in zip(feeds, prefills, strict=True)
        ]
        bounds = list(itertools.accumulate((g.count for g in grids), initial=0))
        for i, layer in enumerate(self.body.layers):
            h = _rms_norm(x, layer.input_layernorm.weight, self.eps)
            qkv = self.qkv[i](h)  # (N, (heads + 2 kv_heads) * head_dim)
            qk = qkv[:, : self.qk_width].view(-1, self.heads + self.kv_heads, self.head_dim)
            qk = _rotate(qk, cos, sin)  # queries and keys rotated in one pass
            v = qkv[:, self.qk_width :].view(-1, self.kv_heads, self.head_dim)
            outs = []
            for f, grid, fresh, mask, runs, lo, hi in zip(
                feeds, grids, prefills, masks, spans, bounds, bounds[1:], strict=False
            ):
                q, k = qk[lo:hi, : self.heads], qk[lo:hi, self.heads :]  # (N_f, heads, d)
                k_all, v_all = f.cache.update(grid.heads_first(k), grid.heads_first(v[lo:hi]), i)
                if fresh:  # a prefill: each run of equal-length rows on its own tokens
                    outs.append(self._attend_prompts(q, k, v[lo:hi], runs))
                    continue
                a = self._attend(grid.heads_first(q), k_all, v_all, mask, runs)  # (B, h, n, d)
                outs.append(grid.tokens(a.transpose(1, 2).flatten(2)))
            x = self.out[i].add(torch.cat(outs) if len(outs) > 1 else outs[0], x)
            h = _rms_norm(x, layer.post_attention_layernorm.weight, self.eps)
            x = self.down[i].add(self.up[i].mul(h, self.gate[i](h, silu=True)), x)
        # Each feed's last `keep` positions (rows are right-aligned, so all real), (B, keep, H).
        lasts = [
            g.grid(x[lo:hi])[:, -f.keep :]
            for f, g, lo, hi in zip(feeds, grids, bounds, bounds[1:], strict=False)
        ]
        hidden = _rms_norm(
            torch.cat([t.flatten(0, 1) for t in lasts]), self.body.norm.weight, self.eps
        )
        logits = self.head(hidden)  # (sum of B * keep, V): one pass over the head for all
        sizes = [t.shape[0] * t.shape[1] for t in lasts]
        return [
            (lg.view(*t.shape[:2], -1), hd.view(t.shape))
            for lg, hd, t in zip(logits.split(sizes), hidden.split(sizes), lasts, strict=True)
        ]

    def _attend_prompts(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, runs: list[tuple[int, int]]
    ) -> torch.Tensor:
        """Causal grouped-query attention of a prefill, token-major: (N, heads, d) queries over
        (N, kv_heads, d) keys and values of the same tokens, rows one after another; each
        (rows, length) run of equal-length rows is one call, with no padding and no mask.
        Returns (N, heads * d)."""
        parts, at = [], 0
        for rows, length in runs:
            end = at + rows * length
            q_run, k_run, v_run = (
                t[at:end].view(rows, length, *t.shape[1:]).transpose(1, 2) for t in (q, k, v)
            )
            a = F.scaled_dot_product_attention(
                q_run, k_run, v_run, is_causal=True, scale=self.head_dim**-0.5, enable_gqa=True
            )  # (rows, heads, length, d)
            parts.append(a.transpose(1, 2).reshape(end - at, -1))
            at = end
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def _attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        mask: torch.Tensor | None,
        runs: list[tuple[int, int, int]],
    ) -> torch.Tensor:
        """Grouped-query attention of (B, heads, n, d) queries over (B, kv_heads, T, d) keys
        and values under (B, 1, n, T) `mask` (None: every column seen), each run of rows from
        its first used column."""
        parts = [
            F.scaled_dot_product_attention(
                q[lo:hi],
                k[lo:hi, :, start:],
                v[lo:hi, :, start:],
                attn_mask=None if mask is None else mask[lo:hi, ..., start:],
                scale=self.head_dim**-0.5,
                enable_gqa=True,
            )
            for lo, hi, start in runs
        ]
        return parts[0] if len(parts) == 1 else torch.cat(parts)


@dataclass
class Feed:
    """One batch for `LlamaDecoder.feed`: (B, n) `input_ids` after each row's cache.

    Attributes:
        input_ids: (B, n) tokens, left-padded where rows differ in length.
        attention_mask: (B, T) long over cache columns plus the n new ones (1 = real token).
        position_ids: (B, n) positions of the new tokens.
        cache: the batch's KV cache; grows by n columns.
        keep: how many last positions get logits.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    position_ids: torch.Tensor
    cache: RoomyCache
    keep: int


class _Grid:
    """Moves tensors between the (B, n) grid of fed positions and its real tokens (N of them,
    row-major); with no padding both are views of each other and nothing is copied."""

    def __init__(self, real: torch.Tensor) -> None:
        self.shape = real.shape  # (B, n)
        self.index = None if bool(real.all()) else real.flatten().nonzero().squeeze(1)  # (N,)
        self.count = real.numel() if self.index is None else self.index.numel()  # N

    def tokens(self, t: torch.Tensor) -> torch.Tensor:
        """(B, n, ...) -> (N, ...)."""
        flat = t.reshape(-1, *t.shape[2:])
        return flat if self.index is None else flat[self.index]

    def grid(self, t: torch.Tensor) -> torch.Tensor:
        """(N, ...) -> (B, n, ...); padding positions are zeros (finite, never attended)."""
        if self.index is not None:
            t = t.new_zeros(self.shape.numel(), *t.shape[1:]).index_copy_(0, self.index, t)
        return t.view(*self.shape, *t.shape[1:])

    def heads_first(self, t: torch.Tensor) -> torch.Tensor:
        """(N, heads, head_dim) -> (B, heads, n, head_dim), the layout attention takes."""
        return self.grid(t).transpose(1, 2)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama's RMSNorm: normalised in fp32, cast back to x's dtype, then scaled (in x's dtype:
    an fp32 weight on bf16 x is cast). `F.rms_norm` of a bf16 tensor computes in fp32 and
    rounds once, so no fp32 copy of x is made."""
    return (weight * F.rms_norm(x, (x.shape[-1],), eps=eps)).to(x.dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding on (N, heads, head_dim) with (N, 1, head_dim) cos and sin, the sin's
    first half negated: x * cos + rotate_half(x) * sin, where rotate_half(x) = (-x2, x1)
    (the negation moved onto sin is exact, so this is transformers' result bit for bit)."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat([x[..., half:], x[..., :half]], dim=-1) * signed_sin


def _row_spans(columns: torch.Tensor, parts: int = 4) -> list[tuple[int, int, int]]:
    """Split the rows into up to `parts` contiguous runs, each with the first cache column one
    of its rows uses: attention reads each run's keys and values from there on.

    Rows are right-aligned, so a short row's left padding spans the columns before its first
    token; over a batch of uneven prompts much of the cache can be padding, and decode
    attention is bound by reading the cache. Rows of one prompt's group (GRPO) sit together,
    so a run's padding is mostly cut. (`columns`: (B, T) mask.)
    """
    rows = columns.shape[0]
    if rows < 2 * parts:
        return [(0, rows, 0)]
    first = columns.argmax(-1).tolist()  # first real column of each row
    bounds = [rows * p // parts for p in range(parts + 1)]
    return [(lo, hi, min(first[lo:hi])) for lo, hi in itertools.pairwise(bounds)]


def _length_runs(columns: torch.Tensor) -> list[tuple[int, int]]:
    """(rows, length) for each run of consecutive rows with the same number of real tokens
    in the (B, T) mask `columns`: the shapes `_attend_prompts` attends over. The engine admits
    prompts longest first, so a batch has one run per distinct length."""
    lengths, counts = torch.unique_consecutive(columns.sum(-1), return_counts=True)
    return [(c, n) for n, c in zip(lengths.tolist(), counts.tolist(), strict=True)]


def _attention_mask(columns: torch.Tensor, n: int, dtype: torch.dtype) -> torch.Tensor | None:
    """(B, 1, n, T) additive mask in `dtype` (0 where seen, -inf elsewhere): new token i sees
    the real cache columns up to its own; None when one new token per row sees every column
    (no padding, as at batch 1). Additive once per forward, since attention would otherwise
    turn a boolean mask into this in every layer.

    `columns` (B, T) marks real tokens; the n new tokens are its last n columns. A padding
    query, should one be fed, sees only itself: a query seeing nothing gives NaN, which would
    reach the cache through its keys and values (0 * NaN is NaN).
    """
    width = columns.shape[1]
    seen = columns.bool()[:, None, None, :]  # (B, 1, 1, T)
    if n == 1 and bool(seen.all()):
        return None
    if n > 1:
        query = torch.arange(width - n, width, device=columns.device)[:, None]  # (n, 1)
        key = torch.arange(width, device=columns.device)[None, :]  # (1, T)
        seen = (seen & (key <= query)) | (key == query)
    return torch.zeros(seen.shape, dtype=dtype, device=columns.device).masked_fill_(
        ~seen, float("-inf")
    )
