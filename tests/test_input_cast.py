"""model.cast_once: a decoder layer casts its normalised input to 16 bits once for all the
projections that read it (backends/input_cast.py) — autocast's arithmetic bit for bit,
forward and backward, with fewer casts."""

import pytest
import torch
from torch import nn

from rlhflab import models as M
from rlhflab.backends.input_cast import projection_inputs
from tests.model_helpers import batch, loaded
from tests.test_weight_cast import logits_and_grads


def nano(runtime, *overrides):
    torch.manual_seed(0)
    return loaded("preset:nano", runtime, "model.compute_dtype=bf16", *overrides, eval_mode=False)


def casts_of_activations(fn) -> int:
    """How many fp32 → bf16 casts of a tensor that is not a weight ``fn`` runs."""
    with torch.profiler.profile(record_shapes=True) as prof:
        fn()
    return sum(
        e.count
        for e in prof.key_averages(group_by_input_shape=True)
        if e.key == "aten::_to_copy" and e.input_shapes and len(e.input_shapes[0]) == 3
    )


@pytest.mark.parametrize(
    "runtime, extra",
    [("native", ()), ("transformers", ()), ("native", ("model.gradient_checkpointing=true",))],
)
def test_one_cast_per_input_gives_autocast_s_logits_and_gradients_bit_for_bit(runtime, extra):
    on, off = nano(runtime, *extra), nano(runtime, "model.cast_once=false", *extra)
    (lo, go), (lf, gf) = logits_and_grads(on), logits_and_grads(off)
    assert lo.dtype == torch.bfloat16 and torch.equal(lo, lf)
    assert all(a.dtype == torch.float32 and torch.equal(a, b) for a, b in zip(go, gf))
    ids, mask = batch()
    with torch.no_grad(), M.compute_autocast("cpu", "bf16"):
        assert torch.equal(M.causal_forward(on, ids, mask).logits, lf)  # no grad: one copy
    # fewer casts: per layer 3 → 1 (native attention) and 2 → 1 (the lean MLP); with
    # activation checkpointing the backward's recomputed forward casts again
    layers = len(on.model.layers)
    fewer = (3 * layers if runtime == "native" else layers) * (2 if extra else 1)
    assert (
        casts_of_activations(lambda: logits_and_grads(off))
        - casts_of_activations(lambda: logits_and_grads(on))
        == fewer
    )


def test_only_plain_linear_layers_under_a_16_bit_autocast_share_a_copy():
    x = torch.randn(2, 3, 8, requires_grad=True)
    plain, other = nn.Linear(8, 4), nn.Identity()
    assert all(t is x for t in projection_inputs(x, (plain, plain)))  # autocast off
    with torch.autocast("cpu", dtype=torch.bfloat16):
        a, b = projection_inputs(x, (plain, plain))
        assert a.dtype == torch.bfloat16 and torch.equal(a, x.to(torch.bfloat16))
        assert a.grad_fn is not b.grad_fn  # each its own node: gradients summed in fp32
        assert all(t is x for t in projection_inputs(x, (plain, other)))
        assert all(t is x for t in projection_inputs(x, (plain, plain), on=False))
        (a.float().sum() + 2 * b.float().sum()).backward()
    assert x.grad.dtype == torch.float32 and torch.equal(x.grad, torch.full_like(x, 3.0))
