"""Is the run honest: reward-hacking monitors, reward-model checks, memory estimates, evaluation."""
