"""Step 8 of a PPO iteration: the epochs over the rollout.

:class:`PPOUpdate` is held by :class:`rlhflab.trainers.ppo.PPOTrainer`. :meth:`PPOUpdate.run`
takes one rollout and its advantages through ``ppo.epochs`` passes of ``ppo.minibatches``
minibatches, each accumulated over micro-batches, and reports the mean of each metric
(:class:`EpochStats`). Each minibatch ends in the guarded update of
:mod:`rlhflab.trainers.update_guard`, which owns the optimisers and skips (and counts) an
update whose reward, loss or gradient is not finite.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from rlhflab.config import Config
from rlhflab.core import algorithms as A
from rlhflab.core import losses as L
from rlhflab.experience.rollout import Rollout, answer_values, policy_outputs
from rlhflab.infra.distributed import accumulate
from rlhflab.trainers.update_guard import GuardedUpdate


@dataclass
class EpochStats:
    """Step 8's report: each metric's mean over the applied updates (empty when the reward
    was not finite; without ``policy/ratio_max`` only then) and how many were applied."""

    metrics: dict[str, float] = field(default_factory=dict)
    applied: int = 0


@dataclass
class ValueLoss:
    loss: torch.Tensor  # aggregated over the micro-batch with the minibatch's denominators
    stats: dict[str, torch.Tensor]  # vf_clipfrac, explained_variance


@dataclass
class MicroLoss:
    """One micro-batch's losses. ``total`` is what the policy's backward runs on; ``value``
    is the value loss, from the policy's backbone or a separate critic (None: no critic)."""

    total: torch.Tensor
    policy: torch.Tensor
    policy_stats: dict[str, torch.Tensor]
    value: ValueLoss | None


