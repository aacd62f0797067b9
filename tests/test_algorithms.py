"""The algorithm core against plain Python loops in float64, plus invariance properties."""

import math

import pytest
import torch

from rlhflab.core import algorithms as A
from tests.maths_helpers import B, T, loop_mean, ragged_mask, rand, with_garbage_padding

# ----------------------------------------------------------------------------- masked statistics


def test_masked_mean_var_whiten_match_loop():
    x, m = rand(B, T), ragged_mask()
    mean, vals = loop_mean(x, m)
    var_u = sum((v - mean) ** 2 for v in vals) / (len(vals) - 1)
    var_b = sum((v - mean) ** 2 for v in vals) / len(vals)
    assert A.masked_mean(x, m).item() == pytest.approx(mean, rel=1e-12)
    assert A.masked_var(x, m).item() == pytest.approx(var_u, rel=1e-12)
    assert A.masked_var(x, m, unbiased=False).item() == pytest.approx(var_b, rel=1e-12)
    w = A.masked_whiten(x, m)
    w_keep = A.masked_whiten(x, m, shift_mean=False)
    for i in range(B):
        for j in range(T):
            expect = (x[i, j].item() - mean) / math.sqrt(var_u + 1e-8) if m[i, j] else 0.0
            assert w[i, j].item() == pytest.approx(expect, rel=1e-10, abs=1e-12)
            expect_keep = expect + mean if m[i, j] else 0.0
            assert w_keep[i, j].item() == pytest.approx(expect_keep, rel=1e-10, abs=1e-12)
    # whitened: masked mean 0, std 1; scale-only whitening keeps the mean
    assert A.masked_mean(w, m).item() == pytest.approx(0.0, abs=1e-12)
    assert A.masked_var(w, m).item() == pytest.approx(1.0, rel=1e-6)
    assert A.masked_mean(w_keep, m).item() == pytest.approx(mean, rel=1e-10)


def test_masked_mean_per_row_and_empty_rows():
    x, m = rand(B, T), ragged_mask(empty_row=True)
    per_row = A.masked_mean(with_garbage_padding(x, m), m, dim=1)
    for i in range(B):
        n = int(m[i].sum())
        expect = sum(x[i, j].item() for j in range(n)) / n if n else 0.0
        assert per_row[i].item() == pytest.approx(expect, rel=1e-12)
    empty = torch.zeros(B, T)
    assert A.masked_mean(x, empty).item() == 0.0
    assert A.masked_var(x, empty).item() == 0.0
    assert torch.equal(A.masked_whiten(x, empty), torch.zeros_like(x))
    one = torch.zeros(B, T)
    one[0, 0] = 1
    assert A.masked_var(x, one).item() == 0.0  # undefined with n = 1: 0, never NaN


def test_padding_content_never_changes_statistics():
    x, m = rand(B, T), ragged_mask()
    for fill in (float("nan"), float("inf"), 1e30):
        xg = with_garbage_padding(x, m, fill)
        assert torch.equal(A.masked_mean(xg, m), A.masked_mean(x, m))
        assert torch.equal(A.masked_var(xg, m), A.masked_var(x, m))
        assert torch.equal(A.masked_whiten(xg, m), A.masked_whiten(x, m))


# ----------------------------------------------------------------------------- log-probs, entropy, KL


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_and_entropy_match_loop(temperature):
    V = 5
    logits, tokens = (
        rand(2, 3, V),
        torch.randint(0, V, (2, 3), generator=torch.Generator().manual_seed(1)),
    )
    lp = A.logprobs_from_logits(logits, tokens, temperature)
    ent = A.entropy_from_logits(logits, temperature)
    for i in range(2):
        for t in range(3):
            z = [logits[i, t, v].item() / temperature for v in range(V)]
            log_z = math.log(sum(math.exp(u) for u in z))
            assert lp[i, t].item() == pytest.approx(z[tokens[i, t]] - log_z, rel=1e-12)
            probs = [math.exp(u - log_z) for u in z]
            assert ent[i, t].item() == pytest.approx(
                -sum(p * math.log(p) for p in probs), rel=1e-10
            )


def test_temperature_changes_logprobs_and_half_precision_is_upcast():
    logits, tokens = rand(2, 3, 7), torch.zeros(2, 3, dtype=torch.long)
    assert not torch.allclose(
        A.logprobs_from_logits(logits, tokens, 0.5), A.logprobs_from_logits(logits, tokens, 1.0)
    )
    half = A.logprobs_from_logits(logits.bfloat16(), tokens)
    assert half.dtype == torch.float32
    with pytest.raises(ValueError, match="temperature"):
        A.logprobs_from_logits(logits, tokens, 0.0)


