"""Memory-lean fine-tuning: LARS low-rank activation subspaces, lean kernels (SiLU product and
RMSNorm keeping fewer tensors for backward), peak-memory measurement, and the SFT loop behind
`leantrain tune`."""

from leantrain.memory.kernels import LeanGatedMLP, LeanRMSNorm, apply_lean_kernels
from leantrain.memory.lars import LarsLinear, apply_lars, principal_basis
from leantrain.memory.probe import SavedTensor, StepMemory, measure_step, saved_tensors

__all__ = [
    "LarsLinear",
    "LeanGatedMLP",
    "LeanRMSNorm",
    "SavedTensor",
    "StepMemory",
    "apply_lars",
    "apply_lean_kernels",
    "measure_step",
    "principal_basis",
    "saved_tensors",
]