class PPOUpdate:
    """The PPO epochs over a rollout and the guarded optimiser updates (step 8)."""

    def __init__(
        self,
        cfg: Config,
        ctx,
        cast,
        train_policy,
        train_critic,
        minibatch_size: int,
        shuffle: torch.Generator,
        save: Callable[..., Path],
    ):
        self.cfg, self.ctx, self.cast = cfg, ctx, cast
        self.device = cast.device
        # the trained models as the forward sees them (DDP-wrapped or FSDP-sharded)
        self.train_policy, self.train_critic = train_policy, train_critic
        self.minibatch_size = minibatch_size  # checked by distributed.rank_split
        self.shuffle = shuffle  # the minibatch order; checkpointed with the trainer's RNGs
        self.guard = GuardedUpdate(cfg, ctx, cast, save)  # optimisers, skips, halts
        self.first_minibatch: dict[str, float] | None = None  # the run's first update
        self.kept_values: torch.Tensor | None = None  # step 2's critic graph (see below)
        self.reuse_filled: torch.Tensor | None = None  # answers whose old log-probs are set
        self.ratio_max = 0.0  # the largest ratio of the current rollout's epochs

    # ------------------------------------------------------------------ step 2's part

    def critic_forward_kept(self, rollout_size: int) -> bool:
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

    def keep_critic_forward(self, ro: Rollout) -> None:
        """Step 2's part under ppo.values_from_training_forward: the old values, detached,
        and the graph that step 8's first value loss backpropagates."""
        T = ro.response_ids.shape[1]
        with self.cast.autocast():
            values = answer_values(self.train_critic, ro.sequences, ro.attention_mask, T)
        ro.values = values.detach()
        self.kept_values = values

    # ------------------------------------------------------------------ step 8

    def run(self, ro: Rollout, advantages, returns, beta: float, scores, iteration: int):
        """Step 8 on rollout ``ro``: advantages and returns (None: no critic) (B, T), the
        KL coefficient, and the raw scores (B,); skipped entirely, and counted, when a
        score is not finite. Returns :class:`EpochStats`."""
        self.guard.iteration = iteration
        try:
            if not self.ctx.all_true(bool(torch.isfinite(scores).all())):
                self.guard.bad_update("reward", int((~torch.isfinite(scores)).sum()))
                return EpochStats()
            return self._epochs(ro, advantages, returns, beta)
        finally:
            self.kept_values = None  # the kept critic graph, used or not, is released here

    def _epochs(self, ro: Rollout, advantages, returns, beta) -> EpochStats:
        p, cast = self.cfg.ppo, self.cast
        B = len(ro)
        if B != self.minibatch_size * p.minibatches:
            raise RuntimeError(
                f"this rank holds {B} answers, not {p.minibatches} minibatches of "
                f"{self.minibatch_size}"
            )
        cast.policy.train()
        if cast.critic is not None:
            cast.critic.train()
        self._fill_old_logprobs_here(ro)
        self.ratio_max = 0.0
        stats: dict[str, list[float]] = {}
        with self.guard.updating_in_backward():
            for idx in self._minibatches(B):
                applied = self._train_minibatch(ro, idx, advantages, returns, beta)
                for k, v in (applied or {}).items():
                    stats.setdefault(k, []).append(v)
        out = {k: sum(v) / len(v) for k, v in stats.items()}
        out["policy/ratio_max"] = self.ratio_max
        if p.dual_clip is None:
            out.pop("policy/dual_clipfrac", None)
        return EpochStats(out, len(stats.get("policy/loss", [])))

    def _fill_old_logprobs_here(self, ro: Rollout) -> None:
        """ppo.reuse_training_forward: the first training forward supplies the old
        log-probs and entropy, answer by answer (``reuse_filled`` says which are set)."""
        if ro.old_logprobs is None:
            ro.old_logprobs = torch.zeros_like(ro.ref_logprobs)
            ro.entropy = torch.zeros_like(ro.ref_logprobs)
            self.reuse_filled = torch.zeros(
                len(ro), dtype=torch.bool, device=ro.ref_logprobs.device
            )
        else:
            self.reuse_filled = None

    def _minibatches(self, B: int) -> Iterator[torch.Tensor]:
        """The answer indices of each minibatch: every epoch, a fresh shuffle of the batch."""
        mb_size = self.minibatch_size
        for _epoch in range(self.cfg.ppo.epochs):
            order = torch.randperm(B, generator=self.shuffle).to(self.device)
            for start in range(0, B, mb_size):
                yield order[start : start + mb_size]

    def _micro_batches(self, idx: torch.Tensor) -> Iterator[tuple[torch.Tensor, bool]]:
        """(indices, whether gradients synchronise after it): the last one syncs."""
        micro = self.cfg.ppo.micro_batch_size or len(idx)
        n_micro = (len(idx) + micro - 1) // micro
        for k_micro, ms in enumerate(range(0, len(idx), micro)):
            yield idx[ms : ms + micro], k_micro == n_micro - 1

    def _train_minibatch(self, ro, idx, advantages, returns, beta) -> dict[str, float] | None:
        """Accumulate the minibatch's gradients over its micro-batches, then update. Returns
        the minibatch's metrics, or None when its update was skipped."""
        n_tokens = ro.response_mask[idx].sum().clamp(min=1)
        agg = self._aggregation(n_tokens, len(idx))
        trained = [t for t in (self.train_policy, self.train_critic) if t is not None]
        mb_stats: dict[str, float] = {}
        finite = True
        for i, sync in self._micro_batches(idx):
            m = ro.response_mask[i]
            with accumulate(trained, sync):
                micro = self._micro_backward(ro, i, m, advantages, returns, beta, agg)
            if micro is None:
                finite = False
                break
            self._add_micro_stats(mb_stats, micro, m.sum().item() / n_tokens.item())
        if not self.guard.apply(finite):
            return None
        mb_stats.update(self.guard.grad_norms)
        if self.first_minibatch is None:
            self.first_minibatch = dict(mb_stats)
        return mb_stats

    def _aggregation(self, n_tokens: torch.Tensor, mb_size: int) -> dict:
        """The loss denominators of one minibatch, equal on every rank."""
        # Global token count: DDP/FSDP average gradients over ranks, so dividing each
        # rank's token sum by (global tokens / world) gives the global token mean.
        global_tokens = self.ctx.all_sum(n_tokens.double().reshape(1))[0]
        return {
            "num_tokens": global_tokens / self.ctx.world,
            "num_seqs": mb_size,
            # Dr. GRPO's constant: one number for every batch, rank and minibatch
            "norm": self.cfg.ppo.loss_agg_norm or self.cfg.rollout.max_new_tokens,
        }

    def _micro_backward(self, ro, i, m, advantages, returns, beta, agg) -> MicroLoss | None:
        """Losses and backward of one micro-batch; None (and no further backward) as soon
        as a loss is not finite on any rank."""
        # A separate critic's graph is disjoint from the policy's: backward each as soon as
        # it is built, so only one model's activations are alive at a time (same
        # gradients, half the activation peak). The graph step 2 kept goes first, before
        # the policy's is built.
        separate = returns is not None and not self.cast.shared
        critic_first = separate and self.kept_values is not None
        critic = None
        if critic_first:
            critic = self._critic_backward(ro, i, m, returns, agg)
            if critic is None:
                return None
        loss = self._micro_loss(ro, i, m, advantages, returns, beta, agg)
        if not self.ctx.all_true(bool(torch.isfinite(loss.total))):
            return None
        self.guard.backward(loss.total)
        if separate and not critic_first:
            critic = self._critic_backward(ro, i, m, returns, agg)
            if critic is None:
                return None
        if separate:  # else the value loss (if any) was in the policy's
            loss.value = critic
        return loss

    def _add_micro_stats(self, mb_stats: dict, micro: MicroLoss, share: float) -> None:
        """Add a micro-batch's metrics to its minibatch's: losses already carry global
        denominators; other statistics are weighted by the micro-batch's token share."""
        named = {
            "policy/loss": micro.policy.item(),
            **{f"policy/{k}": v.item() for k, v in micro.policy_stats.items()},
        }
        if micro.value is not None:
            named["val/loss"] = micro.value.loss.item()
            named["val/clipfrac"] = micro.value.stats["vf_clipfrac"].item()
            named["val/explained_variance"] = micro.value.stats["explained_variance"].item()
        for k, v in named.items():
            mb_stats[k] = mb_stats.get(k, 0.0) + (v if k.endswith("loss") else v * share)
        self.ratio_max = max(self.ratio_max, micro.policy_stats["ratio_max"].item())

    def _micro_loss(self, ro, i, m, advantages, returns, beta, agg) -> MicroLoss:
        """Policy loss (+ KL-in-loss, − entropy bonus) of one micro-batch, plus the value loss
        when the values come from the policy's own backbone (shared layout)."""
        p, cast = self.cfg.ppo, self.cast
        lp, values, ent = policy_outputs(
            self.train_policy,
            ro.sequences[i],
            ro.attention_mask[i],
            ro.prompt_ids.shape[1],
            ro.response_ids[i],
            self.cfg.rollout.temperature,
            with_entropy=p.entropy_coef > 0 or self.reuse_filled is not None,
            shared=cast.shared,
            entropy_grad=p.entropy_coef > 0,
            autocast=cast.autocast,  # model.compute_dtype; the losses below are fp32
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
        vf, value = torch.zeros((), device=lp.device), None
        if returns is not None and cast.shared:
            value = self._value_loss(values, ro, i, m, returns, agg)
            vf = value.loss
        total = loss + self.cfg.model.vf_coef * vf
        return MicroLoss(total, pg, pg_stats, value)

    def _critic_backward(self, ro, i, m, returns, agg) -> ValueLoss | None:
        """Value loss of one micro-batch for a separate critic and its backward; None, and
        no backward, when the loss is not finite. The values come from the critic's own
        forward, or from the one step 2 kept (then ``i`` is the whole rollout, in shuffled
        order)."""
        if self.kept_values is not None:
            values, self.kept_values = self.kept_values[i], None
        else:
            T, seqs, mask = ro.response_ids.shape[1], ro.sequences[i], ro.attention_mask[i]
            with self.cast.autocast():
                values = answer_values(self.train_critic, seqs, mask, T)
        value = self._value_loss(values, ro, i, m, returns, agg)
        if not self.ctx.all_true(bool(torch.isfinite(value.loss))):
            return None
        self.guard.backward(value.loss)
        return value

    def _value_loss(self, values, ro, i, m, returns, agg) -> ValueLoss:
        p = self.cfg.ppo
        vf, stats = L.value_loss(
            values, ro.values[i], returns[i], m, p.value_clip, p.loss_agg, **agg
        )
        return ValueLoss(vf, stats)
