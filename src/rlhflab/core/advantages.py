"""Advantage estimators: steps 5–7 of an iteration (KL shaping, advantages, whitening).

The estimator is a config choice (``ppo.advantage_estimator``) on one training loop, not a
trainer subclass. Each is a pure function with the same signature::

    estimator(scores, kl, mask, values, beta, settings) -> Advantages

- ``scores`` (B,): each answer's score after the missing-EOS penalty and normalisation.
- ``kl`` (B, T): the per-token KL estimate to the reference, 0 on padding (zeros while
  step 8 has yet to supply the old log-probs, which only happens with the KL in the loss).
- ``mask`` (B, T): 1 on response tokens.
- ``values`` (B, T) or None: the critic's old values (None without a critic).
- ``beta``: the KL coefficient of this iteration.
- ``settings``: :class:`AdvantageSettings`, plain numbers and switches read from the config.

It returns :class:`Advantages`: advantages (B, T), 0 on padding; returns (B, T) for the
value loss, or None when there is no critic; and extra metrics to log.

Each registered estimator also says whether it needs a critic and whether each prompt is
sampled ``grpo.group_size`` times in a row (its baseline is the prompt's group).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from rlhflab.core import algorithms as A

# (x, mask) -> (mean, var) over every data-parallel rank; None: the local batch's own
Moments = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class AdvantageSettings:
    """What the estimators read from the config (each reads only its own fields)."""

    kl_in_reward: bool = True  # ppo.kl_placement == "reward": β·KL enters the reward
    gamma: float = 1.0  # gae: ppo.gamma
    lam: float = 0.95  # gae: ppo.lam
    whiten_rewards: bool = False  # gae: ppo.whiten_rewards
    whiten_advantages: bool = True  # gae: ppo.whiten_advantages
    group_size: int = 4  # grpo, rloo: grpo.group_size
    normalize_std: bool = True  # grpo: grpo.normalize_std (False: Dr. GRPO, centre only)
    eps: float = 1e-6  # grpo: grpo.eps
    moments: Moments | None = None  # gae's whitening statistics over every rank


def settings_from_config(cfg, moments: Moments | None = None) -> AdvantageSettings:
    """The estimator settings of a :class:`rlhflab.config.Config`."""
    p, g = cfg.ppo, cfg.grpo
    return AdvantageSettings(
        kl_in_reward=p.kl_placement == "reward",
        gamma=p.gamma,
        lam=p.lam,
        whiten_rewards=p.whiten_rewards,
        whiten_advantages=p.whiten_advantages,
        group_size=g.group_size,
        normalize_std=g.normalize_std,
        eps=g.eps,
        moments=moments,
    )


@dataclass
class Advantages:
    advantages: torch.Tensor  # (B, T), 0 on padding
    returns: torch.Tensor | None  # (B, T) value targets; None without a critic
    metrics: dict[str, float] = field(default_factory=dict)


Fn = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, float, AdvantageSettings],
    Advantages,
]


@dataclass(frozen=True)
class Estimator:
    name: str
    fn: Fn
    needs_critic: bool  # reads values and returns value targets
    grouped: bool  # each prompt sampled grpo.group_size times in a row


_REGISTRY: dict[str, Estimator] = {}


def register(name: str, fn: Fn, *, needs_critic: bool, grouped: bool) -> Estimator:
    """Add an estimator under ``name`` (a second one under the same name is an error)."""
    if name in _REGISTRY:
        raise ValueError(f"advantage estimator {name!r} is already registered")
    _REGISTRY[name] = Estimator(name, fn, needs_critic, grouped)
    return _REGISTRY[name]


def get(name: str) -> Estimator:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(
            f"unknown advantage estimator {name!r}; known: {', '.join(names())}"
        ) from None


def names() -> tuple[str, ...]:
    return tuple(_REGISTRY)


def _whiten(x: torch.Tensor, mask: torch.Tensor, s: AdvantageSettings, **kw) -> torch.Tensor:
    moments = s.moments(x, mask) if s.moments is not None else None
    return A.masked_whiten(x, mask, moments=moments, **kw)


def gae(scores, kl, mask, values, beta, s: AdvantageSettings) -> Advantages:
    """PPO (OAI19, N+): 5. per-token shaping r_t = −β·kl_t + score·[t = last] (β only with
    the KL in the reward), optional reward whitening (scale only); 6. GAE, returns from the
    unwhitened advantages; 7. advantage whitening."""
    if values is None:
        raise ValueError("the gae estimator needs the critic's values")
    # 5. KL shaping
    rewards = A.shape_rewards(scores, kl, mask, beta if s.kl_in_reward else 0.0)
    if s.whiten_rewards:
        rewards = _whiten(rewards, mask, s, shift_mean=False)
    # 6. advantages
    advantages, returns = A.compute_gae(rewards, values, mask, s.gamma, s.lam)
    # 7. whitening
    if s.whiten_advantages:
        advantages = _whiten(advantages, mask, s)
    return Advantages(advantages, returns)


def grpo(scores, kl, mask, values, beta, s: AdvantageSettings) -> Advantages:
    """GRPO (DeepSeekMath): (s − group mean) / (group std + eps) per answer, the same on
    each of its tokens; ``normalize_std=False`` centres only (Dr. GRPO). No critic."""
    seq = _sequence_reward(scores, kl, beta, s)
    adv = A.group_advantages(seq, s.group_size, s.normalize_std, s.eps)
    return _on_every_token("grpo", adv, seq, kl, mask, s.group_size)


def rloo(scores, kl, mask, values, beta, s: AdvantageSettings) -> Advantages:
    """RLOO: s − mean of the other answers to the same prompt, on each token of the answer.
    No critic."""
    seq = _sequence_reward(scores, kl, beta, s)
    adv = A.rloo_advantages(seq, s.group_size)
    return _on_every_token("rloo", adv, seq, kl, mask, s.group_size)


def _sequence_reward(scores, kl, beta, s: AdvantageSettings) -> torch.Tensor:
    """Step 5 of the group estimators: the KL, when in the reward, is one term per answer."""
    return scores - beta * kl.sum(1) if s.kl_in_reward else scores


def _on_every_token(name, adv, seq, kl, mask, group_size: int) -> Advantages:
    """Steps 6–7 of the group estimators (the group statistics are their whitening): each
    answer's advantage (N,) on each of its tokens, and the share of groups with no signal."""
    grouped = seq.reshape(-1, group_size)
    zero_std = (grouped.max(1).values == grouped.min(1).values).float().mean().item()
    advantages = torch.where(mask.bool(), adv[:, None].expand_as(kl), torch.zeros_like(kl))
    # groups whose answers all scored the same carry no signal (DAPO filters them)
    return Advantages(advantages, None, {f"{name}/zero_std_fraction": zero_std})


register("gae", gae, needs_critic=True, grouped=False)
register("grpo", grpo, needs_critic=False, grouped=True)
register("rloo", rloo, needs_critic=False, grouped=True)
