"""What valuation asks of the language model: token ids for prompt/answer rows, sentence
features (mean-pooled hidden states of one layer), and a utility that retrains a small head on
those features. Knows nothing about Shapley or pricing.

Rows are encoded as raw text (no chat template): valuation scores the data as it is, and a
classifier head on a base model's features needs no instruction format.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch
from sklearn.decomposition import PCA
from sklearn.linear_model import LogisticRegression
from sklearn.preprocessing import StandardScaler
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from leantrain.errors import LeantrainError


def encode_rows(
    tokenizer: PreTrainedTokenizerBase, prompts: Sequence[str], answers: Sequence[str]
) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, answer ids) per row; the prompt starts with BOS when the tokenizer has one,
    so that the first text token is predicted too."""
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    return [
        (
            bos + tokenizer.encode(p, add_special_tokens=False),
            tokenizer.encode(a, add_special_tokens=False),
        )
        for p, a in zip(prompts, answers, strict=True)
    ]


def padded(seqs: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ids (B, T) and their attention mask (B, T)."""
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for row, s in enumerate(seqs):
        ids[row, : len(s)] = torch.tensor(s, dtype=torch.long)
        mask[row, : len(s)] = 1
    return ids, mask


class _Stop(Exception):
    """Raised by a forward hook once the wanted layer has run: later layers are skipped."""

    def __init__(self, hidden: torch.Tensor) -> None:
        self.hidden = hidden


@torch.inference_mode()
def embed(
    model: PreTrainedModel,
    seqs: Sequence[Sequence[int]],
    pad_id: int,
    layer: int | None = None,
    batch_size: int = 32,
    on_batch: Callable[[int], None] | None = None,
) -> np.ndarray:
    """Mean over its tokens of the hidden state after decoder layer `layer` (1-based; default
    the middle one), one row per sequence: (N, hidden). Middle layers carry more linearly
    decodable sentence content than the last, which is specialised to predicting the next token,
    and stopping there halves the forward."""
    layers = getattr(model.get_decoder(), "layers", None)
    if layers is None:
        raise LeantrainError(f"{type(model).__name__} has no decoder layers to take features from")
    layer = len(layers) // 2 if layer is None else layer
    if not 1 <= layer <= len(layers):
        raise LeantrainError(f"features layer must be in 1..{len(layers)}, got {layer}")

    def stop(module: torch.nn.Module, args: object, output: object) -> None:
        raise _Stop(output[0] if isinstance(output, tuple) else output)

    device = next(model.parameters()).device
    hook = layers[layer - 1].register_forward_hook(stop)
    out = []
    try:
        for start in range(0, len(seqs), batch_size):
            ids, mask = padded(seqs[start : start + batch_size], pad_id)
            try:
                model(input_ids=ids.to(device), attention_mask=mask.to(device), use_cache=False)
                raise RuntimeError("the feature layer's hook did not run")
            except _Stop as stopped:
                hidden = stopped.hidden.float()  # (B, T, H)
            m = mask.to(device)[..., None].float()
            out.append(((hidden * m).sum(1) / m.sum(1)).cpu())
            if on_batch is not None:
                on_batch(len(ids))
    finally:
        hook.remove()
    return torch.cat(out).numpy()


class HeadUtility:
    """Validation accuracy of a logistic-regression head retrained on a subset of the training
    features: the utility every Shapley estimator and leave-one-out values against.

    Features are standardised, reduced by PCA to `components` dimensions and whitened (unit
    variance, so neither the L2 penalty nor an SGD step favours the first components), all
    fitted on the training features without labels: no subset sees its own statistics, and a fit
    (liblinear, fast for a few hundred rows) takes about a millisecond. With no samples the
    utility is chance, 1 / classes; with one class present the head predicts that class.
    """

    def __init__(
        self,
        train_x: np.ndarray,
        train_y: np.ndarray,
        valid_x: np.ndarray,
        valid_y: np.ndarray,
        components: int = 32,
        c: float = 1.0,
    ) -> None:
        scaler = StandardScaler().fit(train_x)
        dims = min(components, *train_x.shape)
        self.pca = PCA(dims, whiten=True, random_state=0).fit(scaler.transform(train_x))
        self._scaler = scaler
        self.train_x = self.transform(train_x)
        self.valid_x = self.transform(valid_x)
        self.train_y, self.valid_y = np.asarray(train_y), np.asarray(valid_y)
        self.classes = np.unique(np.concatenate([self.train_y, self.valid_y]))
        self.c = c

    def transform(self, x: np.ndarray) -> np.ndarray:
        return self.pca.transform(self._scaler.transform(x))

    def fit(self, indices: np.ndarray) -> LogisticRegression | object:
        """The head trained on `indices` (a constant predictor when they hold one class)."""
        labels = self.train_y[indices]
        if len(np.unique(labels)) < 2:
            return _Constant(labels[0])
        return LogisticRegression(C=self.c, solver="liblinear").fit(self.train_x[indices], labels)

    def accuracy(self, indices: np.ndarray, x: np.ndarray, y: np.ndarray) -> float:
        if len(indices) == 0:
            return 1.0 / len(self.classes)
        return float(np.mean(self.fit(indices).predict(x) == y))

    def __call__(self, indices: np.ndarray) -> float:
        return self.accuracy(np.asarray(indices, dtype=np.int64), self.valid_x, self.valid_y)


class _Constant:
    """The head of a one-class training subset."""

    def __init__(self, label: object) -> None:
        self.label = label

    def predict(self, x: np.ndarray) -> np.ndarray:
        return np.full(len(x), self.label)
