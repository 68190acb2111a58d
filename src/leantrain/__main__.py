"""`python -m leantrain`, and so `torchrun -m leantrain ...`: runs `leantrain.cli` as the main
module, exactly as `python -m leantrain.cli` does (by name: the package root sits below every
area and imports none of them)."""

import runpy

if __name__ == "__main__":
    runpy.run_module("leantrain.cli", run_name="__main__", alter_sys=True)
