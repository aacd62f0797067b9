"""The gold reward's story and Gao et al.'s over-optimisation fit (diagnostics/gold_curve.py),
against float64 references and synthetic curves with a known answer."""

import math
import random

import pytest
import torch

from rlhflab.diagnostics.gold_curve import ema, fit_gao, gao_peak, gold_story
from rlhflab.trainers.ppo_watch import BestGold


def test_ema_is_the_monitors_recurrence_and_best_gold_agrees_with_it():
    xs = [0.3, 0.1, 0.7, 0.65, 0.2]
    want, s = [], None
    for x in xs:
        s = x if s is None else 0.8 * s + 0.2 * x
        want.append(s)
    assert ema(xs, 0.8) == pytest.approx(want, abs=1e-15)
    best = BestGold(0.8)
    news = [best.update(x, i + 1) for i, x in enumerate(xs)]
    top = max(range(len(want)), key=lambda i: want[i])
    assert best.iteration == top + 1 and best.best == pytest.approx(want[top])
    assert news[0] and news[top] and not news[-1]


def _gain(d, alpha, beta):
    return 0.0 if d == 0 else d * (alpha - beta * math.log(d))


@pytest.mark.parametrize("baseline", [None, 0.25])
def test_fit_recovers_alpha_beta_and_baseline_from_exact_data(baseline):
    alpha, beta, g0 = 0.4, 0.3, 0.25
    d = [0.0, 0.1, 0.3, 0.5, 0.8, 1.0, 1.3, 1.7, 2.2, 3.0]
    gold = [g0 + _gain(x, alpha, beta) for x in d]
    fit = fit_gao(d, gold, baseline)
    assert (fit.alpha, fit.beta, fit.baseline) == pytest.approx((alpha, beta, g0), abs=1e-9)
    assert fit.rmse < 1e-9 and fit.points == len(d)


def test_fit_is_the_float64_least_squares_solution_on_noisy_data():
    rng = random.Random(0)
    d = [rng.uniform(0, 2.5) for _ in range(60)] + [0.0]
    gold = [0.3 + _gain(x, 0.5, 0.35) + rng.gauss(0, 0.05) for x in d]
    # the reference: an explicit design matrix solved by torch's float64 least squares
    X = torch.tensor([[1.0, x, -x * math.log(x) if x > 0 else 0.0] for x in d], dtype=torch.float64)
    sol = torch.linalg.lstsq(X, torch.tensor(gold, dtype=torch.float64)[:, None]).solution
    g0, alpha, beta = sol.flatten().tolist()
    fit = fit_gao(d, gold)
    assert (fit.baseline, fit.alpha, fit.beta) == pytest.approx((g0, alpha, beta), abs=1e-9)
    resid = X @ sol - torch.tensor(gold, dtype=torch.float64)[:, None]
    assert fit.rmse == pytest.approx(float(resid.pow(2).mean().sqrt()), rel=1e-9)
    # with the baseline given, a two-unknown fit of gold − g0 (no intercept column)
    fixed = fit_gao(d, gold, baseline=0.3)
    sol2 = torch.linalg.lstsq(X[:, 1:], torch.tensor(gold, dtype=torch.float64)[:, None] - 0.3)
    assert (fixed.alpha, fixed.beta) == pytest.approx(sol2.solution.flatten().tolist(), abs=1e-9)


def test_fit_refuses_too_few_distances_and_collinear_ones():
    assert fit_gao([0.0, 0.0, 0.5, 0.7], [0.1, 0.2, 0.3, 0.4]) is None  # two d > 0
    assert fit_gao([0.5] * 5, [0.1, 0.2, 0.3, 0.4, 0.5]) is None  # every d the same
    with pytest.raises(ValueError, match="3 distances but 2"):
        fit_gao([0.1, 0.2, 0.3], [0.0, 0.1])


@pytest.mark.parametrize("alpha,beta", [(0.4, 0.3), (0.1, 0.2), (1.0, 0.25)])
def test_peak_is_where_the_fitted_gain_is_largest(alpha, beta):
    d_star, kl_star, top = gao_peak(alpha, beta)
    assert d_star == pytest.approx(math.exp(alpha / beta - 1))
    assert kl_star == pytest.approx(d_star**2) and top == pytest.approx(beta * d_star)
    assert top == pytest.approx(_gain(d_star, alpha, beta))
    grid = [i * d_star * 4 / 20000 for i in range(1, 20001)]
    best = max(grid, key=lambda x: _gain(x, alpha, beta))
    assert best == pytest.approx(d_star, rel=1e-3)
    assert gao_peak(0.3, 0.0) is None and gao_peak(0.3, -0.1) is None  # never turns down
    assert gao_peak(400.0, 1.0) is None  # beyond any KL


def _run(n, peak_at, fall, noise=0.02, seed=0):
    """A synthetic run: gold rises to its peak at iteration ``peak_at`` then falls by
    ``fall``; the proxy keeps rising; the KL grows linearly."""
    rng = random.Random(seed)
    its = list(range(1, n + 1))
    gold = [
        (0.3 + 0.3 * min(i, peak_at) / peak_at - fall * max(0, i - peak_at) / (n - peak_at))
        + rng.gauss(0, noise)
        for i in its
    ]
    proxy = [1.0 + 0.1 * i + rng.gauss(0, noise) for i in its]
    kl = [0.05 * (i - 1) for i in its]
    return its, gold, proxy, kl


def test_story_finds_the_best_iteration_and_a_significant_fall_while_the_proxy_rose():
    story = gold_story(*_run(40, peak_at=20, fall=0.25), smoothing=0.8)
    assert 20 <= story["best_iteration"] <= 26  # the EMA lags the true peak a little
    assert story["fell"] and story["proxy_rose"]
    assert story["drop"] == pytest.approx(story["best"] - story["final"])
    assert story["drop"] > 2 * math.sqrt(2) * story["noise"]
    fit = story["fit"]
    assert fit["peak"] is not None and fit["past_peak"]
    assert 0.5 < fit["peak"]["kl"] < 2.0  # the true peak: iteration 20, KL 0.95


def test_story_of_a_still_rising_run_reports_no_fall():
    story = gold_story(*_run(40, peak_at=39, fall=0.0), smoothing=0.8)
    assert not story["fell"] and story["best_iteration"] >= 36
    assert gold_story([], [], [], [], 0.8) == {}


def test_a_batch_without_a_proxy_score_keeps_its_gold():
    """Rows whose proxy scores were all skipped (NaN) still measured gold: they used to be
    dropped whole, so the verdict said "no gold" beside a gold chart, or ended its gold
    line one batch short of the chart's."""
    its, gold, proxy, kl = _run(40, peak_at=20, fall=0.25)
    holed = [math.nan if i in (10, 39) else p for i, p in zip(its, proxy)]
    kl_holed = [math.nan if i == 39 else k for i, k in zip(its, kl)]
    story = gold_story(its, gold, holed, kl_holed, smoothing=0.8)
    whole = gold_story(its, gold, proxy, kl, smoothing=0.8)
    assert story["final"] == whole["final"] and story["best"] == whole["best"]
    assert story["fell"] and story["proxy_rose"]
    assert story["fit"]["points"] == 39 and story["fit"]["final_kl"] == kl[-1]
    none = gold_story(its, gold, [math.nan] * 40, kl, smoothing=0.8)
    assert none["final"] == whole["final"]
    assert none["proxy_final"] is None and none["proxy_rose"] is False
