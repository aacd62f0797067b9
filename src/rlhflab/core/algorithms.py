"""The mathematical core of PPO for RLHF, as pure functions.

Tensors in, tensors out; hyperparameters are plain numbers. This module imports only
torch, so it can be read (and tested) like the papers it follows.

Conventions used by every function below:

* ``(B, T)`` tensors are laid over *response* tokens only; prompt tokens never appear.
* ``response_mask`` is 1 on real response tokens *including* the EOS token and 0 on the
  padding after it (right-padded). A truncated answer (no EOS) is 1 up to its last token.
* Padding content never changes a result: masked positions are selected away with
  ``torch.where`` (never multiplied by 0, which would turn a NaN in padding into a NaN
  result), and a fully masked row never produces NaN.

Sources are cited per function; ``docs/ppo-details.md`` collects them and lists
where they disagree. Short names: OAI19 = Ziegler et al. 2019 (arXiv 1909.08593),
N+ = Huang et al. 2024 "The N+ implementation details of RLHF with PPO" (arXiv 2403.17031),
DSM = DeepSeekMath (arXiv 2402.03300), DrGRPO = Liu et al. 2025 (arXiv 2503.20783),
DAPO = Yu et al. 2025 (arXiv 2503.14476).
"""

from __future__ import annotations

import math

import torch

__all__ = [
    "KL_ESTIMATORS",
    "AdaptiveKLController",
    "FixedKLController",
    "compute_gae",
    "entropy_from_logits",
    "group_advantages",
    "kl_estimate",
    "logprobs_at",
    "logprobs_from_logits",
    "masked_mean",
    "masked_var",
    "masked_whiten",
    "rloo_advantages",
    "scale_by_running_std",
    "shape_rewards",
]

KL_ESTIMATORS = ("k1", "k2", "k3", "k3+", "abs")

# log-ratios are clamped to this range before exp(): exp(20) ~ 5e8 is finite in fp16/bf16/fp32
# and no sane update gets there (verl and OpenRLHF use the same bound).
LOG_RATIO_LIMIT = 20.0


def bool_mask(mask: torch.Tensor) -> torch.Tensor:
    """A 0/1 mask of any dtype as a boolean one (no copy when it already is)."""
    return mask if mask.dtype == torch.bool else mask != 0


def check_same_shape(**tensors: torch.Tensor) -> None:
    """Raise ValueError naming every tensor's shape unless all shapes agree."""
    shapes = {name: tuple(t.shape) for name, t in tensors.items()}
    if len(set(shapes.values())) != 1:
        raise ValueError(f"shape mismatch: {shapes}")


# --------------------------------------------------------------------------- masked statistics


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of ``x`` over positions where ``mask`` is true.

    x, mask: same shape (any). ``dim=None`` reduces everything to a scalar; an int reduces
    that dimension. Where nothing is selected the result is 0, never NaN.
    """
    m = bool_mask(mask)
    total = torch.where(m, x, torch.zeros((), dtype=x.dtype, device=x.device))
    if dim is None:
        return total.sum() / m.sum().clamp(min=1).to(x.dtype)
    return total.sum(dim) / m.sum(dim).clamp(min=1).to(x.dtype)


def masked_var(x: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of the selected elements of ``x`` (scalar).

    ``unbiased=True`` applies Bessel's correction n/(n-1) (torch's default; N+ and OAI19 use
    the population variance, verl the unbiased one — see ppo-details §4.5). With fewer than
    two selected elements the variance is undefined; 0 is returned, never NaN.
    """
    m = bool_mask(mask)
    mean = masked_mean(x, m)
    centred = torch.where(m, x - mean, torch.zeros((), dtype=x.dtype, device=x.device))
    n = m.sum().to(x.dtype)
    var = centred.pow(2).sum() / n.clamp(min=1)
    if unbiased:
        var = torch.where(n > 1, var * n / (n - 1).clamp(min=1), torch.zeros_like(var))
    return var


