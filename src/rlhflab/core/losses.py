"""The losses of PPO, DPO and reward-model training, as pure functions.

Tensors in, tensors out, as in ``rlhflab.core.algorithms`` (whose conventions hold here: (B, T)
tensors over response tokens only, right-padded ``response_mask`` including EOS, padding
selected away with ``torch.where`` so its content never changes a result). Split from
``algorithms`` to keep each file readable; sources are cited per function (short names as
in ``algorithms``: OAI19 = arXiv 1909.08593, N+ = arXiv 2403.17031, DSM = arXiv 2402.03300,
DrGRPO = arXiv 2503.20783, DAPO = arXiv 2503.14476).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from rlhflab.core.algorithms import (
    LOG_RATIO_LIMIT,
    bool_mask,
    check_same_shape,
    masked_mean,
    masked_var,
)

__all__ = [
    "AGG_MODES",
    "aggregate",
    "dpo_loss",
    "pairwise_reward_loss",
    "policy_loss",
    "value_loss",
]

AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def aggregate(
    loss_matrix: torch.Tensor,
    mask: torch.Tensor,
    mode: str = "token-mean",
    norm: float | None = None,
    *,
    num_tokens: float | torch.Tensor | None = None,
    num_seqs: float | None = None,
) -> torch.Tensor:
    """Reduce a per-token loss (B, T) to a scalar — always a named choice (ppo-details §5.6).

    * ``"token-mean"``: Σ m·ℓ / Σ m (DAPO, verl, TRL GRPO default).
    * ``"seq-mean-token-sum"``: mean over sequences of Σ_t m·ℓ.
    * ``"seq-mean-token-mean"``: mean over sequences of Σ_t m·ℓ / Σ_t m (original GRPO).
    * ``"seq-mean-token-sum-norm"``: Σ m·ℓ / (B·norm) with ``norm`` a constant the caller
      must give (DrGRPO's generation budget, ``rollout.max_new_tokens``). Never the padded
      width T: that is this batch's longest answer, so an answer's weight would change from
      batch to batch and from rank to rank. Ignored by the other modes.

    Micro-batching and data parallelism: pass the *global* denominators — ``num_tokens``
    (token-mean) and ``num_seqs`` (every seq-mean mode) — and the per-micro-batch losses then
    sum exactly to the whole-batch loss, whatever the split.
    """
    m = bool_mask(mask)
    masked = torch.where(
        m, loss_matrix, torch.zeros((), dtype=loss_matrix.dtype, device=loss_matrix.device)
    )
    n_seqs = num_seqs if num_seqs is not None else loss_matrix.shape[0]
    if mode == "token-mean":
        denom = num_tokens if num_tokens is not None else m.sum().clamp(min=1)
        return masked.sum() / denom
    if mode == "seq-mean-token-sum":
        return masked.sum() / max(n_seqs, 1)
    if mode == "seq-mean-token-mean":
        per_seq = masked.sum(-1) / m.sum(-1).clamp(min=1)
        return per_seq.sum() / max(n_seqs, 1)
    if mode == "seq-mean-token-sum-norm":
        if norm is None or not norm > 0:
            raise ValueError(
                f"aggregate: mode {mode!r} needs a constant norm > 0 (got {norm}), the same "
                "for every batch and rank, e.g. the generation budget max_new_tokens"
            )
        return masked.sum() / (max(n_seqs, 1) * norm)
    raise ValueError(f"unknown aggregation mode {mode!r}; choose one of {AGG_MODES}")


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    clip_low: float = 0.2,
    clip_high: float | None = None,
    dual_clip: float | None = None,
    agg: str = "token-mean",
    **agg_kwargs,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO clipped surrogate (Schulman et al. 2017), per token then aggregated.

    logprobs (with grad), old_logprobs, advantages, response_mask: (B, T).
    ρ = exp(logp − logp_old) (log-ratio clamped to ±20); per token
    ℓ = max(−A·ρ, −A·clip(ρ, 1 − clip_low, 1 + clip_high)); ``clip_high=None`` means
    symmetric, a larger value is DAPO's clip-higher. ``dual_clip=c`` (Ye et al. 2019,
    arXiv 1912.09729; c > 1) caps ℓ at −A·c where A < 0. ``agg`` and ``agg_kwargs`` go to
    :func:`aggregate`.

    Metrics (detached scalars, masked means over response tokens):

    * ``clipfrac``: fraction of tokens where the clipped term is the binding max
      (−A·clip(ρ) > −A·ρ), as OAI19/TRL/verl define it.
    * ``dual_clipfrac``: fraction where the dual-clip cap binds (0 when off).
    * ``approx_kl``: k3 estimate of KL(π_old ‖ π), mean of (ρ − 1) − log ρ (CleanRL); ≥ 0 and
      exactly 0 when π = π_old.
    * ``ratio_mean``, ``ratio_max``: of ρ.
    """
    check_same_shape(
        logprobs=logprobs,
        old_logprobs=old_logprobs,
        advantages=advantages,
        response_mask=response_mask,
    )
    clip_high = clip_low if clip_high is None else clip_high
    if dual_clip is not None and not dual_clip > 1.0:
        raise ValueError(f"dual_clip must be > 1, got {dual_clip}")
    m = bool_mask(response_mask)
    zero = torch.zeros((), dtype=logprobs.dtype, device=logprobs.device)
    # Padding may hold anything; make it ρ = 1, A = 0 so nothing non-finite is computed there.
    log_ratio = torch.where(m, logprobs - old_logprobs, zero)
    log_ratio = log_ratio.clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
    adv = torch.where(m, advantages, zero)
    ratio = torch.exp(log_ratio)
    unclipped = -adv * ratio
    clipped = -adv * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    per_token = torch.maximum(unclipped, clipped)
    dual_hit = torch.zeros_like(m)
    if dual_clip is not None:
        cap = -adv * dual_clip
        dual_hit = (adv < 0) & (per_token > cap)
        per_token = torch.where(adv < 0, torch.minimum(per_token, cap), per_token)
    loss = aggregate(per_token, m, agg, **agg_kwargs)
    with torch.no_grad():
        metrics = {
            "clipfrac": masked_mean((clipped > unclipped).to(logprobs.dtype), m),
            "dual_clipfrac": masked_mean(dual_hit.to(logprobs.dtype), m),
            "approx_kl": masked_mean((ratio - 1.0) - log_ratio, m),
            "ratio_mean": masked_mean(ratio, m),
            "ratio_max": torch.where(m, ratio, zero).max(),
        }
    return loss, metrics


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    response_mask: torch.Tensor,
    clip_range: float | None = 0.2,
    agg: str = "token-mean",
    **agg_kwargs,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped value loss ½·max((V − R)², (V_clip − R)²), V_clip = V_old + clip(V − V_old, ±c).

    values (with grad), old_values, returns, response_mask: (B, T). ``clip_range=None`` gives
    the plain ½(V − R)². The clip is in reward units (OAI19 0.2; verl/OpenRLHF 0.5).

    Metrics: ``vf_clipfrac`` = fraction of tokens where the clip binds (|V − V_old| > c) and
    the clipped error is the larger;
    ``explained_variance`` = 1 − Var(R − V_old)/Var(R) over response tokens (0 when Var(R) = 0);
    ``value_mean``, ``return_mean``.
    """
    check_same_shape(
        values=values, old_values=old_values, returns=returns, response_mask=response_mask
    )
    m = bool_mask(response_mask)
    zero = torch.zeros((), dtype=values.dtype, device=values.device)
    v = torch.where(m, values, zero)
    v_old = torch.where(m, old_values, zero)
    ret = torch.where(m, returns, zero)
    err = (v - ret).pow(2)
    if clip_range is None:
        per_token = err
        clip_hit = torch.zeros_like(m)
    else:
        v_clipped = v_old + torch.clamp(v - v_old, -clip_range, clip_range)
        err_clipped = (v_clipped - ret).pow(2)
        per_token = torch.maximum(err, err_clipped)
        # a clip only where the clamp bound: inside the range V_old + (V − V_old) is V up to
        # rounding, which would otherwise count ulp-sized "clips" (the loss is the same)
        clip_hit = (err_clipped > err) & ((v - v_old).abs() > clip_range)
    loss = 0.5 * aggregate(per_token, m, agg, **agg_kwargs)
    with torch.no_grad():
        var_ret = masked_var(ret, m)
        resid = masked_var(ret - v_old, m)
        explained = torch.where(var_ret > 0, 1.0 - resid / var_ret.clamp(min=1e-12), zero)
        metrics = {
            "vf_clipfrac": masked_mean(clip_hit.to(values.dtype), m),
            "explained_variance": explained,
            "value_mean": masked_mean(v, m),
            "return_mean": masked_mean(ret, m),
        }
    return loss, metrics


def dpo_loss(
    policy_chosen_logps: torch.Tensor,
    policy_rejected_logps: torch.Tensor,
    ref_chosen_logps: torch.Tensor,
    ref_rejected_logps: torch.Tensor,
    beta: float = 0.1,
    loss_type: str = "sigmoid",
    label_smoothing: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Direct preference optimisation losses per pair.

    All inputs (N,): summed log-probs of each whole answer. With
    h = (logπ(y_w) − logπ_ref(y_w)) − (logπ(y_l) − logπ_ref(y_l)):

    * ``"sigmoid"`` (Rafailov et al. 2023): −log σ(β·h); with ``label_smoothing`` ε the
      conservative-DPO mix −(1−ε)·log σ(βh) − ε·log σ(−βh).
    * ``"ipo"`` (Azar et al. 2023): (h − 1/(2β))². The paper uses length-averaged log-probs;
      pass those if you want that variant.

    Returns ``(losses, chosen_rewards, rejected_rewards)``, each (N,); the implicit rewards
    β·(logπ − logπ_ref) are detached.
    """
    if not beta > 0:
        raise ValueError(f"beta must be > 0, got {beta}")
    if not 0.0 <= label_smoothing < 0.5:
        raise ValueError(f"label_smoothing must be in [0, 0.5), got {label_smoothing}")
    chosen_ratio = policy_chosen_logps - ref_chosen_logps
    rejected_ratio = policy_rejected_logps - ref_rejected_logps
    h = chosen_ratio - rejected_ratio
    if loss_type == "sigmoid":
        losses = -(1.0 - label_smoothing) * F.logsigmoid(beta * h) - label_smoothing * F.logsigmoid(
            -beta * h
        )
    elif loss_type == "ipo":
        if label_smoothing:
            raise ValueError("label_smoothing applies to the sigmoid loss only")
        losses = (h - 1.0 / (2.0 * beta)).pow(2)
    else:
        raise ValueError(f"unknown DPO loss_type {loss_type!r}; choose 'sigmoid' or 'ipo'")
    return losses, beta * chosen_ratio.detach(), beta * rejected_ratio.detach()


def pairwise_reward_loss(
    chosen_scores: torch.Tensor,
    rejected_scores: torch.Tensor,
    margin: torch.Tensor | float | None = None,
    labels: torch.Tensor | None = None,
) -> torch.Tensor:
    """Bradley-Terry reward-model loss: mean of −log σ(s_chosen − s_rejected − margin).

    chosen_scores, rejected_scores: (N,); margin: None, a float or (N,) (Llama-2's margin
    loss, Touvron et al. 2023 §3.2.2). Returns a scalar.

    ``labels`` (N,) in [0, 1] makes it the soft Bradley-Terry loss for per-attribute labels:
    −[y·log σ(d − m) + (1 − y)·log σ(−d − m)] with d = chosen − rejected; y = 1 is the plain
    loss, y = 0 says "rejected" is better on this attribute, y = 0.5 a tie (pulls d to 0).
    """
    check_same_shape(chosen_scores=chosen_scores, rejected_scores=rejected_scores)
    diff = chosen_scores - rejected_scores
    m = 0.0 if margin is None else margin
    if labels is None:
        return -F.logsigmoid(diff - m).mean()
    check_same_shape(chosen_scores=chosen_scores, labels=labels)
    y = labels.to(diff.dtype)
    return -(y * F.logsigmoid(diff - m) + (1.0 - y) * F.logsigmoid(-diff - m)).mean()
