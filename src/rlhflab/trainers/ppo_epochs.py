"""Step 8 of a PPO iteration: the epochs over the rollout, and the guarded optimiser update.

A mixin of :class:`rlhflab.trainers.ppo.PPOTrainer`, which owns the models, optimisers and
configuration read here. Kept apart so that ``ppo.py`` stays a short list of numbered
steps; here are the minibatch and micro-batch loops, the losses they add up, and the guard
that skips an update whose loss or gradient is not finite.
"""

from __future__ import annotations

import contextlib
import logging
import math

import torch

from rlhflab.backends.optim import UpdateInBackward, clip_grad_norms
from rlhflab.core import algorithms as A
from rlhflab.core import losses as L
from rlhflab.experience.rollout import Rollout, answer_values, policy_outputs
from rlhflab.infra.distributed import accumulate
from rlhflab.trainers.common import Halt

log = logging.getLogger(__name__)


class PPOEpochs:
    """PPO epochs, micro-batched losses and the update; mixed into ``PPOTrainer``."""

    def _ppo_epochs(self, ro: Rollout, advantages, returns, beta) -> dict[str, float]:
        p, cast = self.cfg.ppo, self.cast
        B = len(ro)
        mb_size = self.minibatch_size  # PPOTrainer checked the split (distributed.rank_split)
        if B != mb_size * p.minibatches:
            raise RuntimeError(
                f"this rank holds {B} answers, not {p.minibatches} minibatches of {mb_size}"
            )
        micro = p.micro_batch_size or mb_size
        cast.policy.train()
        if cast.critic is not None:
            cast.critic.train()
        stats: dict[str, list[float]] = {}
        if ro.old_logprobs is None:  # ppo.reuse_training_forward: this forward supplies them
            ro.old_logprobs = torch.zeros_like(ro.ref_logprobs)
            ro.entropy = torch.zeros_like(ro.ref_logprobs)
            self.reuse_filled = torch.zeros(B, dtype=torch.bool, device=ro.ref_logprobs.device)
        else:
            self.reuse_filled = None
        # ppo.step_in_backward: AdamW runs inside each backward, tensor by tensor
        self.in_backward = None
        if p.step_in_backward:
            self.in_backward = UpdateInBackward((self.opt, self.critic_opt))
        with self.in_backward or contextlib.nullcontext():
            self._epoch_loop(ro, advantages, returns, beta, stats, B, mb_size, micro)
        out = {k: sum(v) / len(v) for k, v in stats.items()}
        out["policy/ratio_max"] = self.ratio_max
        if p.dual_clip is None:
            out.pop("policy/dual_clipfrac", None)
        return out

    def _epoch_loop(self, ro, advantages, returns, beta, stats, B, mb_size, micro) -> None:
        p, cast = self.cfg.ppo, self.cast
        seqs, attn = ro.sequences, ro.attention_mask
        P = ro.prompt_ids.shape[1]
        self.ratio_max = 0.0
        for _epoch in range(p.epochs):
            order = torch.randperm(B, generator=self.gens["shuffle"]).to(self.device)
            for start in range(0, B, mb_size):
                idx = order[start : start + mb_size]
                n_tokens = ro.response_mask[idx].sum().clamp(min=1)
                # Global token count: DDP/FSDP average gradients over ranks, so dividing each
                # rank's token sum by (global tokens / world) gives the global token mean.
                global_tokens = self.ctx.all_sum(n_tokens.double().reshape(1))[0]
                agg = {
                    "num_tokens": global_tokens / self.ctx.world,
                    "num_seqs": mb_size,
                    # Dr. GRPO's constant: one number for every batch, rank and minibatch
                    "norm": p.loss_agg_norm or self.cfg.rollout.max_new_tokens,
                }
                n_micro = (mb_size + micro - 1) // micro
                mb_stats: dict[str, float] = {}
                finite = True
                for k_micro, ms in enumerate(range(0, mb_size, micro)):
                    i = idx[ms : ms + micro]
                    m = ro.response_mask[i]
                    sync = k_micro == n_micro - 1
                    trained = [t for t in (self.train_policy, self.train_critic) if t is not None]
                    with accumulate(trained, sync):
                        # A separate critic's graph is disjoint from the policy's: backward
                        # each as soon as it is built, so only one model's activations are
                        # alive at a time (same gradients, half the activation peak). The
                        # graph step 2 kept goes first, before the policy's is built.
                        separate = returns is not None and not cast.shared
                        critic_first = separate and self.kept_values is not None
                        if critic_first:
                            vf, vf_stats, finite = self._critic_step(ro, i, m, returns, agg)
                            if not finite:
                                break
                        total, pg, pg_stats, vf_head, vf_head_stats = self._micro_loss(
                            ro, i, m, advantages, returns, beta, agg, seqs, attn, P
                        )
                        if not self.ctx.all_true(bool(torch.isfinite(total))):
                            finite = False
                            break
                        total.backward()
                        if not separate:  # the value loss (if any) was in the policy's
                            vf, vf_stats = vf_head, vf_head_stats
                        elif not critic_first:
                            vf, vf_stats, finite = self._critic_step(ro, i, m, returns, agg)
                            if not finite:
                                break
                    share = m.sum().item() / n_tokens.item()
                    named = {
                        "policy/loss": pg.item(),
                        **{f"policy/{k}": v.item() for k, v in pg_stats.items()},
                    }
                    if vf_stats:
                        named["val/loss"] = vf.item()
                        named["val/clipfrac"] = vf_stats["vf_clipfrac"].item()
                        named["val/explained_variance"] = vf_stats["explained_variance"].item()
                    for k, v in named.items():  # losses already carry global denominators
                        mb_stats[k] = mb_stats.get(k, 0.0) + (
                            v if k.endswith("loss") else v * share
                        )
                    self.ratio_max = max(self.ratio_max, pg_stats["ratio_max"].item())
                if self._apply_update(finite):
                    mb_stats.update(self.grad_norms)
                    if self.first_minibatch is None:
                        self.first_minibatch = dict(mb_stats)
                    for k, v in mb_stats.items():
                        stats.setdefault(k, []).append(v)

    def _micro_loss(self, ro, i, m, advantages, returns, beta, agg, seqs, attn, P):
        """Policy loss (+ KL-in-loss, − entropy bonus) of one micro-batch, plus the value loss
        when the values come from the policy's own backbone (shared layout)."""
        p, cast = self.cfg.ppo, self.cast
        lp, values, ent = policy_outputs(
            self.train_policy,
            seqs[i],
            attn[i],
            P,
            ro.response_ids[i],
            self.cfg.rollout.temperature,
            with_entropy=p.entropy_coef > 0 or self.reuse_filled is not None,
            shared=cast.shared,
            entropy_grad=p.entropy_coef > 0,
        )
        if self.reuse_filled is not None:
            # the weights that sampled the rollout, before any update: these *are* the old
            # log-probs (ratio exactly 1), as a scoring forward would have computed them
            ro.old_logprobs[i] = lp.detach()
            ro.entropy[i] = ent.detach()
            self.reuse_filled[i] = True
        pg, pg_stats = L.policy_loss(
            lp,
            ro.old_logprobs[i],
            advantages[i],
            m,
            p.clip_low,
            p.clip_high,
            p.dual_clip,
            p.loss_agg,
            **agg,
        )
        loss = pg
        if p.kl_placement == "loss":
            kl = A.kl_estimate(lp, ro.ref_logprobs[i], p.kl_estimator)
            loss = loss + beta * L.aggregate(kl, m, p.loss_agg, **agg)
        if p.entropy_coef > 0:
            loss = loss - p.entropy_coef * L.aggregate(ent, m, p.loss_agg, **agg)
        vf, vf_stats = torch.zeros((), device=lp.device), {}
        if returns is not None and cast.shared:
            vf, vf_stats = self._value_loss(values, ro, i, m, returns, agg)
        total = loss + self.cfg.model.vf_coef * vf
        return total, pg, pg_stats, vf, vf_stats

    def _critic_step(self, ro, i, m, returns, agg):
        """Value loss of one micro-batch for a separate critic and its backward; returns
        (loss, stats, finite) and runs no backward when the loss is not finite. The values
        come from the critic's own forward, or from the one step 2 kept (then ``i`` is the
        whole rollout, in shuffled order)."""
        if self.kept_values is not None:
            values, self.kept_values = self.kept_values[i], None
        else:
            T = ro.response_ids.shape[1]
            values = answer_values(self.train_critic, ro.sequences[i], ro.attention_mask[i], T)
        vf, vf_stats = self._value_loss(values, ro, i, m, returns, agg)
        finite = self.ctx.all_true(bool(torch.isfinite(vf)))
        if finite:
            vf.backward()
        return vf, vf_stats, finite

    def _critic_forward_kept(self, rollout_size: int) -> bool:
        """Whether step 2 runs the critic's first training forward and keeps its graph
        (ppo.values_from_training_forward): a separate critic, and the first update covers
        the whole rollout in one micro-batch, so that forward sees the very weights and
        answers the old values are taken on."""
        p = self.cfg.ppo
        return (
            p.values_from_training_forward
            and self.train_critic is not None
            and p.minibatches == 1
            and (p.micro_batch_size or rollout_size) >= rollout_size
        )

    def _keep_critic_forward(self, ro: Rollout) -> None:
        """Step 2's part under ppo.values_from_training_forward: the old values, detached,
        and the graph that step 8's first value loss backpropagates."""
        T = ro.response_ids.shape[1]
        values = answer_values(self.train_critic, ro.sequences, ro.attention_mask, T)
        ro.values = values.detach()
        self.kept_values = values

    def _value_loss(self, values, ro, i, m, returns, agg):
        p = self.cfg.ppo
        return L.value_loss(values, ro.values[i], returns[i], m, p.value_clip, p.loss_agg, **agg)

    def _norm_names(self) -> list[str]:
        """The logged gradient-norm name of each optimiser, in (policy, critic) order: a
        shared backbone's value head is part of the policy's model and of its norm."""
        return ["policy/grad_norm"] + (["val/grad_norm"] if self.critic_opt else [])

    def _apply_update(self, loss_finite: bool) -> bool:
        """Clip each model by its own gradient norm and step, unless the loss or a gradient
        is not finite (then skip and count). The norms go to ``self.grad_norms``."""
        p = self.cfg.ppo
        cause = None if loss_finite else "loss"
        self.grad_norms = {}
        if self.in_backward is not None:  # the optimisers already ran, inside the backward
            return self._finish_update_in_backward(cause)
        if cause is None:
            opts = [o for o in (self.opt, self.critic_opt) if o is not None]
            models = {
                name: [q for g in opt.param_groups for q in g["params"]]
                for name, opt in zip(self._norm_names(), opts)
            }
            self.grad_norms = clip_grad_norms(models, p.max_grad_norm)
            if not all(math.isfinite(n) for n in self.grad_norms.values()):
                cause = "gradient"
        if cause is not None:
            self.opt.zero_grad(set_to_none=True)
            if self.critic_opt:
                self.critic_opt.zero_grad(set_to_none=True)
            self._bad_update(cause)
            return False
        for opt, sched in ((self.opt, self.sched), (self.critic_opt, self.critic_sched)):
            if opt is not None:
                opt.step()
                sched.step()
                opt.zero_grad(set_to_none=True)
        self.consecutive_bad = 0
        return True

    def _finish_update_in_backward(self, cause: str | None) -> bool:
        """ppo.step_in_backward: every tensor with a finite gradient has been updated;
        count the update as skipped if a loss or a gradient was not finite."""
        found_inf = self.in_backward.found_inf
        self.grad_norms = dict(zip(self._norm_names(), self.in_backward.grad_norms()))
        self.in_backward.reset()
        if cause is None and found_inf is not None and bool(found_inf):
            cause = "gradient"
        for opt in (self.opt, self.critic_opt):
            if opt is not None:  # gradients left by an interrupted micro-batch
                opt.zero_grad(set_to_none=True)
        if cause is not None:
            self._bad_update(cause)
            return False
        for sched in (self.sched, self.critic_sched):
            if sched is not None:
                sched.step()
        self.consecutive_bad = 0
        return True

    def _bad_update(self, cause: str, count: int | None = None) -> None:
        self.skipped_total += 1
        self.consecutive_bad += 1
        detail = f" ({count} non-finite scores)" if count else ""
        log.warning(
            "iteration %d: skipped an update: non-finite %s%s", self.iteration + 1, cause, detail
        )
        if self.consecutive_bad >= self.cfg.ppo.max_bad_updates:
            path = self.save(self.iteration)  # weights are still the last good ones
            trainer = getattr(self, "estimator", "ppo").upper()
            halt = Halt(
                trainer, "ppo.lr", lambda: f"The last good state is in {path}.", "iteration"
            )
            raise halt.error(
                self.iteration + 1,
                f"{cause} in {self.consecutive_bad} updates in a row",
                ", use reward.clip, or check the reward function for NaN/inf",
            )