def masked_whiten(
    x: torch.Tensor,
    mask: torch.Tensor,
    shift_mean: bool = True,
    eps: float = 1e-8,
    moments: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """(x − μ) / sqrt(var + eps) over the selected elements; 0 at unselected positions.

    μ and var are the masked mean and (unbiased) variance over *all* selected elements.
    ``shift_mean=False`` adds μ back (scale only), as OAI19 does for reward whitening.
    ``moments=(μ, var)`` supplies statistics computed elsewhere (over every data-parallel
    rank, say). Source: OAI19 ``whiten``; N+ §"advantage whitening".
    """
    m = bool_mask(mask)
    if moments is None:
        mean, var = masked_mean(x, m), masked_var(x, m, unbiased=True)
    else:
        mean, var = moments
    whitened = (x - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        whitened = whitened + mean
    return torch.where(m, whitened, torch.zeros((), dtype=x.dtype, device=x.device))


def scale_by_running_std(x: torch.Tensor, var: float, eps: float = 1e-8) -> torch.Tensor:
    """x / sqrt(var + eps): scores divided by the running std, not shifted (MOSS's reward
    scaling; ppo-details §2.3). ``var`` is the running variance (a float); ``eps`` keeps a
    zero variance from dividing by zero."""
    if not var >= 0:
        raise ValueError(f"var must be >= 0, got {var}")
    return x / math.sqrt(var + eps)


# --------------------------------------------------------------------------- log-probs, entropy, KL


def _scaled(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if logits.dtype in (torch.float16, torch.bfloat16):
        # logsumexp over a vocabulary in half precision loses ~2 digits; upcast first.
        logits = logits.float()
    return logits / temperature if temperature != 1.0 else logits


def logprobs_from_logits(
    logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """log π(token) under softmax(logits / temperature).

    logits: (B, T, V) — logits[:, t] must already be the ones that *predict* tokens[:, t].
    tokens: (B, T) int64. Returns (B, T) in float32 (or float64 for float64 logits).
    Dividing by the sampling temperature everywhere keeps training log-probs equal to the
    sampling distribution's (N+ detail "temperature", ppo-details §9.8).
    Computed as gathered logit − logsumexp, which never materialises a (B, T, V) log-softmax.
    """
    z = _scaled(logits, temperature)
    picked = torch.gather(z, -1, tokens.long().unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(z, dim=-1)


def logprobs_at(
    logits: torch.Tensor, positions: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """log π(tokens[m]) under softmax(logits[:, positions[m]] / temperature), every row.

    logits: (B, S, V); positions, tokens: (M,) int64 → (B, M). One position may be read for
    several tokens (the branches of a token tree: the opener probe's spellings); each
    position's logsumexp is computed once. As :func:`logprobs_from_logits` otherwise.
    """
    z = _scaled(logits, temperature)
    return z[:, positions, tokens] - torch.logsumexp(z, dim=-1)[:, positions]


def entropy_from_logits(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Entropy H of softmax(logits / temperature) at every position.

    logits: (B, T, V) → (B, T). H = logsumexp(z) − Σ softmax(z)·z (N+, TRL).
    """
    z = _scaled(logits, temperature)
    return torch.logsumexp(z, dim=-1) - (torch.softmax(z, dim=-1) * z).sum(-1)


def kl_estimate(
    logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str = "k1"
) -> torch.Tensor:
    """Per-token estimate of KL(π ‖ π_ref) from samples of π (Schulman, "Approximating KL").

    logprobs, ref_logprobs: (B, T) → (B, T). With log r = ref − logp:

    * ``"k1"``  = logp − ref. Unbiased, high variance, may be negative. The right choice for
      KL in the reward (detached), where it yields the reverse-KL policy gradient.
    * ``"k2"``  = ½ (logp − ref)². Biased, ≥ 0. As a *loss*, on-policy, its gradient equals
      that of k1 in the reward (Liu et al.).
    * ``"k3"``  = exp(log r) − log r − 1. Unbiased, low variance, ≥ 0 (DSM's GRPO KL).
    * ``"k3+"`` = k3's value with k2's gradient (straight-through; verl ``low_var_kl+``),
      for KL as a loss without k3's biased gradient.
    * ``"abs"`` = |logp − ref|.

    log r is clamped to ±20 before exp() so k3 cannot overflow.
    Masking is the caller's business: padded positions hold whatever the inputs hold there.
    """
    check_same_shape(logprobs=logprobs, ref_logprobs=ref_logprobs)
    log_ratio = logprobs - ref_logprobs
    if estimator == "k1":
        return log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio.pow(2)
    if estimator in ("k3", "k3+"):
        neg = (-log_ratio).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
        k3 = torch.exp(neg) - neg - 1.0
        if estimator == "k3":
            return k3
        k2 = 0.5 * log_ratio.pow(2)
        return k2 + (k3 - k2).detach()
    if estimator == "abs":
        return log_ratio.abs()
    raise ValueError(f"unknown KL estimator {estimator!r}; choose one of {KL_ESTIMATORS}")


# --------------------------------------------------------------------------- rewards and advantages


def mean_z_score(x: torch.Tensor) -> float:
    """How many standard errors the mean of a sample lies from zero: mean / (std / √N),
    with the unbiased std; x (N,). NaN for N < 2, ±inf for a constant non-zero sample.

    Used on per-answer k1 KL sums: from answers sampled by π itself E[k1] = KL(π‖π_ref) ≥ 0,
    so a batch mean many standard errors below zero says the answers were not sampled
    from the π whose log-probs were used (truncated sampling, a mismatched temperature
    or forward), not that the policy came closer to the reference than zero.
    """
    if x.dim() != 1:
        raise ValueError(f"x: (N,), got {tuple(x.shape)}")
    n = x.numel()
    if n < 2:
        return math.nan
    x = x.double()
    mean, std = x.mean().item(), x.std(unbiased=True).item()
    if std == 0:
        return math.nan if mean == 0 else math.copysign(math.inf, mean)
    return mean / (std / math.sqrt(n))


def last_token_index(response_mask: torch.Tensor) -> torch.Tensor:
    """Index of the last real response token per row: (B, T) → (B,) int64; −1 when empty."""
    m = bool_mask(response_mask)
    positions = torch.arange(m.shape[-1], device=m.device).expand_as(m)
    return torch.where(m, positions, torch.full_like(positions, -1)).max(dim=-1).values


def shape_rewards(
    scores: torch.Tensor, kl: torch.Tensor, response_mask: torch.Tensor, kl_coef: float
) -> torch.Tensor:
    """Per-token RLHF reward r_t = −β·kl_t + score·[t = t_end] (OAI19 eq. 2; ppo-details §2–3).

    scores: (B,) sequence scores. kl: (B, T) per-token KL estimate (k1 for KL-in-reward).
    response_mask: (B, T). Returns (B, T), 0 on padding. t_end is the last response token —
    the EOS, or the last token of a truncated answer — never the first pad after it (the
    TRL/N+ off-by-one discussed in TRL #1893). A row with no response token gets no reward.
    """
    if scores.dim() != 1 or scores.shape[0] != kl.shape[0]:
        raise ValueError(f"scores must be (B,) with B={kl.shape[0]}, got {tuple(scores.shape)}")
    check_same_shape(kl=kl, response_mask=response_mask)
    m = bool_mask(response_mask)
    zero = torch.zeros((), dtype=kl.dtype, device=kl.device)
    rewards = torch.where(m, -kl_coef * kl, zero)
    last = last_token_index(m)
    has_token = last >= 0
    rows = torch.arange(kl.shape[0], device=kl.device)[has_token]
    rewards = rewards.index_put(
        (rows, last[has_token]), scores[has_token].to(kl.dtype), accumulate=True
    )
    return rewards


def compute_gae(
    rewards: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float = 1.0,
    lam: float = 0.95,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over response tokens (Schulman et al. 2016; OAI19).

    rewards, values, response_mask: (B, T). Returns ``(advantages, returns)``, both (B, T)
    and 0 on padding. δ_t = r_t + γ·V_{t+1} − V_t with V = 0 after the last response token,
    A_t = δ_t + γλ·A_{t+1}, returns R_t = A_t + V_t (from *unwhitened* advantages, §4.3).
    Rewards and values at padded positions are treated as 0, whatever they hold.
    """
    check_same_shape(rewards=rewards, values=values, response_mask=response_mask)
    m = bool_mask(response_mask)
    zero = torch.zeros((), dtype=values.dtype, device=values.device)
    r = torch.where(m, rewards, zero)
    v = torch.where(m, values, zero)
    T = r.shape[1]
    advantages = torch.zeros_like(v)
    last_gae = torch.zeros_like(v[:, 0])
    for t in reversed(range(T)):
        next_value = v[:, t + 1] if t + 1 < T else torch.zeros_like(last_gae)
        delta = r[:, t] + gamma * next_value - v[:, t]
        last_gae = delta + gamma * lam * last_gae
        advantages[:, t] = last_gae
    advantages = torch.where(m, advantages, zero)
    return advantages, torch.where(m, advantages + v, zero)


def group_advantages(
    scores: torch.Tensor, group_size: int, normalize_std: bool = True, eps: float = 1e-6
) -> torch.Tensor:
    """GRPO outcome advantages (DSM §4.1.2): (s − group mean) / (group std + eps).

    scores: (N,) with N = prompts·group_size, laid out as consecutive groups (all answers to
    prompt 0, then prompt 1, ...). Returns (N,); broadcast it over each answer's tokens.
    The std is the unbiased one (torch's default; G is small, so this matters).
    ``normalize_std=False`` only centres — DrGRPO's fix for the difficulty bias.
    A group of equal scores (std exactly 0) carries no signal: its advantages are 0, also
    with ``eps = 0``, where the division would be 0/0.
    """
    g = _grouped(scores, group_size)
    centred = g - g.mean(dim=1, keepdim=True)
    if normalize_std:
        std = g.std(dim=1, unbiased=True, keepdim=True)
        centred = torch.where(std > 0, centred / (std + eps), torch.zeros_like(centred))
    return centred.reshape(-1)


def rloo_advantages(scores: torch.Tensor, group_size: int) -> torch.Tensor:
    """REINFORCE leave-one-out advantages (Kool et al. 2019; Ahmadian et al. 2024).

    scores: (N,) in consecutive groups of ``group_size``. A_i = s_i − mean_{j≠i} s_j
    = s_i − (Σ_j s_j − s_i)/(G − 1). Returns (N,).
    """
    g = _grouped(scores, group_size)
    baseline = (g.sum(dim=1, keepdim=True) - g) / (group_size - 1)
    return (g - baseline).reshape(-1)


def _grouped(scores: torch.Tensor, group_size: int) -> torch.Tensor:
    if scores.dim() != 1:
        raise ValueError(f"scores must be 1-D, got shape {tuple(scores.shape)}")
    if group_size < 2:
        raise ValueError(f"group_size must be >= 2 for a group baseline, got {group_size}")
    if scores.shape[0] % group_size:
        raise ValueError(f"{scores.shape[0]} scores do not split into groups of {group_size}")
    return scores.reshape(-1, group_size)


# --------------------------------------------------------------------------- KL controllers


class FixedKLController:
    """A constant β. Same interface as :class:`AdaptiveKLController`."""

    def __init__(self, kl_coef: float):
        if kl_coef < 0:
            raise ValueError(f"kl_coef must be >= 0, got {kl_coef}")
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        """No-op: β stays fixed."""

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.value = float(state["value"])


class AdaptiveKLController:
    """Proportional β control towards a KL target (OAI19 §2.2, ``train_policy.py``):
    e = clip(KL/target − 1, −0.2, 0.2); β ← β·(1 + e·n_steps/horizon).

    Units: ``target`` must be in the units of the ``current_kl`` passed to :meth:`update`.
    rlhflab's trainers pass the k1 KL *summed over each answer's tokens and averaged over the
    batch* — nats per sequence, OAI19's unit (their target was 6). verl passes a per-token
    mean instead, so its targets are ~T times smaller. ``n_steps`` is the number of answers
    in the rollout batch and ``horizon`` is in answers (OAI19: 10 000).
    """

    def __init__(self, init_kl_coef: float, target: float, horizon: float):
        if init_kl_coef <= 0 or target <= 0 or horizon <= 0:
            raise ValueError(
                f"init_kl_coef, target, horizon must be > 0: {init_kl_coef, target, horizon}"
            )
        self.value, self.target, self.horizon = float(init_kl_coef), float(target), float(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        if not math.isfinite(current_kl):  # a skipped batch's KL says nothing about β
            return
        error = min(max(float(current_kl) / self.target - 1.0, -0.2), 0.2)
        factor = 1.0 + error * n_steps / self.horizon
        if not factor > 0:  # config validation keeps 0.2·n < horizon; never a negative β
            raise ValueError(f"adaptive KL: β × {factor:g}; kl_horizon must exceed 0.2 × {n_steps}")
        self.value *= factor

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value, "target": self.target, "horizon": self.horizon}

    def load_state_dict(self, state: dict[str, float]) -> None:
        # β alone: target and horizon are the (validated) config's, which a resume may change
        self.value = float(state["value"])
