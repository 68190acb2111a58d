"""leantrain: lean LLM post-training."""