def test_kl_estimators_match_formulas():
    lp, ref = rand(B, T, seed=1), rand(B, T, seed=2)
    for est, f in {
        "k1": lambda a, b: a - b,
        "k2": lambda a, b: 0.5 * (a - b) ** 2,
        "k3": lambda a, b: math.exp(b - a) - (b - a) - 1,
        "k3+": lambda a, b: math.exp(b - a) - (b - a) - 1,
        "abs": lambda a, b: abs(a - b),
    }.items():
        out = A.kl_estimate(lp, ref, est)
        for i in range(B):
            for j in range(T):
                assert out[i, j].item() == pytest.approx(
                    f(lp[i, j].item(), ref[i, j].item()), rel=1e-10
                )
    assert (A.kl_estimate(lp, ref, "k3") >= 0).all() and (A.kl_estimate(lp, ref, "k2") >= 0).all()
    with pytest.raises(ValueError, match="k9"):
        A.kl_estimate(lp, ref, "k9")


def test_k1_and_k3_are_unbiased_on_a_categorical():
    """E_q[k1] = E_q[k3] = KL(q‖p) exactly, computed by enumeration over a categorical."""
    q = torch.softmax(rand(10, seed=3), 0)
    p = torch.softmax(rand(10, seed=4), 0)
    true_kl = (q * (q.log() - p.log())).sum()
    for est in ("k1", "k3"):
        expect = (q * A.kl_estimate(q.log(), p.log(), est)).sum()
        assert expect.item() == pytest.approx(true_kl.item(), rel=1e-10)


def test_k3_plus_has_k3_value_and_k2_gradient():
    lp = rand(4, 5, seed=5).requires_grad_()
    ref = rand(4, 5, seed=6)
    A.kl_estimate(lp, ref, "k3+").sum().backward()
    g_plus = lp.grad.clone()
    lp.grad = None
    A.kl_estimate(lp, ref, "k2").sum().backward()
    assert torch.allclose(g_plus, lp.grad)


def test_k2_loss_gradient_equals_k1_in_reward_gradient_on_policy():
    """Liu et al.: ∇E_π[k2] = E_π[k1 · ∇log π] when sampling from π (exact by enumeration)."""
    theta = rand(8, seed=7).requires_grad_()
    ref = torch.log_softmax(rand(8, seed=8), 0)
    logq = torch.log_softmax(theta, 0)
    q = logq.exp().detach()
    # k2 as a loss, differentiated through log π only (samples are fixed)
    (q * A.kl_estimate(logq, ref, "k2")).sum().backward()
    g_k2 = theta.grad.clone()
    theta.grad = None
    logq = torch.log_softmax(theta, 0)
    k1 = A.kl_estimate(logq, ref, "k1").detach()
    (q * k1 * logq).sum().backward()  # REINFORCE with the detached k1 as the "reward"
    assert torch.allclose(g_k2, theta.grad, atol=1e-12)


# ----------------------------------------------------------------------------- rewards, GAE


def test_shape_rewards_puts_score_on_last_response_token():
    m = ragged_mask(empty_row=True)
    kl, scores = rand(B, T, seed=1), rand(B, seed=2)
    r = A.shape_rewards(scores, with_garbage_padding(kl, m), m, kl_coef=0.1)
    for i in range(B):
        n = int(m[i].sum())
        for j in range(T):
            expect = -0.1 * kl[i, j].item() if j < n else 0.0
            if n and j == n - 1:
                expect += scores[i].item()
            assert r[i, j].item() == pytest.approx(expect, rel=1e-12, abs=1e-15)


def gae_loop(rewards, values, mask, gamma, lam):
    adv = torch.zeros_like(rewards)
    for i in range(rewards.shape[0]):
        n = int(mask[i].sum())
        last = 0.0
        for t in reversed(range(n)):
            nv = values[i, t + 1].item() if t + 1 < n else 0.0
            delta = rewards[i, t].item() + gamma * nv - values[i, t].item()
            last = delta + gamma * lam * last
            adv[i, t] = last
    return adv, torch.where(mask.bool(), adv + values, torch.zeros_like(adv))


@pytest.mark.parametrize("gamma,lam", [(1.0, 0.95), (0.99, 1.0), (0.9, 0.0)])
def test_gae_matches_loop_and_ignores_padding(gamma, lam):
    m = ragged_mask(seed=3, empty_row=True)
    r, v = rand(B, T, seed=4), rand(B, T, seed=5)
    adv, ret = A.compute_gae(with_garbage_padding(r, m), with_garbage_padding(v, m), m, gamma, lam)
    adv_ref, ret_ref = gae_loop(r, v, m, gamma, lam)
    assert torch.allclose(adv, adv_ref, atol=1e-12)
    assert torch.allclose(ret, ret_ref, atol=1e-12)


