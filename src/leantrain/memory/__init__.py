"""Memory-lean fine-tuning: LARS low-rank activation subspaces, peak-memory measurement, and the
SFT loop behind `leantrain tune`."""

from leantrain.memory.lars import LarsLinear, apply_lars, principal_basis
from leantrain.memory.probe import StepMemory, measure_step

__all__ = ["LarsLinear", "StepMemory", "apply_lars", "measure_step", "principal_basis"]
