"""Checkpoints of a PPO-family trainer (any ``ppo.advantage_estimator``): its trained
models and state, written and read back (the loop that calls them is :mod:`~.loop`); and
its trained models wrapped for data parallelism (:func:`wrap_for_parallel`).

Under torchrun only rank 0 writes logs, samples and
checkpoint files; every rank takes part in gathering sharded (FSDP) weights and optimiser
state into plain tensors first, and on resume rank 0 alone reads them back and sends each
rank its shard. RNG states differ per rank, so all of them are gathered into the one
``state.pt``; a run checkpointed with N ranks resumes with N ranks.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from rlhflab.config import Config, ConfigError
from rlhflab.infra import checkpoint as C
from rlhflab.infra.distributed import (
    full_state_dict,
    load_full_state_dict,
    shard,
    wrap_trained,
)
from rlhflab.trainers.ppo_refresh import plain_module, refreshed_models
from rlhflab.trainers.resume_checks import read_recorded_config

log = logging.getLogger(__name__)


def warn_about_settings(cfg: Config) -> None:
    """Say which settings work but give a run other than the one their user may expect."""
    if not cfg.reward.ensemble and cfg.reward.ensemble_combine != "mean":
        log.warning(
            "reward.ensemble_combine=%s combines the members of reward.ensemble; this run "
            "has none, so it does nothing",
            cfg.reward.ensemble_combine,
        )
    mon = cfg.monitor
    flattery = (mon.flattery_rate, mon.flattery_excess, mon.flattery_opener_ratio)
    if mon.enabled and not mon.phrases and any(t is not None for t in flattery):
        log.warning(
            "monitor.phrases is empty: the flattery signals (flattery_rate, "
            "flattery_excess, flattery_opener_ratio) measure nothing and never alert"
        )
    if cfg.ppo.advantage_estimator == "rloo" and not cfg.grpo.normalize_std:
        log.warning(
            "grpo.normalize_std=false: RLOO's advantage is the answer's score minus the "
            "mean of the group's others, never divided by a std; the setting does nothing"
        )
    if cfg.rollout.logprobs_from_sampling and cfg.model.compute_dtype != "fp32":
        # measured by benchmarks/bf16_speedup.py (docs/real-models.md, "Precision")
        log.warning(
            "rollout.logprobs_from_sampling with model.compute_dtype=%s: the old log-probs "
            "come from the KV-cached sampling pass, whose 16-bit rounding differs from the "
            "training forward's, so the first update's ratio is not 1 (up to 1.21 on "
            "SmolLM2-135M in bf16, where this run clips at 1 + %.2g); turn it off for "
            "ratios that start at 1",
            cfg.model.compute_dtype,
            cfg.ppo.clip_low if cfg.ppo.clip_high is None else cfg.ppo.clip_high,
        )


def wrap_for_parallel(cfg: Config, ctx, cast):
    """Wrap (DDP) or shard (FSDP2) the trained models of ``cast`` before their optimisers
    exist; returns (policy, critic or None) as the training forward calls them. Settings
    that cannot work with several processes are refused first."""
    strategy = cfg.dist.strategy
    fsdp = ctx.enabled and strategy == "fsdp"
    if ctx.enabled and cfg.ppo.step_in_backward:
        raise ConfigError(
            "ppo.step_in_backward: with several processes the gradients are averaged "
            "across ranks after the backward; updating during it is single-process only"
        )
    if fsdp and cast.shared and cfg.rollout.logprobs_from_sampling:
        raise ConfigError(
            "rollout.logprobs_from_sampling: with a shared backbone under fsdp the value "
            "head's weights are sharded outside the sampling pass; use ddp, a separate "
            "critic, or turn it off"
        )
    if fsdp and (cfg.model.lora_r or cfg.model.critic_lora_r):
        raise ConfigError("dist.strategy: LoRA with fsdp is not supported; use ddp")
    policy = wrap_trained(cast.policy, ctx, strategy, cfg.dist.mixed_precision)
    critic = None
    if cast.critic_values is not None:
        critic = wrap_trained(cast.critic_values, ctx, strategy, cfg.dist.mixed_precision)
    if fsdp and cfg.dist.shard_reference and isinstance(cast.reference, torch.nn.Module):
        shard(cast.reference)
    return policy, critic


def gathered_rng(gens: dict[str, torch.Generator], ctx) -> list:
    """Every rank's RNG states, rank by rank (a collective under torchrun)."""
    mine = C.rng_state(gens)
    if not ctx.enabled:
        return [mine]
    out = [None] * ctx.world
    dist.all_gather_object(out, mine)
    return out


