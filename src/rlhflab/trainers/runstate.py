"""The run around a PPO-family trainer: training state, checkpoints, resume, the loop.

Shared by PPO, GRPO and RLOO. Under torchrun only rank 0 writes logs, samples and
checkpoint files; every rank takes part in gathering sharded (FSDP) weights and optimiser
state into plain tensors first, and on resume rank 0 alone reads them back and sends each
rank its shard. RNG states differ per rank, so all of them are gathered into the one
``state.pt``; a run checkpointed with N ranks resumes with N ranks.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch.distributed as dist
import yaml

from rlhflab.config.base import ConfigError, to_dict
from rlhflab.infra import checkpoint as C
from rlhflab.infra.distributed import (
    full_state_dict,
    load_full_state_dict,
    load_optimizer_state,
    optimizer_state,
)
from rlhflab.infra.runlog import RunLog
from rlhflab.trainers.common import progress

log = logging.getLogger(__name__)


class NullLog:
    """What ranks other than 0 write: nothing."""

    def metrics(self, *a) -> None: ...
    def samples(self, *a) -> None: ...
    def alerts(self, *a) -> None: ...
    def close(self) -> None: ...


class CheckpointedRun:
    # ------------------------------------------------------------------ state

    def _gathered_rng(self) -> list:
        mine = C.rng_state(self.gens)
        if not self.ctx.enabled:
            return [mine]
        out = [None] * self.ctx.world
        dist.all_gather_object(out, mine)
        return out

    def state_dict(self) -> dict:
        strategy = self.cfg.dist.strategy
        return {
            "iteration": self.iteration,
            "world": self.ctx.world,
            "optim": optimizer_state(self.cast.policy, self.opt, self.ctx, strategy),
            "sched": self.sched.state_dict(),
            "kl": self.kl_ctl.state_dict(),
            "critic_optim": optimizer_state(
                self.cast.critic_values, self.critic_opt, self.ctx, strategy
            )
            if self.critic_opt
            else {},
            "critic_sched": self.critic_sched.state_dict() if self.critic_sched else {},
            "rng": self._gathered_rng(),
            "data": self.stream.state_dict(),
            "moments": self.moments.state_dict(),
            "monitor": self.monitor.state.state_dict() if self.monitor else {},
            "faults": {"skipped_total": self.skipped_total, "consecutive": self.consecutive_bad},
        }

    def load_state_dict(self, s: dict) -> None:
        if int(s.get("world", 1)) != self.ctx.world:
            raise ConfigError(
                f"--resume: the checkpoint was written by {s.get('world', 1)} "
                f"ranks; resume it with the same number, not {self.ctx.world}"
            )
        strategy = self.cfg.dist.strategy
        self.iteration = int(s["iteration"])
        load_optimizer_state(self.cast.policy, self.opt, s["optim"], self.ctx, strategy)
        self.sched.load_state_dict(s["sched"])
        if self.critic_opt:
            load_optimizer_state(
                self.cast.critic_values, self.critic_opt, s["critic_optim"], self.ctx, strategy
            )
            self.critic_sched.load_state_dict(s["critic_sched"])
        self.kl_ctl.load_state_dict(s["kl"])
        C.restore_rng(s["rng"][self.ctx.rank], self.gens)
        self.stream.load_state_dict(s["data"])
        self.moments.load_state_dict(s["moments"])
        if self.monitor is not None and s.get("monitor"):
            self.monitor.state.load_state_dict(s["monitor"])
        self.skipped_total = int(s["faults"]["skipped_total"])
        self.consecutive_bad = int(s["faults"]["consecutive"])

    # ------------------------------------------------------------------ checkpoints

    def save(self, iteration: int) -> Path:
        """Write checkpoints/step-N (collective under torchrun; files from rank 0 only)."""
        strategy = self.cfg.dist.strategy
        policy_state = full_state_dict(self.cast.policy, self.ctx, strategy)
        critic_state = (
            full_state_dict(self.cast.critic_values, self.ctx, strategy)
            if self.cast.critic_values is not None
            else None
        )
        state = self.state_dict()
        path = Path(self.run_dir) / "checkpoints" / f"step-{iteration}"
        if self.ctx.is_main:
            path = C.save_checkpoint(
                self.run_dir,
                iteration,
                self.cast,
                state,
                self.cfg.log.keep_last,
                policy_state,
                critic_state,
            )
        self.ctx.barrier()
        return path

    def _load(self, path: Path) -> None:
        if not self.fsdp:
            self.load_state_dict(C.load_checkpoint(path, self.cast))
            return
        # sharded: rank 0 alone reads the full weights and optimiser states and sends each
        # tensor on, every rank keeping its shard (load_full_state_dict and
        # load_optimizer_state, broadcast from rank 0); the others read only state.pt. Read
        # on every rank, a resume held the whole model and its two moments once per process
        # (12 bytes per trained fp32 weight: on 8 ranks of one machine, 8 copies of it)
        main = self.ctx.is_main
        policy = C.read_weights(path / "policy") if main else {}
        if self.cast.shared and main:
            head = C.read_weights(path, "value_head.safetensors")
            policy = {
                **{f"lm.{k}": v for k, v in policy.items()},
                **{f"value_head.{k}": v for k, v in head.items()},
            }
        load_full_state_dict(self.cast.policy, policy, self.ctx)
        del policy
        if self.cast.critic_values is not None:
            critic = C.read_weights(path / "critic") if main else {}
            load_full_state_dict(
                self.cast.critic_values, {f"model.{k}": v for k, v in critic.items()}, self.ctx
            )
            del critic
        state = C.read_state(path, optimizers=main)
        if not main:
            state.update({k: {} for k in C.OPTIMIZER_KEYS})
        self.load_state_dict(state)

    # ------------------------------------------------------------------ the loop

    def fit(self, resume: bool = False) -> dict:
        cfg, main = self.cfg, self.ctx.is_main
        resume_step = None
        if resume:
            # every rank picks the same (newest whole) checkpoint; rank 0 sets damaged aside
            last = C.latest_checkpoint(self.run_dir, set_aside=main)
            if last is not None:
                self._load(last)
                resume_step = self.iteration
                log.info("resumed from %s", last)
            else:
                log.info("--resume: no checkpoint in %s; starting fresh", self.run_dir)
        if main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            (self.run_dir / "config.yaml").write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
            runlog = RunLog(
                self.run_dir, cfg.log.tensorboard, cfg.log.wandb, to_dict(cfg), resume_step
            )
        else:
            runlog = NullLog()
        bar = progress(
            range(self.iteration, cfg.ppo.iterations),
            cfg.log.progress and main,
            type(self).__name__.replace("Trainer", ""),
            initial=self.iteration,
            total=cfg.ppo.iterations,
        )
        metrics: dict = {}
        try:
            for _ in bar:
                metrics = self.step()
                self.iteration += 1
                runlog.metrics(self.iteration, metrics)
                if self.monitor is not None:
                    new = [a for a in self.monitor.state.alerts if a.iteration == self.iteration]
                    runlog.alerts([vars(a) | {"message": a.message()} for a in new])
                if cfg.log.samples_per_log and self.iteration % cfg.log.sample_every == 0:
                    runlog.samples(self.iteration, self.sample_rows(cfg.log.samples_per_log))
                if hasattr(bar, "set_postfix"):
                    bar.set_postfix(
                        reward=f"{metrics['objective/scores']:.3f}",
                        kl=f"{metrics['objective/kl']:.3f}",
                        beta=f"{metrics['objective/kl_coef']:.3g}",
                    )
                # 11. checkpoint
                if (
                    self.iteration % cfg.log.checkpoint_every == 0
                    or self.iteration == cfg.ppo.iterations
                    or self.stop_reason
                ):
                    self.save(self.iteration)
                if self.stop_reason:
                    log.warning("stopped: %s", self.stop_reason)
                    break
        finally:
            runlog.close()
        return {"iterations": self.iteration, "last": metrics, "stop_reason": self.stop_reason}

    def sample_rows(self, n: int) -> list[dict]:
        ro = self._last_rollout
        rows = []
        for i in range(min(n, len(ro))):
            m = ro.response_mask[i].bool()
            rows.append(
                {
                    "prompt": ro.prompts[i],
                    "response": ro.responses[i],
                    "score": ro.scores[i].item(),
                    "components": {k: v[i].item() for k, v in ro.components.items()},
                    "kl": (ro.old_logprobs[i] - ro.ref_logprobs[i])[m].sum().item(),
                }
            )
        return rows
