"""``rlhflab rm``'s entry: one reward model, or an ensemble of rm.ensemble_size members
trained one after another (reward.ensemble reads their folders)."""

from __future__ import annotations

import copy
from pathlib import Path

from rlhflab.config import Config
from rlhflab.trainers.rm import rm_trainer, run_rm


def train_rm(cfg: Config, resume: bool = False) -> dict:
    """``rlhflab rm``: train, write the model to ``rm.output_dir``, check it on the held-out
    pairs, summarise. With rm.ensemble_size=k, k models one after another, member i in
    ``rm.output_dir``/member-i with seed + i; the result is member 0's with ``members``
    (every member's result) and ``ensemble`` (their folders, for reward.ensemble)."""
    if cfg.rm.ensemble_size == 1:
        return run_rm(rm_trainer(cfg), resume)
    members = [run_rm(rm_trainer(member), resume) for member in member_configs(cfg)]
    return ensemble_result(members)


def member_configs(cfg: Config) -> list[Config]:
    """rm.ensemble_size=k: member i's config, seed + i, in ``rm.output_dir``/member-i."""
    out = []
    for i in range(cfg.rm.ensemble_size):
        member = copy.deepcopy(cfg)
        member.seed = cfg.seed + i
        member.rm.output_dir = str(Path(cfg.rm.output_dir) / f"member-{i}")
        out.append(member)
    return out


def ensemble_result(members: list[dict]) -> dict:
    """Member 0's result with every member's (``members``) and their folders
    (``ensemble``, for reward.ensemble)."""
    return {**members[0], "members": members, "ensemble": [m["output_dir"] for m in members]}
