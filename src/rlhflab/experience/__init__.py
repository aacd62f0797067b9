"""What a rollout is made of and who makes it: the four-model cast, prompt and pair data,
sampling, scoring and the reward sources."""
