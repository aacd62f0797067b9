"""How the gold reward moved over a run: its smoothed best, whether it fell, and the
over-optimisation curve of Gao, Schulman & Hilton (2022), "Scaling Laws for Reward Model
Overoptimization" (arXiv 2210.10760).

Gao et al. found that, under RL against a proxy reward model, the gold reward gained over
the initial policy follows, as a function of the distance d = √KL(π‖π_init) travelled,

    gain(d) = d · (α − β · ln d)

The form is linear in (α, β) for given d, so it is fitted by linear least squares
(:func:`fit_gao`; with the initial gold as a third unknown, since a run measures it on one
noisy batch). With β > 0 the curve is concave (gain'' = −β/d) and peaks where
gain'(d) = α − β − β ln d = 0:

    d* = exp(α/β − 1),   KL* = d*² = exp(2(α/β − 1)),   gain(d*) = β · d*

(:func:`gao_peak`). With β ≤ 0 the gain never turns down and there is no peak to predict.

Every function here is pure: plain lists of floats in, numbers and dicts out.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass


def ema(values: Sequence[float], smoothing: float) -> list[float]:
    """Exponential moving average (N,) → (N,): s_0 = x_0, s_t = a·s_{t−1} + (1 − a)·x_t with
    a = ``smoothing``, the recurrence the reward-hacking monitor smooths gold with."""
    out: list[float] = []
    for x in values:
        out.append(x if not out else smoothing * out[-1] + (1 - smoothing) * x)
    return out


@dataclass(frozen=True)
class GaoFit:
    alpha: float
    beta: float
    baseline: float  # gold at d = 0, which the gains are measured from (fitted or given)
    points: int  # (d, gold) pairs fitted
    rmse: float  # root-mean-square residual, gold-reward units

    def gain(self, d: float) -> float:
        """The fitted gain over the baseline at distance d ≥ 0 (d·ln d → 0 as d → 0)."""
        return 0.0 if d <= 0 else d * (self.alpha - self.beta * math.log(d))


def _solve(a: list[list[float]], b: list[float]) -> list[float] | None:
    """x with a·x = b for a small square system (Gaussian elimination, partial pivoting);
    None when a is singular relative to its largest entry."""
    n = len(b)
    m = [row[:] + [b[i]] for i, row in enumerate(a)]
    scale = max((abs(x) for row in a for x in row), default=0.0)
    for col in range(n):
        piv = max(range(col, n), key=lambda r: abs(m[r][col]))
        if abs(m[piv][col]) <= 1e-12 * scale:
            return None
        m[col], m[piv] = m[piv], m[col]
        for r in range(col + 1, n):
            f = m[r][col] / m[col][col]
            m[r] = [x - f * y for x, y in zip(m[r], m[col])]
    x = [0.0] * n
    for r in reversed(range(n)):
        x[r] = (m[r][n] - sum(m[r][c] * x[c] for c in range(r + 1, n))) / m[r][r]
    return x


def fit_gao(
    d: Sequence[float], gold: Sequence[float], baseline: float | None = None
) -> GaoFit | None:
    """Least squares of gold ≈ g0 + d·(α − β·ln d) over N pairs: ``d`` (N,) distances √KL ≥ 0
    and ``gold`` (N,) gold rewards. ``baseline``: g0, the initial policy's gold, when it is
    known; None fits it as a third unknown (a run knows it from one noisy batch only, and
    the peak moves a lot with it). The features 1, d and −d·ln d (0 at d = 0) are linear in
    the unknowns: their normal equations are solved in float64. None when fewer than three
    pairs have d > 0 or the features are collinear (every d the same, say)."""
    if len(d) != len(gold):
        raise ValueError(f"fit_gao: {len(d)} distances but {len(gold)} gold rewards")
    if sum(float(x) > 0 for x in d) < 3:
        return None
    free = baseline is None
    rows, ys = [], []
    for di, gi in zip(d, gold):
        u = float(di)
        v = -u * math.log(u) if u > 0 else 0.0
        rows.append([1.0, u, v] if free else [u, v])
        ys.append(float(gi) - (0.0 if free else baseline))
    k = len(rows[0])
    normal = [[sum(r[i] * r[j] for r in rows) for j in range(k)] for i in range(k)]
    rhs = [sum(r[i] * y for r, y in zip(rows, ys)) for i in range(k)]
    x = _solve(normal, rhs)
    if x is None:
        return None
    g0, alpha, beta = x if free else (baseline, *x)
    fit = GaoFit(alpha, beta, g0, len(rows), 0.0)
    sq = sum((float(gi) - g0 - fit.gain(float(di))) ** 2 for di, gi in zip(d, gold))
    return GaoFit(alpha, beta, g0, len(rows), math.sqrt(sq / len(rows)))


def gao_peak(alpha: float, beta: float) -> tuple[float, float, float] | None:
    """(d*, KL*, gain(d*)) where gain(d) = d·(α − β·ln d) peaks: d* = exp(α/β − 1),
    KL* = d*², gain = β·d*. None when β ≤ 0 (no peak) or d* overflows a float."""
    if not beta > 0:
        return None
    exponent = alpha / beta - 1
    if exponent > 300:  # d* beyond any KL a run reaches (and beyond a float's range)
        return None
    d_star = math.exp(exponent)
    return d_star, d_star * d_star, beta * d_star


def _noise_of_ema(values: Sequence[float], smoothing: float) -> float:
    """Standard deviation of an EMA of ``values`` (N,) if they were trend plus white
    noise: σ² estimated from successive differences (E[(x_t − x_{t−1})²] = 2σ² for white
    noise; a trend only inflates it, so this errs on the quiet side), then
    Var(EMA) = σ²·(1 − a)/(1 + a)."""
    diffs = [(b - a) ** 2 for a, b in zip(values, values[1:])]
    if not diffs:
        return math.inf
    sigma2 = sum(diffs) / len(diffs) / 2
    return math.sqrt(sigma2 * (1 - smoothing) / (1 + smoothing))


def ema_of_finite(values: Sequence[float], smoothing: float) -> list[float]:
    """:func:`ema` over the finite values of ``values`` (N,), read at every position (N,):
    NaN before the first finite one; a non-finite value (a batch whose proxy scores were
    skipped) leaves the average where it was."""
    out: list[float] = []
    for x in values:
        last = out[-1] if out else math.nan
        if not math.isfinite(x):
            out.append(last)
        else:
            out.append(x if math.isnan(last) else smoothing * last + (1 - smoothing) * x)
    return out


def gold_story(
    iterations: Sequence[int],
    gold: Sequence[float],
    proxy: Sequence[float],
    kl: Sequence[float],
    smoothing: float,
) -> dict:
    """What the gold reward did over a run, from N logged iterations: ``iterations`` (N,),
    ``gold`` (N,) the batch's mean gold reward (finite), ``proxy`` (N,) its mean proxy
    score and ``kl`` (N,) its KL to the reference (nats per answer; a sampled k1 estimate,
    clipped at 0 for the fit); proxy and KL may be NaN where a batch had none (its proxy
    scores were not finite), and are then left out of their averages and of the fit. All
    four describe the same policy: the one that sampled the batch.

    Returns a JSON-ready dict: the smoothed (:func:`ema`) gold at the start, best and end
    with the best's iteration; ``drop`` (best − end) against ``noise`` (the EMA's standard
    deviation, :func:`_noise_of_ema`); ``fell``: the drop exceeds two standard deviations of
    a difference of two EMA values (2·√2·noise); the smoothed proxy at the best and at the
    end (None where no finite proxy came before), and ``proxy_rose``: it ended above its
    value at the best; and ``fit``: Gao et al.'s curve through (√KL, gold) with its
    predicted peak, or None. Empty dict when N = 0."""
    if not gold:
        return {}
    g, p = ema(gold, smoothing), ema_of_finite(proxy, smoothing)
    best = max(range(len(g)), key=lambda i: g[i])  # the first of equal maxima
    noise = _noise_of_ema(gold, smoothing)
    drop = g[best] - g[-1]
    with_kl = [i for i, k in enumerate(kl) if math.isfinite(k)]
    d = [math.sqrt(max(kl[i], 0.0)) for i in with_kl]
    fit = fit_gao(d, [gold[i] for i in with_kl])
    fitted = None
    if fit is not None:
        fitted = asdict(fit)
        peak = gao_peak(fit.alpha, fit.beta)
        fitted["peak"] = (
            None
            if peak is None
            else {"d": peak[0], "kl": peak[1], "gold": fit.baseline + peak[2], "gain": peak[2]}
        )
        fitted["final_kl"] = max(kl[with_kl[-1]], 0.0)
        fitted["past_peak"] = peak is not None and d[-1] > peak[0]
    return {
        "smoothing": smoothing,
        "first": g[0],
        "best": g[best],
        "best_iteration": int(iterations[best]),
        "final": g[-1],
        "final_iteration": int(iterations[-1]),
        "drop": drop,
        "noise": noise,
        "fell": bool(drop > 2 * math.sqrt(2) * noise),
        "proxy_at_best": None if math.isnan(p[best]) else p[best],
        "proxy_final": None if math.isnan(p[-1]) else p[-1],
        "proxy_rose": bool(p[-1] > p[best]),  # False where either is NaN
        "fit": fitted,
    }


def story_from_rows(rows: Sequence[dict], smoothing: float) -> dict:
    """:func:`gold_story` of metrics.jsonl rows: those with a finite ``monitor/gold``, their
    ``objective/scores`` and ``objective/kl`` NaN where not finite (a batch whose proxy
    scores were skipped still measured its gold); empty dict when there are none."""
    good = [r for r in rows if is_finite_number(r.get("monitor/gold"))]

    def column(key: str) -> list[float]:
        return [float(r[key]) if is_finite_number(r.get(key)) else math.nan for r in good]

    return gold_story(
        [r["iteration"] for r in good],
        column("monitor/gold"),
        column("objective/scores"),
        column("objective/kl"),
        smoothing,
    )


def is_finite_number(value) -> bool:
    """A real number (not a bool, not None, not NaN or ±inf), as a metrics row may hold."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
