"""GRPO and RLOO: PPO's loop without a critic; the group of answers is the baseline.

G answers are sampled per prompt (DeepSeekMath). The advantage of answer i is its score
against the others in its group — (s − mean)/std for GRPO (centred only for Dr. GRPO), or
the leave-one-out baseline for RLOO — the same for every token of the answer. The KL goes in
the loss (k3 by default, as DSM; k2 or the straight-through k3+ as options) or in the
reward. Both are :class:`rlhflab.trainers.ppo.PPOTrainer` with ``ppo.advantage_estimator``
set (:mod:`rlhflab.core.advantages`); this module keeps their defaults and entry points.
"""

from __future__ import annotations

import copy

from rlhflab.config import CRITIC_FREE_ESTIMATORS, Config, validate
from rlhflab.config.stages import CRITIC_FREE_BASE
from rlhflab.trainers.ppo import PPOTrainer

# The critic-free methods' defaults live in the config tree (config.stages.STAGE_DEFAULTS,
# applied by load_config for stage grpo/rloo); this name stays for callers that build a
# config by hand.
GRPO_BASE = CRITIC_FREE_BASE


def GRPOTrainer(cfg: Config, cast=None, estimator: str = "grpo") -> PPOTrainer:  # noqa: N802
    """A :class:`PPOTrainer` whose advantage estimator is ``estimator`` (grpo or rloo), on
    a copy of ``cfg`` when it names another; kept under its old class-like name for
    existing callers."""
    if estimator not in CRITIC_FREE_ESTIMATORS:
        raise ValueError(f"estimator must be 'grpo' or 'rloo', got {estimator!r}")
    if cfg.ppo.advantage_estimator != estimator:
        cfg = copy.deepcopy(cfg)
        cfg.ppo.advantage_estimator = estimator
    return PPOTrainer(validate(cfg, estimator), cast)


def train(cfg: Config, estimator: str = "grpo", resume: bool = False) -> dict:
    return GRPOTrainer(cfg, estimator=estimator).fit(resume)
