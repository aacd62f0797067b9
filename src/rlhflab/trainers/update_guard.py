"""The guarded optimiser update of the trained models (the end of step 8).

:class:`GuardedUpdate` owns the optimisers and learning-rate schedules of the policy (with
a shared backbone's value head) and of a separate critic. :meth:`GuardedUpdate.apply`
clips each model by its own gradient norm and steps, unless the loss or a gradient is not
finite: then the update is skipped and counted (:meth:`GuardedUpdate.bad_update`), and
ppo.max_bad_updates in a row stop the run with a checkpoint of the last good state. Under
model.compute_dtype=fp16 it also holds the loss scale (:class:`~rlhflab.backends.loss_scale.
LossScaler`): losses are scaled before backward (:meth:`GuardedUpdate.backward`), gradients
unscaled before the clip, and an overflow lowers the scale and skips the update without
counting it as bad.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable
from pathlib import Path

from rlhflab.backends.loss_scale import LossScaler
from rlhflab.backends.optim import UpdateInBackward, clip_grad_norms
from rlhflab.config import Config
from rlhflab.infra import checkpoint as C
from rlhflab.infra.distributed import load_optimizer_state, optimizer_state
from rlhflab.trainers.common import Halt, build_optimizer, build_scheduler, load_keeping_settings

log = logging.getLogger(__name__)


class GuardedUpdate:
    """Optimisers, schedules and the non-finite guard of one PPO-family run."""

    def __init__(self, cfg: Config, ctx, cast, save: Callable[..., Path]):
        p = cfg.ppo
        self.cfg, self.ctx, self.cast = cfg, ctx, cast
        self.save = save  # writes the checkpoint the run halts with
        # as a halt's message names the method: PPO, GRPO or RLOO
        estimator = cfg.ppo.advantage_estimator
        self.trainer_name = "PPO" if estimator == "gae" else estimator.upper()
        total_steps = p.iterations * p.epochs * p.minibatches
        policy = [
            q
            for n, q in cast.policy.named_parameters()
            if q.requires_grad and not n.startswith("value_head")
        ]
        groups = [{"params": policy, "lr": p.lr}]
        if cast.shared:
            groups.append({"params": list(cast.policy.value_head.parameters()), "lr": p.critic_lr})
        self.opt = build_optimizer(groups, p)
        self.sched = build_scheduler(self.opt, p.warmup_steps, total_steps, p.lr_schedule, "ppo")
        self.critic_opt = self.critic_sched = None
        if cast.critic is not None:
            critic = [q for q in cast.critic.parameters() if q.requires_grad]  # LoRA: a few
            self.critic_opt = build_optimizer([{"params": critic, "lr": p.critic_lr}], p)
            self.critic_sched = build_scheduler(
                self.critic_opt, p.warmup_steps, total_steps, p.lr_schedule
            )
        self.skipped_total = self.consecutive_bad = 0
        self.iteration = 0  # the iteration being trained (0-based), for messages
        self.in_backward: UpdateInBackward | None = None  # under ppo.step_in_backward
        self.grad_norms: dict[str, float] = {}  # of the last update, before the clip
        # model.compute_dtype=fp16: one scale for every trained model's loss (a joint
        # overflow skips the whole update, as a non-finite gradient does)
        self.scaler = LossScaler.for_model(cfg.model)

    def backward(self, loss) -> None:
        """Backpropagate a (finite) loss, scaled under fp16."""
        self.scaler.scaled(loss).backward()

    def updating_in_backward(self):
        """The context of one rollout's epochs: under ppo.step_in_backward, AdamW runs
        inside each backward, tensor by tensor (small tensors together right after it:
        UpdateInBackward.flush); else nothing."""
        self.in_backward = None
        if self.cfg.ppo.step_in_backward:
            self.in_backward = UpdateInBackward((self.opt, self.critic_opt))
        return self.in_backward or contextlib.nullcontext()

    def state_dict(self) -> dict:
        """Optimiser moments (gathered under FSDP: a collective), schedules, fault counts."""
        strategy, cast = self.cfg.dist.strategy, self.cast
        critic = self.critic_opt
        return {
            "optim": optimizer_state(cast.policy, self.opt, self.ctx, strategy),
            "sched": self.sched.state_dict(),
            "critic_optim": optimizer_state(cast.critic_values, critic, self.ctx, strategy)
            if critic
            else {},
            "critic_sched": self.critic_sched.state_dict() if self.critic_sched else {},
            "faults": {"skipped_total": self.skipped_total, "consecutive": self.consecutive_bad},
            "loss_scale": self.scaler.state_dict(),
        }

    def load_state_dict(self, s: dict) -> None:
        strategy = self.cfg.dist.strategy
        # moments and step counts from the checkpoint; lr, weight decay, eps: the config's
        load_keeping_settings(
            self.opt,
            lambda: load_optimizer_state(self.cast.policy, self.opt, s["optim"], self.ctx, strategy),
        )  # fmt: skip
        self.sched.load_state_dict(s["sched"])
        if self.critic_opt:
            critic, opt = self.cast.critic_values, self.critic_opt
            load_keeping_settings(
                opt, lambda: load_optimizer_state(critic, opt, s["critic_optim"], self.ctx, strategy)
            )  # fmt: skip
            self.critic_sched.load_state_dict(s["critic_sched"])
        self._rescale_schedules(s.get("updates_per_iteration"))
        self.skipped_total = int(s["faults"]["skipped_total"])
        self.consecutive_bad = int(s["faults"]["consecutive"])
        self.scaler.load_state_dict(s.get("loss_scale", {}))

    def _rescale_schedules(self, was: int | None) -> None:
        """The schedules count optimiser steps, their length ppo.iterations × epochs ×
        minibatches of this config: where a resume changed the updates per iteration, the
        position is moved to the same iteration (else a linear decay from 4 updates an
        iteration to 1 ended at lr 0 halfway). None: a checkpoint from before it was kept."""
        now = self.cfg.ppo.epochs * self.cfg.ppo.minibatches
        if not was or was == now:
            return
        for sched in (self.sched, self.critic_sched):
            if sched is not None:
                sched.last_epoch = round(sched.last_epoch * now / was)
                sched.load_state_dict(sched.state_dict())  # its lrs at the new position
        if self.ctx.is_main:
            log.warning(
                "--resume: %d updates an iteration, not %d: the lr schedule goes on from step "
                "%d of %d", now, was, self.sched.last_epoch, self.cfg.ppo.iterations * now,
            )  # fmt: skip

    def _norm_names(self) -> list[str]:
        """The logged gradient-norm name of each optimiser, in (policy, critic) order: a
        shared backbone's value head is part of the policy's model and of its norm."""
        return ["policy/grad_norm"] + (["val/grad_norm"] if self.critic_opt else [])

    def apply(self, loss_finite: bool) -> bool:
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
            for params in models.values():
                self.scaler.unscale_(params)
            self.grad_norms = clip_grad_norms(models, p.max_grad_norm)
            if not all(math.isfinite(n) for n in self.grad_norms.values()):
                cause = "gradient"
            # fp16: an overflow lowers the loss scale and skips quietly (not a bad update)
            if self.scaler.update(overflow=cause is not None):
                cause = "overflow"
        if cause is not None:
            self.opt.zero_grad(set_to_none=True)
            if self.critic_opt:
                self.critic_opt.zero_grad(set_to_none=True)
            if cause == "overflow":
                log.info(
                    "iteration %d: fp16 gradients overflowed; update skipped, loss scale now %g",
                    self.iteration + 1,
                    self.scaler.scale,
                )
            else:
                self.bad_update(cause)
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
        self.in_backward.flush()  # the small parameters, deferred to one call
        found_inf = self.in_backward.found_inf
        self.grad_norms = dict(zip(self._norm_names(), self.in_backward.grad_norms()))
        self.in_backward.reset()
        if cause is None and found_inf is not None and bool(found_inf):
            cause = "gradient"
        for opt in (self.opt, self.critic_opt):
            if opt is not None:  # gradients left by an interrupted micro-batch
                opt.zero_grad(set_to_none=True)
        if cause is not None:
            self.bad_update(cause)
            return False
        for sched in (self.sched, self.critic_sched):
            if sched is not None:
                sched.step()
        self.consecutive_bad = 0
        return True

    def bad_update(self, cause: str, count: int | None = None) -> None:
        """Count a skipped update (a non-finite ``cause``: reward, loss or gradient); after
        ppo.max_bad_updates in a row, checkpoint the last good state and halt the run."""
        self.skipped_total += 1
        self.consecutive_bad += 1
        detail = f" ({count} non-finite scores)" if count else ""
        log.warning(
            "iteration %d: skipped an update: non-finite %s%s", self.iteration + 1, cause, detail
        )
        if self.consecutive_bad >= self.cfg.ppo.max_bad_updates:
            # the weights are finite, but hold the updates of this iteration's minibatches that
            # came before the bad ones: kept under a name --resume does not take, so that a
            # resume starts from the last whole iteration and stays exact
            halted = self.save(self.iteration, name=f"halted-{self.iteration + 1}")
            resumable = C.list_checkpoints(halted.parent.parent)
            since = str(resumable[-1]) if resumable else "the start"

            def kept() -> str:
                return f"The state at the halt is in {halted}; --resume continues from {since}."

            halt = Halt(self.trainer_name, "ppo.lr", kept, "iteration")
            raise halt.error(
                self.iteration + 1,
                f"{cause} in {self.consecutive_bad} updates in a row",
                ", scale the reward down or set reward.normalize (with reward.clip), or check "
                "the reward function for NaN/inf",
            )
