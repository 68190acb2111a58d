"""The GRPO learner sequence-parallel (Ulysses, `distributed.sequence_parallel_size: 2`) on 2
gloo ranks against the same learner in one process (SP=1), on the same fixed trajectories.

One pair of processes runs every case (start-up is most of the cost): each rank builds the same
tiny model, takes 2 learner steps with SP=2, records the full gradient at every optimizer step,
and rank 0 saves them with the step stats; this process runs the single-process learner on the
same batches and compares, in fp32: every gradient element within 1e-6 absolute (measured: 1.6e-7
at most; 3e-17 in float64) and the loss and the other stats within 1e-6 relative.
That holds only if each rank scores exactly its own tokens, attention never crosses a packed
sequence's boundary (nor reaches the padding), and the loss divides by the micro-batch's global
counts: a rank-local normalisation, a leak between packed sequences or a token counted on both
ranks is off by orders of magnitude more. The second step's gradients are taken on weights the
first SP step updated, so the update path is covered too. The weights themselves are not held to
1e-6: Adam divides by sqrt(v), so on gradient elements near zero the 1e-7 rounding noise of a
different attention kernel order becomes weight differences near 1e-5 after 2 steps at lr 1e-3.

The same pair then checks that a head count SP=2 does not divide is refused on both ranks with
an error naming the setting, before any collective (so neither rank waits for the other). The
other refusals (a rank count SP does not divide, in the learner and in a run before it connects)
and the row split need no second process.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.distributed.tensor import DTensor
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from leantrain.distributed import World, join, leave, shard_row
from leantrain.distributed.launch import spawn_ranks
from leantrain.distributed.ulysses import sequence_lengths
from leantrain.errors import LeantrainError
from leantrain.rl.config import RLConfig
from leantrain.rl.grpo import GRPORun
from leantrain.rl.learner import Learner
from leantrain.rl.trajectory import Trajectory

# Each case: the model family (with its KV heads) and the GRPO settings. Llama's 2 KV heads are
# split over the 2 ranks; Qwen2's single KV head is repeated to every query head before the
# swap. The second case also runs the frozen reference and the no-grad proximal forwards.
CASES: dict[str, tuple[str, int, dict]] = {
    "llama_dapo": ("llama", 2, {"loss_type": "dapo"}),
    "qwen2_grpo_kl_two_passes": (
        "qwen2",
        1,
        {"loss_type": "grpo", "beta": 0.04, "num_iterations": 2},
    ),
}
STEPS = 2
PROMPTS, GROUP = 2, 4  # 8 trajectories a step
BUDGET = 48  # micro_batch_tokens
TOLERANCE = 1e-6  # fp32
JOIN_TIMEOUT_S = 240
# One pytest worker runs the module (`make test`: --dist loadgroup), so its ranks spawn once.
pytestmark = pytest.mark.xdist_group("sequence-parallel-learner")


def _model(family: str, kv_heads: int, heads: int = 4) -> torch.nn.Module:
    torch.manual_seed(0)
    kind, model = {
        "llama": (LlamaConfig, LlamaForCausalLM),
        "qwen2": (Qwen2Config, Qwen2ForCausalLM),
    }[family]
    config = kind(
        vocab_size=64,
        hidden_size=8 * heads,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=128,
        tie_word_embeddings=True,
    )
    config._attn_implementation = "sdpa"
    return model(config).float().eval()


def _config(case: str, sequence_parallel: int) -> RLConfig:
    return RLConfig(
        steps=STEPS,
        device="cpu",
        grpo={
            "prompts_per_step": PROMPTS,
            "group_size": GROUP,
            "lr": 1e-3,
            "warmup_steps": 0,
            **CASES[case][2],
            "mask_truncated": True,
            "micro_batch_tokens": BUDGET,
        },
        sampling={"max_new_tokens": 16, "temperature": 1.0},
        distributed={"sequence_parallel_size": sequence_parallel},
    )


def _batches() -> list[list[Trajectory]]:
    """STEPS batches of random prompts and responses of uneven lengths (odd row lengths leave
    the last shard padded), with environment tokens (mask 0), a truncated response, behaviour
    logprobs that make some ratios clip, and one trajectory whose 46-token prompt fills the
    first half of its own micro-batch: rank 0 holds none of that row's response tokens."""
    g = torch.Generator().manual_seed(1)
    batches = []
    for _ in range(STEPS):
        rows = []
        for i in range(PROMPTS * GROUP):
            p, r = (int(n) for n in torch.randint(3, 17, (2,), generator=g))
            p, r = (BUDGET - 2, 2) if i == 0 else (p, r)
            rows.append(
                Trajectory(
                    prompt_ids=torch.randint(1, 64, (p,), generator=g).tolist(),
                    response_ids=torch.randint(1, 64, (r,), generator=g).tolist(),
                    logprobs=(-4.0 + 0.5 * torch.randn(r, generator=g)).tolist(),
                    versions=[0] * r,
                    loss_mask=[0 if j % 5 == 3 else 1 for j in range(r)],
                    finish_reason="length" if i == 5 else "stop",
                    reward=float(torch.rand((), generator=g) < 0.5),
                    group_id=i // GROUP,
                )
            )
        batches.append(rows)
    return batches


