"""The EAGLE-style drafter (Li et al. 2024, as TLT trains it): one decoder layer that reads the
target's last hidden state and the next token's embedding and predicts the next hidden state;
its logits come through the target's own (frozen, shared) `lm_head`.

    feature_0 = target hidden that sampled token t_0
    x_j = fc([embed(t_j), feature_j])            (2H -> H)
    feature_{j+1} = norm(layer(x_j | x_0..x_{j-1}))   attention over the draft chain so far
    q_{j+1} = softmax(lm_head(feature_{j+1}) / T), and t_{j+1} is drawn from it

The layer (and the final norm) start as copies of the target's last layer; `fc` starts as the sum
of the two inputs. Training unrolls the same chain on the target's real tokens, feeding the
drafter its own predicted features exactly as drafting does, so training matches use; the loss
is TLT's: 0.5 x smooth-L1 regression on the next hidden state + 0.5 x cross-entropy against the
target's next-token distribution, on response tokens only (only they are captured).

Online training (the spot trainer) and the warm-start cache are in spot_trainer.py.
"""

from __future__ import annotations

import copy
import inspect
import threading
from collections.abc import Mapping, Sequence

import torch
import torch.nn.functional as F
from transformers import DynamicCache, PreTrainedModel

from leantrain.errors import LeantrainError
from leantrain.generation.config import SamplingParams
from leantrain.generation.sampling import inverse_cdf
from leantrain.generation.speculative import Draft, SeqView


