"""rlhflab's FusedAdamW and LambdaSchedule against torch.optim's AdamW and LambdaLR."""

import copy

import pytest
import torch

from rlhflab.optim import FusedAdamW, LambdaSchedule
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


def test_unsupported_parameters_are_refused():
    with pytest.raises(ValueError, match="floating"):
        FusedAdamW([torch.zeros(3, dtype=torch.long)])
    p = torch.nn.Parameter(torch.zeros(3))
    with pytest.raises(ValueError, match="two groups"):
        FusedAdamW([{"params": [p]}, {"params": [p]}])
    opt = FusedAdamW([p])
    with pytest.raises(ValueError, match="groups do not match"):
        opt.load_state_dict({"state": {}, "param_groups": [{"params": [0, 1]}]})
