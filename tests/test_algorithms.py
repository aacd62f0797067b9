"""The algorithm core against plain Python loops in float64, plus invariance properties."""

import math

import pytest
import torch

from rlhflab import algorithms as A

B, T = 6, 9


def ragged_mask(seed=0, b=B, t=T, empty_row=False):
    """Right-padded mask with ragged lengths, always including a length-1 row."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, t + 1, (b,), generator=g)
    lengths[0] = 1
    lengths[1] = t
    if empty_row:
        lengths[-1] = 0
    return (torch.arange(t)[None, :] < lengths[:, None]).to(torch.float64)


def rand(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def with_garbage_padding(x, mask, value=float("nan")):
    return torch.where(mask.bool(), x, torch.full_like(x, value))


def loop_mean(x, m):
    vals = [x[i][j].item() for i in range(x.shape[0]) for j in range(x.shape[1]) if m[i][j]]
    return sum(vals) / len(vals), vals


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
    with pytest.raises(ValueError, match="groups of 5"):
        A.group_advantages(s, 5)
    with pytest.raises(ValueError, match=">= 2"):
        A.rloo_advantages(s, 1)


# ----------------------------------------------------------------------------- aggregation


def agg_loop(loss, m, mode, norm=None):
    rows = [[loss[i, j].item() for j in range(T) if m[i, j]] for i in range(loss.shape[0])]
    if mode == "token-mean":
        flat = [x for r in rows for x in r]
        return sum(flat) / len(flat)
    if mode == "seq-mean-token-sum":
        return sum(sum(r) for r in rows) / len(rows)
    if mode == "seq-mean-token-mean":
        return sum(sum(r) / len(r) if r else 0.0 for r in rows) / len(rows)
    return sum(sum(r) for r in rows) / (len(rows) * (norm or T))


@pytest.mark.parametrize("mode", A.AGG_MODES)
def test_aggregate_matches_loop_and_ignores_padding(mode):
    m, loss = ragged_mask(seed=11, empty_row=True), rand(B, T, seed=12)
    out = A.aggregate(with_garbage_padding(loss, m), m, mode)
    assert out.item() == pytest.approx(agg_loop(loss, m, mode), rel=1e-12)
    if mode == "seq-mean-token-sum-norm":
        assert A.aggregate(loss, m, mode, norm=32).item() == pytest.approx(
            agg_loop(loss, m, mode, 32), rel=1e-12
        )


@pytest.mark.parametrize("mode", A.AGG_MODES)
def test_micro_batches_sum_to_whole_batch_with_global_counts(mode):
    m, loss = ragged_mask(seed=13), rand(B, T, seed=14)
    whole = A.aggregate(loss, m, mode)
    kw = {"num_tokens": m.sum(), "num_seqs": B}
    parts = sum(
        A.aggregate(loss[s], m[s], mode, **kw) for s in (slice(0, 1), slice(1, 4), slice(4, B))
    )
    assert parts.item() == pytest.approx(whole.item(), rel=1e-12)


# ----------------------------------------------------------------------------- policy and value losses


def policy_loop(lp, old, adv, m, cl, ch, dual):
    losses, clipped = [], 0
    for i in range(B):
        for j in range(T):
            if not m[i, j]:
                continue
            ratio = math.exp(lp[i, j].item() - old[i, j].item())
            a = adv[i, j].item()
            l1, l2 = -a * ratio, -a * min(max(ratio, 1 - cl), 1 + ch)
            val = max(l1, l2)
            clipped += l2 > l1
            if dual is not None and a < 0:
                val = min(val, -a * dual)
            losses.append(val)
    return sum(losses) / len(losses), clipped / len(losses)


@pytest.mark.parametrize("clip_high,dual", [(None, None), (0.28, None), (None, 3.0)])
def test_policy_loss_matches_loop(clip_high, dual):
    m = ragged_mask(seed=15)
    old, adv = rand(B, T, seed=16), rand(B, T, seed=17) * 2
    lp = old + rand(B, T, seed=18) * 0.8
    loss, met = A.policy_loss(
        with_garbage_padding(lp, m),
        with_garbage_padding(old, m),
        with_garbage_padding(adv, m),
        m,
        0.2,
        clip_high,
        dual,
    )
    ref_loss, ref_clip = policy_loop(lp, old, adv, m, 0.2, clip_high or 0.2, dual)
    assert loss.item() == pytest.approx(ref_loss, rel=1e-12)
    assert met["clipfrac"].item() == pytest.approx(ref_clip, rel=1e-12)
    assert torch.isfinite(torch.stack(list(met.values()))).all()


def test_dual_clip_binds_for_large_ratio_and_negative_advantage():
    lp, old = torch.tensor([[3.0]], dtype=torch.float64), torch.zeros(1, 1, dtype=torch.float64)
    adv = torch.tensor([[-1.0]], dtype=torch.float64)
    plain, _ = A.policy_loss(lp, old, adv, torch.ones(1, 1))
    capped, met = A.policy_loss(lp, old, adv, torch.ones(1, 1), dual_clip=3.0)
    assert plain.item() == pytest.approx(math.exp(3.0))
    assert capped.item() == pytest.approx(3.0)
    assert met["dual_clipfrac"].item() == 1.0
    with pytest.raises(ValueError, match="dual_clip"):
        A.policy_loss(lp, old, adv, torch.ones(1, 1), dual_clip=1.0)


def test_first_step_identity():
    m, old, adv = ragged_mask(), rand(B, T), rand(B, T, seed=1)
    _, met = A.policy_loss(old.clone(), old, adv, m)
    assert met["ratio_mean"].item() == 1.0 and met["approx_kl"].item() == 0.0
    assert met["clipfrac"].item() == 0.0


def test_value_clipfrac_counts_clips_not_rounding():
    """Inside the clip range V_old + (V − V_old) is V only up to float rounding, which makes
    the "clipped" error larger by an ulp on about half the tokens: those are not clips."""
    m = torch.ones(64, 32, dtype=torch.bool)
    g = torch.Generator().manual_seed(0)
    # values near zero, of either sign (a critic whose head starts at zero): V − V_old is
    # then inexact, unlike for values within a factor of two of each other
    old = 1e-3 * torch.randn(64, 32, generator=g)
    v, ret = 1e-3 * torch.randn(64, 32, generator=g), torch.randn(64, 32, generator=g)
    assert not torch.equal(old + (v - old), v)  # the rounding this is about is there
    assert A.value_loss(v, old, ret, m)[1]["vf_clipfrac"].item() == 0.0
    # a quarter of the values jump onto their returns: clipped wherever |R − V_old| > 0.2
    jump = torch.rand(64, 32, generator=g) < 0.25
    frac = A.value_loss(torch.where(jump, ret, v), old, ret, m)[1]["vf_clipfrac"].item()
    assert frac == (jump & ((ret - old).abs() > 0.2)).float().mean().item()


def test_value_loss_matches_loop_and_explained_variance():
    m = ragged_mask(seed=19)
    old, ret = rand(B, T, seed=20), rand(B, T, seed=21)
    v = old + rand(B, T, seed=22) * 0.5
    loss, met = A.value_loss(v, old, ret, m, clip_range=0.2)
    plain, _ = A.value_loss(v, old, ret, m, clip_range=None)
    errs, clipped, plain_errs = [], 0, []
    for i in range(B):
        for j in range(T):
            if m[i, j]:
                vv, oo, rr = v[i, j].item(), old[i, j].item(), ret[i, j].item()
                vc = oo + min(max(vv - oo, -0.2), 0.2)
                e1, e2 = (vv - rr) ** 2, (vc - rr) ** 2
                errs.append(max(e1, e2))
                plain_errs.append(e1)
                clipped += e2 > e1 and abs(vv - oo) > 0.2
    assert loss.item() == pytest.approx(0.5 * sum(errs) / len(errs), rel=1e-12)
    assert plain.item() == pytest.approx(0.5 * sum(plain_errs) / len(plain_errs), rel=1e-12)
    assert met["vf_clipfrac"].item() == pytest.approx(clipped / len(errs), rel=1e-12)
    ev = 1 - A.masked_var(ret - old, m) / A.masked_var(ret, m)
    assert met["explained_variance"].item() == pytest.approx(ev.item(), rel=1e-12)
    perfect = A.value_loss(ret, ret, ret, m)[1]["explained_variance"]
    assert perfect.item() == pytest.approx(1.0)


def test_fully_masked_batch_gives_finite_zero_losses():
    m = torch.zeros(B, T)
    x = torch.full((B, T), float("nan"), dtype=torch.float64)
    for mode in A.AGG_MODES:
        loss, met = A.policy_loss(x, x, x, m, agg=mode)
        assert loss.item() == 0.0 and all(torch.isfinite(v) for v in met.values())
        loss, met = A.value_loss(x, x, x, m, agg=mode)
        assert loss.item() == 0.0 and all(torch.isfinite(v) for v in met.values())


def test_loss_gradients_pass_gradcheck():
    m = ragged_mask(seed=23)
    old, adv, ret = rand(B, T, seed=24), rand(B, T, seed=25), rand(B, T, seed=26)
    # keep ρ away from the clip edges where the surrogate has kinks
    lp = (old + 0.05 * rand(B, T, seed=27)).requires_grad_()
    for mode in A.AGG_MODES:
        assert torch.autograd.gradcheck(
            lambda x, mode=mode: A.policy_loss(x, old, adv, m, agg=mode)[0], (lp,)
        )
    v = (ret + 0.01 * rand(B, T, seed=28)).requires_grad_()
    v_old = ret + 0.3 * rand(B, T, seed=35)  # some tokens clipped, some not
    assert torch.autograd.gradcheck(lambda x: A.value_loss(x, v_old, ret, m)[0], (v,))
    c, r = rand(5, seed=29).requires_grad_(), rand(5, seed=30).requires_grad_()
    assert torch.autograd.gradcheck(lambda a, b: A.pairwise_reward_loss(a, b, 0.5), (c, r))
    rc, rr = rand(5, seed=33), rand(5, seed=34)
    for lt in ("sigmoid", "ipo"):
        assert torch.autograd.gradcheck(
            lambda a, b, lt=lt: A.dpo_loss(a, b, rc, rr, 0.3, lt)[0].sum(), (c, r)
        )
    logits = rand(2, 3, 4, seed=31).requires_grad_()
    assert torch.autograd.gradcheck(lambda z: A.entropy_from_logits(z, 0.8), (logits,))
    lp2 = rand(B, T, seed=32).requires_grad_()
    for est in ("k1", "k2", "k3"):  # k3+ has k2's gradient by design (tested above)
        assert torch.autograd.gradcheck(lambda x, est=est: A.kl_estimate(x, old, est), (lp2,))


# ----------------------------------------------------------------------------- DPO, Bradley-Terry


def test_dpo_losses_match_formulas():
    pc, pr, rc, rr = (rand(5, seed=s) for s in range(40, 44))
    sig = lambda x: 1 / (1 + math.exp(-x))  # noqa: E731
    for loss_type, ls in (("sigmoid", 0.0), ("sigmoid", 0.1), ("ipo", 0.0)):
        losses, cr, rj = A.dpo_loss(
            pc, pr, rc, rr, beta=0.2, loss_type=loss_type, label_smoothing=ls
        )
        for i in range(5):
            h = (pc[i] - rc[i] - pr[i] + rr[i]).item()
            if loss_type == "sigmoid":
                expect = -(1 - ls) * math.log(sig(0.2 * h)) - ls * math.log(sig(-0.2 * h))
            else:
                expect = (h - 1 / 0.4) ** 2
            assert losses[i].item() == pytest.approx(expect, rel=1e-10)
            assert cr[i].item() == pytest.approx(0.2 * (pc[i] - rc[i]).item(), rel=1e-12)
            assert rj[i].item() == pytest.approx(0.2 * (pr[i] - rr[i]).item(), rel=1e-12)
    with pytest.raises(ValueError, match="loss_type"):
        A.dpo_loss(pc, pr, rc, rr, loss_type="hinge2")


def test_pairwise_reward_loss_matches_formula():
    c, r = rand(6, seed=50), rand(6, seed=51)
    margin = torch.linspace(0, 1, 6, dtype=torch.float64)
    expect = (
        sum(-math.log(1 / (1 + math.exp(-(c[i] - r[i] - margin[i]).item()))) for i in range(6)) / 6
    )
    assert A.pairwise_reward_loss(c, r, margin).item() == pytest.approx(expect, rel=1e-12)
    assert A.pairwise_reward_loss(c, r).item() < A.pairwise_reward_loss(c, r, 1.0).item()
    # soft labels: y = 1 is the plain loss, y = 0 swaps the pair, y = 0.5 averages both
    ones, zeros = torch.ones(6, dtype=torch.float64), torch.zeros(6, dtype=torch.float64)
    assert torch.allclose(A.pairwise_reward_loss(c, r, labels=ones), A.pairwise_reward_loss(c, r))
    assert torch.allclose(A.pairwise_reward_loss(c, r, labels=zeros), A.pairwise_reward_loss(r, c))
    half = A.pairwise_reward_loss(c, r, labels=ones * 0.5)
    assert torch.allclose(half, 0.5 * (A.pairwise_reward_loss(c, r) + A.pairwise_reward_loss(r, c)))


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
    clone = A.AdaptiveKLController(1.0, 1.0, 1.0)
    clone.load_state_dict(ctl.state_dict())
    assert clone.state_dict() == ctl.state_dict()
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
