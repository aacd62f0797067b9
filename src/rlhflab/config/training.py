"""Sampling (`rollout`) and the PPO update (`ppo`), which GRPO and RLOO share."""

from __future__ import annotations

from dataclasses import dataclass

from rlhflab.config.base import setting

# KL estimators whose gradient pulls toward the reference when differentiated in the loss
LOSS_KL_ESTIMATORS = ("k2", "k3", "k3+")
# ppo.advantage_estimator's choices (the registry in rlhflab/core/advantages.py; a test keeps
# the two equal) and those that train no critic, their baseline being the prompt's group
ADVANTAGE_ESTIMATORS = ("gae", "grpo", "rloo")
CRITIC_FREE_ESTIMATORS = ("grpo", "rloo")


@dataclass
class RolloutConfig:
    prompts_per_iteration: int = setting(
        16,
        "Answers sampled per PPO iteration. Larger batches tame the noise of one score per "
        "answer (pain point three).",
        low=1,
    )
    max_prompt_tokens: int = setting(
        64, "Longest prompt in tokens; longer ones are a data error.", low=1
    )
    max_new_tokens: int = setting(32, "Answer length limit; answers cut here have no EOS.", low=1)
    ignore_eos: bool = setting(
        False,
        "Treat EOS as an ordinary token: every answer is max_new_tokens long and none 'ends' "
        "(so reward.missing_eos_penalty hits all). For benchmarks that need equal work.",
    )
    temperature: float = setting(
        1.0,
        "Sampling temperature; every log-prob in training uses the same one (N+ detail).",
        low=0.0,
        low_open=True,
        hint="for greedy answers set rollout.top_k=1",
    )
    top_k: int = setting(
        0,
        "Top-k sampling (0 = off). Off by default: a truncated sampler makes the training "
        "log-probs differ from the sampling distribution (OAI19, N+ use neither).",
        low=0,
    )
    top_p: float = setting(
        1.0, "Nucleus sampling (1.0 = off); same caveat as top_k.", low=0.0, high=1.0, low_open=True
    )
    sampler: str = setting(
        "multinomial",
        "How each answer token is drawn from the softmax. 'multinomial': torch.multinomial, "
        "the random stream of every documented run. 'gumbel': the argmax of the logits plus "
        "Gumbel noise made from torch.rand (the Gumbel-max trick: the same distribution, a "
        "different random stream); on a CPU 9.9 → 2.1 ms per draw of 8 tokens at SmolLM2's "
        "49,152-token vocabulary, because torch.multinomial draws its exponentials with a "
        "scalar loop (docs/benchmarks.md). Used by PPO's, the monitor's and the reward "
        "refresh's sampling and by `rlhflab generate` / `rlhflab eval`; the gold "
        "evaluations (inside training, `rlhflab demo`'s and `rlhflab compare`'s) keep "
        "multinomial.",
        choices=("multinomial", "gumbel"),
    )
    score_micro_batch: int = setting(
        32, "Sequences per no-grad forward pass when scoring rollouts (memory vs speed).", low=1
    )
    logprobs_from_sampling: bool = setting(
        False,
        "Take the old log-probs and entropy (with a shared backbone, the values too) from "
        "the sampling pass, whose every step already has the logits of the token it draws, "
        "instead of a separate no-grad policy forward over prompt + answer: one policy "
        "forward fewer per iteration, as TRL's PPOTrainer does. Off by default because the "
        "KV-cached pass equals a full forward only to float rounding (~1e-6 in fp32; with "
        "model.compute_dtype=bf16 a first ratio up to 1.21 on SmolLM2-135M, beyond the "
        "clip, and a warning says so; more too with another sampling engine), so the "
        "first update's ratio is not exactly 1.",
    )


