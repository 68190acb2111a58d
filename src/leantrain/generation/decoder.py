"""The engine's own forward for Llama-family decoders (Llama, Qwen2, Mistral without a sliding
window): the arithmetic of the transformers modules, without what a rollout does not need.

Why: on this CPU a rollout step of a small model is mostly work around the matmuls. Profiled on
SmolLM2-135M in bf16 at batch 64 (docs/backends.md, "The native engine's decode step"): the
matmuls were under half the time, the rest went to repeating K/V for every query head (GQA),
RMSNorm's five fp32 ops per call, a 4-D mask built per forward, and Python around 30 layers of
wrapped modules. Here:

- on CPU in bf16 every linear runs through oneDNN on weights packed once (1.3-1.9x a plain bf16
  matmul at decode batch sizes on AMX, bit-identical), q/k/v and gate/up fused into one matmul
  each; packed copies are rebuilt when a weight changes in place (a weight sync, an optimizer
  step). Elsewhere (fp32, GPUs) the model's own weights are used as they are, with no copies;
- attention is `scaled_dot_product_attention` with `enable_gqa` (no K/V repeat) under one
  boolean mask per forward;
- RMSNorm is `F.rms_norm` in fp32, cast back as transformers does.

The KV cache is the engine's `RoomyCache`, updated through `cache.update` exactly as the
transformers attention updates it, so the engine's row bookkeeping (admission, eviction,
speculative rollback) is the same on both paths. Models this does not cover (other
architectures, LoRA-wrapped linears, sliding windows, images) keep the transformers forward.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel

from leantrain.generation.kv_cache import RoomyCache

_FAMILIES = ("llama", "qwen2", "mistral")


def supports(model: PreTrainedModel) -> bool:
    """True when `LlamaDecoder` computes what `model` computes: a Llama-family decoder with
    plain linear layers, SiLU gating, full attention on every layer and no tensor-parallel
    split of its weights."""
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


class _Projection:
    """One or more linear layers applied to the same input, returning each one's output.

    Packed (CPU, bf16, oneDNN): the weights are concatenated and reordered once into oneDNN's
    blocked layout, so a call is one matmul; repacked when any weight's in-place version moves.
    Otherwise each layer's own weight is used, nothing copied.
    """

    def __init__(self, linears: Sequence[torch.nn.Linear], packed: bool) -> None:
        self.linears = list(linears)
        self.sizes = [m.out_features for m in self.linears]
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
            weight = torch.cat([m.weight for m in self.linears])
            # The batch-size hint only picks the blocking; 16 rows matches decode batches.
            self._weight = torch.ops.mkldnn._reorder_linear_weight(weight, 16)
            biases = [m.bias for m in self.linears]
            self._bias = None if biases[0] is None else torch.cat(biases)
        self._stamp = stamp

    def __call__(self, x: torch.Tensor) -> list[torch.Tensor]:
        if not self.packed:
            return [F.linear(x, m.weight, m.bias) for m in self.linears]
        out = torch.ops.mkldnn._linear_pointwise(x, self._weight, self._bias, "none", [], "")
        return list(out.split(self.sizes, dim=-1)) if len(self.sizes) > 1 else [out]


def _packable(model: PreTrainedModel) -> bool:
    """oneDNN-packed bf16 linears: a CPU model in bf16 on a CPU with native bf16 (AMX or
    AVX-512 BF16); elsewhere oneDNN would emulate bf16 and lose to the plain matmul."""
    param = next(model.parameters())
    return (
        param.device.type == "cpu"
        and param.dtype == torch.bfloat16
        and torch.backends.mkldnn.is_available()
        and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    )


class LlamaDecoder:
    """The forward the engine calls in place of `model(...)` for a supported model.

    Args:
        model: a model for which `supports(model)` holds; read live (norms, embeddings and, when
            unpacked, linears), so weight updates are seen.
    """

    def __init__(self, model: PreTrainedModel) -> None:
        if not supports(model):
            raise ValueError(f"{type(model).__name__} is not a supported Llama-family decoder")
        config = model.config
        self.model = model
        self.body = model.model
        packed = _packable(model)
        self.qkv = []
        self.out = []
        self.gate_up = []
        self.down = []
        for layer in self.body.layers:
            attn, mlp = layer.self_attn, layer.mlp
            self.qkv.append(_Projection([attn.q_proj, attn.k_proj, attn.v_proj], packed))
            self.out.append(_Projection([attn.o_proj], packed))
            self.gate_up.append(_Projection([mlp.gate_proj, mlp.up_proj], packed))
            self.down.append(_Projection([mlp.down_proj], packed))
        self.head = _Projection([model.get_output_embeddings()], packed)
        self.heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.heads
        self.eps = config.rms_norm_eps

    def refresh(self) -> None:
        """Repack any packed weight that changed since the last call (once per `generate`)."""
        for proj in (*self.qkv, *self.out, *self.gate_up, *self.down, self.head):
            proj.refresh()

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
        batch, n = input_ids.shape
        # Token-major: the linear layers, norms and rotary run on the real tokens only, (N, H);
        # attention and the cache see the (B, n) grid. A prefill of left-padded prompts of
        # uneven length skips its padding this way (half the tokens for typical prompt sets).
        grid = _Grid(attention_mask[:, -n:].bool())
        x = self.body.embed_tokens(grid.tokens(input_ids))  # (N, H)
        cos, sin = self.body.rotary_emb(x, grid.tokens(position_ids)[None])  # (1, N, head_dim)
        cos, sin = cos[0, :, None], sin[0, :, None]  # (N, 1, head_dim): broadcast over heads
        mask = _attention_mask(attention_mask, n)  # (B, 1, n, T) bool
        for i, layer in enumerate(self.body.layers):
            h = _rms_norm(x, layer.input_layernorm.weight, self.eps)
            q, k, v = self.qkv[i](h)  # (N, heads * head_dim), (N, kv_heads * head_dim) x 2
            q = _rotate(q.view(-1, self.heads, self.head_dim), cos, sin)
            k = _rotate(k.view(-1, self.kv_heads, self.head_dim), cos, sin)
            q, k, v = (grid.heads_first(t.view(t.shape[0], -1, self.head_dim)) for t in (q, k, v))
            k, v = cache.update(k, v, i)  # (B, kv_heads, T, head_dim)
            a = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, scale=self.head_dim**-0.5, enable_gqa=True
            )  # (B, heads, n, head_dim)
            x = x + self.out[i](grid.tokens(a.transpose(1, 2).reshape(batch, n, -1)))[0]
            h = _rms_norm(x, layer.post_attention_layernorm.weight, self.eps)
            gate, up = self.gate_up[i](h)
            x = x + self.down[i](F.silu(gate) * up)[0]
        last = grid.grid(x)[:, -keep:]  # (B, keep, H); rows are right-aligned, so all real
        hidden = _rms_norm(last, self.body.norm.weight, self.eps)
        return self.head(hidden)[0], hidden


class _Grid:
    """Moves tensors between the (B, n) grid of fed positions and its real tokens (N of them,
    row-major); with no padding both are views of each other and nothing is copied."""

    def __init__(self, real: torch.Tensor) -> None:
        self.shape = real.shape  # (B, n)
        self.index = None if bool(real.all()) else real.flatten().nonzero().squeeze(1)  # (N,)

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
    """Llama's RMSNorm: normalised in fp32, cast back to x's dtype, then scaled."""
    return weight * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding on (N, heads, head_dim) with (N, 1, head_dim) cos and sin:
    x * cos + rotate_half(x) * sin."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def _attention_mask(columns: torch.Tensor, n: int) -> torch.Tensor:
    """(B, 1, n, T) boolean: new token i sees the real cache columns up to its own.

    `columns` (B, T) marks real tokens; the n new tokens are its last n columns. A padding
    query (left padding in a prefill) sees only itself: a query seeing nothing gives NaN, which
    would reach the cache through its keys and values (a masked weight is 0, and 0 * NaN is NaN).
    """
    width = columns.shape[1]
    real = columns.bool()[:, None, None, :]  # (B, 1, 1, T)
    if n == 1:
        return real
    query = torch.arange(width - n, width, device=columns.device)[:, None]  # (n, 1)
    key = torch.arange(width, device=columns.device)[None, :]  # (1, T)
    return (real & (key <= query)) | (key == query)