class CastCheckpoints:
    """Checkpoint folders of a PPO-family run: the trained models of the cast (policy, a
    value head or critic) and the trainer's state, written and read back; with
    reward.refresh_every, the reward models a refresh trains too (``reward/``, or
    ``reward-i/`` per ensemble member: whole reward-model folders)."""

    def __init__(self, cfg: Config, ctx, cast, run_dir: Path, fsdp: bool):
        self.cfg, self.ctx, self.cast = cfg, ctx, cast
        self.run_dir = run_dir
        self.fsdp = fsdp  # sharded weights: gathered to save, broadcast from rank 0 to load
        # name → ModelReward (a refresh is single-process: never sharded)
        self.rewards = refreshed_models(cast) if cfg.reward.refresh_every else {}

    def save(
        self,
        iteration: int,
        state_dict: Callable[[], dict],
        name: str | None = None,
        optimizers: bool = True,
    ) -> Path:
        """Write checkpoints/step-N (or ``name``) with the weights and ``state_dict()``
        (collective under torchrun; files from rank 0 only). ``optimizers=False`` leaves the
        optimisers' states out (``optimizer.pt`` holds none): a checkpoint to export, not to
        resume from."""
        strategy = self.cfg.dist.strategy
        policy_state = full_state_dict(self.cast.policy, self.ctx, strategy)
        critic_state = (
            full_state_dict(self.cast.critic_values, self.ctx, strategy)
            if self.cast.critic_values is not None
            else None
        )
        state = state_dict()
        if not optimizers:
            state = {k: v for k, v in state.items() if k not in C.OPTIMIZER_KEYS}
        path = Path(self.run_dir) / "checkpoints" / (name or f"step-{iteration}")
        if self.ctx.is_main:
            path = C.save_checkpoint(
                self.run_dir,
                iteration,
                self.cast,
                state,
                self.cfg.log.keep_last,
                policy_state,
                critic_state,
                name,
                {k: (plain_module(r.model), r.tokenizer) for k, r in self.rewards.items()},
            )
        self.ctx.barrier()
        return path

    def _rewards_in(self, path: Path) -> dict:
        """The reward models to read back from checkpoint ``path``: the refreshed ones; and
        when this run has reward.refresh_every off but the checkpoint holds refreshed reward
        models (``reward/``, ``reward-i/``), those too — resuming must not silently go back
        to the reward model from before the refreshes."""
        if self.rewards or not any(path.glob("reward*/config.json")):
            return self.rewards
        if self.cfg.model.reward_precision != "fp32":
            raise C.CheckpointError(
                f"{path}: holds reward models a refresh trained (fp32); this run has "
                f"reward.refresh_every off and model.reward_precision="
                f"{self.cfg.model.reward_precision}, so they cannot be read back: resume with "
                "model.reward_precision=fp32, or start a new run with reward.model pointing "
                f"at {path / 'reward'}"
            )
        log.info("%s: reading back the refreshed reward models of the checkpoint", path)
        # and saving them into this run's checkpoints too: else the next ones would lack
        # them, keep_last would prune the old ones, and a later resume would score with the
        # reward model from before the refreshes
        self.rewards = refreshed_models(self.cast)
        return self.rewards

    def load(self, path: Path) -> dict:
        """Load the weights of checkpoint ``path`` into the cast; returns its state (on
        ranks other than 0 under FSDP without the optimisers' moments, which rank 0 sends)."""
        if not self.fsdp:
            state = C.load_checkpoint(path, self.cast)
            for name, reward in self._rewards_in(path).items():
                if (path / name).is_dir():  # else written before refreshes were switched on
                    C.load_weights_into(plain_module(reward.model), path / name)
            return state
        # sharded: rank 0 alone reads the full weights and optimiser states and sends each
        # tensor on, every rank keeping its shard (load_full_state_dict and
        # load_optimizer_state, broadcast from rank 0); the others read only state.pt. Read
        # on every rank, a resume held the whole model and its two moments once per process
        # (12 bytes per trained fp32 weight: on 8 ranks of one machine, 8 copies of it)
        main = self.ctx.is_main
        policy = C.read_weights_for(self.cast.policy_lm, path / "policy") if main else {}
        if self.cast.shared and main:
            head = C.read_weights(path, "value_head.safetensors")
            policy = {
                **{f"lm.{k}": v for k, v in policy.items()},
                **{f"value_head.{k}": v for k, v in head.items()},
            }
        load_full_state_dict(self.cast.policy, policy, self.ctx)
        del policy
        if self.cast.critic_values is not None:
            critic = C.read_weights_for(self.cast.critic, path / "critic") if main else {}
            load_full_state_dict(
                self.cast.critic_values, {f"model.{k}": v for k, v in critic.items()}, self.ctx
            )
            del critic
        state = C.read_state(path, optimizers=main)
        if not main:
            state.update({k: {} for k in C.OPTIMIZER_KEYS})
        return state


