"""rlhflab: RLHF centred on PPO."""

__version__ = "0.1.0"
