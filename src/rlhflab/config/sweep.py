"""The settings of ``rlhflab sweep``: what is searched, what is optimised, when a trial is
cut short (docs/sweeps.md)."""

from __future__ import annotations

from dataclasses import dataclass

from rlhflab.config.base import setting

# The spaces searched when `sweep.space` is empty: the hyperparameters the RLHF literature
# reports as sensitive (lr, β, clip, epochs, batch, whitening; N+, MOSS), over ranges that
# hold both the built-in presets' values (lr 5e-5 .. 3e-4) and real models' (1e-6 .. 1e-5).
DEFAULT_SPACES: dict[str, dict[str, dict]] = {
    "ppo": {
        "ppo.lr": {"low": 1e-6, "high": 1e-3, "log": True},
        "ppo.kl_coef": {"low": 0.005, "high": 0.5, "log": True},
        "ppo.clip_low": {"low": 0.1, "high": 0.3},
        "ppo.epochs": {"low": 1, "high": 4},
        "ppo.minibatches": {"choices": [1, 2, 4]},
        "rollout.prompts_per_iteration": {"choices": [16, 32, 64]},
        "ppo.whiten_advantages": {"choices": [True, False]},
        "model.vf_coef": {"low": 0.05, "high": 0.5, "log": True},
    },
    "grpo": {
        "ppo.lr": {"low": 1e-6, "high": 1e-3, "log": True},
        "ppo.kl_coef": {"low": 0.001, "high": 0.2, "log": True},
        "ppo.clip_low": {"low": 0.1, "high": 0.3},
        "ppo.epochs": {"low": 1, "high": 4},
        "grpo.group_size": {"choices": [2, 4, 8]},
        "rollout.prompts_per_iteration": {"choices": [16, 32, 64]},
        "grpo.normalize_std": {"choices": [True, False]},
    },
}
DEFAULT_SPACES["rloo"] = {
    k: v for k, v in DEFAULT_SPACES["grpo"].items() if k != "grpo.normalize_std"
}


@dataclass
class SweepConfig:
    method: str = setting(
        "ppo",
        "The trainer each trial runs: ppo, grpo or rloo (as the command of that name).",
        choices=("ppo", "grpo", "rloo"),
    )
    space: dict[str, dict] = setting(
        {},
        "Setting → range searched: {low, high} (a float range; ints when both are ints), "
        "{low, high, log: true} (log scale), or {choices: [...]}. Empty: the method's "
        "default space (rlhflab.config.sweep.DEFAULT_SPACES: lr, β, clip, epochs, "
        "minibatches or group size, prompts per iteration, whitening, vf_coef).",
    )
    objective: str = setting(
        "auto",
        "What a trial maximises, per iteration: 'gold' (monitor/gold, the batch's mean gold "
        "reward; needs monitor.gold), 'proxy' (objective/scores, the reward the policy "
        "optimises) or 'auto' (gold where monitor.gold is set, else proxy).",
        choices=("auto", "gold", "proxy"),
    )
    kl_budget: float | None = setting(
        4.0,
        "KL to the reference (objective/kl, nats per answer) a trial may spend for free; "
        "above it the objective loses kl_penalty per nat, so the sweep does not simply pick "
        "the run that drifts furthest to game the reward. None: no penalty.",
        low=0.0,
    )
    kl_penalty: float = setting(0.1, "Objective lost per nat of KL above kl_budget.", low=0.0)
    last_iterations: int = setting(
        3,
        "A trial's value: the mean of its last N iterations' objective (one batch's mean "
        "moves by ±0.1 at 64 answers); the pruner sees the same mean up to each iteration.",
        low=1,
    )
    pruner: str = setting(
        "median",
        "'median': stop a trial whose running objective is below the median of earlier "
        "trials at the same iteration (its current value, not its best so far as Optuna's "
        "MedianPruner compares: every trial's first iteration is the same reference policy; "
        "rlhflab/app/sweep_study.py); 'none': every trial runs out.",
        choices=("median", "none"),
    )
    prune_after_trials: int = setting(
        4, "Trials that run out before the pruner compares against them.", low=0
    )
    prune_warmup: float = setting(
        0.3,
        "Share of a trial's iterations before it can be pruned (early iterations say little).",
        low=0.0,
        high=1.0,
    )
    startup_trials: int = setting(
        5,
        "Trials sampled at random before TPE models the objective (Optuna's n_startup_trials).",
        low=1,
    )
