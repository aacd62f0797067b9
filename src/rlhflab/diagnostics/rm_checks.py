"""Is the reward model any good? Checks on held-out preference pairs (``rlhflab rm``).

Held-out accuracy alone does not say what PPO will do with a reward model. Two more
things do, and users of other RLHF libraries keep asking how to see them
(docs/ppo.md, "Is the reward model any good?"):

* **calibration**: a Bradley-Terry model says P(chosen ≻ rejected) = σ(r_c − r_r). When
  its confident pairs are right no more often than its unsure ones, its score gaps are
  noise that PPO will chase (expected calibration error, Guo et al. 2017, "On Calibration
  of Modern Neural Networks").
* **length bias**: reward models prefer the longer answer more often than the labels
  they learnt from do (Singhal et al. 2023, "A Long Way to Go: Investigating Length
  Correlations in RLHF"), and PPO then lengthens its answers (reward hacking, pain point
  four). Measured as the share of pairs of unequal length where the model scores the
  longer answer higher, against the share where the label prefers it, and as the
  correlation between score and answer length.

Pure functions: tensors in, numbers out (and the warning text built from them), no model
or config.
"""

from __future__ import annotations

import math

import torch

from rlhflab.diagnostics.monitor import pearson  # the monitor's: 0 for a constant sample

# A warning when the reward PPO will optimise prefers the longer of two answers in more
# than this share of held-out pairs (a coin is 0.5). A threshold, not a measured boundary:
# on the demo's task the default annotator's reward model prefers the longer answer in
# 0.24-0.27 of pairs, the `hacking` preset's 0.71-0.75 (its PPO runs lengthen their answers:
# length_ratio alerts at iterations 15-25, docs/monitors.md)
LONGER_PREFERRED_WARNING = 0.6
# A warning when the reward agrees with a gold reward on fewer held-out pairs than this
# (chance is 0.5). Also a threshold: on the demo's task the default annotator's reward
# agrees on 0.83-0.85 of pairs, the `hacking` preset's on 0.48-0.51
GOLD_AGREEMENT_WARNING = 0.65


def calibration_error(diff: torch.Tensor, outcome: torch.Tensor, bins: int = 10) -> float:
    """Expected calibration error of the Bradley-Terry probability σ(diff).

    diff: (N,) score gaps r_chosen − r_rejected. outcome: (N,) 1.0 where the chosen answer
    is indeed the better one, 0.0 where it is the worse (ties left out by the caller).
    Each pair's prediction is the answer σ(diff) favours, with confidence
    max(σ, 1 − σ) ∈ [0.5, 1]; pairs are put in ``bins`` equal-width confidence bins over
    [0.5, 1], and the error is Σ_b (n_b / N) · |accuracy_b − mean confidence_b|.
    0 = perfectly calibrated. NaN for N = 0.
    """
    if diff.shape != outcome.shape or diff.dim() != 1:
        raise ValueError(f"diff {tuple(diff.shape)} and outcome {tuple(outcome.shape)}: (N,) each")
    n = diff.numel()
    if n == 0:
        return math.nan
    p = torch.sigmoid(diff.double())
    confidence = torch.maximum(p, 1 - p)
    correct = ((p > 0.5) == (outcome > 0.5)).double()
    # confidence 0.5 .. 1 → bin 0 .. bins − 1 (1.0 falls in the last bin)
    index = ((confidence - 0.5) * 2 * bins).floor().clamp(0, bins - 1).long()
    err = 0.0
    for b in range(bins):
        inside = index == b
        if inside.any():
            gap = correct[inside].mean() - confidence[inside].mean()
            err += int(inside.sum()) / n * abs(gap.item())
    return err


def longer_preferred(diff: torch.Tensor, len_chosen: torch.Tensor, len_rejected: torch.Tensor):
    """Share of pairs of unequal length in which ``diff`` favours the longer answer.

    diff: (N,) > 0 where the chosen answer is favoured, < 0 where the rejected one is, 0 for
    neither (counts as half). Pass a reward model's score gaps, or label − 0.5 for what the
    labels prefer. len_chosen, len_rejected: (N,) answer lengths. Returns (share, pairs
    counted); share is NaN when every pair has equal lengths.
    """
    if not diff.shape == len_chosen.shape == len_rejected.shape or diff.dim() != 1:
        raise ValueError("diff, len_chosen, len_rejected: (N,) each")
    unequal = len_chosen != len_rejected
    n = int(unequal.sum())
    if n == 0:
        return math.nan, 0
    chosen_longer = (len_chosen > len_rejected)[unequal].double()
    favours_chosen = torch.sign(diff[unequal].double()) * 0.5 + 0.5  # 1, 0.5 or 0
    # the longer one is favoured when (chosen longer and chosen favoured) or the reverse
    share = chosen_longer * favours_chosen + (1 - chosen_longer) * (1 - favours_chosen)
    return share.mean().item(), n


