"""Trainers: PPO (and the stages around it) on shared rollout, reward and logging code."""
