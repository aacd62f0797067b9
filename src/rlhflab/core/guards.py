"""Guards of the reward against overoptimisation: the maths alone, tensors in and out.

* Reward-model ensembles (Coste et al., ICLR 2024, "Reward Model Ensembles Help Mitigate
  Overoptimization"): :func:`ensemble_combine` (mean, worst-case, uncertainty-weighted) and
  :func:`ensemble_spread`.
* PAR shaping (Fu et al., 2025, "Reward Shaping to Mitigate Reward Hacking in RLHF"):
  :func:`par_shape`.
* ODIN's disentangled length head (Chen et al., 2024, "ODIN: Disentangled Reward Mitigates
  Hacking in RLHF"): :func:`pearson_corr` (differentiable) and :func:`odin_length_loss`.
"""

from __future__ import annotations

import torch

ENSEMBLE_COMBINES = ("mean", "wco", "uwo")


def ensemble_combine(member_scores: torch.Tensor, mode: str, uwo_lambda: float) -> torch.Tensor:
    """One score per answer (B,) from the k members' scores ``member_scores`` (k, B).

    ``mean``: the members' mean. ``wco`` (worst-case optimisation): the minimum over
    members. ``uwo`` (uncertainty-weighted optimisation): mean − ``uwo_lambda`` · variance
    over members, the population variance (1/k Σ (r_i − mean)²), as Coste et al. write it.
    """
    if member_scores.dim() != 2 or member_scores.shape[0] < 1:
        raise ValueError(
            f"ensemble_combine: expected (k, B) scores, got {tuple(member_scores.shape)}"
        )
    if mode == "mean":
        return member_scores.mean(0)
    if mode == "wco":
        return member_scores.min(0).values
    if mode == "uwo":
        return member_scores.mean(0) - uwo_lambda * member_scores.var(0, unbiased=False)
    raise ValueError(f"ensemble_combine: unknown mode {mode!r}; one of {ENSEMBLE_COMBINES}")


def ensemble_spread(member_scores: torch.Tensor) -> torch.Tensor:
    """(B,) population standard deviation of the k members' scores (k, B) per answer: how
    much the members disagree (0 with one member)."""
    return member_scores.std(0, unbiased=False)


def par_shape(scores: torch.Tensor, reference_scores: torch.Tensor) -> torch.Tensor:
    """PAR's RL reward σ(r − r_ref) (B,): ``scores`` (B,) of the policy's answers,
    ``reference_scores`` (B,) of the reference policy's answers to the same prompts.

    Bounded in (0, 1) and flat once the policy's answer beats the reference's by a few
    units: pushing the proxy further earns almost nothing, which is what removes the
    incentive to hack it (Fu et al. 2025: bounded, rapid initial growth then gradual
    convergence, centred on a reference reward). Non-finite scores pass through as NaN/±1
    of σ, for the trainer's count of non-finite rewards."""
    if scores.shape != reference_scores.shape:
        raise ValueError(
            f"par_shape: scores {tuple(scores.shape)} and reference scores "
            f"{tuple(reference_scores.shape)} differ in shape"
        )
    return torch.sigmoid(scores - reference_scores)


def pearson_corr(x: torch.Tensor, y: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """Pearson correlation of two (N,) tensors, differentiable; 0-d tensor. ``eps`` keeps a
    constant input from dividing by zero (its correlation is then ≈ 0)."""
    xc, yc = x - x.mean(), y - y.mean()
    return (xc * yc).sum() / ((xc.pow(2).sum() * yc.pow(2).sum()).sqrt() + eps)


def odin_length_loss(
    quality_scores: torch.Tensor, length_scores: torch.Tensor, lengths: torch.Tensor
) -> torch.Tensor:
    """ODIN's length loss over a batch of N answers: Σ_k |ρ(quality_k, L)| − ρ(length, L).

    quality_scores (N, K): the quality heads' scores; length_scores (N,): the length head's;
    lengths (N,): the answers' lengths (tokens). ρ is the batch Pearson correlation
    (:func:`pearson_corr`). Minimising it decorrelates every quality head from length and
    pushes the length head's correlation with length up to 1 (Chen et al. 2024:
    L_L = |ρ(r^Q, L)| − ρ(r^L, L), summed here over the quality heads)."""
    lengths = lengths.to(quality_scores.dtype)
    loss = -pearson_corr(length_scores, lengths)
    for k in range(quality_scores.shape[1]):
        loss = loss + pearson_corr(quality_scores[:, k], lengths).abs()
    return loss


def head_orthogonality_loss(
    weight: torch.Tensor, length_index: int, quality: list[int] | None = None
) -> torch.Tensor:
    """ODIN's orthogonality loss on a linear head ``weight`` (K, H): Σ_{k ∈ quality}
    |w_k · w_length|, so the quality heads read other directions of the last hidden state
    than the length head (Chen et al. 2024). ``quality``: the rows to count (default: every
    row but the length head's)."""
    w_len = weight[length_index]
    if quality is None:
        quality = [k for k in range(weight.shape[0]) if k != length_index]
    return (weight[quality] @ w_len).abs().sum()


def odin_quality_heads(num_heads: int, length_index: int, exempt: list[int]) -> list[int]:
    """The head indices ODIN disentangles from length: all of ``num_heads`` but the length
    head and the ``exempt`` heads (rm.length_exempt: heads whose label is about length
    itself, which decorrelated from length could learn nothing)."""
    return [k for k in range(num_heads) if k != length_index and k not in exempt]


def odin_ranked_scores(scores: torch.Tensor, length_index: int, exempt: list[int]) -> torch.Tensor:
    """The scores (N, K) each head's Bradley-Terry loss ranks under ODIN: a quality head's
    score plus the length head's (so the length preference of the labels can flow into the
    length head), an ``exempt`` head's own score alone. Differentiable."""
    add = torch.ones(scores.shape[1], dtype=scores.dtype, device=scores.device)
    add[exempt] = 0.0
    return scores + add * scores[:, length_index : length_index + 1]
