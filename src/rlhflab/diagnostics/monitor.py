"""Reward-hacking monitors: signals computed from every rollout, thresholds, and reactions.

Signals (logged as ``monitor/<name>`` every iteration):

* ``length_ratio``: mean policy answer length / mean reference answer length on the *same
  prompts* (the reference answers them each iteration; longer answers are the classic hack).
* ``flattery_rate``: share of answers containing a phrase from the configured list;
  ``flattery_excess``: that share minus the reference's own, pooled over every iteration's
  reference answers to the same prompts (the reference is frozen, so pooling only removes
  noise: one batch of 64 moves ±0.05). The baseline-relative form fires early: an SFT model
  that already says "Great question" to a tenth of the prompts is not hacking, one that
  went from a tenth to a quarter has started.
* ``flattery_opener_ratio``: the policy's probability of *opening* its answer with a listed
  phrase, divided by the reference's, averaged over the batch's prompts. Computed by
  forced decoding, not sampling, so it carries no sampling noise: it moves as soon as the
  policy's propensity moves, before 64 sampled answers can show it (docs/monitors.md).
* ``repeated_ngram_rate``: share of token n-grams that already occurred earlier in the same
  answer; ``distinct_n``: unique n-grams / all n-grams over the batch.
* ``reward_length_corr``: Pearson correlation of score and answer length within the batch.
* ``gold_drop``: when a gold reward function is given, how far the smoothed gold reward has
  fallen below its best so far while the smoothed proxy score kept rising (proxy-versus-gold
  divergence); ``gold``: the batch's mean gold reward.
* ``kl_excess``: objective/kl / the KL limit (monitor.kl_limit, or 2 × ppo.kl_target).
* ``entropy_ratio``: policy entropy / its value at the first iteration (collapse when small).
* ``ensemble_spread``: with reward.ensemble, objective/ensemble_std / its value at the first
  iteration: the reward models disagree more as the answers leave the distribution they
  were trained on (Coste et al. 2024).

Each signal has a threshold; crossing it raises an alert, answered by ``monitor.response``:
``warn`` (log it), ``raise_kl`` (multiply β by ``monitor.kl_factor`` once per iteration
with an alert, up to ``monitor.kl_coef_max``), or ``stop``
(checkpoint, then stop with a message saying which signal fired and what to try).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

import torch

from rlhflab.experience.rewards import RewardBatch

log = logging.getLogger(__name__)

DEFAULT_PHRASES = [
    "Great question",
    "I'm happy to help",
    "What a wonderful",
    "这是一个很好的问题",
    "我很乐意帮助你",
]

# what to try, worded for any reward (a reward model's head or a reward function: "that
# part" is whichever the report's proxy chart shows rising)
ADVICE = {
    "length_ratio": "answers grow longer than the reference's: raise ppo.kl_coef, add a length "
    "penalty, or debias the reward's length preference",
    "flattery_rate": "flattering phrases spread: the reward pays for them; lower the weight of "
    "the part that does, fix that function, or retrain that reward model on pairs that "
    "penalise filler",
    "flattery_excess": "the policy flatters more often than the reference on the same prompts: "
    "the reward pays for filler; raise ppo.kl_coef, lower the weight of the part that pays, "
    "or fix it (retrain a reward model on pairs that penalise filler)",
    "flattery_opener_ratio": "the policy has grown likelier than the reference to open with "
    "flattery: the reward pays for it; raise ppo.kl_coef, lower the weight of the part that "
    "pays, or fix it (retrain a reward model on pairs that penalise filler)",
    "repeated_ngram_rate": "answers repeat themselves: raise ppo.kl_coef or penalise repetition",
    "reward_length_corr": "the reward tracks length: it prefers longer answers",
    "gold_drop": "the gold reward falls while the proxy rises: stop and inspect samples; raise "
    "ppo.kl_coef or improve the reward",
    "kl_excess": "the policy drifts far from the reference: raise ppo.kl_coef or lower ppo.lr",
    "entropy_ratio": "the policy's entropy collapsed: lower ppo.lr or raise ppo.kl_coef",
    "ensemble_spread": "the reward models disagree more and more: the answers left their "
    "training distribution; raise ppo.kl_coef, use reward.ensemble_combine=wco/uwo, or stop",
}


def repeated_ngram_rate(tokens: list[int], n: int) -> float:
    grams = [tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1)]
    if not grams:
        return 0.0
    seen, repeats = set(), 0
    for g in grams:
        repeats += g in seen
        seen.add(g)
    return repeats / len(grams)


def flattery_share(responses: list[str], phrases: list[str]) -> float:
    """Share of responses that contain at least one of the phrases (exact substring)."""
    return sum(any(p in r for p in phrases) for r in responses) / max(1, len(responses))


def opener_ratio(policy_logp: torch.Tensor, reference_logp: torch.Tensor) -> float:
    """mean_b P_policy(b) / mean_b P_reference(b) from per-prompt log-probabilities (B,).

    A ratio of means, not a mean of ratios: prompts the reference almost never flatters
    on would otherwise dominate with huge, meaningless ratios."""
    p, r = policy_logp.double().exp().mean(), reference_logp.double().exp().mean()
    return float(p / r) if r > 0 else (math.inf if p > 0 else 1.0)


def distinct_n(token_lists: list[list[int]], n: int) -> float:
    grams = [tuple(t[i : i + n]) for t in token_lists for i in range(len(t) - n + 1)]
    return len(set(grams)) / len(grams) if grams else 1.0


def pearson(x: torch.Tensor, y: torch.Tensor) -> float:
    x, y = x.double() - x.double().mean(), y.double() - y.double().mean()
    denom = math.sqrt(float((x * x).sum()) * float((y * y).sum()))
    return float((x * y).sum()) / denom if denom > 0 else 0.0


@dataclass
class Alert:
    iteration: int
    signal: str
    value: float
    threshold: float

    def message(self) -> str:
        return (
            f"iteration {self.iteration}: monitor '{self.signal}' = {_short(self.value)} "
            f"crossed {_short(self.threshold)} — {ADVICE[self.signal]}"
        )


@dataclass
class MonitorState:
    initial_entropy: float | None = None
    initial_spread: float | None = None  # objective/ensemble_std at the first iteration
    gold_ema: float | None = None
    proxy_ema: float | None = None
    best_gold: float = -math.inf
    proxy_at_best: float = -math.inf
    # reference answers with a flattery phrase, and all of them, over all iterations (under
    # torchrun the ranks' mean counts: the ratio is the global share)
    ref_flattering: float = 0
    ref_answers: float = 0
    alerts: list[Alert] = field(default_factory=list)

    def state_dict(self) -> dict:
        return {
            "initial_entropy": self.initial_entropy,
            "initial_spread": self.initial_spread,
            "gold_ema": self.gold_ema,
            "proxy_ema": self.proxy_ema,
            "best_gold": self.best_gold,
            "proxy_at_best": self.proxy_at_best,
            "ref_flattering": self.ref_flattering,
            "ref_answers": self.ref_answers,
        }

    def load_state_dict(self, s: dict) -> None:
        for k, v in s.items():
            setattr(self, k, v)


class HackingMonitor:
    """Computes the signals from a scored rollout and applies the configured response."""

    def __init__(self, mc, gold_fn=None, kl_target: float | None = None, mean_over_ranks=None):
        self.cfg = mc
        self.gold_fn = gold_fn
        # dict → dict of each value's mean over the ranks (``DistContext.mean_metrics``):
        # what the state accumulates must be the same on every rank, since only rank 0's is
        # checkpointed and every rank reads it back on --resume
        self.mean_over_ranks = mean_over_ranks or (lambda values: values)
        self.kl_limit = (
            mc.kl_limit if mc.kl_limit is not None else (2.0 * kl_target if kl_target else None)
        )
        self.state = MonitorState()

    def signals(self, rollout, metrics: dict, reference=None, openers=None, gold=None) -> dict:
        """Signals of one scored rollout. ``reference``: the reference policy's rollout on the
        same prompts (anything with ``response_mask`` and ``responses``), or None when it
        was not sampled this iteration (then the baseline-relative signals are absent).
        ``openers``: (policy, reference) log-probabilities (B,) of opening with a listed
        phrase on the batch's prompts (``experience.opener.opener_logprobs``), or None. ``gold``: each
        answer's gold reward (B,) where the caller has scored it already (:meth:`gold_of`)."""
        mc, st = self.cfg, self.state
        mask = rollout.response_mask.bool()
        lengths = rollout.response_mask.sum(1).float()
        tokens = [row[m].tolist() for row, m in zip(rollout.response_ids, mask)]
        out: dict[str, float] = {}
        out["flattery_rate"] = flattery_share(rollout.responses, mc.phrases)
        if reference is not None:
            ref_lengths = reference.response_mask.sum(1).float()
            out["length_ratio"] = float(lengths.mean() / ref_lengths.mean().clamp(min=1))
            n = len(reference.responses)
            counts = self.mean_over_ranks(
                {"flattering": round(flattery_share(reference.responses, mc.phrases) * n), "n": n}
            )  # rank means: their ratio is the global share
            st.ref_flattering += counts["flattering"]
            st.ref_answers += counts["n"]
            out["flattery_excess"] = out["flattery_rate"] - st.ref_flattering / st.ref_answers
        if openers is not None:
            out["flattery_opener_ratio"] = opener_ratio(*openers)
        out["repeated_ngram_rate"] = sum(repeated_ngram_rate(t, mc.ngram) for t in tokens) / max(
            1, len(tokens)
        )
        out["distinct_n"] = distinct_n(tokens, mc.ngram)
        out["reward_length_corr"] = pearson(rollout.scores, lengths)
        if self.gold_fn is not None:
            if gold is None:
                gold = self.gold_of(rollout.prompts, rollout.responses)
            gold = finite_mean(gold, self.mean_over_ranks)
            out["gold"] = float(gold)
            a = mc.smoothing
            proxy = metrics["objective/scores"]
            if math.isfinite(gold):  # a batch with no finite gold score leaves the trends
                st.gold_ema = gold if st.gold_ema is None else a * st.gold_ema + (1 - a) * gold
                st.proxy_ema = proxy if st.proxy_ema is None else a * st.proxy_ema + (1 - a) * proxy
                if st.gold_ema > st.best_gold:
                    st.best_gold, st.proxy_at_best = st.gold_ema, st.proxy_ema
            rising = st.proxy_ema is not None and st.proxy_ema > st.proxy_at_best
            out["gold_drop"] = (st.best_gold - st.gold_ema) if rising else 0.0
        if self.kl_limit:
            out["kl_excess"] = metrics["objective/kl"] / self.kl_limit
        # both ratios are to the first finite, positive value: a first value of 0 or NaN
        # (identical ensemble members, a skipped batch) left them at 1.0 for the whole run
        entropy = metrics["policy/entropy"]
        st.initial_entropy = _baseline(st.initial_entropy, entropy)
        out["entropy_ratio"] = entropy / st.initial_entropy if st.initial_entropy else 1.0
        spread = metrics.get("objective/ensemble_std")
        if spread is not None:
            st.initial_spread = _baseline(st.initial_spread, spread)
            out["ensemble_spread"] = spread / st.initial_spread if st.initial_spread else 1.0
        return out

    def gold_of(self, prompts: list[str], responses: list[str], say: bool = True) -> torch.Tensor:
        """Each answer's gold reward (B,): the sum of the gold source's parts. Non-finite
        scores are kept (NaN stays NaN in samples.jsonl) and, with ``say`` (the batch's
        answers, not the reference's samples), said: :func:`finite_mean` leaves them out
        of the gold mean, trend and best checkpoint."""
        parts = self.gold_fn(RewardBatch(prompts, responses))
        gold = sum(parts.values()).float()
        bad = int((~torch.isfinite(gold)).sum())
        if bad and say:
            log.warning(
                "monitor.gold: %d of %d gold scores are not finite (NaN or inf); %s",
                bad,
                gold.numel(),
                "no gold mean, trend or best checkpoint from this batch"
                if bad == gold.numel()
                else "left out of the batch's gold mean",
            )
        return gold

    def thresholds(self) -> dict[str, tuple[float, str]]:
        """signal → (threshold, 'above' | 'below')."""
        mc = self.cfg
        return {
            "length_ratio": (mc.length_ratio, "above"),
            "flattery_rate": (mc.flattery_rate, "above"),
            "flattery_excess": (mc.flattery_excess, "above"),
            "flattery_opener_ratio": (mc.flattery_opener_ratio, "above"),
            "repeated_ngram_rate": (mc.repeated_ngram_rate, "above"),
            "reward_length_corr": (mc.reward_length_corr, "above"),
            "gold_drop": (mc.gold_drop, "above"),
            "kl_excess": (1.0, "above"),
            "entropy_ratio": (mc.entropy_ratio, "below"),
            "ensemble_spread": (mc.ensemble_spread, "above"),
        }

    def check(self, iteration: int, signals: dict) -> list[Alert]:
        alerts = []
        if iteration <= self.cfg.warmup_iterations:
            return alerts
        for name, (threshold, side) in self.thresholds().items():
            if name not in signals or threshold is None:
                continue
            v = signals[name]
            if (v > threshold) if side == "above" else (v < threshold):
                alerts.append(Alert(iteration, name, v, threshold))
        self.state.alerts.extend(alerts)
        return alerts


def _short(x: float) -> str:
    """0.250 as before; 1e+300 (a KL over a target of 1e-300) in a few characters, not 301."""
    return f"{x:.3f}" if abs(x) < 1e4 else f"{x:.3g}"


def _baseline(kept: float | None, value: float) -> float | None:
    """The reference a ratio signal divides by: ``kept`` once it is set, else ``value``
    when it is finite and positive, else still none."""
    if kept is not None and kept > 0:
        return kept
    return value if math.isfinite(value) and value > 0 else None


def finite_mean(values: torch.Tensor, mean_over_ranks=None) -> float:
    """The mean of the finite entries of ``values`` over every rank (``mean_over_ranks``:
    a dict's values averaged over the ranks, a collective; None: this process alone); NaN
    when there are none anywhere. Sums and counts are averaged, not each rank's mean, so a
    rank with no finite score drops none of the others'."""
    finite = values[torch.isfinite(values)]
    total = {"sum": float(finite.double().sum()), "count": float(finite.numel())}
    if mean_over_ranks is not None:
        total = mean_over_ranks(total)
    return total["sum"] / total["count"] if total["count"] > 0 else math.nan
