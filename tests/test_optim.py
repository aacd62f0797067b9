"""rlhflab's FusedAdamW and LambdaSchedule against torch.optim's AdamW and LambdaLR."""

import copy
import math

import pytest
import torch

from rlhflab.backends.optim import FusedAdamW, LambdaSchedule, UpdateInBackward
from rlhflab.trainers.common import lr_factor


def _params(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(*s, generator=g)) for s in ((5, 3), (7,), (2, 2))]


def _groups(ps):
    return [
        {"params": ps[:2], "lr": 3e-3, "weight_decay": 0.1},
        {"params": ps[2:], "lr": 1e-2, "weight_decay": 0.0},
    ]


def _train(opt, sched, ps, steps, seed=1):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        loss = sum((p * torch.randn(p.shape, generator=g)).sum() ** 2 for p in ps)
        loss.backward()
        ps[1].grad = None if _ % 3 == 2 else ps[1].grad  # a parameter without a gradient
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)


def test_updates_and_learning_rates_are_bitwise_torchs():
    factor = lambda s: lr_factor(s, 2, 6, "cosine")  # noqa: E731
    ours, theirs = _params(), _params()
    opt = FusedAdamW(_groups(ours), eps=1e-5)
    ref = torch.optim.AdamW(_groups(theirs), eps=1e-5, fused=True)
    s1, s2 = LambdaSchedule(opt, factor), torch.optim.lr_scheduler.LambdaLR(ref, factor)
    _train(opt, s1, ours, 6)
    _train(ref, s2, theirs, 6)
    for a, b in zip(ours, theirs):
        assert torch.equal(a, b)
    assert s1.get_last_lr() == s2.get_last_lr()
    assert [g["lr"] for g in opt.param_groups] == [g["lr"] for g in ref.param_groups]


def test_state_dicts_cross_load_and_resume_identically():
    factor = lambda s: lr_factor(s, 1, 8, "linear")  # noqa: E731
    ps = _params()
    opt = FusedAdamW(_groups(ps), eps=1e-5)
    sched = LambdaSchedule(opt, factor)
    _train(opt, sched, ps, 3)
    # torch's AdamW (and LambdaLR) continue from our state exactly as we do
    cont = [torch.nn.Parameter(p.detach().clone()) for p in ps]
    ref = torch.optim.AdamW(_groups(cont), eps=1e-5, fused=True)
    ref_sched = torch.optim.lr_scheduler.LambdaLR(ref, factor)  # made first, as trainers do
    ref.load_state_dict(copy.deepcopy(opt.state_dict()))  # as torch.save/torch.load would
    ref_sched.load_state_dict({**ref_sched.state_dict(), **sched.state_dict()})
    # and ours loads torch's state dict back
    again = [torch.nn.Parameter(p.detach().clone()) for p in ps]
    back = FusedAdamW(_groups(again), eps=1e-5)
    back_sched = LambdaSchedule(back, factor)
    back.load_state_dict(copy.deepcopy(ref.state_dict()))
    back_sched.load_state_dict(ref_sched.state_dict())
    for o, s, p in ((opt, sched, ps), (ref, ref_sched, cont), (back, back_sched, again)):
        _train(o, s, p, 3, seed=5)
    for a, b, c in zip(ps, cont, again):
        assert torch.equal(a, b) and torch.equal(a, c)


def test_loaded_moments_are_taken_as_they_are_when_device_and_dtype_match():
    ps = _params()
    opt = FusedAdamW(_groups(ps))
    _train(opt, LambdaSchedule(opt, lambda s: 1.0), ps, 2)
    loaded = copy.deepcopy(opt.state_dict())  # as torch.load hands it over
    again = [torch.nn.Parameter(p.detach().clone()) for p in ps]
    back = FusedAdamW(_groups(again))
    back.load_state_dict(loaded)
    for i, p in enumerate(again):  # resuming holds the moments once
        for key in ("exp_avg", "exp_avg_sq"):
            assert back.state[p][key].data_ptr() == loaded["state"][i][key].data_ptr()
    wider = copy.deepcopy(opt.state_dict())
    for st in wider["state"].values():
        st["exp_avg"] = st["exp_avg"].double()
    back.load_state_dict(wider)  # another dtype is converted to the parameter's
    assert all(back.state[p]["exp_avg"].dtype == torch.float32 for p in again)
    assert torch.equal(back.state[again[0]]["exp_avg"], opt.state[ps[0]]["exp_avg"])


def test_unsupported_parameters_are_refused():
    with pytest.raises(ValueError, match="floating"):
        FusedAdamW([torch.zeros(3, dtype=torch.long)])
    p = torch.nn.Parameter(torch.zeros(3))
    with pytest.raises(ValueError, match="two groups"):
        FusedAdamW([{"params": [p]}, {"params": [p]}])
    opt = FusedAdamW([p])
    with pytest.raises(ValueError, match="groups do not match"):
        opt.load_state_dict({"state": {}, "param_groups": [{"params": [0, 1]}]})


