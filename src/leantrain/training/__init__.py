"""The small shared training kit: token logprobs (one scorer), one SFT loop, checkpoints and the
run folder. Sits beside `generation` (it may use the engine), below every area that trains."""
