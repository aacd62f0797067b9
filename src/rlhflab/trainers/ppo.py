"""Online RLHF with PPO's update. :meth:`PPOTrainer.step` reads top to bottom: 1 generate
(1b centre a reward ensemble) → 2 score → 3 missing-EOS penalty (3b PAR shaping) → 4 score
normalisation → 5–7 the estimator that ppo.advantage_estimator names (gae with a critic, or
the group baselines grpo / rloo: :mod:`rlhflab.core.advantages`) → 8 PPO epochs → 9 metrics
→ 10 KL controller → 11 reward-model refresh (optional); the run loop (:mod:`~.loop`) adds
12, the checkpoint. The trainer holds its parts: :class:`~.ppo_epochs.PPOUpdate` (step 8;
optimisers in :class:`~.update_guard.GuardedUpdate`), :class:`~.ppo_watch.PPOWatch`,
:class:`~.ppo_refresh.RewardRefresh` (step 11) and :class:`~.runstate.CastCheckpoints`.
The maths is in :mod:`rlhflab.core.algorithms`.
"""

from __future__ import annotations

import random
import time
from pathlib import Path

import torch

from rlhflab.config import Config, ConfigError
from rlhflab.config.base import to_dict
from rlhflab.core import advantages as ADV
from rlhflab.core import algorithms as A
from rlhflab.core.stats import RunningMoments
from rlhflab.diagnostics.memory import peak_rss_bytes
from rlhflab.experience.cast import ModelCast, build_cast, load_policy_tokenizer
from rlhflab.experience.rollout import Rollout, generate_rollout, score_policy, score_rollout
from rlhflab.experience.sampling import SamplingScores
from rlhflab.infra.distributed import (
    global_batch_moments,
    global_moments,
    init_distributed,
    rank_split,
)
from rlhflab.trainers import ppo_guards as guards
from rlhflab.trainers.common import load_prompt_set, refuse_before_models
from rlhflab.trainers.loop import RunLoop
from rlhflab.trainers.ppo_epochs import EpochStats, PPOUpdate
from rlhflab.trainers.ppo_metrics import (
    METRICS,
    answer_kl,
    iteration_metrics,
    progress_summary,
    run_facts,
    sample_rows,
)
from rlhflab.trainers.ppo_refresh import RewardRefresh
from rlhflab.trainers.ppo_watch import PPOWatch
from rlhflab.trainers.runstate import (
    CastCheckpoints,
    ppo_state,
    restore_ppo_state,
    warn_about_settings,
    wrap_for_parallel,
)

__all__ = ["METRICS", "PPOTrainer", "train"]  # METRICS: where docs/ppo.md points


