"""Online PPO against a reward model. One iteration reads top to bottom as numbered steps:

1 generate → 2 score → 3 missing-EOS penalty → 4 score normalisation → 5 per-token KL
shaping → 6 GAE → 7 advantage whitening → 8 PPO epochs → 9 metrics → 10 KL controller →
11 checkpoint. Step 8, the epochs and the guarded update, is in
:mod:`rlhflab.trainers.ppo_epochs`; checkpoints and resume in :mod:`~.runstate`.

Every implementation detail is a field of :class:`rlhflab.config.Config`; the maths is in
:mod:`rlhflab.core.algorithms`; devices, logs and checkpoints sit behind the helpers below.
"""

from __future__ import annotations

import random
import time
from pathlib import Path

import torch

from rlhflab.config import Config, ConfigError
from rlhflab.core import algorithms as A
from rlhflab.diagnostics.memory import peak_rss_bytes
from rlhflab.diagnostics.monitor import HackingMonitor
from rlhflab.experience.cast import ModelCast, build_cast, load_policy_tokenizer
from rlhflab.experience.rewards import FunctionReward, RunningMoments
from rlhflab.experience.rollout import (
    Rollout,
    generate_rollout,
    score_policy,
    score_rollout,
)
from rlhflab.experience.sampling import SamplingScores
from rlhflab.infra.distributed import (
    global_batch_moments,
    global_moments,
    init_distributed,
    rank_split,
    shard,
    wrap_trained,
)
from rlhflab.trainers.common import (
    build_optimizer,
    build_scheduler,
    load_prompt_set,
)
from rlhflab.trainers.ppo_epochs import PPOEpochs
from rlhflab.trainers.ppo_watch import PPOWatch
from rlhflab.trainers.runstate import CheckpointedRun

METRICS = {
    "objective/scores": "mean combined score after the missing-EOS penalty, before normalisation",
    "objective/scores/<name>": "mean of each reward component (each head, each function)",
    "objective/kl": "KL to the reference: batch mean of Σ_t (logp_old − logp_ref) (k1, nats "
    "per answer; OAI19)",
    "objective/kl_k3": "the same KL with the k3 estimator, never negative (a negative "
    "objective/kl beside it: the answers were not sampled by π; a warning says so)",
    "objective/kl_coef": "β used this iteration",
    "objective/non_score_reward": "batch mean of Σ_t −β·kl_t (the KL part of the RLHF reward)",
    "objective/rlhf_reward": "objective/scores + objective/non_score_reward",
    "objective/entropy": "batch mean of Σ_t −logp_old (sampled entropy per answer)",
    "policy/entropy": "token mean of the full-distribution entropy H_t at the sampling τ",
    "policy/approx_kl": "KL(π_old‖π) k3 estimate, mean over PPO minibatches",
    "policy/clipfrac": "fraction of tokens where the clipped surrogate binds, mean over minibatches",
    "policy/ratio_mean": "mean ρ over minibatches (should stay ≈ 1)",
    "policy/ratio_max": "largest ρ seen in the iteration",
    "policy/loss": "policy loss, mean over minibatches",
    "policy/grad_norm": "policy gradient norm before its own clip (a shared value head in it)",
    "val/loss": "value loss, mean over minibatches",
    "val/clipfrac": "fraction of tokens where the value clip binds (|V − V_old| > "
    "ppo.value_clip) and the clipped error is the larger",
    "val/explained_variance": "1 − Var(R − V_old)/Var(R) over response tokens",
    "val/grad_norm": "a separate critic's gradient norm before its own clip",
    "response/length_mean": "mean answer length in tokens (EOS included)",
    "response/length_max": "longest answer in tokens",
    "response/eos_rate": "fraction of answers that ended with EOS",
    "response/count": "answers generated this iteration, all ranks",
    "response/tokens": "answer tokens generated this iteration, all ranks (the compute budget)",
    "time/generate": "seconds sampling",
    "time/score": "seconds scoring",
    "time/train": "seconds in the PPO epochs",
    "time/monitor_probe": "seconds in the monitor's flattery-opener probe (0 when it is off)",
    "throughput/tokens_per_sec": "generated answer tokens per second of sampling",
    "memory/peak_mib": "peak resident memory (CPU) or peak allocated (CUDA), MiB",
    "faults/skipped_updates": "updates skipped so far for a non-finite reward, loss or gradient",
    "lr/policy": "policy learning rate after this iteration",
}