def ppo_state(trainer) -> dict:
    """A :class:`~.ppo.PPOTrainer`'s resumable state beside the weights: optimisers and
    schedules, fp16 loss scale, KL controller, every rank's random streams, data order, reward moments,
    monitor, best-gold tracker, faults and the reward refresh's pairs. Gathering sharded
    optimiser state is a collective: every rank calls this."""
    update = trainer.update.guard.state_dict()
    return {
        "iteration": trainer.iteration,
        "world": trainer.ctx.world,
        # the optimisers' state format: torch's (by position) or FSDP's full one (by name)
        "strategy": trainer.cfg.dist.strategy if trainer.ctx.enabled else None,
        "optim": update["optim"],
        "sched": update["sched"],
        "kl": trainer.kl_ctl.state_dict(),
        # the settings a resume rescales by where they changed (β, the schedule's position)
        "kl_coef": trainer.cfg.ppo.kl_coef,
        "updates_per_iteration": trainer.cfg.ppo.epochs * trainer.cfg.ppo.minibatches,
        "critic_optim": update["critic_optim"],
        "critic_sched": update["critic_sched"],
        "rng": gathered_rng(trainer.gens, trainer.ctx),
        "data": trainer.stream.state_dict(),
        "moments": trainer.moments.state_dict(),
        "monitor": trainer.monitor.state.state_dict() if trainer.monitor else {},
        "best": trainer.watch.best.state_dict(),
        "faults": update["faults"],
        "loss_scale": update["loss_scale"],  # model.compute_dtype=fp16
        "refresh": trainer.refresh.state_dict() if trainer.refresh is not None else {},
    }


def restore_ppo_state(trainer, s: dict) -> None:
    """The inverse of :func:`ppo_state`; refuses a checkpoint of another world size."""
    ctx = trainer.ctx
    if int(s.get("world", 1)) != ctx.world:
        raise ConfigError(
            f"--resume: the checkpoint was written by {s.get('world', 1)} "
            f"rank{'s' * (int(s.get('world', 1)) != 1)}; resume it with the same number, "
            f"not {ctx.world}"
        )
    was, now = s.get("strategy"), trainer.cfg.dist.strategy if ctx.enabled else None
    if was is None and now is not None:  # a checkpoint from before it was recorded there
        recorded = read_recorded_config(Path(trainer.run_dir) / "config.yaml")
        was = (recorded.get("dist") or {}).get("strategy") if s.get("world", 1) > 1 else None
    if was == "ddp" and now == "fsdp":  # the other way, FSDP's full state loads by position
        raise ConfigError(
            "--resume: dist.strategy is 'fsdp', but the checkpoint was written under 'ddp', "
            "whose optimiser state FSDP cannot read; resume with dist.strategy=ddp"
        )
    trainer.iteration = int(s["iteration"])
    trainer.update.guard.load_state_dict(s)
    trainer.kl_ctl.load_state_dict(s["kl"])
    _restart_changed_kl_coef(trainer, s)
    if trainer.cfg.ppo.kl_target is not None and not trainer.kl_ctl.value > 0:
        raise ConfigError(  # a β the horizon guard (2026-12-07) now keeps positive
            f"--resume: the checkpoint's adaptive β is {trainer.kl_ctl.value:g} (a KL bonus, "
            "not a penalty: ppo.kl_horizon was too short); resume an earlier checkpoint or "
            "start afresh"
        )
    C.restore_rng(s["rng"][ctx.rank], trainer.gens)
    trainer.stream.load_state_dict(s["data"])
    trainer.moments.load_state_dict(s["moments"])
    if trainer.monitor is not None and s.get("monitor"):
        trainer.monitor.state.load_state_dict(s["monitor"])
    if "best" in s:  # checkpoints from 2026-12-06 on
        trainer.watch.best.load_state_dict(s["best"])
    if trainer.refresh is not None and s.get("refresh"):  # a run with refreshes
        trainer.refresh.load_state_dict(s["refresh"])


def _restart_changed_kl_coef(trainer, s: dict) -> None:
    """A resume with another ``ppo.kl_coef`` than the checkpoint's run: β is scaled by
    now / was, keeping what the adaptive controller or the monitor's raise_kl made of it
    (before, the new value was said as a change and never used). Checkpoints from before
    2026-12-08 hold no kl_coef: the settings recorded for their step are read instead."""
    was = s.get("kl_coef")
    if was is None:
        run = Path(trainer.run_dir)
        kept = run / f"config.until-step-{int(s['iteration'])}.yaml"
        saved = kept if kept.is_file() else run / "config.yaml"
        was = (
            (read_recorded_config(saved).get("ppo") or {}).get("kl_coef")
            if saved.is_file()
            else None
        )
    now = trainer.cfg.ppo.kl_coef
    if isinstance(was, (int, float)) and was > 0 and float(was) != now:
        beta = trainer.kl_ctl.value * now / float(was)
        if trainer.ctx.is_main:
            log.warning(
                "--resume: ppo.kl_coef %g → %g: β %.4g → %.4g (scaled by the same factor)",
                was, now, trainer.kl_ctl.value, beta,
            )  # fmt: skip
        trainer.kl_ctl.value = beta