def test_gae_hand_worked_three_tokens():
    r = torch.tensor([[0.0, 0.0, 1.0]], dtype=torch.float64)
    v = torch.tensor([[0.5, 0.6, 0.7]], dtype=torch.float64)
    adv, ret = A.compute_gae(r, v, torch.ones(1, 3), gamma=1.0, lam=0.95)
    d2 = 1.0 - 0.7
    d1 = 0.7 - 0.6
    d0 = 0.6 - 0.5
    a2, a1 = d2, d1 + 0.95 * d2
    a0 = d0 + 0.95 * a1
    assert adv[0].tolist() == pytest.approx([a0, a1, a2], rel=1e-12)
    assert ret[0].tolist() == pytest.approx([a0 + 0.5, a1 + 0.6, a2 + 0.7], rel=1e-12)


def test_group_and_rloo_advantages_match_loop():
    G = 4
    s = rand(12, seed=9)
    grpo, dr, rloo = (
        A.group_advantages(s, G),
        A.group_advantages(s, G, normalize_std=False),
        A.rloo_advantages(s, G),
    )
    for k in range(3):
        grp = [s[k * G + i].item() for i in range(G)]
        mu = sum(grp) / G
        sd = math.sqrt(sum((x - mu) ** 2 for x in grp) / (G - 1))
        for i in range(G):
            assert grpo[k * G + i].item() == pytest.approx((grp[i] - mu) / (sd + 1e-6), rel=1e-10)
            assert dr[k * G + i].item() == pytest.approx(grp[i] - mu, rel=1e-10, abs=1e-14)
            others = (sum(grp) - grp[i]) / (G - 1)
            assert rloo[k * G + i].item() == pytest.approx(grp[i] - others, rel=1e-10, abs=1e-14)
    equal = torch.ones(8, dtype=torch.float64)
    assert torch.equal(A.group_advantages(equal, 4), torch.zeros(8, dtype=torch.float64))
    # eps = 0: an equal group was 0/0 = NaN, which halted the run as a "non-finite loss"
    zero_eps = A.group_advantages(torch.cat([equal[:4], s[4:8]]), 4, eps=0.0)
    assert torch.equal(zero_eps[:4], torch.zeros(4, dtype=torch.float64))
    assert torch.isfinite(zero_eps).all() and zero_eps[4:].abs().sum() > 0
    with pytest.raises(ValueError, match="groups of 5"):
        A.group_advantages(s, 5)
    with pytest.raises(ValueError, match=">= 2"):
        A.rloo_advantages(s, 1)


# ----------------------------------------------------------------------------- KL controllers


def test_adaptive_kl_controller_follows_ziegler_update_and_round_trips():
    ctl = A.AdaptiveKLController(0.1, target=6.0, horizon=10_000)
    ctl.update(current_kl=12.0, n_steps=64)  # error clipped to +0.2
    assert ctl.value == pytest.approx(0.1 * (1 + 0.2 * 64 / 10_000))
    before = ctl.value
    ctl.update(current_kl=5.4, n_steps=64)  # error −0.1, inside the clip
    assert ctl.value == pytest.approx(before * (1 - 0.1 * 64 / 10_000))
    ctl.update(current_kl=0.0, n_steps=10_000)  # error clipped to −0.2
    assert ctl.value < before
    # a resume restores β; target and horizon are the config's (which it may change)
    clone = A.AdaptiveKLController(1.0, target=6.0, horizon=20_000)
    clone.load_state_dict(ctl.state_dict())
    assert clone.state_dict() == {**ctl.state_dict(), "horizon": 20_000}
    clone.update(float("nan"), 64)  # a skipped batch's KL leaves β as it was
    assert clone.value == ctl.value
    fixed = A.FixedKLController(0.05)
    fixed.update(100.0, 64)
    assert fixed.value == 0.05
    with pytest.raises(ValueError):
        A.AdaptiveKLController(0.1, target=0.0, horizon=1)


def test_mean_z_score_matches_loop():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(40, generator=g, dtype=torch.float64) - 0.3
    vals = x.tolist()
    mean = sum(vals) / len(vals)
    std = math.sqrt(sum((v - mean) ** 2 for v in vals) / (len(vals) - 1))
    assert A.mean_z_score(x) == pytest.approx(mean / (std / math.sqrt(len(vals))), abs=1e-12)
    assert math.isnan(A.mean_z_score(torch.zeros(5))) and math.isnan(A.mean_z_score(x[:1]))
    assert A.mean_z_score(torch.full((3,), -1.0)) == -math.inf


