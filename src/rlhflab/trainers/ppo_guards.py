"""Step 1b of a PPO iteration, step 3 and its optional 3b: the ensemble's centring on the
reference policy's answers (reward.ensemble_center), the missing-EOS penalty, and PAR
reward shaping (reward.shaping=par; Fu et al. 2025, "Reward Shaping to Mitigate Reward
Hacking in RLHF") against the reference policy's answers to the same prompts.

The reference's answers come from :meth:`~.ppo_watch.PPOWatch.reference_rollout` (the
monitor's reference sampling, shared with it in iterations where it samples too); the
shaping itself is :func:`rlhflab.core.guards.par_shape`.
"""

from __future__ import annotations

import logging

import torch

from rlhflab.core import guards as G
from rlhflab.experience.ensemble import EnsembleReward
from rlhflab.experience.rewards import RewardBatch
from rlhflab.experience.rollout import Rollout
from rlhflab.models import position_limit, positions_of

log = logging.getLogger(__name__)


@torch.no_grad()
def center_ensemble(cast, watch, ctx, rollout: Rollout, iteration: int) -> dict[str, float]:
    """Step 1b (reward.ensemble_center=reference): set the ensemble's member offsets from its
    members' mean scores on the reference's answers to ``rollout``'s prompts (averaged over
    every rank, so each rank combines alike) before step 2 scores the policy's answers;
    returns the spread of the offsets as a metric. Nothing without an ensemble."""
    ensembles = [s for s, _ in cast.reward.sources if isinstance(s, EnsembleReward)]
    if not ensembles:
        return {}
    ens = ensembles[0]
    ref = watch.reference_rollout(rollout, iteration)
    batch = RewardBatch(ref.prompts, ref.responses, ref.sequences, ref.attention_mask, ref.ended)
    sums, _ = ens.member_sums(batch)  # (k, B)
    # each member's mean over its finite scores on every rank: one non-finite score must
    # not make every offset, and so every answer's reward, non-finite
    finite = torch.isfinite(sums)
    stats = torch.stack([torch.where(finite, sums.double(), 0.0).sum(1), finite.sum(1).double()])
    if ctx.enabled:
        stats = ctx.all_sum(stats.to(ctx.device)).cpu()
    total, count = stats
    if (count == 0).any():
        log.warning(
            "reward.ensemble_center: a member scored no reference answer with a finite "
            "number at iteration %d; the members are not centred this iteration",
            iteration + 1,
        )
        offsets = ens.set_offsets(torch.zeros(len(ens.members)))
    else:
        offsets = ens.set_offsets((total / count).float())
    return {"objective/ensemble_offset_range": (offsets.max() - offsets.min()).item()}


# the metric of the penalty's mean (≤ 0), beside the reward components' objective/scores/<name>:
# the parts of objective/scores add up to it (the report draws them together)
EOS_PART = "objective/scores/missing_eos_penalty"


def policy_positions(cfg, cast) -> int | None:
    """The positions the policy covers: a built ``cast``'s, else those its folder's
    config.json declares (read before any model loads, so that a rollout too long for them
    is said in seconds)."""
    if cast is not None:
        return positions_of(cast.policy_lm.config)
    return position_limit(cfg.model.policy, "model.policy")


def penalise_missing_eos(scores: torch.Tensor, ended: torch.Tensor, penalty) -> torch.Tensor:
    """Step 3: ``scores`` (B,) less ``penalty`` (reward.missing_eos_penalty; None: off) where
    ``ended`` (B,) bool says no EOS ended the answer; a new tensor."""
    scores = scores.clone()
    if penalty is not None:
        scores = torch.where(ended, scores, scores - penalty)
    return scores


def eos_penalty_part(penalised: torch.Tensor, scores: torch.Tensor, penalty) -> dict:
    """The penalty's batch mean (≤ 0) as its metric (:data:`EOS_PART`; none with the penalty
    off): a part of objective/scores, logged beside the reward components."""
    return {} if penalty is None else {EOS_PART: (penalised - scores).mean().item()}


