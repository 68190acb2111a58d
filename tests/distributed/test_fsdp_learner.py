"""The GRPO learner data-parallel over 2 gloo ranks (FSDP2) against the same learner in one
process, on the same fixed trajectories.

One pair of processes runs every loss type (start-up is most of the cost): each builds the same
tiny Llama, takes 2 learner steps on 2 synthetic batches, and rank 0 saves the weights; this
process runs the single-process learner on the same batches and compares. The same pair then
runs 4 dapo steps with sharded checkpoints (torch.distributed.checkpoint) at steps 1 and 2, and
resumes a fresh learner from step 2; this process loads that checkpoint too, for evaluation and
to resume on one process. Equality within 1e-6
holds only if each rank's loss is its exact share of the whole step's loss and FSDP sums the
shares: a mean over ranks, a local normalisation or a lost micro-batch is off by far more.
Another pair checks that a rank killed mid-step ends the other with a named `RankError`.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from leantrain.distributed import RankError, join, leave
from leantrain.distributed.launch import free_port, spawn_ranks
from leantrain.errors import LeantrainError
from leantrain.models import load_sharded_weights
from leantrain.rl.config import RLConfig
from leantrain.rl.learner import Learner
from leantrain.rl.packing import pack, packed_logprobs
from leantrain.rl.trajectory import Trajectory
from leantrain.training.run_folder import RunFolder

# Each case's GRPO settings: every loss type, then the paths one pass without KL skips (the
# frozen reference, sharded too; a no-grad proximal forward per micro-batch before 2 passes).
CASES: dict[str, dict] = {
    "grpo": {"loss_type": "grpo"},
    "dr_grpo": {"loss_type": "dr_grpo"},
    "dapo": {"loss_type": "dapo"},
    "bnpo": {"loss_type": "bnpo"},
    "dapo_kl_two_passes": {"loss_type": "dapo", "beta": 0.04, "num_iterations": 2},
}
STEPS = 2
RESUME_STEPS, SAVED_AT = 4, 2  # the checkpointed run: saved at steps 1 and 2, keeping 1
PROMPTS, GROUP = 4, 4  # 16 trajectories a step, dealt to 2 ranks as 5 micro-batches
JOIN_TIMEOUT_S = 240
# One pytest worker runs the module (`make test`: --dist loadgroup), so its ranks spawn once.
pytestmark = pytest.mark.xdist_group("fsdp-learner")


def _model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=True,  # the root FSDP unit holds both ends of the tied weight
    )
    config._attn_implementation = "sdpa"
    return LlamaForCausalLM(config).float().eval()


def _config(case: str, steps: int = STEPS) -> RLConfig:
    return RLConfig(
        steps=steps,
        device="cpu",
        grpo={
            "prompts_per_step": PROMPTS,
            "group_size": GROUP,
            "lr": 1e-3,
            "warmup_steps": 0,
            **CASES[case],
            "mask_truncated": True,
            "micro_batch_tokens": 48,
        },
        sampling={"max_new_tokens": 16, "temperature": 1.0},
    )


def _batches() -> list[list[Trajectory]]:
    """RESUME_STEPS batches (the loss-type cases train on the first STEPS) of random prompts
    and responses of uneven lengths, with environment tokens (mask 0), truncated responses and
    behaviour logprobs a little off the model's own (so some ratios leave the clip range)."""
    g = torch.Generator().manual_seed(1)
    model = _model()
    batches = []
    for _ in range(RESUME_STEPS):
        rows = []
        for i in range(PROMPTS * GROUP):
            p, r = (int(n) for n in torch.randint(3, 17, (2,), generator=g))
            response = torch.randint(1, 64, (r,), generator=g).tolist()
            mask = [0 if j % 5 == 3 else 1 for j in range(r)]
            rows.append(
                Trajectory(
                    prompt_ids=torch.randint(1, 64, (p,), generator=g).tolist(),
                    response_ids=response,
                    logprobs=[0.0] * r,
                    versions=[0] * r,
                    loss_mask=mask,
                    finish_reason="length" if i % 7 == 6 else "stop",
                    reward=float(torch.rand((), generator=g) < 0.5),
                    group_id=i // GROUP,
                )
            )
        with torch.no_grad():
            packed = pack(rows, torch.zeros(len(rows)))
            own = packed_logprobs(model, packed)
        noisy = own + 0.3 * torch.randn(own.shape, generator=g)
        for row, lp in zip(rows, noisy.split([len(t.response_ids) for t in rows]), strict=True):
            row.logprobs = lp.tolist()
        batches.append(rows)
    return batches


