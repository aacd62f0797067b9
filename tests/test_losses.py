"""The losses (PPO policy and value, aggregation, DPO, Bradley-Terry) against plain Python
loops in float64, plus invariance properties."""

import math

import pytest
import torch

from rlhflab.core import algorithms as A
from rlhflab.core import losses as L
from tests.maths_helpers import B, T, ragged_mask, rand, with_garbage_padding

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


@pytest.mark.parametrize("mode", L.AGG_MODES)
def test_aggregate_matches_loop_and_ignores_padding(mode):
    m, loss = ragged_mask(seed=11, empty_row=True), rand(B, T, seed=12)
    out = L.aggregate(with_garbage_padding(loss, m), m, mode, norm=32)
    assert out.item() == pytest.approx(agg_loop(loss, m, mode, 32), rel=1e-12)


def test_dr_grpo_constant_is_required_and_the_batch_width_never_weighs_an_answer():
    mode = "seq-mean-token-sum-norm"
    m, loss = ragged_mask(seed=15), rand(B, T, seed=16)
    # no silent fallback to the padded width: that width is whatever this batch's longest
    # answer happened to be
    with pytest.raises(ValueError, match="norm"):
        L.aggregate(loss, m, mode)
    short = 3  # row 0 is one token long: its padded batch alone is 3 wide, with row 1 it is T
    alone = L.aggregate(loss[:1, :short], m[:1, :short], mode, norm=40, num_seqs=2)
    other = L.aggregate(loss[1:2], m[1:2], mode, norm=40, num_seqs=2)
    together = L.aggregate(loss[:2], m[:2], mode, norm=40)
    assert together.item() == pytest.approx(alone.item() + other.item(), rel=1e-12)
    assert alone.item() == pytest.approx(loss[0, 0].item() / (2 * 40), rel=1e-12)


@pytest.mark.parametrize("mode", L.AGG_MODES)
def test_micro_batches_sum_to_whole_batch_with_global_counts(mode):
    m, loss = ragged_mask(seed=13), rand(B, T, seed=14)
    whole = L.aggregate(loss, m, mode, norm=20)
    kw = {"num_tokens": m.sum(), "num_seqs": B, "norm": 20}
    parts = sum(
        L.aggregate(loss[s], m[s], mode, **kw) for s in (slice(0, 1), slice(1, 4), slice(4, B))
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
    loss, met = L.policy_loss(
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
    plain, _ = L.policy_loss(lp, old, adv, torch.ones(1, 1))
    capped, met = L.policy_loss(lp, old, adv, torch.ones(1, 1), dual_clip=3.0)
    assert plain.item() == pytest.approx(math.exp(3.0))
    assert capped.item() == pytest.approx(3.0)
    assert met["dual_clipfrac"].item() == 1.0
    with pytest.raises(ValueError, match="dual_clip"):
        L.policy_loss(lp, old, adv, torch.ones(1, 1), dual_clip=1.0)


def test_first_step_identity():
    m, old, adv = ragged_mask(), rand(B, T), rand(B, T, seed=1)
    _, met = L.policy_loss(old.clone(), old, adv, m)
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
    assert L.value_loss(v, old, ret, m)[1]["vf_clipfrac"].item() == 0.0
    # a quarter of the values jump onto their returns: clipped wherever |R − V_old| > 0.2
    jump = torch.rand(64, 32, generator=g) < 0.25
    frac = L.value_loss(torch.where(jump, ret, v), old, ret, m)[1]["vf_clipfrac"].item()
    assert frac == (jump & ((ret - old).abs() > 0.2)).float().mean().item()


def test_value_loss_matches_loop_and_explained_variance():
    m = ragged_mask(seed=19)
    old, ret = rand(B, T, seed=20), rand(B, T, seed=21)
    v = old + rand(B, T, seed=22) * 0.5
    loss, met = L.value_loss(v, old, ret, m, clip_range=0.2)
    plain, _ = L.value_loss(v, old, ret, m, clip_range=None)
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
    perfect = L.value_loss(ret, ret, ret, m)[1]["explained_variance"]
    assert perfect.item() == pytest.approx(1.0)


def test_fully_masked_batch_gives_finite_zero_losses():
    m = torch.zeros(B, T)
    x = torch.full((B, T), float("nan"), dtype=torch.float64)
    for mode in L.AGG_MODES:
        loss, met = L.policy_loss(x, x, x, m, agg=mode, norm=T)
        assert loss.item() == 0.0 and all(torch.isfinite(v) for v in met.values())
        loss, met = L.value_loss(x, x, x, m, agg=mode, norm=T)
        assert loss.item() == 0.0 and all(torch.isfinite(v) for v in met.values())


def test_loss_gradients_pass_gradcheck():
    m = ragged_mask(seed=23)
    old, adv, ret = rand(B, T, seed=24), rand(B, T, seed=25), rand(B, T, seed=26)
    # keep ρ away from the clip edges where the surrogate has kinks
    lp = (old + 0.05 * rand(B, T, seed=27)).requires_grad_()
    for mode in L.AGG_MODES:
        assert torch.autograd.gradcheck(
            lambda x, mode=mode: L.policy_loss(x, old, adv, m, agg=mode, norm=T)[0], (lp,)
        )
    v = (ret + 0.01 * rand(B, T, seed=28)).requires_grad_()
    v_old = ret + 0.3 * rand(B, T, seed=35)  # some tokens clipped, some not
    assert torch.autograd.gradcheck(lambda x: L.value_loss(x, v_old, ret, m)[0], (v,))
    c, r = rand(5, seed=29).requires_grad_(), rand(5, seed=30).requires_grad_()
    assert torch.autograd.gradcheck(lambda a, b: L.pairwise_reward_loss(a, b, 0.5), (c, r))
    rc, rr = rand(5, seed=33), rand(5, seed=34)
    for lt in ("sigmoid", "ipo"):
        assert torch.autograd.gradcheck(
            lambda a, b, lt=lt: L.dpo_loss(a, b, rc, rr, 0.3, lt)[0].sum(), (c, r)
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
        losses, cr, rj = L.dpo_loss(
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
        L.dpo_loss(pc, pr, rc, rr, loss_type="hinge2")


def test_pairwise_reward_loss_matches_formula():
    c, r = rand(6, seed=50), rand(6, seed=51)
    margin = torch.linspace(0, 1, 6, dtype=torch.float64)
    expect = (
        sum(-math.log(1 / (1 + math.exp(-(c[i] - r[i] - margin[i]).item()))) for i in range(6)) / 6
    )
    assert L.pairwise_reward_loss(c, r, margin).item() == pytest.approx(expect, rel=1e-12)
    assert L.pairwise_reward_loss(c, r).item() < L.pairwise_reward_loss(c, r, 1.0).item()
    # soft labels: y = 1 is the plain loss, y = 0 swaps the pair, y = 0.5 averages both
    ones, zeros = torch.ones(6, dtype=torch.float64), torch.zeros(6, dtype=torch.float64)
    assert torch.allclose(L.pairwise_reward_loss(c, r, labels=ones), L.pairwise_reward_loss(c, r))
    assert torch.allclose(L.pairwise_reward_loss(c, r, labels=zeros), L.pairwise_reward_loss(r, c))
    half = L.pairwise_reward_loss(c, r, labels=ones * 0.5)
    assert torch.allclose(half, 0.5 * (L.pairwise_reward_loss(c, r) + L.pairwise_reward_loss(r, c)))