class PPOTrainer:
    """PPO-family RLHF on one loop: the advantage estimator is a config choice."""

    def __init__(self, cfg: Config, cast: ModelCast | None = None, rewards=(), gold=None):
        """``rewards``: (source, weight) pairs beside the configured ones, and ``gold``: a
        reward source for the monitor instead of monitor.gold (the Python API's callables,
        :mod:`rlhflab.app.api`); a ``cast`` already holds its rewards."""
        self.cfg = cfg
        random.seed(cfg.seed)
        torch.manual_seed(cfg.seed)
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        self.estimator = ADV.get(cfg.ppo.advantage_estimator)  # steps 5–7
        # answers that stay on one rank together: a group's baseline is the rank's (PPO: 1)
        self.group_size = cfg.grpo.group_size if self.estimator.grouped else 1
        self.ctx = init_distributed(cfg.device)
        # checked before any model loads: ppo.minibatches steps per epoch on every rank
        r, p = cfg.rollout, cfg.ppo
        args = (r.prompts_per_iteration, self.ctx.world, p.minibatches, p.micro_batch_size)
        self.minibatch_size = rank_split(*args, self.group_size)
        # the prompts first, with the policy's tokenizer alone, and lengths against its
        # config.json: a bad data file is reported in seconds, not after four models load
        tokenizer = cast.tokenizer if cast is not None else load_policy_tokenizer(cfg)
        self.stream = load_prompt_set(cfg, tokenizer)
        self.stream.batch_size = r.prompts_per_iteration // self.group_size  # distinct prompts
        self._check_batch(guards.policy_positions(cfg, cast))
        refuse_before_models(cfg, Path(cfg.log.output_dir), "log.output_dir", self.ctx.is_main)
        device = self.ctx.device if self.ctx.enabled else None
        self.cast = cast or build_cast(cfg, device, tokenizer, rewards)
        self.device = self.cast.device
        self.fsdp = self.ctx.enabled and cfg.dist.strategy == "fsdp"
        warn_about_settings(cfg)
        self.train_policy, self.train_critic = wrap_for_parallel(cfg, self.ctx, self.cast)
        # under FSDP every rank must run the same number of forward passes while sampling
        self.all_done = self.ctx.all_true if self.fsdp else None
        self.kl_ctl = (
            A.AdaptiveKLController(p.kl_coef, p.kl_target, p.kl_horizon)
            if p.kl_target
            else A.FixedKLController(p.kl_coef)
        )
        self.gens = {
            # data order is shared by every rank; sampling differs per rank (seed + offset)
            "sample": torch.Generator(device=self.device).manual_seed(
                cfg.seed + 1000 * self.ctx.rank
            ),
            "shuffle": torch.Generator().manual_seed(cfg.seed + 1),
            "monitor": torch.Generator(device=self.device).manual_seed(cfg.seed + 2),
        }
        self.iteration = 0
        self.run_dir = Path(cfg.log.output_dir)
        self.refresh = RewardRefresh.build(cfg, self.ctx, self.cast, self.run_dir)  # or None
        self.checkpoints = CastCheckpoints(cfg, self.ctx, self.cast, self.run_dir, self.fsdp)
        trained, shuffle = (self.train_policy, self.train_critic), self.gens["shuffle"]
        self.update = PPOUpdate(  # step 8; owns the optimisers
            cfg, self.ctx, self.cast, *trained, self.minibatch_size, shuffle, self.save
        )
        self.watch = PPOWatch(  # steps 2b and 9b, and the KL-sign check
            cfg, self.ctx, self.cast, self.kl_ctl, self.gens["monitor"], self.all_done, gold
        )
        self.moments = RunningMoments()  # reward.normalize=running
        moments = self._moments if self.ctx.enabled else None  # whitening over every rank
        self.adv_settings = ADV.settings_from_config(cfg, moments)
        self.callbacks: list = []  # called as cb(trainer, rollout, metrics) after step 9
        self.step_hooks: list = []  # hook(iteration, metrics) after it is logged (RunLoop)
        self.last_rollout: Rollout | None = None

    # read-only views of the parts, for callers and tests
    opt = property(lambda self: self.update.guard.opt)
    critic_opt = property(lambda self: self.update.guard.critic_opt)
    skipped_total = property(lambda self: self.update.guard.skipped_total)
    first_minibatch = property(lambda self: self.update.first_minibatch)
    monitor = property(lambda self: self.watch.monitor)
    stop_reason = property(lambda self: self.watch.stop_reason)

    def _check_batch(self, limit: int | None) -> None:
        r = self.cfg.rollout
        if limit is not None and r.max_prompt_tokens + r.max_new_tokens > limit:
            who = "max_prompt_tokens" if r.max_prompt_tokens >= limit else "max_new_tokens"
            raise ConfigError(
                f"rollout.{who}: rollout.max_prompt_tokens + rollout.max_new_tokens = "
                f"{r.max_prompt_tokens + r.max_new_tokens} exceeds the model's {limit} "
                "positions (the position limit of its config.json); lower one of them"
            )

    def step(self) -> dict[str, float]:
        """One iteration, steps 1–10; returns its metrics, averaged over every rank."""
        prompts = self._local_share(self.next_prompts())
        reuse = self.reuses_training_forward()  # old log-probs then come from step 8
        # the monitor's opener probe (2b) extends the prompts' KV caches of steps 1 and 2
        caches = self.watch.prompt_caches(self.iteration) or {}
        times: dict[str, float] = {}
        # 1. generate (with rollout.logprobs_from_sampling, also the old log-probs)
        t0 = time.perf_counter()
        rollout = self._generate(prompts, reuse, caches.get("policy"))
        times["time/generate"] = time.perf_counter() - t0
        # 1b. the reward ensemble centred on the reference's answers (optional)
        centring = {}
        if self.cfg.reward.ensemble and self.cfg.reward.ensemble_center == "reference":
            centring = guards.center_ensemble(
                self.cast, self.watch, self.ctx, rollout, self.iteration
            )
        # 2. score: old and reference log-probs, values, reward
        t0 = time.perf_counter()
        self._score(rollout, reuse, caches.get("reference"))
        times["time/score"] = time.perf_counter() - t0
        # 2b. the monitor's flattery probe, on the weights that sampled this rollout
        t0 = time.perf_counter()
        openers = self.watch.opener_probe(rollout, caches or None)
        times["time/monitor_probe"] = time.perf_counter() - t0 if caches else 0.0
        # 2c. the batch's gold reward (monitor.gold); log.keep_best keeps the weights that
        # sampled it, before step 8 changes them, when its smoothed mean is the best so far
        if self.watch.score_gold(rollout, self.iteration + 1) and self.watch.keep_best:
            self.save(self.iteration, "best")

        # 3. missing-EOS penalty; 3b. PAR shaping against the reference's answers (optional)
        penalty = self.cfg.reward.missing_eos_penalty
        raw_scores = guards.penalise_missing_eos(rollout.scores, rollout.ended, penalty)
        eos_part = guards.eos_penalty_part(raw_scores, rollout.scores, penalty)
        scores, shaping = raw_scores, {}
        if self.cfg.reward.shaping == "par":
            args = (rollout, raw_scores, self.iteration, penalty)
            scores, shaping = guards.par_scores(self.cast, self.watch, *args)
        # 4. score normalisation (optional) and clipping
        scores = self._normalise(scores)

        # 5.–7. KL shaping, advantages, whitening: the configured estimator. With the KL
        # in the loss it takes no part in them (zeros stand in for it until step 8 has the
        # old log-probs)
        beta = self.kl_ctl.value
        kl = torch.zeros_like(rollout.ref_logprobs) if reuse else self._token_kl(rollout)
        values = rollout.values if self.estimator.needs_critic else None
        adv = self.estimator.fn(scores, kl, rollout.response_mask, values, beta, self.adv_settings)

        # 8. PPO epochs (skipped entirely when the reward is not finite)
        t0 = time.perf_counter()
        train = self.update.run(
            rollout, adv.advantages, adv.returns, beta, raw_scores, self.iteration
        )
        if reuse:
            self._score_unfilled_old_logprobs(rollout)
            kl = self._token_kl(rollout)
        times["time/train"] = time.perf_counter() - t0
        if not getattr(self, "_gap_said", False):  # once, however step() is called
            self._gap_said = guards.reference_gap_checked(self, rollout, beta)

        # 9. metrics, the same on every rank, then the monitor's reaction to them (9b)
        metrics = self._metrics(rollout, raw_scores, kl, beta, train, adv.metrics, times)
        metrics = self.ctx.mean_metrics(
            metrics | shaping | centring | eos_part
        )  # every rank logs and decides on global means
        metrics.update(self.watch.react(rollout, metrics, openers, self.iteration))
        for cb in self.callbacks:
            cb(self, rollout, metrics)

        # 10. KL controller, on the global per-answer KL (the controller's unit)
        self.kl_ctl.update(metrics["objective/kl"], len(rollout) * self.ctx.world)
        self.last_rollout = rollout

        # 11. reward-model refresh (reward.refresh_every): the policy's fresh answers to the
        # batch's prompts, labelled, fine-tune the reward model the next iterations use
        if self.refresh is not None and self.refresh.due(self.iteration + 1):
            distinct = rollout.prompts[:: self.group_size]  # a group's prompt once
            metrics.update(self.refresh.run(distinct, self.iteration + 1))
        return metrics

    def next_prompts(self) -> list[str]:
        """The global batch's prompts; a grouped estimator's each G times in a row (groups
        are consecutive, as the group advantages expect)."""
        return [q for q in self.stream.next_batch() for _ in range(self.group_size)]

    def _local_share(self, prompts: list[str]) -> list[str]:
        """This rank's contiguous slice of the global batch (whole groups for GRPO/RLOO)."""
        if not self.ctx.enabled:
            return prompts
        b = len(prompts) // self.ctx.world
        return prompts[self.ctx.rank * b : (self.ctx.rank + 1) * b]

    def _generate(self, prompts: list[str], reuse: bool, prompt_caches=None) -> Rollout:
        """Step 1: sample an answer to each prompt with the current policy (``prompt_caches``:
        where to keep the prompts' KV cache for the opener probe)."""
        r = self.cfg.rollout
        self.cast.policy.eval()
        return generate_rollout(
            self.cast.policy_lm,
            self.cast.tokenizer,
            prompts,
            r.max_new_tokens,
            r.temperature,
            r.top_k,
            r.top_p,
            self.gens["sample"],
            self.device,
            all_done=self.all_done,
            ignore_eos=r.ignore_eos,
            scores=self._sampling_scores(reuse),
            autocast=self.cast.autocast,  # model.compute_dtype, as scoring and training
            prompt_caches=prompt_caches,
            sampler=r.sampler,
        )

    def _score(self, rollout: Rollout, reuse: bool, prompt_caches=None) -> None:
        """Step 2: old and reference log-probs, values, reward (a separate critic's values
        may come from its first training forward, run here and kept for step 8;
        ``prompt_caches``: where to keep the reference's KV cache of the prompts)."""
        r = self.cfg.rollout
        policy_forward = not reuse and rollout.old_logprobs is None
        critic_now = self.update.critic_forward_kept(len(rollout))
        score_rollout(
            self.cast,
            rollout,
            r.temperature,
            r.score_micro_batch,
            policy_forward,
            not critic_now,
            prompt_caches,
        )
        if critic_now:
            self.update.keep_critic_forward(rollout)

    def _normalise(self, scores: torch.Tensor) -> torch.Tensor:
        """Step 4: reward.normalize (batch or running, over every rank), then reward.clip."""
        mode, clip = self.cfg.reward.normalize, self.cfg.reward.clip
        if mode == "batch":
            every = torch.ones_like(scores, dtype=torch.bool)
            scores = A.masked_whiten(scores, every, moments=self._moments(scores, every))
        elif mode == "running":
            # moments over every rank's scores: each rank scales by the same number
            finite = scores[torch.isfinite(scores)]
            self.moments.merge(*global_batch_moments(finite, self.ctx))
            scores = A.scale_by_running_std(scores, self.moments.var)
        if clip is not None:
            scores = scores.clamp(-clip, clip)
        return scores

    def _moments(self, x: torch.Tensor, mask: torch.Tensor):
        """Whitening statistics over every rank's data (None: local, single process)."""
        return global_moments(x, mask, self.ctx) if self.ctx.enabled else None

    def _token_kl(self, rollout: Rollout) -> torch.Tensor:
        """Per-token KL estimate (B, T) of the old policy to the reference, 0 on padding."""
        kl = A.kl_estimate(rollout.old_logprobs, rollout.ref_logprobs, self.cfg.ppo.kl_estimator)
        return torch.where(rollout.response_mask.bool(), kl, torch.zeros_like(kl))

    def _score_unfilled_old_logprobs(self, rollout: Rollout) -> None:
        """After step 8 under ppo.reuse_training_forward: an update skipped for a non-finite
        value left old log-probs unset; score them the way step 2 would have."""
        r = self.cfg.rollout
        if rollout.old_logprobs is None or not self.update.reuse_filled.all():
            score_policy(self.cast, rollout, r.temperature, r.score_micro_batch)

    def reuses_training_forward(self) -> bool:
        """Whether step 8's forward can supply the old log-probs (ppo.reuse_training_forward):
        one update on the sampling weights, no values needed for the advantages, and no KL
        in the reward (which would need the old log-probs before the advantages)."""
        p = self.cfg.ppo
        return (
            p.reuse_training_forward
            and p.epochs == 1
            and p.minibatches == 1
            and p.kl_placement == "loss"
            and not self.cast.has_values
        )

    def _sampling_scores(self, reuse: bool) -> SamplingScores | None:
        """What step 1 records for step 2 (rollout.logprobs_from_sampling), or None."""
        if not self.cfg.rollout.logprobs_from_sampling or reuse:
            return None
        if self.cast.shared:
            return SamplingScores(self.cast.policy_lm, self.cast.policy.value_head)
        return SamplingScores()

    def _metrics(self, ro: Rollout, raw_scores, kl, beta, train: EpochStats, adv, times):
        """Step 9: this rank's metrics (METRICS names them); checks the KL's sign first."""
        seq_kl = answer_kl(ro)
        self.watch.check_kl_sign(seq_kl)
        run = {
            "memory/peak_mib": self._peak_memory() / 2**20,
            "faults/skipped_updates": self.skipped_total,
            "lr/policy": self.opt.param_groups[0]["lr"],
        }
        scaler = self.update.guard.scaler
        if scaler.enabled:  # model.compute_dtype=fp16
            run |= {"faults/overflow_skips": scaler.overflows, "faults/loss_scale": scaler.scale}
        in_reward, world = self.cfg.ppo.kl_placement == "reward", self.ctx.world
        return iteration_metrics(
            ro, raw_scores, seq_kl, kl, beta, in_reward, world, train.metrics, adv, times, run
        )

    def _peak_memory(self) -> int:
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device)
        return peak_rss_bytes()

    # ------------------------------------------------------------------ the run

    def fit(self, resume: bool = False) -> dict:
        """Run to ppo.iterations (from the newest checkpoint with ``resume``)."""
        name = "PPO" if self.estimator.name == "gae" else self.estimator.name.upper()
        loop = RunLoop(
            self.run_dir,
            self.cfg.ppo.iterations,
            self.cfg.log,
            to_dict(self.cfg),
            name,
            self.ctx.is_main,
            samples=self.sample_rows,
            alerts=self.watch.new_alerts,
            postfix=progress_summary,
            facts=self.run_facts,
        )
        done = loop.run(self, resume)
        return {"iterations": done.steps, "last": done.last, "stop_reason": done.stop_reason}

    def state_dict(self) -> dict:
        """Everything but the weights that resume needs (collective under FSDP)."""
        return ppo_state(self)

    def load_state_dict(self, s: dict) -> None:
        restore_ppo_state(self, s)

    def save(self, iteration: int, name: str | None = None) -> Path:
        """Write checkpoints/step-N or ``name`` (collective; rank 0 writes the files).
        ``best`` (log.keep_best) goes without the optimisers' moments: it is for export."""
        return self.checkpoints.save(iteration, self.state_dict, name, name != "best")

    def load_checkpoint(self, path: Path) -> None:
        self.load_state_dict(self.checkpoints.load(path))

    def sample_rows(self, n: int) -> list[dict]:
        """Up to n answers of the last iteration with their scores, KL and gold, and the
        reference's answer to the same prompt (:meth:`PPOWatch.sample_extras`)."""
        rows = sample_rows(self.last_rollout, n)
        return [{**r, **x} for r, x in zip(rows, self.watch.sample_extras(len(rows)))]

    def run_facts(self) -> dict:
        """What run.json adds for this run: model sizes, and the gold reward's story."""
        return run_facts(self.cast, self.run_dir, self.cfg.monitor.smoothing, self.watch.keep_best)


def train(cfg: Config, resume: bool = False) -> dict:
    return PPOTrainer(cfg).fit(resume)