@pytest.mark.parametrize("defer_below", [0, 10, 1 << 16])
def test_update_in_backward_matches_step_after_backward(monkeypatch, defer_below):
    """Stepping each tensor from its post-accumulate hook — or, under DEFER_BELOW elements,
    all of them together in flush() — gives bit-identical weights and moments to
    backward-then-step(). 0: every tensor in its hook (no two gradients alive at once); 10:
    the (5, 3) tensor in its hook, the (7,) and (2, 2) ones deferred; 65,536: all deferred."""
    monkeypatch.setattr(UpdateInBackward, "DEFER_BELOW", defer_below)
    a, b = _params(), _params()
    opt_a, opt_b = FusedAdamW(_groups(a), eps=1e-5), FusedAdamW(_groups(b), eps=1e-5)
    alive = []
    for p in b:  # registered first, so it runs just before the update: gradients alive now
        p.register_post_accumulate_grad_hook(
            lambda _p: alive.append(sum(q.grad is not None for q in b))
        )
    with UpdateInBackward([opt_b]) as upd:
        for step in range(4):
            g = torch.Generator().manual_seed(step)
            xs = [torch.randn(p.shape, generator=g) for p in a]
            sum(((p * x).sum() ** 2 for p, x in zip(a, xs))).backward()
            opt_a.step()
            opt_a.zero_grad()
            sum(((p * x).sum() ** 2 for p, x in zip(b, xs))).backward()
            # updated in the hook: gradient gone; deferred: waiting for flush()
            assert [p.grad is None for p in b] == [p.numel() >= defer_below for p in b]
            upd.flush()
            assert all(p.grad is None for p in b)
            assert not bool(upd.found_inf)
            assert len(upd.grad_norms()) == 1 and upd.grad_norms()[0] > 0
            upd.reset()
    if defer_below == 0:
        assert alive and max(alive) == 1
    for p, q in zip(a, b):
        assert torch.equal(p, q)
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(opt_a.state[p][key], opt_b.state[q][key])


@pytest.mark.parametrize("defer_below", [0, 1 << 16])
@pytest.mark.parametrize("bad", [[math.nan], [math.inf], [-math.inf], [math.inf, -math.inf]])
def test_update_in_backward_leaves_a_tensor_with_a_non_finite_gradient_alone(
    monkeypatch, bad, defer_below
):
    monkeypatch.setattr(UpdateInBackward, "DEFER_BELOW", defer_below)
    ps = _params()
    opt = FusedAdamW(_groups(ps))
    before = [p.detach().clone() for p in ps]
    w = torch.ones_like(ps[0]).flatten()  # finite but for a few elements
    w[: len(bad)] = torch.tensor(bad)
    with UpdateInBackward([opt]) as upd:
        ((ps[0] * w.view_as(ps[0])).sum() + ps[1].sum() + ps[2].sum()).backward()
        upd.flush()
    assert bool(upd.found_inf)
    assert torch.equal(ps[0], before[0])
    assert opt.state[ps[0]]["step"].item() == 0 and not opt.state[ps[0]]["exp_avg"].any()
    assert not torch.equal(ps[1], before[1]) and opt.state[ps[1]]["step"].item() == 1
    assert all(p.grad is None for p in ps)
    # leaving the context removes the hooks: a plain backward keeps its gradient
    ps[1].sum().backward()
    assert ps[1].grad is not None


def test_deferred_updates_refuse_a_second_backward_and_drop_unflushed_gradients():
    ps = _params()
    opt = FusedAdamW(_groups(ps))
    before = [p.detach().clone() for p in ps]
    with UpdateInBackward([opt]) as upd:
        sum(p.sum() for p in ps).backward()
        with pytest.raises(RuntimeError, match="two backward passes"):
            sum(p.sum() for p in ps).backward()
        upd.reset()  # an interrupted update: nothing stepped, no gradient left behind
        assert all(p.grad is None for p in ps)
        assert all(torch.equal(p, b) for p, b in zip(ps, before))
        sum(p.sum() for p in ps).backward()
    assert all(p.grad is None for p in ps)  # leaving the context drops them too
    assert all(torch.equal(p, b) for p, b in zip(ps, before))


def test_step_params_matches_step_across_groups_and_dtypes():
    def make():
        ps = [torch.nn.Parameter(torch.randn(4, 3, dtype=dt)) for dt in (torch.float32,) * 2]
        ps.append(torch.nn.Parameter(torch.randn(5, dtype=torch.float64)))
        for p in ps:
            p.grad = torch.full_like(p, 0.5)
        return ps, FusedAdamW([{"params": ps[:1]}, {"params": ps[1:], "lr": 0.1}])

    torch.manual_seed(0)
    a, opt_a = make()
    torch.manual_seed(0)
    b, opt_b = make()
    opt_a.step()
    opt_b.step_params(b)
    for p, q in zip(a, b):
        assert torch.equal(p, q) and p.dtype == q.dtype


def test_update_in_backward_needs_fused_adamw():
    ps = _params()
    with pytest.raises(TypeError, match="FusedAdamW"):
        with UpdateInBackward([torch.optim.SGD(ps, lr=0.1)]):
            pass
