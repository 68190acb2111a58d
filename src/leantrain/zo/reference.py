"""The baseline: MeZO as its reference code runs it (princeton-nlp/MeZO, large_models/trainer.py,
`zo_step` / `zo_perturb_parameters` / `zo_forward` / `zo_update`), in a plain PyTorch loop.

Per step: draw a seed with numpy; reseed torch's global generator and, per parameter tensor, draw
z with `torch.normal` and rebind `param.data = param.data + scale * z * eps` (+1, forward, -2,
forward, +1); the projected gradient is `((loss1 - loss2) / (2 eps)).item()`; reseed, redraw z per
tensor and rebind `param.data = param.data - lr * (g * z + weight_decay * param.data)` (no decay
on biases and norms). Each forward is what the reference's `zo_forward` does: `model.eval()`,
`torch.inference_mode()`, the model's own loss over a padded batch with an attention mask (full
logits at every position). Parameters keep `requires_grad` on, as in the Trainer.

n-SPSA (`directions` > 1), which the reference does only through a torch optimizer, is the same
loop per seed with g divided by the number of directions, updates applied last seed first (the
order `engine.ZOEngine` uses). Other estimators have no reference; this class refuses them.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import PreTrainedModel

from leantrain.zo.data import Pair, pad_pairs
from leantrain.zo.directions import SeedStream
from leantrain.zo.engine import StepResult


class MeZOReference:
    """MeZO-SGD on the trainable parameters of `model`, the reference code's way."""

    def __init__(
        self,
        model: PreTrainedModel,
        eps: float,
        lr: float,
        seed: int,
        pad_id: int,
        *,
        directions: int = 1,
        weight_decay: float = 0.0,
    ) -> None:
        self.model = model
        self.eps = eps
        self.lr = lr
        self.pad_id = pad_id
        self.directions = directions
        self.weight_decay = weight_decay
        self.seeds = SeedStream(seed)
        self.named_parameters_to_optim = [
            (name, p) for name, p in model.named_parameters() if p.requires_grad
        ]

    def step(self, pairs: Sequence[Pair]) -> StepResult:
        ids, labels = pad_pairs(pairs, self.pad_id)
        lengths = torch.tensor([len(p.prompt) + len(p.completion) for p in pairs])
        mask = (torch.arange(ids.shape[1]) < lengths[:, None]).long()  # what HF collators give
        batch = {"input_ids": ids, "attention_mask": mask, "labels": labels}
        losses, grads = [], []
        seeds = self.seeds.next(self.directions)
        for seed in seeds:
            self.perturb_parameters(seed, scaling_factor=1)
            loss1 = self.forward(batch)
            self.perturb_parameters(seed, scaling_factor=-2)
            loss2 = self.forward(batch)
            grads.append(((loss1 - loss2) / (2 * self.eps)).item() / self.directions)
            losses += [loss1.item(), loss2.item()]
            self.perturb_parameters(seed, scaling_factor=1)
        for seed, g in reversed(list(zip(seeds, grads, strict=True))):
            self.update(seed, g)
        return StepResult(losses, grads)

    def perturb_parameters(self, seed: int, scaling_factor: float) -> None:
        torch.manual_seed(seed)
        for _, param in self.named_parameters_to_optim:
            z = torch.normal(
                mean=0, std=1, size=param.data.size(), device=param.device, dtype=param.dtype
            )
            param.data = param.data + scaling_factor * z * self.eps

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        self.model.eval()
        with torch.inference_mode():
            device = next(self.model.parameters()).device
            loss = self.model(**{k: v.to(device) for k, v in batch.items()}).loss
        return loss.detach()

    def update(self, seed: int, projected_grad: float) -> None:
        torch.manual_seed(seed)
        for name, param in self.named_parameters_to_optim:
            z = torch.normal(
                mean=0, std=1, size=param.data.size(), device=param.device, dtype=param.dtype
            )
            if "bias" not in name and "layer_norm" not in name and "layernorm" not in name:
                param.data = param.data - self.lr * (
                    projected_grad * z + self.weight_decay * param.data
                )
            else:
                param.data = param.data - self.lr * (projected_grad * z)
