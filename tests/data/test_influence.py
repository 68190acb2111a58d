"""TracIn: per-example gradients from torch.func equal a loop of ordinary backward passes, the
projection keeps inner products in expectation, and the scores match a hand computation."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from leantrain.data.influence import (
    Checkpoint,
    GradientProjector,
    per_example_gradients,
    select_parameters,
    sgd_checkpoints,
    tracin,
)
from leantrain.errors import LeantrainError
from leantrain.models import load_model
from leantrain.models.finetune import IGNORE


def head_loss(forward, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(forward(x[None]), y[None])


def lm_loss(forward, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return forward(input_ids=ids[None], labels=labels[None], use_cache=False).loss


def loop_gradients(model, names, loss_fn, inputs) -> torch.Tensor:
    """Reference: one backward per sample, gradients flattened in `names` order."""
    params = dict(model.named_parameters())
    rows = []
    for i in range(len(inputs[0])):
        loss = loss_fn(model, *[x[i] for x in inputs])
        grads = torch.autograd.grad(loss, [params[n] for n in names])
        rows.append(torch.cat([g.flatten() for g in grads]))
    return torch.stack(rows)


def test_per_example_gradients_match_a_loop_on_a_head() -> None:
    torch.manual_seed(0)
    head = torch.nn.Linear(5, 3)
    x, y = torch.randn(7, 5), torch.randint(0, 3, (7,))
    names = ["weight", "bias"]
    got = per_example_gradients(
        head, names, head_loss, (x, y), GradientProjector({}, None), chunk=3
    )
    torch.testing.assert_close(got, loop_gradients(head, names, head_loss, (x, y)))


def test_per_example_gradients_match_a_loop_on_the_tiny_lm(tiny_path) -> None:
    model, _ = load_model(tiny_path)
    names = select_parameters(model, "last")
    assert names and all("layers.3." in n or n == "model.norm.weight" for n in names)
    ids = torch.randint(3, 200, (3, 9))
    labels = ids.clone()
    labels[:, :4] = IGNORE
    labels[2, 7:] = IGNORE  # a padded row
    got = per_example_gradients(model, names, lm_loss, (ids, labels), GradientProjector({}, None))
    torch.testing.assert_close(
        got, loop_gradients(model, names, lm_loss, (ids, labels)), atol=1e-5, rtol=1e-4
    )


def test_projection_keeps_inner_products_in_expectation() -> None:
    """E[<P g1, P g2>] = <g1, g2> for the Kronecker (matrix) and dense (vector) projections."""
    gen = torch.Generator().manual_seed(0)
    g = {"w": torch.randn(2, 6, 5, generator=gen), "b": torch.randn(2, 6, generator=gen)}
    exact = float(sum((t[0] * t[1]).sum() for t in g.values()))
    shapes = {"w": torch.Size([6, 5]), "b": torch.Size([6])}
    estimates = []
    for seed in range(400):
        p = GradientProjector(shapes, k=2, seed=seed)(g)
        assert p.shape == (2, 2 * 2 + 2 * 2)
        estimates.append(float(p[0] @ p[1]))
    assert np.mean(estimates) == pytest.approx(exact, abs=4 * np.std(estimates) / 20)
    # k = 3: the 30-number matrix becomes 3 x 3; the 6-number vector (<= 9) is kept exactly.
    kept = GradientProjector(shapes, k=3)(g)
    assert kept.shape == (2, 9 + 6)
    torch.testing.assert_close(kept[:, 9:], g["b"])
    with pytest.raises(LeantrainError, match=">= 1"):
        GradientProjector(shapes, k=0)


def test_tracin_equals_the_hand_computed_sum_over_checkpoints() -> None:
    """For a linear model with squared loss, grad l = 2 (w.x - y) x, so
    TracIn(z, z') = sum_c w_c 4 (w_c.x - y)(w_c.x' - y') x.x'."""
    model = torch.nn.Linear(3, 1, bias=False)

    def sq_loss(forward, x, y):
        return ((forward(x[None])[0, 0] - y) ** 2).sum()

    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(4, 3, generator=gen), torch.randn(4, generator=gen)
    vx, vy = torch.randn(5, 3, generator=gen), torch.randn(5, generator=gen)
    ckpts = [Checkpoint({"weight": torch.randn(1, 3, generator=gen)}, w) for w in (0.1, 0.3)]
    before = model.weight.detach().clone()
    scores = tracin(model, ckpts, sq_loss, (x, y), (vx, vy))
    value, self_inf = np.zeros(4), np.zeros(4)
    for c in ckpts:
        w = c.params["weight"][0]
        g = (2 * (x @ w - y))[:, None] * x  # (4, 3)
        gv = ((2 * (vx @ w - vy))[:, None] * vx).mean(0)
        value += c.weight * (g @ gv).numpy()
        self_inf += c.weight * (g * g).sum(1).numpy()
    np.testing.assert_allclose(scores.value, value, rtol=1e-5)
    np.testing.assert_allclose(scores.self_influence, self_inf, rtol=1e-5)
    torch.testing.assert_close(model.weight, before)  # weights restored


def test_sgd_checkpoints_train_only_the_chosen_parameters_and_flag_flipped_labels() -> None:
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    y = torch.randint(0, 2, (60,), generator=gen)
    x = torch.randn(60, 4, generator=gen) + 2.0 * (2 * y[:, None] - 1)
    noisy = y.clone()
    noisy[:6] = 1 - noisy[:6]
    head = torch.nn.Linear(4, 2)
    bias = head.bias.detach().clone()
    ckpts = sgd_checkpoints(
        head,
        ["weight"],
        head_loss,
        (x, noisy),
        steps=50,
        lr=0.1,
        batch_size=16,
        checkpoint_every=20,
    )
    assert [c.weight for c in ckpts] == pytest.approx([2.0, 2.0, 1.0])  # 20, 20, 10 steps
    assert list(ckpts[0].params) == ["weight"] and head.bias.requires_grad
    torch.testing.assert_close(head.bias.detach(), bias)
    assert not torch.equal(ckpts[0].params["weight"], head.weight)
    scores = tracin(head, ckpts, head_loss, (x, noisy), (x[30:], y[30:]), projection=1)
    assert set(np.argsort(scores.value)[:6]) == set(range(6))
    assert set(np.argsort(-scores.self_influence)[:6]) == set(range(6))


def test_select_parameters_by_regex_and_bad_patterns(tiny_path) -> None:
    model, _ = load_model(tiny_path)
    assert select_parameters(model, r"lm_head|embed_tokens") == ["model.embed_tokens.weight"]
    assert len(select_parameters(model, "all")) == len(list(model.parameters()))
    with pytest.raises(LeantrainError, match="matches no parameter"):
        select_parameters(model, "lora_")
    with pytest.raises(LeantrainError, match="not a regular expression"):
        select_parameters(model, "(")
