"""`leantrain tune` over 4 gloo ranks as 2 data-parallel groups x 2 sequence-parallel ranks
(FSDP2 over all 4, Ulysses attention inside each group) against the same run in one process.

Each rank takes the path `leantrain tune --nproc-per-node 4 --sequence-parallel 2` takes under
torchrun (`cli.tune.step_hooks`), runs 2 steps of `SFTRun` on the tiny model (4 heads: 2 a rank
inside the all-to-all), and rank 0 saves its evaluation copy's weights (the trained ones,
gathered) and the run folder. This process runs one process on the same global batches and
compares. The batch of 4 rows goes 2 rows to each group, in 2 chunks of 1 row, and each rank of a
group scores half of every row's positions; one process runs 2 chunks of 2 rows. Both runs go
once in fp32 and once with the model in float64. Equality holds only if the loss is divided by
the whole batch's labelled tokens (not a group's, nor a rank's, nor counted twice by a group's 2
ranks), labels are shifted before the row is split, and FSDP sums all 4 ranks' gradients: a
token or row in the wrong place moves the weights, and a uniform scale (which AdamW's update
would hide) moves the logged grad_norm, far beyond either bound.

The refusals (a sequence-parallel size that does not divide the ranks, the model's heads, or
groups that do not divide the batch) need no second process.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from float64_hooks import Float64, Float64Parallel
from typer.testing import CliRunner

from leantrain.cli import app
from leantrain.cli.tune import step_hooks
from leantrain.distributed import DataParallelHooks, World, leave
from leantrain.distributed.launch import spawn_ranks
from leantrain.errors import LeantrainError
from leantrain.memory.config import TuneConfig
from leantrain.memory.sft import SFTRun
from leantrain.settings import load_settings

RANKS, SP = 4, 2
# Each dtype's bound on the max |weight difference| after 2 steps. fp32: rounding alone moves
# weights by about this much (different matmul shapes, and AdamW turning a gradient element that
# is mostly rounding noise into a full lr-sized step): one process against itself, chunks 2 vs 1,
# differs by 3.1e-6 (tests/distributed/test_data_parallel_tune.py, which holds its lora and lars
# cases to 5e-6); these 4 ranks measured 3.0e-6. float64 shows the step is the same step:
# measured 2.6e-15, where a wrong normalisation or a token scored twice is off by far more.
CASES = {"float32": 5e-6, "float64": 1e-12}
JOIN_TIMEOUT_S = 420
# One pytest worker runs the module (`make test`: --dist loadgroup), so its ranks spawn once.
pytestmark = pytest.mark.xdist_group("sequence-data-parallel-tune")


def _config(out: Path) -> TuneConfig:
    return load_settings(
        TuneConfig,
        None,
        method="full",
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
        **{"distributed.timeout_s": 240, "distributed.sequence_parallel_size": SP},
    )


def _rank(rank: int, out: str) -> None:
    torch.set_num_threads(1)
    for dtype in CASES:
        cfg = _config(Path(out) / dtype)
        hooks = step_hooks(cfg, nproc_per_node=RANKS)  # what `--nproc-per-node 4` does
        assert isinstance(hooks, DataParallelHooks) and hooks.groups == RANKS // SP
        if dtype == "float64":
            hooks = Float64Parallel(hooks.world, SP)
        SFTRun(cfg, hooks=hooks, progress=False).run()
        assert hooks.sequence is not None
        if hooks.is_main:
            weights = {k: v.clone() for k, v in hooks.policy.state_dict().items()}
            torch.save(weights, Path(out) / f"{dtype}.pt")
    leave()


@pytest.fixture(scope="module")
def four_ranks(tiny_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The folder where rank 0 left each case's weights and run folder."""
    out = tmp_path_factory.mktemp("ranks")
    assert spawn_ranks(_rank, (str(out),), JOIN_TIMEOUT_S, RANKS) == [0] * RANKS
    return out


@pytest.mark.slow
@pytest.mark.parametrize("dtype", list(CASES))
def test_two_groups_of_two_sequence_ranks_equal_one_process(
    four_ranks: Path, tmp_path: Path, dtype: str
) -> None:
    torch.set_num_threads(1)
    hooks = Float64() if dtype == "float64" else None
    one = SFTRun(_config(tmp_path / "one"), hooks=hooks, progress=False)  # no SP in one process
    start = {k: v.clone() for k, v in one.model.state_dict().items()}
    one.run()
    four = torch.load(four_ranks / f"{dtype}.pt")
    assert four.keys() == start.keys()
    weights = one.model.state_dict()
    moved = {name: (w - start[name]).abs().max().item() for name, w in weights.items()}
    diffs = {name: (w - four[name]).abs().max().item() for name, w in weights.items()}
    worst = max(diffs, key=diffs.get)
    assert diffs[worst] <= CASES[dtype], f"{dtype}: {worst} differs by {diffs[worst]}"
    assert all(m > 1e-4 for m in moved.values()), "one process did not train"
    # Rank 0 wrote the run folder, with the whole step's loss and gradient norm.
    folder = four_ranks / dtype
    records = [json.loads(line) for line in (folder / "metrics.jsonl").open()]
    for mine, theirs in zip(one.metrics.read(), records, strict=True):
        for key in ("loss", "grad_norm"):
            assert theirs[key] == pytest.approx(mine[key], rel=1e-5), key
    assert json.loads((folder / "summary.json").read_text())["steps"] == 2


runner = CliRunner()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--nproc-per-node", "3", "--sequence-parallel", "2"],
            r"--sequence-parallel = 2 must divide the number of ranks \(3\)",
        ),
        (
            ["--nproc-per-node", "6", "-o", "distributed.sequence_parallel_size=4"],
            r"distributed.sequence_parallel_size = 4 must divide the number of ranks \(6\)",
        ),
        (
            ["--nproc-per-node", "4", "--sequence-parallel", "2", "-o", "batch_size=3"],
            r"batch_size 3 is not a multiple of the 2 data-parallel groups \(4 ranks "
            r"\(--nproc-per-node\) / --sequence-parallel 2\)",
        ),
    ],
)
def test_ranks_the_sequence_parallel_size_cannot_split_are_refused(
    args: list[str], message: str
) -> None:
    result = runner.invoke(app, ["tune", *args, "--device", "cpu"])  # before any launch
    assert result.exit_code == 2
    assert re.search(message, " ".join(result.output.split())), result.output


def test_a_head_count_the_sequence_parallel_size_does_not_divide_is_refused(
    model: torch.nn.Module, tok
) -> None:
    hooks = DataParallelHooks(World(0, 6, torch.device("cpu")), 3)  # the tiny model has 4 heads
    with pytest.raises(
        LeantrainError,
        match=r"distributed.sequence_parallel_size 3 does not "
        r"divide the model's 4 attention heads; valid sizes: \[1, 2, 4\]",
    ):
        hooks.attach(model, tok)  # refused before any collective: no process group needed