class EagleDrafter(torch.nn.Module):
    """One-layer drafter over `target`'s hidden states (Llama-family decoders: Llama, Qwen2,
    SmolLM, Mistral). Only `fc`, `layer` and `norm` are its own parameters; the embedding and
    lm_head are the target's, read live, so they follow the policy's current weights."""

    needs_hidden = True

    def __init__(
        self,
        target: PreTrainedModel,
        vocab: torch.Tensor | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        decoder = target.get_decoder()
        if not all(hasattr(decoder, a) for a in ("layers", "norm", "rotary_emb")):
            raise LeantrainError(
                f"the EAGLE drafter needs a Llama-style decoder (layers, norm, rotary_emb); "
                f"{type(target).__name__} has none"
            )
        hidden = target.config.hidden_size
        ref = next(target.parameters())
        # The drafter drafts in the target's dtype (bf16 small-batch matmuls are cheaper on a
        # CPU too); the copy that trains asks for fp32 (`SpotTrainer`). The target's embedding,
        # hiddens and lm_head are cast to this dtype where the drafter reads them.
        dtype = dtype or ref.dtype
        self.fc = torch.nn.Linear(2 * hidden, hidden, bias=False, device=ref.device, dtype=dtype)
        with torch.no_grad():
            eye = torch.eye(hidden, device=ref.device, dtype=dtype)
            self.fc.weight.copy_(torch.cat([eye, eye], 1))
        self.layer = copy.deepcopy(decoder.layers[-1]).to(dtype)
        self.layer.self_attn.layer_idx = 0  # the only layer of the drafter's own cache
        self.norm = copy.deepcopy(decoder.norm).to(dtype)
        self.rotary = copy.deepcopy(decoder.rotary_emb).to(dtype)
        self.requires_grad_(True)
        # Draft vocabulary: the token ids it may propose (None: all). On a CPU the lm_head over
        # SmolLM2's 49k tokens costs a fifth of the whole target forward per draft token; the few
        # thousand tokens a task's responses use cost almost nothing (EAGLE-3 trims it too).
        self.register_buffer("vocab", None if vocab is None else vocab.to(ref.device))
        # Shared, not registered: neither trained nor saved with the drafter.
        self._target = (target,)
        accepted = inspect.signature(self.layer.forward).parameters
        self._cache_kwarg = "cache" if "cache" in accepted else "past_key_values"
        self.lock = threading.Lock()  # held while drafting and while a new version is loaded

    def load_weights(self, weights: Mapping[str, torch.Tensor], version: int) -> None:
        """Load a published version of the drafter's own weights (a `weights_snapshot` of the
        trainer's copy), between drafts; the version is the caller's to track."""
        with self.lock:
            self.load_state_dict(dict(weights))

    @property
    def target(self) -> PreTrainedModel:
        return self._target[0]

    def step(
        self, tokens: torch.Tensor, features: torch.Tensor, cache: DynamicCache, j: int
    ) -> torch.Tensor:
        """Chain step j: tokens (N,) and features (N, H) in, predicted next features (N, H)
        out; `cache` holds the chain's earlier steps."""
        # The target's weights are read detached: the drafter's loss must never leave gradients
        # on the policy, which another thread may be training.
        embed = F.embedding(tokens, self.target.get_input_embeddings().weight.detach())
        dtype = self.fc.weight.dtype
        x = self.fc(torch.cat([embed.to(dtype), features.to(dtype)], -1))[:, None]  # (N, 1, H)
        positions = torch.full((len(tokens), 1), j, device=tokens.device)
        out = self.layer(
            x,
            attention_mask=None,  # one query over the whole chain so far: nothing to mask
            position_ids=positions,
            position_embeddings=self.rotary(x, positions),
            use_cache=True,
            **{self._cache_kwarg: cache},
        )
        out = out[0] if isinstance(out, tuple) else out
        return self.norm(out)[:, 0]

    def head(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The target's lm_head weight (V', H) and bias, detached, cut to the draft vocabulary,
        in the drafter's dtype."""
        head = self.target.get_output_embeddings()
        weight = head.weight.detach()
        bias = None if head.bias is None else head.bias.detach()
        if self.vocab is not None:
            weight = weight[self.vocab]
            bias = None if bias is None else bias[self.vocab]
        dtype = self.fc.weight.dtype
        return weight.to(dtype), None if bias is None else bias.to(dtype)

    def logits(
        self,
        features: torch.Tensor,
        head: tuple[torch.Tensor, torch.Tensor | None] | None = None,
    ) -> torch.Tensor:
        """fp32 logits (..., V') over the draft vocabulary of (..., H) features; `head` reuses
        a `self.head()` already cut."""
        weight, bias = head if head is not None else self.head()
        return F.linear(features.to(weight.dtype), weight, bias).float()

    def unroll(self, features: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """Teacher-forced chain: features (N, H) that sampled tokens[:, 0], tokens (N, k) ->
        predicted features (N, k, H), each step fed the previous prediction."""
        cache = DynamicCache()
        preds = []
        for j in range(tokens.shape[1]):
            features = self.step(tokens[:, j], features, cache, j)
            preds.append(features)
        return torch.stack(preds, 1)

    def begin(self, seqs: Sequence[SeqView]) -> None:
        """Nothing to prepare: the drafter reads only the live rows' last token and hidden."""

    def end(self) -> None:
        """Nothing to release."""

    @torch.inference_mode()
    def propose(
        self,
        seqs: Sequence[SeqView],
        hidden: torch.Tensor | None,
        k: int,
        params: SamplingParams,
        generator: torch.Generator,
    ) -> Draft:
        """k tokens per row, each drawn from the drafter's own q (argmax when greedy)."""
        if hidden is None:
            raise LeantrainError("the EAGLE drafter needs the target's hidden states")
        tokens = torch.tensor([s.response_ids[-1] for s in seqs], device=hidden.device)
        cache = DynamicCache()
        drafted, probs = [], []
        vocab_size = self.target.get_output_embeddings().weight.shape[0]
        with self.lock:
            head = self.head()
            features = hidden.to(self.fc.weight.dtype)
            for j in range(k):
                features = self.step(tokens, features, cache, j)
                logits = self.logits(features, head)  # (B, V')
                if params.greedy:
                    index = logits.argmax(-1)
                else:
                    q = (logits / params.temperature).softmax(-1)
                    index = inverse_cdf(q, generator)
                    if self.vocab is not None:  # q over the whole vocabulary, 0 off the draft's
                        q = q.new_zeros(len(seqs), vocab_size).index_copy_(1, self.vocab, q)
                    probs.append(q)
                tokens = index if self.vocab is None else self.vocab[index]
                drafted.append(tokens)
        lengths = torch.full((len(seqs),), k, device=hidden.device)
        return Draft(torch.stack(drafted, 1), lengths, torch.stack(probs, 1) if probs else None)


def drafter_loss(
    drafter: EagleDrafter, features: torch.Tensor, tokens: torch.Tensor, targets: torch.Tensor
) -> tuple[torch.Tensor, dict[str, float]]:
    """TLT's drafter loss on a batch of chains.

    Args:
        features: (N, H) target hiddens that sampled tokens[:, 0].
        tokens: (N, k) the target's next k response tokens.
        targets: (N, k, H) the target hiddens that sampled the token after each.

    Returns:
        0.5 x smooth-L1(predicted, target hiddens) + 0.5 x cross-entropy of the drafter's
        next-token distribution against the target's (both over the draft vocabulary), and
        those two parts as floats.
    """
    preds = drafter.unroll(features, tokens)  # (N, k, H)
    regression = F.smooth_l1_loss(preds.float(), targets.float())
    head = drafter.head()
    with torch.no_grad():
        target_probs = drafter.logits(targets, head).softmax(-1)  # (N, k, V')
    cross_entropy = -(target_probs * drafter.logits(preds, head).log_softmax(-1)).sum(-1).mean()
    loss = 0.5 * regression + 0.5 * cross_entropy
    return loss, {
        "regression": float(regression.detach()),
        "cross_entropy": float(cross_entropy.detach()),
    }