@torch.no_grad()
def par_scores(cast, watch, rollout: Rollout, scores: torch.Tensor, iteration: int, penalty):
    """Step 3b: (σ(r − r_ref) (B,), its metrics). ``scores`` (B,): the policy's answers'
    scores after the missing-EOS penalty; r_ref: the reference's answer to the same prompt,
    scored by the same reward and given the same penalty."""
    ref = watch.reference_rollout(rollout, iteration)
    batch = RewardBatch(ref.prompts, ref.responses, ref.sequences, ref.attention_mask, ref.ended)
    ref_scores = cast.reward(batch).score.to(scores.device)
    ref_scores = penalise_missing_eos(ref_scores, ref.ended.to(scores.device), penalty)
    shaped = G.par_shape(scores, ref_scores)
    return shaped, {
        "objective/reference_scores": ref_scores.mean().item(),
        "objective/shaped_scores": shaped.mean().item(),
    }


# mean |log π − log π_ref| per answer token at the first iteration above which the gap of
# an unchanged policy to its own frozen copy is the reference's rounding, not float noise
# (bf16 reference on SmolLM2-135M: 0.03; an int8 one: 1.16)
REFERENCE_GAP_WARN = 0.1

_INT8_ADVICE = (
    "int8 here is torch's dynamic quantisation, which also rounds each batch's activations "
    "to 8 bits per tensor, and the outlier features of real language models do not survive "
    "that; use bf16 (half fp32's bytes, ~0.03 nats a token on SmolLM2-135M) or fp32"
)


@torch.no_grad()
def warn_reference_gap(
    rollout: Rollout, precision: str, iteration: int, beta: float, ctx=None
) -> float | None:
    """At the first iteration of a fresh run the policy is still the model its reference
    was copied from, so their log-probs differ only by the reference's arithmetic
    (model.reference_precision): say so (once, on the main rank) when that gap is large
    enough to steer training, since the KL penalty then pushes the policy against the
    reference's rounding from the first update on (an int8 SmolLM2-135M: 1.2 nats a
    token). ``ctx``: the run's process context (the gap over every rank: a collective, so
    every rank calls this alike). Returns the gap (nats a token), or None after the first
    iteration."""
    if iteration != 0 or rollout.old_logprobs is None or rollout.ref_logprobs is None:
        return None
    mask = rollout.response_mask.bool()
    diff = (rollout.old_logprobs - rollout.ref_logprobs).double()
    totals = {
        "abs": float(diff[mask].abs().sum()),
        "k1": float(diff.masked_fill(~mask, 0.0).sum()),
        "tokens": float(mask.sum()),
        "answers": float(len(diff)),
    }
    if ctx is not None:
        totals = ctx.mean_metrics(totals)
    if not totals["tokens"]:
        return None
    gap = totals["abs"] / totals["tokens"]
    if gap > REFERENCE_GAP_WARN and (ctx is None or ctx.is_main):
        cause = (
            f"the reference's {precision} arithmetic"
            if precision != "fp32"
            else "a difference between how the policy and the reference compute"
        )
        effect = (
            "which the KL penalty will push the policy against from the first update on"
            if beta > 0
            else "which the logged KL carries (the penalty itself is off: β = 0)"
        )
        log.warning(
            "model.reference_precision=%s: at the first iteration, where the policy is still "
            "the model its reference was copied from, their log-probs differ by %.3g nats a "
            "token on average (k1 KL estimate %+.3g nats an answer): %s, %s%s",
            precision,
            gap,
            totals["k1"] / max(totals["answers"], 1.0),
            cause,
            effect,
            f"; {_INT8_ADVICE}" if precision == "int8" else "",
        )
    return gap


def reference_gap_checked(trainer, rollout: Rollout, beta: float) -> bool:
    """:func:`warn_reference_gap` for ``trainer``'s iteration; True once it has run."""
    precision = trainer.cfg.model.reference_precision
    return warn_reference_gap(rollout, precision, trainer.iteration, beta, trainer.ctx) is not None