# ----------------------------------------------------------------------------- running score scale


def test_running_scale_of_equal_scores_is_finite():
    from rlhflab.core.stats import RunningMoments

    for value in (0.0, 1.0, -3.0):
        moments, scores = RunningMoments(), torch.full((8,), value)
        moments.update(scores)
        out = A.scale_by_running_std(scores, moments.var)
        assert torch.isfinite(out).all()
        # no spread seen yet, so no scale to divide by: the scores stay as they are
        assert torch.equal(out, A.scale_by_running_std(scores, 1.0))
    x = rand(5, seed=40)
    for i, v in enumerate(A.scale_by_running_std(x, 0.25, eps=1e-8).tolist()):
        assert v == pytest.approx(x[i].item() / math.sqrt(0.25 + 1e-8), rel=1e-12)


class _ThreadGroup:
    """``world`` ranks as threads: all_sum adds every rank's tensor, as all_reduce does."""

    def __init__(self, world):
        import threading

        self.world, self.slots = world, [None] * world
        self.barrier = threading.Barrier(world)

    def rank(self, r):
        group = self

        class Ctx:
            enabled, world = group.world > 1, group.world

            def all_sum(self, t):
                group.slots[r] = t.clone()
                group.barrier.wait()
                total = sum(group.slots)
                group.barrier.wait()  # nobody overwrites a slot before all have read
                return total

        return Ctx()


def test_running_moments_are_global_over_ranks_and_equal_the_concatenated_data():
    import threading

    from rlhflab.core.stats import RunningMoments
    from rlhflab.infra.distributed import global_batch_moments

    # two iterations; rank 1's first share is all equal, the shards differ in size
    shards = [
        [rand(3, seed=41) + 5.0, torch.full((4,), 2.0, dtype=torch.float64)],
        [rand(6, seed=42) * 3.0, rand(2, seed=43) - 7.0],
    ]
    group, found = _ThreadGroup(2), [None, None]

    def run(r):
        ctx, moments = group.rank(r), RunningMoments()
        for it in shards:
            moments.merge(*global_batch_moments(it[r].float(), ctx))
        found[r] = moments

    threads = [threading.Thread(target=run, args=(r,)) for r in (0, 1)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=30)
    every = torch.cat([x.float().double() for it in shards for x in it])
    for moments in found:  # every rank holds the same, global moments
        assert moments.count == every.numel()
        assert moments.mean == pytest.approx(every.mean().item(), rel=1e-12)
        assert moments.var == pytest.approx(every.var().item(), rel=1e-12)
    assert found[0].state_dict() == found[1].state_dict()


def test_student_t_cdf_and_quantile_match_closed_forms_and_the_normal():
    """df = 1 (Cauchy) and df = 2 have closed forms; large df tends to the normal;
    the quantile inverts the cdf."""
    from statistics import NormalDist

    from rlhflab.core.stats import student_t_cdf, student_t_quantile

    for t in (-30.0, -4.0, -1.5, 0.0, 0.7, 3.0):
        assert student_t_cdf(t, 1) == pytest.approx(0.5 + math.atan(t) / math.pi, abs=1e-12)
        two = 0.5 + t / (2 * math.sqrt(2 + t * t))
        assert student_t_cdf(t, 2) == pytest.approx(two, abs=1e-9)
        assert student_t_cdf(t, 400) == pytest.approx(NormalDist().cdf(t), abs=2e-3)
    assert student_t_cdf(-4.0, 3) == pytest.approx(0.0140, abs=1e-4)  # why a fixed −4 misled
    # quantiles against closed forms (df 1 and 2) and a printed table (t_0.05,7 = −1.8946)
    for p in (3e-5, 0.01, 0.3):
        assert student_t_quantile(p, 1) == pytest.approx(math.tan(math.pi * (p - 0.5)), rel=1e-6)
        two = (2 * p - 1) / math.sqrt(2 * p * (1 - p))
        assert student_t_quantile(p, 2) == pytest.approx(two, rel=1e-6)
    assert student_t_quantile(0.05, 7) == pytest.approx(-1.8946, abs=1e-4)
    assert student_t_quantile(3e-5, 999) == pytest.approx(NormalDist().inv_cdf(3e-5), rel=5e-3)
    with pytest.raises(ValueError, match="df must be >= 1"):
        student_t_cdf(0.0, 0.5)
