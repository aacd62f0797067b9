"""Student's t distribution, for the tests a run makes on a batch's mean (no SciPy needed),
and the running moments of ``reward.normalize=running``.

The batch's per-answer numbers are few on a laptop (4–16 answers): a mean's z-score then
follows Student's t with N − 1 degrees of freedom, whose tails are far heavier than the
normal's (P(T < −4) is 1.4 % with 3 degrees of freedom, 3e-5 under the normal), so a
fixed normal threshold raises false alarms at small N.
"""

from __future__ import annotations

import math
from functools import lru_cache
from statistics import NormalDist

import torch


def student_t_cdf(t: float, df: float, steps: int = 2000) -> float:
    """P(T ≤ t) for Student's t with ``df`` ≥ 1 degrees of freedom (below 1 the integrand
    below is infinite at the ends; a sample of N gives N − 1 ≥ 1).

    With t = √df · tan θ the density becomes c · cos^(df−1) θ on θ ∈ (−π/2, π/2), with
    c = Γ((df+1)/2) / (√π Γ(df/2)): a smooth integrand on a finite interval, integrated
    here by Simpson's rule over ``steps`` (even) intervals."""
    if df < 1:
        raise ValueError(f"df must be >= 1, got {df}")
    if math.isinf(t):
        return 0.0 if t < 0 else 1.0
    c = math.exp(math.lgamma((df + 1) / 2) - math.lgamma(df / 2)) / math.sqrt(math.pi)
    lo, hi = -math.pi / 2, math.atan(t / math.sqrt(df))
    h = (hi - lo) / steps

    def f(theta: float) -> float:  # the density in θ, less its constant c
        return max(math.cos(theta), 0.0) ** (df - 1) if df != 1 else 1.0

    total = f(lo) + f(hi)
    for i in range(1, steps):
        total += (4 if i % 2 else 2) * f(lo + i * h)
    return min(1.0, max(0.0, c * total * h / 3))


@lru_cache(maxsize=256)
def student_t_quantile(p: float, df: float) -> float:
    """The t with P(T ≤ t) = ``p`` (0 < p < 1), by bisection on :func:`student_t_cdf`;
    from 1000 degrees of freedom on, the normal's (within 0.3 % there, and the integrand
    too peaked for the fixed Simpson grid)."""
    if not 0.0 < p < 1.0:
        raise ValueError(f"p must be in (0, 1), got {p}")
    if df >= 1000:
        return NormalDist().inv_cdf(p)
    lo, hi = -1.0, 1.0
    while student_t_cdf(lo, df) > p:
        lo *= 2
    while student_t_cdf(hi, df) < p:
        hi *= 2
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if student_t_cdf(mid, df) < p else (lo, mid)
    return (lo + hi) / 2


class RunningMoments:
    """Running count, mean and sum of squared deviations of scores (Chan et al.'s parallel
    update), for 'running' normalisation. Under data parallelism feed :meth:`merge` the
    batch moments over every rank (:func:`rlhflab.infra.distributed.global_batch_moments`), so
    each rank holds the same, global moments and scales its scores identically."""

    def __init__(self):
        self.count, self.mean, self.m2 = 0, 0.0, 0.0

    def update(self, x: torch.Tensor) -> None:
        """Add this process's scores (single process)."""
        x = x.double().reshape(-1)
        n = x.numel()
        if n:
            mean = x.mean().item()
            self.merge(n, mean, ((x - mean) ** 2).sum().item())

    def merge(self, n: int, mean: float, m2: float) -> None:
        """Add a batch given as its count, mean and sum of squared deviations from it."""
        if n < 0 or m2 < 0 or not (math.isfinite(mean) and math.isfinite(m2)):
            raise ValueError(f"RunningMoments.merge: bad batch moments n={n} mean={mean} m2={m2}")
        if n == 0:
            return
        delta, total = mean - self.mean, self.count + n
        self.mean += delta * n / total
        self.m2 += m2 + delta**2 * self.count * n / total
        self.count = total

    @property
    def var(self) -> float:
        """Unbiased variance of every score seen; 1.0 while it measures no scale yet (fewer
        than two scores, or all equal, e.g. a 0/1 reward nobody earned): dividing by a
        zero spread would blow the scores up, and there is nothing to normalise by."""
        if self.count < 2 or self.m2 <= 0.0:
            return 1.0
        return self.m2 / (self.count - 1)

    @property
    def std(self) -> float:
        return math.sqrt(self.var)

    def state_dict(self) -> dict:
        return {"count": self.count, "mean": self.mean, "m2": self.m2}

    def load_state_dict(self, s: dict) -> None:
        self.count, self.mean, self.m2 = int(s["count"]), float(s["mean"]), float(s["m2"])