def _recording_gradients(learner: Learner) -> list[dict[str, torch.Tensor]]:
    """The full gradients at each of `learner`'s optimizer steps, filled as it steps (gathered
    from FSDP's shards: every rank records, since gathering is a collective)."""
    recorded: list[dict[str, torch.Tensor]] = []
    step = learner.optimizer.step

    def recording(*args, **kwargs):
        recorded.append(
            {
                name: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).clone()
                for name, p in learner.model.named_parameters()
            }
        )
        return step(*args, **kwargs)

    learner.optimizer.step = recording  # type: ignore[method-assign]
    return recorded


def _rank(rank: int, batches: list[list[Trajectory]], out: str) -> None:
    torch.set_num_threads(1)
    world = join(torch.device("cpu"), timeout_s=60)
    for case, (family, kv_heads, _) in CASES.items():
        learner = Learner(_config(case, 2), _model(family, kv_heads), torch.device("cpu"), world)
        gradients = _recording_gradients(learner)
        stats = [learner.step(batch if world.is_main else None) for batch in batches]
        if world.is_main:
            torch.save({"stats": stats, "gradients": gradients}, Path(out) / f"{case}.pt")
    try:  # 3 heads: refused on each rank by itself, before any collective
        Learner(_config("llama_dapo", 2), _model("llama", 1, heads=3), torch.device("cpu"), world)
    except LeantrainError as e:
        (Path(out) / f"refused-{rank}.txt").write_text(str(e))
    leave()


@pytest.fixture(scope="module")
def batches() -> list[list[Trajectory]]:
    return _batches()


@pytest.fixture(scope="module")
def two_ranks(batches: list[list[Trajectory]], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The folder where the 2 ranks left their gradients and stats."""
    out = tmp_path_factory.mktemp("sp")
    codes = spawn_ranks(_rank, (batches, str(out)), JOIN_TIMEOUT_S)
    assert codes == [0, 0]
    return out


@pytest.mark.parametrize("case", CASES)
def test_sp2_equals_one_process(
    case: str, batches: list[list[Trajectory]], two_ranks: Path
) -> None:
    torch.set_num_threads(1)
    family, kv_heads, settings = CASES[case]
    learner = Learner(_config(case, 1), _model(family, kv_heads), torch.device("cpu"))
    gradients = _recording_gradients(learner)
    stats = [learner.step(batch) for batch in batches]
    sp = torch.load(two_ranks / f"{case}.pt")
    assert len(gradients) == len(sp["gradients"]) == STEPS * settings.get("num_iterations", 1)
    for i, (one, two) in enumerate(zip(gradients, sp["gradients"], strict=True)):
        assert one.keys() == two.keys()
        for name, grad in one.items():
            assert grad.abs().max() > 1e-5, f"{case}: {name} got no gradient"
            diff = (grad - two[name]).abs().max().item()
            assert diff <= TOLERANCE, f"{case}: gradient {i} of {name} differs by {diff}"
    for one_step, two_step in zip(stats, sp["stats"], strict=True):
        assert two_step.keys() == one_step.keys()
        for key, value in one_step.items():
            assert two_step[key] == pytest.approx(value, rel=TOLERANCE, abs=1e-7), key


def test_a_head_count_sp_does_not_divide_is_refused_on_every_rank(two_ranks: Path) -> None:
    for rank in range(2):
        message = (two_ranks / f"refused-{rank}.txt").read_text()
        assert message == (
            "distributed.sequence_parallel_size 2 does not divide the model's 3 attention "
            "heads; valid sizes: [1, 3]"
        )


@pytest.mark.parametrize("ranks", [1, 3])
def test_a_rank_count_sp_does_not_divide_is_refused(ranks: int) -> None:
    """Before any collective: no process group is needed to be refused."""
    world = World(0, ranks, torch.device("cpu"), "gloo" if ranks > 1 else "none")
    expected = (
        rf"^distributed\.sequence_parallel_size = 2 must divide the number of ranks \({ranks}\)"
    )
    with pytest.raises(LeantrainError, match=expected):
        Learner(_config("llama_dapo", 2), _model("llama", 2), torch.device("cpu"), world)


def test_a_run_refuses_a_rank_count_sp_does_not_divide_before_connecting(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    env = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "3", "MASTER_ADDR": "127.0.0.1"}
    for key, value in {**env, "MASTER_PORT": "1"}.items():  # nothing listens there
        monkeypatch.setenv(key, value)
    expected = r"^distributed\.sequence_parallel_size = 2 must divide the number of ranks \(3\)"
    with pytest.raises(LeantrainError, match=expected):
        GRPORun(_config("llama_dapo", 2), progress=False)


def test_shard_row_pads_with_a_sequence_of_its_own() -> None:
    ids = torch.tensor([[5, 6, 7, 8, 9]])  # two packed sequences: 3 tokens, then 2
    positions = torch.tensor([[0, 1, 2, 0, 1]])
    first = shard_row(ids, positions, 0, 2)
    second = shard_row(ids, positions, 1, 2, pad_id=0)
    assert first[0].tolist() == [[5, 6, 7]] and second[0].tolist() == [[8, 9, 0]]
    assert first[1].tolist() == [[0, 1, 2]] and second[1].tolist() == [[0, 1, 0]]
    assert first[2].tolist() == second[2].tolist() == [[0, 1, 2, 0, 1, 0]]
    assert (first[3], second[3]) == (0, 3)
    assert sequence_lengths(first[2]) == [3, 2, 1]  # the padding attends to itself only
