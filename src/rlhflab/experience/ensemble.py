"""A reward-model ensemble as one reward source (``reward.ensemble``; Coste et al., ICLR
2024, "Reward Model Ensembles Help Mitigate Overoptimization").

Each member is an ordinary :class:`~rlhflab.experience.rewards.ModelReward` (frozen, in
``model.reward_precision``); its heads are summed with the reward.heads weights, and the k
sums are combined per answer by :func:`rlhflab.core.guards.ensemble_combine`.
"""

from __future__ import annotations

import torch

from rlhflab.core import guards as G
from rlhflab.experience.rewards import RewardBatch, RewardError

SCORE, SPREAD = "ensemble/score", "ensemble/std"


class EnsembleReward:
    """k reward models scored one after another (one ModelReward each, k forward passes).

    Components: ``rm/<head>`` (the members' mean of each head, as one reward model's would
    be named), ``ensemble/member<i>`` (member i's weighted head sum), ``ensemble/std`` (the
    members' population std per answer, :func:`~rlhflab.core.guards.ensemble_spread`) and
    ``ensemble/score`` (the combined score: the one component to optimise, weight 1)."""

    name = "ensemble"

    def __init__(self, members: list, weights: dict[str, float], combine: str, uwo_lambda: float):
        if len(members) < 2:
            raise RewardError("reward.ensemble: an ensemble needs at least two members")
        heads = members[0].head_names
        for i, m in enumerate(members):
            if m.head_names != heads:
                raise RewardError(
                    f"reward.ensemble[{i}]: heads {m.head_names} differ from member 0's {heads}"
                )
        if combine not in G.ENSEMBLE_COMBINES:
            raise RewardError(f"reward.ensemble_combine: unknown {combine!r}")
        self.members, self.heads, self.weights = members, heads, weights
        self.combine, self.uwo_lambda = combine, uwo_lambda

    def __call__(self, batch: RewardBatch) -> dict[str, torch.Tensor]:
        per_head: dict[str, list[torch.Tensor]] = {h: [] for h in self.heads}
        sums = []
        for m in self.members:
            parts = m(batch)
            values = {h: parts[f"{m.name}/{h}"] for h in self.heads}
            for h, v in values.items():
                per_head[h].append(v)
            sums.append(sum(self.weights.get(h, 0.0) * v for h, v in values.items()))
        stack = torch.stack(sums)  # (k, B)
        out = {f"rm/{h}": torch.stack(v).mean(0) for h, v in per_head.items()}
        out.update({f"ensemble/member{i}": s for i, s in enumerate(stack)})
        out[SPREAD] = G.ensemble_spread(stack)
        out[SCORE] = G.ensemble_combine(stack, self.combine, self.uwo_lambda)
        return out