def reward_checks(
    chosen: torch.Tensor,
    rejected: torch.Tensor,
    label: torch.Tensor | None,
    len_chosen: torch.Tensor,
    len_rejected: torch.Tensor,
) -> dict[str, float]:
    """Every check for one reward (a head, or the heads' weighted sum).

    chosen, rejected: (N,) scores of the pairs' two answers. label: (N,) in [0, 1] (1:
    chosen better, 0: worse, 0.5: tie, NaN: no label), or None where this reward has no
    labels of its own (a weighted sum of heads). len_chosen, len_rejected: (N,) answer
    lengths in tokens. Keys: ``longer_preferred`` (the reward's share, pairs of unequal
    length), ``score_length_corr`` (over all 2N answers), and with labels also
    ``accuracy`` and ``calibration_error`` (decided pairs), ``longer_preferred_by_labels``
    and ``length_bias`` = longer_preferred − longer_preferred_by_labels (pairs of unequal
    length with a decided label, for both shares), ``pairs`` (decided pairs).
    """
    diff = chosen - rejected
    out = {
        "longer_preferred": longer_preferred(diff, len_chosen, len_rejected)[0],
        "score_length_corr": pearson(
            torch.cat([chosen, rejected]), torch.cat([len_chosen, len_rejected]).double()
        ),
    }
    if label is None:
        return out
    decided = ~torch.isnan(label) & (label != 0.5)
    outcome = (label[decided] > 0.5).double()
    d, lc, lr = diff[decided], len_chosen[decided], len_rejected[decided]
    by_model, _ = longer_preferred(d, lc, lr)
    by_labels, _ = longer_preferred(outcome - 0.5, lc, lr)
    out.update(
        accuracy=((d > 0).double() == outcome).double().mean().item() if d.numel() else math.nan,
        calibration_error=calibration_error(d, outcome),
        longer_preferred=by_model,
        longer_preferred_by_labels=by_labels,
        length_bias=by_model - by_labels,
        pairs=int(decided.sum()),
    )
    return out


def length_warning(reward: dict[str, float]) -> str | None:
    """A warning when ``reward`` (the checks of what PPO will optimise) prefers the longer
    answer in more than LONGER_PREFERRED_WARNING of held-out pairs; else None."""
    share = reward["longer_preferred"]
    if not share > LONGER_PREFERRED_WARNING:
        return None
    labels = reward.get("longer_preferred_by_labels", math.nan)
    return (
        f"the reward PPO will optimise (reward.heads) prefers the longer answer in "
        f"{100 * share:.0f}% of held-out pairs of unequal length"
        + ("" if math.isnan(labels) else f" (its preference labels: {100 * labels:.0f}%)")
        + ": PPO against it is likely to lengthen its answers; watch response/length and "
        "the monitor's length signals"
    )


def gold_warning(reward_vs_gold: dict[str, float]) -> str | None:
    """A warning when the reward (its checks against a gold reward's choices) agrees with
    the gold reward on fewer than GOLD_AGREEMENT_WARNING of held-out pairs; else None."""
    agreement = reward_vs_gold.get("accuracy", math.nan)
    if not agreement < GOLD_AGREEMENT_WARNING:
        return None
    n = reward_vs_gold.get("pairs")
    of = "held-out pairs" if n is None else f"{n} held-out pair{'' if n == 1 else 's'}"
    return (
        f"the reward PPO will optimise agrees with the gold reward on {100 * agreement:.0f}% "
        f"of {of} (chance: 50%): PPO against it can raise the proxy score while the "
        "gold reward stalls or falls; watch monitor/gold and the gold_drop alert"
        + (few_pairs(n) if n is not None else "")
    )


# held-out pairs below which a share of them is mostly chance (one pair: 0 % or 100 %)
FEW_PAIRS = 30


def few_pairs(n: int) -> str:
    """What to add to a warning drawn from ``n`` held-out pairs when they are few."""
    if n >= FEW_PAIRS:
        return ""
    return (
        f" — but {n} pair{' says' if n == 1 else 's say'} little either way: hold out more "
        "(rm.heldout_fraction, or more pairs)"
    )