def _join(timeout_s: float):
    torch.set_num_threads(1)
    return join(torch.device("cpu"), timeout_s=timeout_s)


def _rank_train(rank: int, batches: list[list[Trajectory]], out: str) -> None:
    world = _join(timeout_s=60)
    for case in CASES:
        learner = Learner(_config(case), _model(), torch.device("cpu"), world)
        stats = [learner.step(batch if world.is_main else None) for batch in batches[:STEPS]]
        if world.is_main:
            weights = {k: v.clone() for k, v in learner.policy.state_dict().items()}
            torch.save({"weights": weights, "stats": stats}, Path(out) / f"{case}.pt")
    # Resume: 4 steps, checkpointed (every rank) at steps 1 and 2 keeping 1; a fresh learner
    # loads step 2 (every rank) and takes steps 3 and 4.
    root = Path(out) / "checkpoints"
    straight = Learner(_config("dapo", RESUME_STEPS), _model(), torch.device("cpu"), world)
    for step, batch in enumerate(batches, start=1):
        straight.step(batch if world.is_main else None)
        if step <= SAVED_AT:
            path = straight.save(root, keep=1, state={"accuracy_before": 0.5})
            assert (path is not None) == world.is_main
        if step == SAVED_AT and world.is_main:
            torch.save(straight.policy.state_dict(), Path(out) / "saved.pt")
    resumed = Learner(_config("dapo", RESUME_STEPS), _model(), torch.device("cpu"), world)
    state = resumed.load(root / f"step-{SAVED_AT:06d}")
    assert (resumed.steps, resumed.version, state["accuracy_before"]) == (SAVED_AT, SAVED_AT, 0.5)
    for batch in batches[SAVED_AT:]:
        resumed.step(batch if world.is_main else None)
    # A one-process checkpoint (written by the test process at step 1) resumed on 2 ranks.
    from_one = Learner(_config("dapo"), _model(), torch.device("cpu"), world)
    from_one.load(Path(out) / "one" / "step-000001")
    from_one.step(batches[1] if world.is_main else None)
    if world.is_main:
        torch.save(straight.policy.state_dict(), Path(out) / "straight.pt")
        torch.save(resumed.policy.state_dict(), Path(out) / "resumed.pt")
        torch.save(from_one.policy.state_dict(), Path(out) / "from_one.pt")
    # Both ranks done before either tears the group down (a run ends on a checkpoint's barrier).
    torch.distributed.barrier()
    leave()


def _rank_killed(rank: int, batches: list[list[Trajectory]], out: str) -> None:
    world = _join(timeout_s=30)
    learner = Learner(_config("dapo"), _model(), torch.device("cpu"), world)
    if rank == 1:  # dies inside its second micro-batch's forward, mid-step
        import leantrain.rl.learner as learner_module

        calls = []
        real = learner_module.packed_logprobs

        def dying(*args, **kwargs):
            calls.append(1)
            if len(calls) == 2:
                os._exit(3)
            return real(*args, **kwargs)

        learner_module.packed_logprobs = dying
    start = time.monotonic()
    try:
        learner.step(batches[0] if world.is_main else None)
    except RankError as e:
        (Path(out) / "error.txt").write_text(f"{time.monotonic() - start:.1f}\n{e}")


