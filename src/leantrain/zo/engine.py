"""The inference-workload ZO engine: a MeZO-family step run with inference machinery only.

No autograd (`torch.inference_mode`), no gradient buffers or optimizer state, directions
regenerated from seeds, fused in-place moves (`directions.Directions`, z drawn once per seed and
step where it fits the buffer). Scoring is what an inference engine does with a batch it scores
again and again: on Llama models (`packed.LeanLlama`) the batch is packed into the tree of its
distinct prefixes, so a prefix that rows share (a prompt template, a repeated context) is computed
once, with no padding, and the last layer and lm_head run only where a token is scored. Other
models go through the batched forward of `training.logprobs` (lm_head only where labels are, no
attention mask) in length-sorted micro-batches of at most `forward_tokens` padded tokens (on a
CPU a forward that spills out of cache costs more per token, and sorting cuts padding). With
LoRA targets, all perturbed states of a step are snapshots of the small adapter and are scored
together: S states x the batch in ONE forward over the frozen base (stacked adapters). With
all parameters as targets the states cannot share a forward (each is a full copy of the weights),
so they are scored one after another, moving the weights in place between them.

With a `scorer` (`scoring.VLLMScorer`, `zo.backend: vllm`) the states are scored on vLLM
instead: the adapter snapshots go to it as S batched LoRA adapters, or (all parameters) the
weights are published per state; everything else in a step stays here.

Same seeds, same moves and same update rule as `reference.MeZOReference`, so the two walk the
same loss trajectory; only the machinery differs (and the loss's float summation order).

What it does NOT know about: where batches come from, logging, checkpoints.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from leantrain.errors import LeantrainError
from leantrain.training.logprobs import label_logprobs
from leantrain.zo.data import Pair, pad_pairs
from leantrain.zo.directions import Directions, SeedStream, small_magnitude_masks
from leantrain.zo.estimators import SPSA, OneSided, Plan
from leantrain.zo.lora import lora_factors, stacked_adapters
from leantrain.zo.packed import LeanLlama, PrefixTree, prefix_groups
from leantrain.zo.scoring import VLLMScorer

# One forward's worth of rows: a prefix tree (lean forward) or padded (ids, labels).
Piece = PrefixTree | tuple[torch.Tensor, torch.Tensor]


@dataclass
class StepResult:
    """What one ZO step measured: the loss of every scored state (plan order) and the projected
    gradient of every direction (seed order)."""

    losses: list[float]
    grads: list[float]

    @property
    def loss(self) -> float:
        """The step's training loss as MeZO logs it: the first scored state's."""
        return self.losses[0]


class ZOEngine:
    """ZO steps over the trainable tensors of `model` (those with requires_grad).

    Args:
        model: an HF causal LM; wrap it with `lora.add_lora` first for LoRA-ZO.
        estimator: `SPSA` or `OneSided` (see `estimators.py`).
        lr: step size of theta <- theta - lr * g * z.
        seed: seeds the direction seeds (`SeedStream`), as the reference's run seed does.
        pad_id: padding token id.
        batched: score all states of a step in one forward with stacked LoRA adapters (needs a
            peft LoRA model whose trainable tensors are exactly the LoRA factors).
        sparse_fraction: perturb only this fraction of each tensor's entries, the smallest in
            magnitude (Sparse MeZO); None perturbs all.
        chunk_numel: elements per fused perturbation chunk (bounds a move's temporaries; z
            itself is held whole when the trainable tensors fit `Directions`' hold_numel).
        forward_tokens: padded tokens per forward (all states together when batched). Small
            suits a CPU (the forward stays in cache); an accelerator wants it large.
        lean: score Llama models with `packed.LeanLlama` over the batch's prefix tree (each
            distinct prefix run once, no padding); other models, or False, use the model's
            own forward over length-sorted padded micro-batches of `forward_tokens`.
        tree_nodes: prefix-tree nodes per packed forward (all states together). Large shares
            more prefixes (on a CPU too: the packed forward has no padding to spill); it bounds
            activation memory.
        scorer: where the states are scored (`scoring.make_scorer`): None, this engine's own
            forward; a `scoring.VLLMScorer`, vLLM (adapter states with `batched`, else the
            weights published per state). Seeds, moves and the update stay here either way.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        estimator: SPSA | OneSided,
        lr: float,
        seed: int,
        pad_id: int,
        *,
        batched: bool = False,
        sparse_fraction: float | None = None,
        chunk_numel: int = 1 << 18,
        forward_tokens: int = 512,
        lean: bool = True,
        tree_nodes: int = 2048,
        scorer: VLLMScorer | None = None,
    ) -> None:
        self.model = model
        self.estimator = estimator
        self.lr = lr
        self.pad_id = pad_id
        self.sparse_fraction = sparse_fraction
        self.forward_tokens = forward_tokens
        self.tree_nodes = tree_nodes
        self.scorer = scorer
        self.params = [p for _, p in model.named_parameters() if p.requires_grad]
        self.directions = Directions(self.params, chunk_numel)
        self.seeds = SeedStream(seed)
        self.factors = lora_factors(model) if batched else []
        self.lean = LeanLlama(model) if lean and LeanLlama.supports(model) else None
        if batched and [f.weight for f in self.factors] != self.params:
            raise LeantrainError(
                "batched scoring stacks LoRA adapters: the trainable tensors must be exactly the "
                "LoRA factors (use target 'lora')"
            )

    @torch.inference_mode()
    def step(self, pairs: Sequence[Pair]) -> StepResult:
        """One ZO step on the batch `pairs`: score the plan's states, update the weights."""
        self.model.eval()
        seeds = self.seeds.next(self.estimator.directions)
        plan = self.estimator.plan(seeds)
        if self.sparse_fraction is not None:
            self.directions.masks = small_magnitude_masks(self.params, self.sparse_fraction)
        score = self._score_batched if self.factors else self._score_sequential
        losses = score(plan, pairs)
        grads = self.estimator.coefficients(losses)
        self._return_and_update(plan, seeds, grads)
        return StepResult(losses, grads)

    def _micro_batches(
        self, pairs: Sequence[Pair], states: int
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """`pairs` sorted by length and cut into padded (ids, labels) micro-batches whose forward
        (each row repeated for `states` states) holds at most `forward_tokens` tokens."""
        chunks: list[list[Pair]] = [[]]
        for pair in sorted(pairs, key=lambda p: len(p.prompt) + len(p.completion)):
            width = len(pair.prompt) + len(pair.completion)  # the longest so far: sorted
            if chunks[-1] and (len(chunks[-1]) + 1) * width * states > self.forward_tokens:
                chunks.append([])
            chunks[-1].append(pair)
        return [pad_pairs(chunk, self.pad_id) for chunk in chunks]

    def _pieces(self, pairs: Sequence[Pair], states: int) -> list[Piece]:
        """What the forwards of one state set score: prefix trees for the lean forward (rows
        sharing a prefix in one tree), padded micro-batches for the model's own."""
        if self.lean is None:
            return self._micro_batches(pairs, states)
        groups = prefix_groups(pairs, self.tree_nodes // states)
        return [PrefixTree.build(group, self.directions.device) for group in groups]

    def _mean_losses(
        self, pieces: list[Piece], states: int, stacks: list[torch.Tensor] | None = None
    ) -> list[float]:
        """Token-mean loss of each state over `pieces`: the current weights (states = 1), or
        the adapter states in `stacks` (one (S, out, in) tensor per LoRA factor)."""
        logp = torch.zeros(states, dtype=torch.float64, device=self.directions.device)
        count = 0
        if self.lean is not None:
            by_factor = dict(zip(self.factors, stacks, strict=True)) if stacks else None
            for tree in pieces:
                logp += self.lean.logprobs(tree, by_factor).double()
                count += len(tree.targets)
            return (-logp / count).tolist()
        with stacked_adapters(self.factors, stacks) if stacks else contextlib.nullcontext():
            for ids, labels in pieces:
                sums, n = label_logprobs(
                    self.model, ids.repeat(states, 1), labels.repeat(states, 1)
                )
                logp += sums.view(states, -1).sum(-1).double()  # (S,)
                count += int(n.view(states, -1)[0].sum())
        return (-logp / count).tolist()

    def _score_sequential(self, plan: Plan, pairs: Sequence[Pair]) -> list[float]:
        """Move the weights to each state in turn and score it."""
        pieces = self._pieces(pairs, 1) if self.scorer is None else []
        losses = []
        for moves in plan.moves:
            for seed, scale in moves:
                self.directions.move_(seed, scale, self.estimator.eps)
            if self.scorer is None:
                losses += self._mean_losses(pieces, 1)
            else:
                losses.append(self.scorer.weights_loss(pairs))
        return losses

    def _score_batched(self, plan: Plan, pairs: Sequence[Pair]) -> list[float]:
        """Snapshot the adapter at each state into stacks, then score all states together: each
        forward runs the same rows once per state."""
        states = len(plan.moves)
        stacks = [p.new_empty((states, *p.shape)) for p in self.params]  # (S, out, in) each
        for k, moves in enumerate(plan.moves):
            for seed, scale in moves:
                self.directions.move_(seed, scale, self.estimator.eps)
            for stack, p in zip(stacks, self.params, strict=True):
                stack[k].copy_(p)
        if self.scorer is not None:
            return self.scorer.adapter_losses(pairs, stacks)
        return self._mean_losses(self._pieces(pairs, states), states, stacks)

    def _return_and_update(self, plan: Plan, seeds: list[int], grads: list[float]) -> None:
        """Move back to the current weights and take the update, last direction first; the last
        move back and that direction's update share one draw of z."""
        *moves, (last_seed, last_scale) = plan.back
        for seed, scale in moves:
            self.directions.move_(seed, scale, self.estimator.eps)
        for seed, g in reversed(list(zip(seeds, grads, strict=True))):
            if seed == last_seed:
                self.directions.move_and_update_(seed, last_scale, self.estimator.eps, g, self.lr)
            else:
                self.directions.update_(seed, g, self.lr)
