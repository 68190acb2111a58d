"""`leantrain tune` data-parallel over 2 gloo ranks (FSDP2) against the same run in one process.

One pair of processes runs every case (start-up is most of the cost): each rank takes the path
`leantrain tune` takes under torchrun (`cli.tune.step_hooks` joins the group and returns the
data-parallel hooks), runs 2 steps of `SFTRun` on the tiny model, and rank 0 saves its evaluation
copy's weights (the trained ones, gathered) and the run folder. This process runs each case in
one process on the same global batches and compares. The batch of 4 is dealt 2 rows a rank, in
2 chunks a rank (1 row each) against 2 chunks of 2 rows in one process. Full fine-tuning runs
once in fp32 and once with the model in float64, where equality within 1e-12 holds only if each
rank's loss is divided by the whole batch's token count and FSDP sums the ranks' gradients: a
mean over ranks or a per-rank normalisation is off by far more.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import NamedTuple

import pytest
import torch
from float64_hooks import Float64, Float64Parallel
from typer.testing import CliRunner

from leantrain.cli import app
from leantrain.cli.tune import step_hooks
from leantrain.distributed import DataParallelHooks, leave
from leantrain.distributed.launch import spawn_ranks
from leantrain.errors import LeantrainError
from leantrain.memory.config import TuneConfig
from leantrain.memory.sft import SFTRun
from leantrain.settings import load_settings


class Case(NamedTuple):
    method: str
    settings: dict
    bound: float  # on the max |weight difference| after 2 steps
    float64: bool = False  # the model in float64 (settings offer no float64)


# In fp32, rounding alone moves weights by about this much: the two runs split the batch into
# different chunks (different matmul shapes), and AdamW turns a gradient element that is mostly
# rounding noise (e.g. k_proj's direction that softmax ignores) into a full lr-sized step. One
# process against itself, chunks 2 vs 1, differs by 3.1e-6 (full) and 2.1e-6 (lora); 2 ranks
# measured 8.4e-7 on one host and 1.7e-6 on another (full), 1.7e-6 to 2.6e-6 (lora), 2.6e-6 to
# 3.2e-6 (lars). float64 shows the step is the same step (measured 3.1e-15), as in
# test_sequence_data_parallel_tune.py. LARS keeps each rank's own activation subspace (as each
# chunk's in one process), so it equals one process only at a rank >= every width.
CASES: dict[str, Case] = {
    "full": Case("full", {}, 5e-6),
    "full_float64": Case("full", {}, 1e-12, float64=True),
    "lora": Case("lora", {}, 5e-6),
    "lars": Case("lars", {"lars.rank": 512}, 5e-6),  # the tiny model's widths: 128 and 512
}
JOIN_TIMEOUT_S = 240
# One pytest worker runs the module (`make test`: --dist loadgroup), so its ranks spawn once.
pytestmark = pytest.mark.xdist_group("data-parallel-tune")


def _config(case: str, out: Path) -> TuneConfig:
    return load_settings(
        TuneConfig,
        None,
        **CASES[case].settings,
        method=CASES[case].method,
        task="arith",
        task_options={"max_items": 4},
        steps=2,
        batch_size=4,
        chunks=2,
        lr=1e-3,
        warmup_steps=0,
        eval_size=2,
        max_new_tokens=4,
        log_completions=1,
        device="cpu",
        out=out,
        **{"distributed.timeout_s": 120},
    )


def _rank(rank: int, out: str) -> None:
    torch.set_num_threads(1)
    for case in CASES:
        cfg = _config(case, Path(out) / case)
        hooks = step_hooks(cfg)  # what `torchrun -m leantrain tune` does on every rank
        assert isinstance(hooks, DataParallelHooks) and hooks.world.size == 2
        if CASES[case].float64:
            hooks = Float64Parallel(hooks.world)
        SFTRun(cfg, hooks=hooks, progress=False).run()
        if hooks.is_main:
            weights = {k: v.clone() for k, v in hooks.policy.state_dict().items()}
            torch.save(weights, Path(out) / f"{case}.pt")
    leave()


@pytest.fixture(scope="module")
def two_ranks(tiny_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The folder where rank 0 left each case's weights and run folder."""
    out = tmp_path_factory.mktemp("ranks")
    codes = spawn_ranks(_rank, (str(out),), JOIN_TIMEOUT_S)
    assert codes == [0, 0]
    return out


@pytest.mark.parametrize("case", list(CASES))
def test_two_ranks_equal_one_process(two_ranks: Path, tmp_path: Path, case: str) -> None:
    torch.set_num_threads(1)
    hooks = Float64() if CASES[case].float64 else None
    one = SFTRun(_config(case, tmp_path / "one"), hooks=hooks, progress=False)
    start = {k: v.clone() for k, v in one.model.state_dict().items()}
    one.run()
    two = torch.load(two_ranks / f"{case}.pt")
    assert two.keys() == start.keys()
    weights = one.model.state_dict()
    moved = {name: (w - start[name]).abs().max().item() for name, w in weights.items()}
    diffs = {name: (w - two[name]).abs().max().item() for name, w in weights.items()}
    worst = max(diffs, key=diffs.get)
    assert diffs[worst] <= CASES[case].bound, f"{case}: {worst} differs by {diffs[worst]}"
    params = dict(one.model.named_parameters())
    assert all(moved[n] > 1e-4 for n, p in params.items() if p.requires_grad), "one did not train"
    assert all(moved[n] == 0 for n, p in params.items() if not p.requires_grad), "a frozen moved"
    # Rank 0 wrote the whole run folder, with the whole step's loss and padded tokens.
    folder = two_ranks / case
    for name in ("metrics.jsonl", "metrics.png", "completions.jsonl", "summary.json"):
        assert (folder / name).exists(), name
    records = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    for mine, theirs in zip(one.metrics.read(), records, strict=True):
        for key in ("loss", "grad_norm"):  # the whole step's, not a rank's share or mean
            assert theirs[key] == pytest.approx(mine[key], rel=1e-5), key
    summary = json.loads((folder / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["trainable_parameters"] == sum(
        p.numel() for p in one.trainable
    )


runner = CliRunner()


def test_a_rank_count_that_does_not_divide_the_batch_is_refused() -> None:
    args = ["tune", "--nproc-per-node", "3", "-o", "batch_size=4", "--device", "cpu"]
    result = runner.invoke(app, args)  # refused before anything is launched
    assert result.exit_code == 2
    assert "batch_size 4 is not a multiple of the 3 data-parallel ranks" in result.output


def test_torchrun_settings_that_disagree_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    env = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "3", "MASTER_ADDR": "127.0.0.1"}
    for key, value in {**env, "MASTER_PORT": "1"}.items():  # refused before any connection
        monkeypatch.setenv(key, value)
    cfg = TuneConfig(batch_size=4)
    with pytest.raises(LeantrainError, match=r"batch_size 4 is not a multiple .* \(WORLD_SIZE\)"):
        step_hooks(cfg)
    with pytest.raises(LeantrainError, match=r"--nproc-per-node 2 but torchrun started 3"):
        step_hooks(TuneConfig(batch_size=6), nproc_per_node=2)
    monkeypatch.setenv("RANK", "3")
    with pytest.raises(LeantrainError, match=r"RANK=3 with WORLD_SIZE=3"):
        step_hooks(TuneConfig(batch_size=6))
    monkeypatch.setenv("WORLD_SIZE", "two")
    with pytest.raises(LeantrainError, match=r"WORLD_SIZE='two' is not an integer"):
        step_hooks(TuneConfig(batch_size=6))