def _spawn(target, batches: list[list[Trajectory]], out: Path) -> list[int | None]:
    """Run `target` on 2 ranks; their exit codes (None: still running after the timeout)."""
    return spawn_ranks(target, (batches, str(out)), JOIN_TIMEOUT_S)


@pytest.fixture(scope="module")
def batches() -> list[list[Trajectory]]:
    return _batches()


@pytest.fixture(scope="module")
def two_ranks(batches: list[list[Trajectory]], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The folder where the ranks of `_rank_train` left their weights (and, first, a one-process
    checkpoint of 1 dapo step for them to resume from)."""
    out = tmp_path_factory.mktemp("ranks")
    torch.set_num_threads(1)
    one = Learner(_config("dapo"), _model(), torch.device("cpu"))
    one.step(batches[0])
    one.save(out / "one", keep=1, state={})
    assert _spawn(_rank_train, batches, out) == [0, 0]
    return out


def test_two_ranks_equal_one_process_for_every_loss_type(
    batches: list[list[Trajectory]], two_ranks: Path
) -> None:
    torch.set_num_threads(1)
    start = _model().state_dict()
    for case in CASES:
        learner = Learner(_config(case), _model(), torch.device("cpu"))
        stats = [learner.step(batch) for batch in batches[:STEPS]]
        two = torch.load(two_ranks / f"{case}.pt")
        assert learner.version == STEPS * CASES[case].get("num_iterations", 1)
        for name, weight in learner.model.state_dict().items():
            moved = (weight - start[name]).abs().max().item()
            diff = (weight - two["weights"][name]).abs().max().item()
            assert moved > 1e-4, f"{case}: {name} did not train ({moved})"
            assert diff <= 1e-6, f"{case}: {name} differs by {diff} on 2 ranks"
        for one_step, two_step in zip(stats, two["stats"], strict=True):
            assert two_step.keys() == one_step.keys()
            for key, value in one_step.items():
                assert two_step[key] == pytest.approx(value, rel=1e-5, abs=1e-7), key


def test_two_rank_resume_equals_a_straight_two_rank_run(two_ranks: Path) -> None:
    """4 steps with a sharded checkpoint at step 2; a fresh learner resumes from it for steps 3
    and 4: the same weights as the straight run, bit for bit."""
    straight = torch.load(two_ranks / "straight.pt")
    resumed = torch.load(two_ranks / "resumed.pt")
    assert straight.keys() == resumed.keys()
    for name, weight in straight.items():
        assert torch.equal(weight, resumed[name]), name


def test_a_one_process_checkpoint_resumes_on_two_ranks(two_ranks: Path) -> None:
    """1 step in one process, resumed on 2 ranks for step 2: the straight 2-rank run's weights
    within 1e-6 (one process and 2 ranks differ by float summation order only)."""
    straight = torch.load(two_ranks / "dapo.pt")["weights"]
    resumed = torch.load(two_ranks / "from_one.pt")
    for name, weight in straight.items():
        assert (weight - resumed[name]).abs().max().item() <= 1e-6, name


def test_a_two_rank_checkpoint_is_sharded_and_rotated(two_ranks: Path) -> None:
    """Each rank wrote its own shards and RNG state, nothing gathered; keep=1 left step 2."""
    [checkpoint] = (two_ranks / "checkpoints").iterdir()
    assert checkpoint.name == f"step-{SAVED_AT:06d}"
    files = {p.name for p in checkpoint.iterdir()}
    shards = {".metadata", "__0_0.distcp", "__1_0.distcp", "rng-0.pt", "rng-1.pt"}
    assert shards | {"config.json", "state.json"} <= files
    assert "model.safetensors" not in files and "optimizer.pt" not in files


def test_a_two_rank_checkpoint_loads_into_one_process_for_evaluation(two_ranks: Path) -> None:
    """The shards read into a plain model (no process group) are rank 0's gathered weights."""
    torch.set_num_threads(1)
    model = _model()
    load_sharded_weights(two_ranks / "checkpoints" / f"step-{SAVED_AT:06d}", model)
    saved = torch.load(two_ranks / "saved.pt")
    assert saved.keys() == model.state_dict().keys()
    for name, weight in model.state_dict().items():
        assert torch.equal(weight, saved[name]), name


def test_a_two_rank_checkpoint_resumes_on_one_process(
    batches: list[list[Trajectory]], two_ranks: Path
) -> None:
    """DCP reshards: the 2-rank checkpoint at step 2 resumed by one process for steps 3 and 4
    lands within 1e-6 of a straight single-process 4-step run (itself within 1e-6 of 2 ranks)."""
    torch.set_num_threads(1)
    straight = Learner(_config("dapo", RESUME_STEPS), _model(), torch.device("cpu"))
    for batch in batches:
        straight.step(batch)
    resumed = Learner(_config("dapo", RESUME_STEPS), _model(), torch.device("cpu"))
    resumed.load(two_ranks / "checkpoints" / f"step-{SAVED_AT:06d}")
    assert (resumed.steps, resumed.version) == (SAVED_AT, SAVED_AT)
    for batch in batches[SAVED_AT:]:
        resumed.step(batch)
    expected = straight.model.state_dict()
    for name, weight in resumed.model.state_dict().items():
        assert (weight - expected[name]).abs().max().item() <= 1e-6, name


def test_a_half_written_checkpoint_is_never_resumed_from(two_ranks: Path) -> None:
    """A write interrupted before its rename (shards down, no index yet) is skipped on resume,
    and reading it on purpose, or a checkpoint missing a rank's shard, is one named error."""
    root = two_ranks / "checkpoints"
    complete = root / f"step-{SAVED_AT:06d}"
    partial = root / f"step-{SAVED_AT + 1:06d}.partial"
    shutil.copytree(complete, partial)
    (partial / ".metadata").unlink()
    assert RunFolder.open(two_ranks, resume=True).last_checkpoint() == complete
    learner = Learner(_config("dapo", RESUME_STEPS), _model(), torch.device("cpu"))
    with pytest.raises(LeantrainError, match="corrupt checkpoint"):
        learner.load(partial)
    shutil.rmtree(partial)
    broken = two_ranks / "broken"
    shutil.copytree(complete, broken)
    (broken / "__1_0.distcp").unlink()
    with pytest.raises(LeantrainError, match=f"corrupt checkpoint {broken}"):
        learner.load(broken)


def test_a_killed_rank_ends_the_run_with_a_named_error(
    batches: list[list[Trajectory]], tmp_path: Path
) -> None:
    start = time.monotonic()
    codes = _spawn(_rank_killed, batches, tmp_path)
    assert codes == [0, 3]  # rank 0 caught the RankError and returned; rank 1 died
    assert time.monotonic() - start < 60
    seconds, message = (tmp_path / "error.txt").read_text().split("\n", 1)
    assert float(seconds) < 60
    assert message.startswith("rank 0 of 2: learner step 1 failed: a peer rank")


def test_a_missing_rank_is_named_at_the_rendezvous(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 0 of 2 alone: the rendezvous gives up after its timeout with a named error."""
    port = free_port()
    env = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1"}
    for key, value in {**env, "MASTER_PORT": str(port)}.items():
        monkeypatch.setenv(key, value)
    start = time.monotonic()
    expected = rf"^rank 0 of 2: joining the process group at 127\.0\.0\.1:{port} failed"
    with pytest.raises(RankError, match=expected):
        join(torch.device("cpu"), timeout_s=5)
    assert time.monotonic() - start < 30  # the 5 s timeout, not a hang
    assert not torch.distributed.is_initialized()
