"""Steps 2b and 9b of a PPO iteration: the reward-hacking monitor's probe and its reaction.

A mixin of :class:`rlhflab.trainers.ppo.PPOTrainer` (which owns the models, the monitor and
the KL controller read here), kept apart so that ``ppo.py`` stays a short list of numbered
steps. The signals themselves are computed in ``rlhflab.monitor``.
"""

from __future__ import annotations

import logging

from rlhflab.rollout import Rollout, generate_rollout, opener_logprobs

log = logging.getLogger(__name__)


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
