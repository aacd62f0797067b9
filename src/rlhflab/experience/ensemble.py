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
    ``ensemble/score`` (the combined score: the one component to optimise, weight 1);
    ``ensemble/member<i>``, the spread and the score come from the centred sums once
    :meth:`set_offsets` has been called (``rm/<head>`` stays uncentred)."""

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

        # (k,) subtracted from the members' sums before combining (set_offsets); None: raw
        self.offsets: torch.Tensor | None = None

    def member_sums(self, batch: RewardBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Each member's weighted head sum (k, B), uncentred, and each head's members' mean
        (B,) by head name."""
        per_head: dict[str, list[torch.Tensor]] = {h: [] for h in self.heads}
        sums = []
        for m in self.members:
            parts = m(batch)
            values = {h: parts[f"{m.name}/{h}"] for h in self.heads}
            for h, v in values.items():
                per_head[h].append(v)
            sums.append(sum(self.weights.get(h, 0.0) * v for h, v in values.items()))
        return torch.stack(sums), {h: torch.stack(v).mean(0) for h, v in per_head.items()}

    def set_offsets(self, member_means: torch.Tensor) -> torch.Tensor:
        """Centre the members from now on (reward.ensemble_center): ``member_means`` (k,), each
        member's mean sum over the same answers (the reference policy's); member i is then
        shifted by its mean less the members' average, so every member has the same mean on
        those answers and the ensemble's own level is kept. Returns the offsets (k,).

        Why: a Bradley–Terry model is trained on score differences, so its offset is
        arbitrary; uncentred, ``wco``'s minimum follows whichever member happens to sit
        lowest and ``uwo``'s variance counts the offsets as disagreement (docs/hacking.md)."""
        if member_means.shape != (len(self.members),):
            raise RewardError(
                f"reward.ensemble_center: {tuple(member_means.shape)} means for "
                f"{len(self.members)} members"
            )
        self.offsets = member_means - member_means.mean()
        return self.offsets

    def __call__(self, batch: RewardBatch) -> dict[str, torch.Tensor]:
        stack, head_means = self.member_sums(batch)  # (k, B)
        if self.offsets is not None:
            stack = stack - self.offsets.to(stack)[:, None]
        out = {f"rm/{h}": v for h, v in head_means.items()}
        out.update({f"ensemble/member{i}": s for i, s in enumerate(stack)})
        out[SPREAD] = G.ensemble_spread(stack)
        out[SCORE] = G.ensemble_combine(stack, self.combine, self.uwo_lambda)
        return out
