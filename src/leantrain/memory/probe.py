"""Peak memory of one training step, and the exact bytes autograd saves for backward.

- CUDA: `torch.cuda.max_memory_allocated` after `reset_peak_memory_stats`, minus the memory
  allocated before the step.
- CPU: PyTorch has no allocator statistics on CPU, so the peak is the process's resident set
  high-water mark (Linux `VmHWM`, reset through `/proc/self/clear_refs`) minus the resident set
  before the step, plus nothing else: tracemalloc's peak of Python-heap allocations is reported
  beside it (it lives inside the resident set already). For the RSS to follow tensor lifetimes,
  glibc must hand big blocks back to the OS when they are freed: start the process with
  `MALLOC_MMAP_THRESHOLD_=65536` (benchmarks/memory.py does); otherwise freed memory can stay
  resident and later peaks read low.
- Saved activations: a `saved_tensors_hooks` pair counts every distinct storage autograd keeps for
  backward during the step (parameters excluded). It is exact and noise-free, so tests use it.
  `saved_tensors` lists them one by one with the module that saved each: the honest
  decomposition of where backward memory goes.

Knows nothing about which model or method is being measured.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import tracemalloc
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

_CLEAR_REFS = Path("/proc/self/clear_refs")
_STATUS = Path("/proc/self/status")


@dataclass(frozen=True)
class StepMemory:
    """What one measured step used, in bytes.

    Attributes:
        peak_bytes: peak memory above what was in use before the step (see module docstring).
        saved_activation_bytes: distinct storages autograd saved for backward (no parameters).
        python_peak_bytes: tracemalloc's peak of Python-heap allocations during the step.
        source: how `peak_bytes` was measured: "cuda", "rss" or "rss-lifetime" (a kernel without
            a resettable high-water mark: the process's lifetime peak, an upper bound).
    """

    peak_bytes: int
    saved_activation_bytes: int
    python_peak_bytes: int
    source: str


def _status_kib(field: str) -> int:
    for line in _STATUS.read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in {_STATUS}")


def _settle_heap() -> None:
    """Collect garbage and hand freed heap memory back to the OS (glibc's `malloc_trim`) before
    the baseline is read: a collection of an earlier run's cycles inside the step would free
    memory while the step allocates, and the resident set would hide the step's peak (a
    64 MiB temporary read as 0 after the suite's vLLM and model tests)."""
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):  # not glibc: nothing to hand back
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def _reset_rss_peak() -> bool:
    try:
        _CLEAR_REFS.write_text("5")  # "5" resets VmHWM to the current RSS (Linux >= 4.0)
    except OSError:
        return False
    return True


@dataclass(frozen=True)
class SavedTensor:
    """One distinct storage autograd kept for backward.

    Attributes:
        module: the innermost module running when it was saved ("" outside every module).
        shape: shape of the first tensor saved on this storage.
        dtype: its dtype, e.g. "torch.float32".
        nbytes: bytes of the whole storage.
        producer: the autograd node that computed it ("leaf" for a tensor made outside autograd),
            which tells apart, say, SiLU's output from the product's other operand.
    """

    module: str
    shape: tuple[int, ...]
    dtype: str
    nbytes: int
    producer: str


class _SavedTensorCounter:
    """saved_tensors_hooks that record distinct non-parameter storages saved for backward."""

    def __init__(self, params: set[int], where: Callable[[], str] = lambda: "") -> None:
        self.params = params
        self.where = where
        self.seen: set[int] = set()
        self.saved: list[SavedTensor] = []

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key not in self.params and key not in self.seen:
            self.seen.add(key)
            producer = "leaf" if t.grad_fn is None else type(t.grad_fn).__name__
            self.saved.append(
                SavedTensor(self.where(), tuple(t.shape), str(t.dtype), storage.nbytes(), producer)
            )
        return t

    @staticmethod
    def unpack(t: torch.Tensor) -> torch.Tensor:
        return t

    @property
    def bytes(self) -> int:
        return sum(s.nbytes for s in self.saved)


def _parameter_storages(model: nn.Module) -> set[int]:
    return {p.untyped_storage().data_ptr() for p in model.parameters()}


@contextlib.contextmanager
def _module_stack(model: nn.Module) -> Iterator[list[str]]:
    """The names of the modules of `model` currently running, innermost last."""
    stack: list[str] = []

    def leave(module: nn.Module, args: object, output: object) -> None:
        stack.pop()  # returns None: the module's output is left as it is

    handles = []
    for name, module in model.named_modules():
        handles.append(module.register_forward_pre_hook(lambda m, a, name=name: stack.append(name)))
        handles.append(module.register_forward_hook(leave))
    try:
        yield stack
    finally:
        for handle in handles:
            handle.remove()


def saved_tensors(model: nn.Module, step: Callable[[], object]) -> list[SavedTensor]:
    """Run `step()` once and list every distinct storage autograd saved for backward during it
    (parameters excluded), in the order they were saved."""
    with _module_stack(model) as stack:
        counter = _SavedTensorCounter(
            _parameter_storages(model), lambda: stack[-1] if stack else ""
        )
        with torch.autograd.graph.saved_tensors_hooks(counter.pack, counter.unpack):
            step()
    return counter.saved


def measure_step(model: nn.Module, step: Callable[[], object]) -> StepMemory:
    """Run `step()` (forward, backward, optimizer step of `model`) once and measure it."""
    device = next(model.parameters()).device
    counter = _SavedTensorCounter(_parameter_storages(model))
    hooks = torch.autograd.graph.saved_tensors_hooks(counter.pack, counter.unpack)
    tracemalloc.start()
    try:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            before = torch.cuda.memory_allocated(device)
            with hooks:
                step()
            torch.cuda.synchronize(device)
            peak, source = torch.cuda.max_memory_allocated(device) - before, "cuda"
        else:
            _settle_heap()
            source = "rss" if _reset_rss_peak() else "rss-lifetime"
            before = _status_kib("VmRSS")
            with hooks:
                step()
            peak = (_status_kib("VmHWM") - before) * 1024
        _, python_peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return StepMemory(max(0, peak), counter.bytes, python_peak, source)
