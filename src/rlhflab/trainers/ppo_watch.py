"""Steps 2b and 9b of a PPO iteration: the reward-hacking monitor's probe and its reaction,
and step 9's check that the KL to the reference is not significantly negative.

A mixin of :class:`rlhflab.trainers.ppo.PPOTrainer` (which owns the models, the monitor and
the KL controller read here), kept apart so that ``ppo.py`` stays a short list of numbered
steps. The signals themselves are computed in ``rlhflab.diagnostics.monitor``.
"""

from __future__ import annotations

import logging

import torch

from rlhflab.core import algorithms as A
from rlhflab.experience.rollout import Rollout, generate_rollout, opener_logprobs

log = logging.getLogger(__name__)

# A batch's mean k1 KL this many standard errors below zero cannot come from answers that
# π itself sampled (E[k1] = KL ≥ 0). At z = −4 a correct run is wrongly warned about with
# probability ~3e-5 per iteration even at KL exactly 0 (normal approximation).
NEGATIVE_KL_Z = -4.0


class PPOWatch:
    """The monitor's work inside an iteration; mixed into ``PPOTrainer``."""

    def _opener_probe(self, rollout: Rollout):
        """(policy, reference) log P(answer opens with a flattery phrase), (B,) each, or None
        when the monitor or its flattery_opener_ratio signal is off."""
        mc, r = self.cfg.monitor, self.cfg.rollout
        if self.monitor is None or mc.flattery_opener_ratio is None or not mc.phrases:
            return None
        args = (rollout.prompt_ids, rollout.prompt_mask, mc.phrases, r.temperature)
        tok, micro = self.cast.tokenizer, r.score_micro_batch
        # every rank's prompts: the signal is a ratio of means over the global batch
        return tuple(
            self.ctx.all_gather_cat(opener_logprobs(model, tok, *args, micro, mc.opener_tokens))
            for model in (self.cast.policy_lm, self.cast.reference)
        )

    def _check_kl_sign(self, seq_kl: torch.Tensor) -> None:
        """Warn once a run when the global batch's per-answer k1 KL (B,) is significantly
        negative. TRL users meet "KL divergence is starting to become negative" and ask why
        (trl #925, #1161; LlamaFactory #664); this names the causes this config has."""
        if getattr(self, "kl_sign_warned", False):
            return
        z = A.mean_z_score(self.ctx.all_gather_cat(seq_kl.detach().float()))
        if not z < NEGATIVE_KL_Z:
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

    def _watch(self, rollout: Rollout, metrics: dict, openers=None) -> dict[str, float]:
        """Step 9b: reward-hacking signals, alerts, and the configured reaction."""
        mc, r = self.cfg.monitor, self.cfg.rollout
        it = self.iteration + 1
        ref = None
        if mc.reference_every and it % mc.reference_every == 0:
            ref = generate_rollout(
                self.cast.reference,
                self.cast.tokenizer,
                rollout.prompts,
                r.max_new_tokens,
                r.temperature,
                r.top_k,
                r.top_p,
                self.gens["monitor"],
                self.device,
                all_done=self.all_done,
                ignore_eos=r.ignore_eos,
            )
        signals = self.monitor.signals(rollout, metrics, ref, openers)
        signals = self.ctx.mean_metrics(signals)
        alerts = self.monitor.check(it, signals)
        for alert in alerts:
            log.warning("%s", alert.message())
            if mc.response == "raise_kl":
                self.kl_ctl.value *= mc.kl_factor
                log.warning("monitor.response=raise_kl: β → %.4g", self.kl_ctl.value)
            elif mc.response == "stop" and self.stop_reason is None:
                self.stop_reason = f"{alert.message()} (monitor.response=stop)"
        return {**{f"monitor/{k}": v for k, v in signals.items()}, "monitor/alerts": len(alerts)}
