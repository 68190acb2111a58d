"""Speculation plugged into a rollout backend: the drafters (the EAGLE-style one and its loss,
drafter.py; the model-free suffix drafter, suffix_drafter.py), the bandit that picks drafter and
draft length (bandit.py), the speculator the engine calls, which speculates only in the long tail
(speculator.py), the online drafter trainer and its warm start (spot_trainer.py), and their
assembly for a run (long_tail.py). The engine's side, the `Speculator` protocol and the lossless
verification, is generation/speculative.py."""