class PPOTrainer(PPOEpochs, PPOWatch, CheckpointedRun):
    def __init__(self, cfg: Config, cast: ModelCast | None = None):
        self.cfg = cfg
        random.seed(cfg.seed)
        torch.manual_seed(cfg.seed)
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        self.ctx = init_distributed(cfg.device)
        # checked before any model loads: ppo.minibatches steps per epoch on every rank
        r, p = cfg.rollout, cfg.ppo
        args = (r.prompts_per_iteration, self.ctx.world, p.minibatches, p.micro_batch_size)
        self.minibatch_size = rank_split(*args, self._group_size())
        # the prompts first, with the policy's tokenizer alone: a bad data file is reported
        # in seconds, not after four models have been loaded
        tokenizer = cast.tokenizer if cast is not None else load_policy_tokenizer(cfg)
        self.stream = load_prompt_set(cfg, tokenizer)
        device = self.ctx.device if self.ctx.enabled else None
        self.cast = cast or build_cast(cfg, device, tokenizer)
        self.device = self.cast.device
        self._setup_parallel()
        total_steps = p.iterations * p.epochs * p.minibatches
        groups = [
            {
                "params": [
                    q
                    for n, q in self.cast.policy.named_parameters()
                    if q.requires_grad and not n.startswith("value_head")
                ],
                "lr": p.lr,
            }
        ]
        if self.cast.shared:
            groups.append(
                {"params": list(self.cast.policy.value_head.parameters()), "lr": p.critic_lr}
            )
        self.opt = build_optimizer(groups, p)
        self.sched = build_scheduler(self.opt, p.warmup_steps, total_steps, p.lr_schedule)
        self.critic_opt = self.critic_sched = None
        if self.cast.critic is not None:
            self.critic_opt = build_optimizer(
                [{"params": list(self.cast.critic.parameters()), "lr": p.critic_lr}], p
            )
            self.critic_sched = build_scheduler(
                self.critic_opt, p.warmup_steps, total_steps, p.lr_schedule
            )
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
            # the monitor's reference samples draw from their own stream, so switching the
            # monitor on or off never changes what the policy samples
            "monitor": torch.Generator(device=self.device).manual_seed(cfg.seed + 2),
        }
        self.monitor = None
        if cfg.monitor.enabled:
            gold = FunctionReward(cfg.monitor.gold) if cfg.monitor.gold else None
            self.monitor = HackingMonitor(cfg.monitor, gold, p.kl_target)
        self.moments = RunningMoments()
        self.skipped_total = self.consecutive_bad = 0
        self.iteration = 0
        self.run_dir = Path(cfg.log.output_dir)
        self.first_minibatch: dict[str, float] | None = None
        self.reuse_filled: torch.Tensor | None = None  # step 8 filling old log-probs
        self.kept_values: torch.Tensor | None = None  # step 2's critic graph, for step 8
        self.in_backward = None  # step 8's UpdateInBackward under ppo.step_in_backward
        self.callbacks: list = []  # called as cb(trainer, rollout, metrics) after step 9
        self.stop_reason: str | None = None
        self._check_batch()

    def _setup_parallel(self) -> None:
        """Wrap (DDP) or shard (FSDP2) the trained models before their optimisers exist."""
        cfg, ctx, cast = self.cfg, self.ctx, self.cast
        strategy = cfg.dist.strategy
        if ctx.enabled and cfg.ppo.step_in_backward:
            raise ConfigError(
                "ppo.step_in_backward: with several processes the gradients are averaged "
                "across ranks after the backward; updating during it is single-process only"
            )
        if (
            ctx.enabled
            and strategy == "fsdp"
            and cast.shared
            and cfg.rollout.logprobs_from_sampling
        ):
            raise ConfigError(
                "rollout.logprobs_from_sampling: with a shared backbone under fsdp the value "
                "head's weights are sharded outside the sampling pass; use ddp, a separate "
                "critic, or turn it off"
            )
        if ctx.enabled and strategy == "fsdp" and cfg.model.lora_r:
            raise ConfigError("dist.strategy: LoRA with fsdp is not supported; use ddp")
        self.fsdp = ctx.enabled and strategy == "fsdp"
        self.train_policy = wrap_trained(cast.policy, ctx, strategy, cfg.dist.mixed_precision)
        self.train_critic = None
        if cast.critic_values is not None:
            self.train_critic = wrap_trained(
                cast.critic_values, ctx, strategy, cfg.dist.mixed_precision
            )
        if self.fsdp and cfg.dist.shard_reference and isinstance(cast.reference, torch.nn.Module):
            shard(cast.reference)
        # under FSDP every rank must run the same number of forward passes while sampling
        self.all_done = ctx.all_true if self.fsdp else None

    def _group_size(self) -> int:
        """Answers that must stay on one rank together (1: PPO's answers are independent)."""
        return 1

    def _local_share(self, prompts: list[str]) -> list[str]:
        """This rank's contiguous slice of the global batch (whole groups for GRPO/RLOO)."""
        if not self.ctx.enabled:
            return prompts
        b = len(prompts) // self.ctx.world
        return prompts[self.ctx.rank * b : (self.ctx.rank + 1) * b]

    def _moments(self, x: torch.Tensor, mask: torch.Tensor):
        """Whitening statistics over every rank's data (None: local, single process)."""
        return global_moments(x, mask, self.ctx) if self.ctx.enabled else None

    def _check_batch(self) -> None:
        r = self.cfg.rollout
        if (
            r.max_prompt_tokens + r.max_new_tokens
            > self.cast.policy_lm.config.max_position_embeddings
        ):
            raise ValueError(
                "rollout: max_prompt_tokens + max_new_tokens exceeds the model's "
                "max_position_embeddings"
            )

    # ------------------------------------------------------------------ one iteration

    def step(self) -> dict[str, float]:
        cfg, p, r = self.cfg, self.cfg.ppo, self.cfg.rollout
        cast = self.cast
        prompts = self._local_share(self.next_prompts())

        # 1. generate (with rollout.logprobs_from_sampling, also the old log-probs)
        t0 = time.perf_counter()
        cast.policy.eval()
        reuse = self._reuse_training_forward()  # old log-probs then come from step 8
        scores = self._sampling_scores(reuse)
        rollout = generate_rollout(
            cast.policy_lm,
            cast.tokenizer,
            prompts,
            r.max_new_tokens,
            r.temperature,
            r.top_k,
            r.top_p,
            self.gens["sample"],
            self.device,
            all_done=self.all_done,
            ignore_eos=r.ignore_eos,
            scores=scores,
        )
        t_gen = time.perf_counter() - t0

        # 2. score: old and reference log-probs, values, reward (a separate critic's values
        # may come from its first training forward, run here and kept for step 8)
        t0 = time.perf_counter()
        policy_forward = not reuse and rollout.old_logprobs is None
        critic_now = self._critic_forward_kept(len(rollout))
        score_rollout(
            cast, rollout, r.temperature, r.score_micro_batch, policy_forward, not critic_now
        )
        if critic_now:
            self._keep_critic_forward(rollout)
        t_score = time.perf_counter() - t0
        mask = rollout.response_mask
        # 2b. the monitor's flattery probe, on the weights that sampled this rollout
        t0 = time.perf_counter()
        openers = self._opener_probe(rollout)
        t_probe = time.perf_counter() - t0

        # 3. missing-EOS penalty
        scores = rollout.scores.clone()
        if cfg.reward.missing_eos_penalty is not None:
            scores = torch.where(rollout.ended, scores, scores - cfg.reward.missing_eos_penalty)
        raw_scores = scores

        # 4. score normalisation (optional) and clipping
        scores = self._normalise(scores)

        # 5.–7. KL shaping, advantages (GAE for PPO; group baselines for GRPO/RLOO), whitening
        beta = self.kl_ctl.value
        # with the KL in the loss it takes no part in the advantages (zeros stand in for it
        # until step 8 has the old log-probs)
        kl = torch.zeros_like(rollout.ref_logprobs) if reuse else self._token_kl(rollout)
        in_reward = p.kl_placement == "reward"
        advantages, returns, adv_stats = self.advantages(rollout, scores, kl, beta)

        # 8. PPO epochs (skipped entirely when the reward is not finite)
        t0 = time.perf_counter()
        if self.ctx.all_true(bool(torch.isfinite(raw_scores).all())):
            train_stats = self._ppo_epochs(rollout, advantages, returns, beta)
        else:
            train_stats = {}
            self._bad_update("reward", int((~torch.isfinite(raw_scores)).sum()))
        self.kept_values = None  # the kept critic graph, used or not, is released here
        if reuse:
            if rollout.old_logprobs is None or not self.reuse_filled.all():
                # an update skipped for a non-finite value: score the way step 2 would have
                score_policy(cast.policy, rollout, r.temperature, r.score_micro_batch)
            kl = self._token_kl(rollout)
        t_train = time.perf_counter() - t0

        # 9. metrics
        k1 = torch.where(mask.bool(), rollout.old_logprobs - rollout.ref_logprobs, 0.0)
        seq_kl = k1.sum(1)
        self._check_kl_sign(seq_kl)
        k3 = A.kl_estimate(rollout.old_logprobs, rollout.ref_logprobs, "k3")
        non_score = (-beta * kl).sum(1) if in_reward else torch.zeros_like(seq_kl)
        lengths = mask.sum(1).float()
        metrics = {
            "objective/scores": raw_scores.mean().item(),
            **{f"objective/scores/{k}": v.mean().item() for k, v in rollout.components.items()},
            "objective/kl": seq_kl.mean().item(),
            "objective/kl_k3": torch.where(mask.bool(), k3, 0.0).sum(1).mean().item(),
            "objective/kl_coef": beta,
            "objective/non_score_reward": non_score.mean().item(),
            "objective/rlhf_reward": (raw_scores + non_score).mean().item(),
            "objective/entropy": torch.where(mask.bool(), -rollout.old_logprobs, 0.0)
            .sum(1)
            .mean()
            .item(),
            "policy/entropy": A.masked_mean(rollout.entropy, mask).item(),
            **train_stats,
            **adv_stats,
            "response/length_mean": lengths.mean().item(),
            "response/length_max": lengths.max().item(),
            "response/eos_rate": rollout.ended.float().mean().item(),
            # rank-mean × world = global total once mean_metrics has averaged over ranks
            "response/count": float(len(rollout) * self.ctx.world),
            "response/tokens": lengths.sum().item() * self.ctx.world,
            "time/generate": t_gen,
            "time/score": t_score,
            "time/train": t_train,
            "time/monitor_probe": t_probe,
            "throughput/tokens_per_sec": lengths.sum().item() / max(t_gen, 1e-9),
            "memory/peak_mib": self._peak_memory() / 2**20,
            "faults/skipped_updates": self.skipped_total,
            "lr/policy": self.opt.param_groups[0]["lr"],
        }
        metrics = self.ctx.mean_metrics(metrics)  # every rank logs and decides on global means
        if self.monitor is not None:
            metrics.update(self._watch(rollout, metrics, openers))
        for cb in self.callbacks:
            cb(self, rollout, metrics)

        # 10. KL controller, on the global per-answer KL (the controller's unit)
        self.kl_ctl.update(metrics["objective/kl"], len(rollout) * self.ctx.world)
        self._last_rollout = rollout
        return metrics

    def _token_kl(self, rollout: Rollout) -> torch.Tensor:
        """Per-token KL estimate (B, T) of the old policy to the reference, 0 on padding."""
        kl = A.kl_estimate(rollout.old_logprobs, rollout.ref_logprobs, self.cfg.ppo.kl_estimator)
        return torch.where(rollout.response_mask.bool(), kl, torch.zeros_like(kl))

    def _reuse_training_forward(self) -> bool:
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

    def next_prompts(self) -> list[str]:
        return self.stream.next_batch()

    def advantages(self, rollout: Rollout, scores, kl, beta):
        """Steps 5–7 of PPO: per-token KL shaping r_t = −β·kl_t + score·[t = last], optional
        reward whitening, GAE (returns from unwhitened advantages), advantage whitening.
        Returns (advantages (B, T), returns (B, T), extra metrics)."""
        p, mask = self.cfg.ppo, rollout.response_mask
        rewards = A.shape_rewards(scores, kl, mask, beta if p.kl_placement == "reward" else 0.0)
        if p.whiten_rewards:
            rewards = A.masked_whiten(
                rewards, mask, shift_mean=False, moments=self._moments(rewards, mask)
            )
        advantages, returns = A.compute_gae(rewards, rollout.values, mask, p.gamma, p.lam)
        if p.whiten_advantages:
            advantages = A.masked_whiten(advantages, mask, moments=self._moments(advantages, mask))
        return advantages, returns, {}

    def _normalise(self, scores: torch.Tensor) -> torch.Tensor:
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

    def _peak_memory(self) -> int:
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device)
        return peak_rss_bytes()


def train(cfg: Config, resume: bool = False) -> dict:
    return PPOTrainer(cfg).fit(resume)
