"""GRPO and RLOO: PPO's loop without a critic; the group of answers is the baseline.

G answers are sampled per prompt (DeepSeekMath). The advantage of answer i is its score
against the others in its group — (s − mean)/std for GRPO (centred only for Dr. GRPO), or
the leave-one-out baseline for RLOO — the same for every token of the answer. The KL goes in
the loss (k3 by default, as DSM; k2 or the straight-through k3+ as options) or in the
reward. Rollout, reward sources, monitors, logging, checkpoints and resume are PPO's own
code: only the prompt grouping (step 0) and the advantages (steps 5–7) differ.
"""

from __future__ import annotations

import torch

from rlhflab.config import Config
from rlhflab.core import algorithms as A
from rlhflab.experience.rollout import Rollout
from rlhflab.trainers.ppo import PPOTrainer

# Defaults that differ from PPO's; a config file or override still wins.
GRPO_BASE = {
    "model": {"value_model": "none"},
    "ppo": {"kl_placement": "loss", "kl_estimator": "k3", "kl_coef": 0.04},
}


class GRPOTrainer(PPOTrainer):
    def __init__(self, cfg: Config, cast=None, estimator: str = "grpo"):
        if estimator not in ("grpo", "rloo"):
            raise ValueError(f"estimator must be 'grpo' or 'rloo', got {estimator!r}")
        super().__init__(cfg, cast)
        self.estimator = estimator
        self.group = cfg.grpo.group_size
        self.stream.batch_size = cfg.rollout.prompts_per_iteration // self.group

    def _group_size(self) -> int:
        """Whole groups per rank (checked by PPOTrainer with the world size): a group's
        baseline is computed from the answers one rank holds."""
        return self.cfg.grpo.group_size

    def next_prompts(self) -> list[str]:
        """Each prompt G times in a row: groups are consecutive, as the advantages expect."""
        return [p for p in self.stream.next_batch() for _ in range(self.group)]

    def advantages(self, rollout: Rollout, scores, kl, beta):
        p, g, mask = self.cfg.ppo, self.cfg.grpo, rollout.response_mask
        seq = scores - beta * kl.sum(1) if p.kl_placement == "reward" else scores
        if self.estimator == "rloo":
            adv = A.rloo_advantages(seq, self.group)
        else:
            adv = A.group_advantages(seq, self.group, g.normalize_std, g.eps)
        grouped = seq.reshape(-1, self.group)
        zero_std = (grouped.max(1).values == grouped.min(1).values).float().mean().item()
        advantages = torch.where(mask.bool(), adv[:, None].expand_as(kl), torch.zeros_like(kl))
        # groups whose answers all scored the same carry no signal (DAPO filters them)
        return advantages, None, {f"{self.estimator}/zero_std_fraction": zero_std}


def train(cfg: Config, estimator: str = "grpo", resume: bool = False) -> dict:
    return GRPOTrainer(cfg, estimator=estimator).fit(resume)
