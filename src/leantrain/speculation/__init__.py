"""Speculation around the rollout engine: the online drafter trainer and its warm start
(spot_trainer.py), and the long-tail switch that turns speculative decoding on once a batch's
live rows fall under a threshold (long_tail.py). The engine's verify step, the drafters and the
bandit still live in generation/ (the engine calls them)."""
