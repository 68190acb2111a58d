"""Scoring as an inference engine does it: a batch packed into a prefix tree, and a lean forward
for Llama-style models that runs every distinct prefix once.

Two rows that start with the same tokens have the same hidden states over those tokens (the model
is causal), so an inference engine computes them once (vLLM's prefix caching, SGLang's radix
tree). `PrefixTree` packs a batch of (prompt, completion) rows into the tree of their distinct
prefixes: one node per distinct prefix, no padding, and only the nodes that some scored token
depends on (a row's last token predicts nothing). `LeanLlama` runs the decoder over the nodes:
every linear layer, norm and MLP once per node; attention per row, over the row's path of nodes
(gathered, then SDPA with `is_causal`), its output taken back at one place each node occurs. In
the last layer only the positions that predict a scored token ask in attention and go on past
it, and the lm_head runs only there, once per scored token.

Several adapter states (perturbed LoRA factors, `stacks`) run together: a leading state axis S on
the activations, the frozen base's matmuls shared where the input is (the embeddings and the first
layer's base projections are the same for every state), the LoRA products batched per state.

Same numbers as the model's own forward over the padded batch, up to float summation order
(tested within 1e-5). Only `LlamaForCausalLM` (and peft LoRA on its linear layers) is supported;
`LeanLlama.supports` says so, and callers fall back to the model's forward otherwise.

What it does NOT know about: perturbations and seeds (stacks are whatever the caller fills),
estimators, where batches come from.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from peft.tuners.lora import LoraLayer
from torch import nn
from transformers.models.llama.modeling_llama import LlamaForCausalLM, rotate_half

from leantrain.errors import LeantrainError
from leantrain.training.logprobs import token_logprobs
from leantrain.zo.data import Pair
from leantrain.zo.lora import ADAPTER


@dataclass(frozen=True)
class PrefixTree:
    """A batch of rows as the tree of their distinct prefixes (index tensors on one device).

    N nodes, R rows, longest path L, M predicting nodes, K scored tokens, at most W predicting
    positions in a row.
    """

    tokens: torch.Tensor  # (N,) the token each node adds to its parent's prefix
    positions: torch.Tensor  # (N,) its position in the row (depth in the tree)
    paths: torch.Tensor  # (R, L) the node at each position of each row; 0 past the row's end
    owners: torch.Tensor  # (N,) flat index r * L + t of one place each node occurs
    predictors: torch.Tensor  # (M,) nodes whose next-token distribution is scored
    picks: torch.Tensor  # (K,) the predictor of each scored token (index into predictors)
    targets: torch.Tensor  # (K,) the scored tokens
    # The last layer's attention runs only for each row's W predicting positions (from its
    # first, padded past its end): their nodes, a causal mask over the row, and where each
    # predictor is found among them.
    queries: torch.Tensor  # (R*W,) nodes
    query_mask: torch.Tensor  # (R, W, L) bool: key t is visible to query j
    predictor_owners: torch.Tensor  # (M,) flat index r * W + j
    row_tokens: int  # tokens of the batch before packing (what a padding-free forward runs)

    @property
    def nodes(self) -> int:
        return len(self.tokens)

    @classmethod
    def build(cls, pairs: Sequence[Pair], device: torch.device | str = "cpu") -> PrefixTree:
        """Pack `pairs`: the loss is on each completion token, predicted from the token before it
        (position 0 is never scored, as in `training.logprobs.label_logprobs`)."""
        index: dict[tuple[int, int], int] = {}  # (parent node, token) -> node; parent -1 = root
        tokens: list[int] = []
        positions: list[int] = []
        owners: list[tuple[int, int]] = []
        paths: list[list[int]] = []
        slot: dict[int, int] = {}  # predicting node -> its index in predictors
        slot_owners: list[tuple[int, int]] = []  # (row, offset from the row's first predictor)
        first: list[int] = []  # each row's first predicting position
        picks: list[int] = []
        targets: list[int] = []
        for r, pair in enumerate(pairs):
            row = pair.prompt + pair.completion
            path: list[int] = []
            parent = -1
            for t, token in enumerate(row[:-1]):  # the last token predicts nothing
                node = index.get((parent, token))
                if node is None:
                    node = index[parent, token] = len(tokens)
                    tokens.append(token)
                    positions.append(t)
                    owners.append((r, t))
                path.append(node)
                parent = node
            paths.append(path)
            first.append(max(1, len(pair.prompt)) - 1)
            for t in range(first[-1] + 1, len(row)):
                if path[t - 1] not in slot:
                    slot[path[t - 1]] = len(slot)
                    slot_owners.append((r, t - 1 - first[-1]))
                picks.append(slot[path[t - 1]])
                targets.append(row[t])
        if not targets:
            raise LeantrainError("nothing to score: every row's completion is empty")
        width = max(map(len, paths))
        grid = torch.zeros((len(paths), width), dtype=torch.long)
        for r, path in enumerate(paths):
            grid[r, : len(path)] = torch.tensor(path, dtype=torch.long)
        scored = max(len(path) - f for path, f in zip(paths, first, strict=True))
        offsets = torch.tensor(first)[:, None] + torch.arange(scored)  # (R, W) positions

        def longs(values: Sequence[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.long, device=device)

        return cls(
            tokens=longs(tokens),
            positions=longs(positions),
            paths=grid.to(device),
            owners=longs([r * width + t for r, t in owners]),
            predictors=longs(list(slot)),
            picks=longs(picks),
            targets=longs(targets),
            queries=grid.gather(1, offsets.clamp(max=width - 1)).flatten().to(device),
            query_mask=(torch.arange(width) <= offsets[..., None]).to(device),
            predictor_owners=longs([r * scored + j for r, j in slot_owners]),
            row_tokens=sum(len(p.prompt) + len(p.completion) for p in pairs),
        )


def prefix_groups(pairs: Sequence[Pair], max_nodes: int) -> list[list[Pair]]:
    """`pairs` sorted by their tokens (rows that share a prefix side by side) and cut into
    groups whose prefix tree has at most `max_nodes` nodes (a longer row is a group alone)."""
    groups: list[list[Pair]] = [[]]
    nodes = 0
    previous: list[int] = []
    for pair in sorted(pairs, key=lambda p: p.prompt + p.completion):
        row = (pair.prompt + pair.completion)[:-1]  # the nodes a row needs
        # Sorted rows: the longest prefix this row shares with the group is the previous row's.
        shared = next(
            (n for n, (a, b) in enumerate(zip(row, previous, strict=False)) if a != b),
            min(len(row), len(previous)),
        )
        if groups[-1] and nodes + len(row) - shared > max_nodes:
            groups.append([])
            nodes = shared = 0
        groups[-1].append(pair)
        nodes += len(row) - shared
        previous = row
    return groups


_ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
_MLP = ("gate_proj", "up_proj", "down_proj")


class _Projection:
    """One linear layer of the model, plain or peft LoRA: base weight, and the LoRA factors and
    scaling when an active, unmerged adapter is on it."""

    def __init__(self, module: nn.Module) -> None:
        self.lora_a: nn.Linear | None = None
        self.lora_b: nn.Linear | None = None
        self.scaling = 1.0
        if isinstance(module, LoraLayer):
            if ADAPTER in module.lora_A and not module.merged and not module.disable_adapters:
                self.lora_a, self.lora_b = module.lora_A[ADAPTER], module.lora_B[ADAPTER]
                self.scaling = module.scaling[ADAPTER]
            module = module.get_base_layer()
        if not isinstance(module, nn.Linear) or module.bias is not None:
            raise LeantrainError(f"lean scoring needs bias-free nn.Linear layers, got {module}")
        self.base = module

    def __call__(self, x: torch.Tensor, stacks: Mapping[nn.Module, torch.Tensor]) -> torch.Tensor:
        """x (S' or 1, N, in) -> (S, N, out): the base once, the adapter per state."""
        out = F.linear(x, self.base.weight)
        if self.lora_a is None:
            return out
        a = stacks.get(self.lora_a, self.lora_a.weight[None])  # (S, r, in)
        b = stacks.get(self.lora_b, self.lora_b.weight[None])  # (S, out, r)
        return out + torch.matmul(torch.matmul(x, a.transpose(1, 2)), b.transpose(1, 2)) * (
            self.scaling
        )


class LeanLlama:
    """The scoring forward of a `LlamaForCausalLM` (optionally wrapped by peft LoRA) over a
    `PrefixTree`, reading the model's own weights on every call (so in-place moves show)."""

    def __init__(self, model: nn.Module) -> None:
        if not self.supports(model):
            raise LeantrainError(
                f"lean scoring supports LlamaForCausalLM only, got {type(_unwrap(model)).__name__}"
            )
        llama = _unwrap(model)
        self.model = llama
        config = llama.config
        self.heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.heads
        self.layers = []
        for layer in llama.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            self.layers.append(
                {
                    "norm1": layer.input_layernorm,
                    "norm2": layer.post_attention_layernorm,
                    "act": mlp.act_fn,
                    **{
                        name: _Projection(getattr(owner, name))
                        for owner, names in ((attn, _ATTENTION), (mlp, _MLP))
                        for name in names
                    },
                }
            )

    @staticmethod
    def supports(model: nn.Module) -> bool:
        """Whether the lean forward computes what `model` does: a Llama without biases, plain
        LoRA (if any, no DoRA) only on the decoder layers' linear projections."""
        llama = _unwrap(model)
        if not isinstance(llama, LlamaForCausalLM):
            return False
        config = llama.config
        lora = {name: m for name, m in llama.named_modules() if isinstance(m, LoraLayer)}
        adapted = {name.rsplit(".", 1)[-1] for name in lora}
        dora = any(m.use_dora.get(ADAPTER, False) for m in lora.values())  # not plain x A^T B^T
        return not (
            config.attention_bias or config.mlp_bias or dora or adapted - {*_ATTENTION, *_MLP}
        )

    def logprobs(
        self, tree: PrefixTree, stacks: Mapping[nn.Module, torch.Tensor] | None = None
    ) -> torch.Tensor:
        """(S,) fp32 sum of log p(scored token) over the whole batch, per adapter state.

        Args:
            tree: the packed batch.
            stacks: LoRA factor `nn.Linear` -> (S, out, in) weights for S states; factors not
                named (or None) use their own weight, and S is then 1.
        """
        stacks = stacks or {}
        llama = self.model.model
        h = llama.embed_tokens(tree.tokens)[None]  # (1, N, d): the same for every state
        cos, sin = llama.rotary_emb(h, tree.positions[None])  # (1, N, head_dim)
        cos, sin = cos[0, :, None], sin[0, :, None]  # (N, 1, head_dim), broadcast over heads
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            x = layer["norm1"](h)
            q = self._rotate(layer["q_proj"](x, stacks), self.heads, cos, sin)
            k = self._rotate(layer["k_proj"](x, stacks), self.kv_heads, cos, sin)
            v = layer["v_proj"](x, stacks)
            attended = self._attend(q, k, v, tree, i == last)  # (S, N or M, heads*hd)
            if i == last:  # only what predicts a scored token goes on
                h = h.index_select(1, tree.predictors)
            h = h + layer["o_proj"](attended, stacks)
            x = layer["norm2"](h)
            gated = layer["act"](layer["gate_proj"](x, stacks)) * layer["up_proj"](x, stacks)
            h = h + layer["down_proj"](gated, stacks)
        # One row per scored token (a predictor can predict several): (S, K, d), then (S, K, V).
        logits = self.model.lm_head(llama.norm(h).index_select(1, tree.picks))
        return token_logprobs(logits, tree.targets.expand(len(logits), -1)).sum(-1)

    def _rotate(
        self, x: torch.Tensor, heads: int, cos: torch.Tensor, sin: torch.Tensor
    ) -> torch.Tensor:
        """(S', N, heads*head_dim) -> (S', N, heads, head_dim) with rotary position embedding."""
        x = x.view(*x.shape[:2], heads, self.head_dim)
        return x * cos + rotate_half(x) * sin

    def _attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tree: PrefixTree, last: bool
    ) -> torch.Tensor:
        """Causal attention of each row over its path, q (S', N, heads, hd), k and v
        (S', N, kv_heads * hd), taken back per node: (S, N, heads*hd). With `last`, only the
        predicting positions ask (a masked attention over W queries a row): (S, M, heads*hd)."""
        states = max(q.shape[0], k.shape[0], v.shape[0])
        rows = len(tree.paths)

        def per_row(x: torch.Tensor, nodes: torch.Tensor) -> torch.Tensor:
            x = x.view(*x.shape[:2], -1, self.head_dim).expand(states, -1, -1, -1)
            x = x.index_select(1, nodes)  # (S, R*T, heads, hd)
            return x.view(states * rows, -1, *x.shape[2:]).transpose(1, 2)  # (S*R, heads, T, hd)

        keys = tree.paths.flatten()
        gqa = self.kv_heads != self.heads
        k, v = per_row(k, keys), per_row(v, keys)
        if last:
            mask = tree.query_mask[None, :, None].expand(states, -1, -1, -1, -1).flatten(0, 1)
            out = F.scaled_dot_product_attention(
                per_row(q, tree.queries), k, v, attn_mask=mask, enable_gqa=gqa
            )  # (S*R, heads, W, hd)
            owners = tree.predictor_owners
        else:  # positions past a row's end are padding that nobody reads
            out = F.scaled_dot_product_attention(
                per_row(q, keys), k, v, is_causal=True, enable_gqa=gqa
            )  # (S*R, heads, L, hd)
            owners = tree.owners
        out = out.transpose(1, 2).reshape(states, -1, self.heads * self.head_dim)
        return out.index_select(1, owners)


def _unwrap(model: nn.Module) -> nn.Module:
    """The transformers model under a peft wrapper (or `model` itself)."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model