@dataclass
class PPOConfig:
    iterations: int = setting(20, "Rollout-then-train iterations.", low=1)
    epochs: int = setting(4, "Passes over each rollout batch (OAI19, N+, TRL: 4).", low=1)
    minibatches: int = setting(
        1,
        "Optimiser steps per epoch; must divide prompts_per_iteration. With 1 epoch and 1 "
        "minibatch the ratio is always 1 and clipping never binds.",
        low=1,
    )
    reuse_training_forward: bool = setting(
        True,
        "With 1 epoch of 1 minibatch, no value model and the KL in the loss (GRPO as "
        "usually run), the training forward is the first forward on the sampling weights: "
        "take the old log-probs and entropy from it (ratio exactly 1) instead of a separate "
        "no-grad policy forward while scoring, as TRL does. Ignored in every other case.",
    )
    values_from_training_forward: bool = setting(
        True,
        "With a separate critic and one minibatch of one micro-batch (the defaults), the "
        "critic's first training forward sees the weights and answers the old values are "
        "taken on: run it while scoring, take the old values from it and keep its graph "
        "for the first value loss, instead of a separate no-grad critic forward (one "
        "critic forward fewer per iteration; docs/benchmarks.md measures it). Same values; the "
        "critic runs in training mode either way. Ignored in every other case.",
    )
    step_in_backward: bool = setting(
        False,
        "Update each weight with AdamW as soon as its gradient is complete in the backward "
        "pass and free that gradient, so a trained model's gradients are never all held "
        "at once (the peak it saves: docs/benchmarks.md); tensors under 65,536 elements are "
        "updated together right after the backward instead (less per-tensor overhead). "
        "Same updates bit for bit. Needs max_grad_norm null (a clip "
        "needs all of a model's gradients first), one micro-batch per minibatch and a single "
        "process. The guard then holds back only tensors whose gradient is not finite (the "
        "rest are already updated, and their AdamW step counts advance while the "
        "learning-rate schedule does not, as for any skipped update), and a non-finite loss "
        "holds back only the backwards not yet run: a separate critic's backward comes "
        "after the policy's, or before it when its values come from its training forward "
        "(values_from_training_forward, one minibatch), and the model whose backward already "
        "ran keeps its update; a shared backbone is one backward, skipped whole.",
    )
    micro_batch_size: int | None = setting(
        None,
        "Gradient-accumulation chunk (sequences); None = the whole minibatch. Results do "
        "not depend on it: the loss is normalised by the minibatch's global token count.",
        low=1,
    )
    clip_low: float = setting(
        0.2,
        "PPO clip ε below 1 (all sources: 0.2): the ratio's floor is 1 − ε.",
        low=0.0,
        high=1.0,
    )
    clip_high: float | None = setting(
        None, "PPO clip above 1; None = clip_low. DAPO's clip-higher uses 0.28.", low=0.0
    )
    dual_clip: float | None = setting(
        None,
        "Dual-clip bound c for negative advantages (Ye et al. 2019; c = 3). Off: vanilla PPO.",
        low=1.0,
        low_open=True,
    )
    value_clip: float | None = setting(
        0.2,
        "Value-loss clip in reward units (OAI19, N+, TRL 0.2; verl 0.5). None: unclipped.",
        low=0.0,
    )
    advantage_estimator: str = setting(
        "gae",
        "Steps 5–7 of the loop (rlhflab/core/advantages.py). 'gae': per-token KL shaping, GAE "
        "from the critic's values, whitening (PPO). 'grpo': each answer's score against its "
        "prompt's group of grpo.group_size answers, (s − mean)/std (DeepSeekMath; centred only "
        "with grpo.normalize_std=false, Dr. GRPO). 'rloo': the leave-one-out mean of the group "
        "as baseline. grpo and rloo train no critic (model.value_model=none) and sample each "
        "prompt group_size times in a row; rlhflab grpo and rlhflab rloo set it to their name.",
        choices=ADVANTAGE_ESTIMATORS,
    )
    gamma: float = setting(
        1.0, "Discount; 1 because the episode is one answer (OAI19).", low=0.0, high=1.0
    )
    lam: float = setting(0.95, "GAE λ (OAI19, N+, TRL 0.95; verl 1.0).", low=0.0, high=1.0)
    whiten_advantages: bool = setting(True, "Whiten advantages over the rollout batch (OAI19).")
    whiten_rewards: bool = setting(
        False, "Scale-only whitening of shaped per-token rewards (OAI19 on; N+, TRL off)."
    )
    kl_coef: float = setting(
        0.05,
        "β of the KL penalty (N+, TRL: 0.05). The initial value when kl_target is set.",
        low=0.0,
    )
    kl_target: float | None = setting(
        None,
        "Adaptive KL control target in nats per answer (summed over its tokens; OAI19 "
        "used 6). None: β stays fixed.",
        low=0.0,
        low_open=True,
    )
    kl_horizon: float = setting(
        10000.0, "Adaptive controller horizon in answers (OAI19).", low=0.0, low_open=True
    )
    kl_estimator: str = setting(
        "k1",
        "KL estimator: k1 in the reward is the correct gradient; in the loss use k2 or k3+ "
        "(k3 is DSM's biased choice; k1 and abs are refused there: no KL gradient; "
        "ppo-details §3.4).",
        choices=("k1", "k2", "k3", "k3+", "abs"),
    )
    kl_placement: str = setting(
        "reward",
        "'reward': −β·KL per token flows through GAE (PPO-RLHF standard). 'loss': "
        "β·KL added to the policy loss, differentiated (GRPO style).",
        choices=("reward", "loss"),
    )
    entropy_coef: float = setting(
        0.0, "Entropy bonus; 0 in RLHF (OAI19, N+, verl). Logged anyway.", low=0.0
    )
    loss_agg: str = setting(
        "token-mean",
        "Loss aggregation (ppo-details §5.6).",
        choices=(
            "token-mean",
            "seq-mean-token-sum",
            "seq-mean-token-mean",
            "seq-mean-token-sum-norm",
        ),
    )
    loss_agg_norm: int | None = setting(
        None,
        "The constant that loss_agg=seq-mean-token-sum-norm divides each answer's token sum "
        "by (Dr. GRPO: the generation budget). None: rollout.max_new_tokens. The same on every "
        "rank and minibatch, never the batch's longest answer, so an answer's weight does not "
        "depend on which other answers share its batch.",
        low=1,
    )
    lr: float = setting(
        1e-5,
        "Policy learning rate (typical 1e-6..1e-5; tiny models need more).",
        low=0.0,
        low_open=True,
    )
    critic_lr: float = setting(
        3e-5, "Critic learning rate; 3–10× the policy's is common.", low=0.0, low_open=True
    )
    lr_schedule: str = setting(
        "constant",
        "After warm-up: constant, linear decay, or cosine.",
        choices=("constant", "linear", "cosine"),
    )
    warmup_steps: int = setting(0, "Linear learning-rate warm-up, in optimiser steps.", low=0)
    max_grad_norm: float | None = setting(
        1.0,
        "Gradient-norm clip, applied to each trained model on its own: the policy (with a "
        "shared backbone, its value head too) and a separate critic, as verl and OpenRLHF "
        "(1.0) do, so a large critic gradient never shrinks the policy's step. Both norms "
        "are logged (policy/grad_norm, val/grad_norm). None: no clip.",
        low=0.0,
        low_open=True,
    )
    adam_eps: float = setting(1e-5, "Adam ε (OAI19, N+, CleanRL use 1e-5).", low=0.0, low_open=True)
    weight_decay: float = setting(0.0, "AdamW weight decay.", low=0.0)
    max_bad_updates: int = setting(
        3,
        "Consecutive skipped updates (NaN/inf reward, loss or gradient) before the run stops "
        "with a checkpoint of the last good state.",
        low=1,
    )
