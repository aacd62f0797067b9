"""Steps 2b, 2c and 9b of a PPO iteration: the reward-hacking monitor's probe, the batch's
gold reward (and whether it is the best so far, for ``log.keep_best``), the monitor's
reaction, and step 9's check that the KL to the reference is not significantly negative.

:class:`PPOWatch` is held by :class:`rlhflab.trainers.ppo.PPOTrainer`; it owns the monitor
and may raise the KL controller's β or ask the run to stop (``stop_reason``). The signals
themselves are computed in ``rlhflab.diagnostics.monitor``.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch

from rlhflab.config import Config, ConfigError
from rlhflab.core import algorithms as A
from rlhflab.core.stats import student_t_quantile
from rlhflab.diagnostics.monitor import HackingMonitor, finite_mean
from rlhflab.experience.opener import PromptCaches, opener_logprobs
from rlhflab.experience.rewards import FunctionReward, RewardBatch
from rlhflab.experience.rollout import Rollout, generate_rollout

log = logging.getLogger(__name__)


def raised_kl_coef(beta: float, factor: float, ceiling: float) -> float:
    """monitor.response=raise_kl's new β after an iteration with alerts: β × ``factor``,
    at most ``ceiling`` (never lowered by it: a β set above the ceiling stays). Once per
    iteration however many signals alerted, since the flattery signals are three views of
    one change and used to multiply β up to three times an iteration (docs/hacking.md: β
    reached 1.3e5 and the critic's loss 1e8)."""
    return max(beta, min(beta * factor, ceiling))


# A batch's mean k1 KL significantly below zero cannot come from answers that π itself
# sampled (E[k1] = KL ≥ 0). The threshold is the z-score a correct run at KL exactly 0 falls
# below with this probability per iteration: −4.0 for large batches, Student's t quantile
# for small ones (−33 at 4 answers, where a fixed −4 alarmed 1.4 % of iterations).
NEGATIVE_KL_P = 3e-5


@dataclass
class BestGold:
    """The best exponential moving average of the batches' mean gold reward so far (the
    recurrence of :func:`rlhflab.diagnostics.gold_curve.ema`, so the report finds the same
    iteration from metrics.jsonl); ``iteration``: the logged iteration it was reached at."""

    smoothing: float
    ema: float | None = None
    best: float = -math.inf
    iteration: int = 0

    def update(self, gold: float, iteration: int) -> bool:
        """Smooth in one batch's mean gold; True when that is a new best."""
        a = self.smoothing
        self.ema = gold if self.ema is None else a * self.ema + (1 - a) * gold
        if self.ema > self.best:
            self.best, self.iteration = self.ema, iteration
            return True
        return False

    def state_dict(self) -> dict:
        return {"ema": self.ema, "best": self.best, "iteration": self.iteration}

    def load_state_dict(self, s: dict) -> None:
        self.ema, self.best, self.iteration = s["ema"], s["best"], s["iteration"]


class PPOWatch:
    """The monitor's work inside an iteration, and the KL-sign check."""

    def __init__(
        self, cfg: Config, ctx, cast, kl_ctl, generator: torch.Generator, all_done, gold=None
    ):
        self.cfg, self.ctx, self.cast = cfg, ctx, cast
        self.kl_ctl = kl_ctl  # monitor.response=raise_kl multiplies its β
        # the reference's samples draw from their own stream, so switching the monitor on
        # or off never changes what the policy samples
        self.generator = generator
        self.all_done = all_done  # the sampler's every-rank stop test under FSDP, or None
        self.monitor: HackingMonitor | None = None
        if cfg.monitor.enabled:
            # gold: a reward source a Python caller brings, else monitor.gold's function
            if gold is None and cfg.monitor.gold:
                gold = FunctionReward(cfg.monitor.gold)
            self.monitor = HackingMonitor(
                cfg.monitor, gold, cfg.ppo.kl_target, mean_over_ranks=ctx.mean_metrics
            )
        self._reference: tuple[int, Rollout] | None = None  # (iteration, its answers)
        self.kl_sign_warned = False
        self.stop_reason: str | None = None  # set by monitor.response=stop
        has_gold = self.monitor is not None and self.monitor.gold_fn is not None
        if cfg.log.keep_best and not has_gold:
            raise ConfigError(
                "log.keep_best: the best policy is judged by a gold reward; set monitor.gold "
                "(and keep monitor.enabled), or leave log.keep_best unset"
            )
        self.keep_best = has_gold if cfg.log.keep_best is None else cfg.log.keep_best
        self.best = BestGold(cfg.monitor.smoothing)
        # this iteration's per-answer gold (B,) and the reference's rollout on the same
        # prompts (None: not sampled this iteration), for the logged samples
        self.last_gold: torch.Tensor | None = None
        self.last_reference = None

    def score_gold(self, rollout: Rollout, iteration: int) -> bool:
        """Step 2c of iteration ``iteration`` (1-based): each answer's gold reward, kept for
        the monitor and the samples; True when the smoothed mean over every rank is the
        best so far (the same decision on every rank: a collective save may follow)."""
        self.last_gold = None
        if self.monitor is None or self.monitor.gold_fn is None:
            return False
        self.last_gold = self.monitor.gold_of(rollout.prompts, rollout.responses)
        mean = finite_mean(self.last_gold, self.ctx.mean_metrics)
        # NaN on any rank is NaN on every rank: all skip alike (a collective save may follow)
        return math.isfinite(mean) and self.best.update(mean, iteration)

    def prompt_caches(self, iteration: int) -> dict[str, PromptCaches] | None:
        """Where steps 1 and 2 of iteration ``iteration`` (0-based) keep the prompts' KV
        caches for the opener probe: the sampling pass's for the policy, the scoring
        forward's for the reference; None when the probe is off or skips this iteration
        (monitor.opener_every: it runs at the first and at every N-th)."""
        mc, it = self.cfg.monitor, iteration + 1
        if self.monitor is None or mc.flattery_opener_ratio is None or not mc.phrases:
            return None
        if it != 1 and it % mc.opener_every:
            return None
        # under FSDP every rank runs as many probe forwards as the others: no skipping of
        # a rank's repeated prompts there
        chunk, distinct = self.cfg.rollout.score_micro_batch, self.all_done is None
        return {role: PromptCaches(chunk, distinct) for role in ("policy", "reference")}

    def opener_probe(self, rollout: Rollout, caches: dict[str, PromptCaches] | None):
        """(policy, reference) log P(answer opens with a flattery phrase), (B,) each, or None
        when the probe does not run this iteration. ``caches``: what :meth:`prompt_caches`
        gave steps 1 and 2, filled (each serves one probe); None: not probing."""
        if caches is None:
            return None
        mc, r = self.cfg.monitor, self.cfg.rollout
        args = (rollout.prompt_ids, rollout.prompt_mask, mc.phrases, r.temperature)
        tok, micro = self.cast.tokenizer, r.score_micro_batch
        # every rank's prompts: the signal is a ratio of means over the global batch; each
        # model in the arithmetic it trains or scores in (model.compute_dtype)
        cast, out = self.cast, []
        for role, model, autocast in (
            ("policy", cast.policy_lm, cast.autocast),
            ("reference", cast.reference, cast.reference_autocast),
        ):
            kept, distinct = caches[role].parts, caches[role].distinct
            with autocast():  # (it empties ``kept``: each cache serves one probe)
                lp = opener_logprobs(
                    model, tok, *args, micro, mc.opener_tokens, kept, distinct=distinct
                )
            out.append(self.ctx.all_gather_cat(lp))
        return tuple(out)

    def reference_rollout(self, rollout: Rollout, iteration: int) -> Rollout:
        """The reference policy's answers to ``rollout``'s prompts at ``iteration``, sampled
        once however many users ask (the monitor's length and flattery baselines,
        reward.shaping=par), from the monitor's own random stream."""
        if self._reference is not None and self._reference[0] == iteration:
            return self._reference[1]
        r = self.cfg.rollout
        ref = generate_rollout(
            self.cast.reference,
            self.cast.tokenizer,
            rollout.prompts,
            r.max_new_tokens,
            r.temperature,
            r.top_k,
            r.top_p,
            self.generator,
            self.cast.device,
            all_done=self.all_done,
            ignore_eos=r.ignore_eos,
            autocast=self.cast.reference_autocast,
            sampler=r.sampler,
        )
        self._reference = (iteration, ref)
        return ref

    def check_kl_sign(self, seq_kl: torch.Tensor) -> None:
        """Warn once a run when the global batch's per-answer k1 KL (B,) is significantly
        negative. TRL users meet "KL divergence is starting to become negative" and ask why
        (trl #925, #1161; LlamaFactory #664); this names the causes this config has."""
        if self.kl_sign_warned:
            return
        kl = self.ctx.all_gather_cat(seq_kl.detach().float())
        z = A.mean_z_score(kl)
        if kl.numel() < 2 or not z < student_t_quantile(NEGATIVE_KL_P, kl.numel() - 1):
            return
        self.kl_sign_warned = True
        r = self.cfg.rollout
        causes = ["a sampler or forward that does not compute π's own log-probs"]
        if r.top_k or r.top_p < 1.0:
            causes.insert(
                0,
                "rollout.top_k/top_p truncate the sampling distribution, while "
                "the log-probs are the full distribution's",
            )
        log.warning(
            "objective/kl (k1) is %.1f standard errors below zero: the answers were not "
            "sampled from the policy whose log-probs are used, so KL(π‖π_ref), the KL "
            "penalty and the ratio are off. Likely: %s. objective/kl_k3 (never negative) "
            "is logged beside it.",
            -z,
            "; or ".join(causes),
        )

    def react(self, rollout: Rollout, metrics: dict, openers, iteration: int) -> dict[str, float]:
        """Step 9b of iteration ``iteration`` (0-based): reward-hacking signals, alerts, and
        the configured reaction; the ``monitor/`` metrics (none with the monitor off)."""
        if self.monitor is None:
            return {}
        mc, it = self.cfg.monitor, iteration + 1
        ref = None
        if mc.reference_every and it % mc.reference_every == 0:
            ref = self.reference_rollout(rollout, iteration)
        self.last_reference = ref
        signals = self.monitor.signals(rollout, metrics, ref, openers, self.last_gold)
        signals = self.ctx.mean_metrics(signals)
        alerts = self.monitor.check(it, signals)
        for alert in alerts:
            log.warning("%s", alert.message())
            if mc.response == "stop" and self.stop_reason is None:
                self.stop_reason = f"{alert.message()} (monitor.response=stop)"
        if alerts and mc.response == "raise_kl":
            before = self.kl_ctl.value
            self.kl_ctl.value = raised_kl_coef(before, mc.kl_factor, mc.kl_coef_max)
            if self.kl_ctl.value != before:
                log.warning("monitor.response=raise_kl: β → %.4g", self.kl_ctl.value)
            else:  # "β → 0.005" where it stayed read as a raise that never happened
                log.warning("monitor.response=raise_kl: β stays %.4g (monitor.kl_coef_max)", before)
        return {**{f"monitor/{k}": v for k, v in signals.items()}, "monitor/alerts": len(alerts)}

    def sample_extras(self, n: int) -> list[dict]:
        """For the first ``n`` answers of the last rollout: their gold reward, and the
        reference's answer to the same prompt with its proxy score, per-component scores and
        gold (each where this iteration has it)."""
        out: list[dict] = [{} for _ in range(n)]
        if self.last_gold is not None:
            for i, row in enumerate(out):
                row["gold"] = float(self.last_gold[i])
        ref = self.last_reference
        if ref is None or n == 0:
            return out
        n = min(n, len(ref))
        batch = RewardBatch(
            ref.prompts[:n],
            ref.responses[:n],
            ref.sequences[:n],
            ref.attention_mask[:n],
            ref.ended[:n],
        )
        with torch.no_grad():
            scored = self.cast.reward(batch)
        gold = (
            self.monitor.gold_of(batch.prompts, batch.responses, say=False)
            if self.last_gold is not None
            else None
        )
        for i in range(n):
            out[i]["reference"] = {
                "response": ref.responses[i],
                "score": float(scored.score[i]),
                "components": {k: float(v[i]) for k, v in scored.components.items()},
                **({"gold": float(gold[i])} if gold is not None else {}),
            }
        return out

    def new_alerts(self, iteration: int) -> list[dict]:
        """The alerts raised at ``iteration`` (1-based), as the run log writes them."""
        if self.monitor is None:
            return []
        new = [a for a in self.monitor.state.alerts if a.iteration == iteration]
        return [vars(a) | {"message": a.message()} for a in new]
