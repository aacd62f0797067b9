"""What a rollout is made of: prompt and pair data, sampling, scoring, reward sources."""
