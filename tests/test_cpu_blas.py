"""model.cpu_matmul=numpy: Linear products on numpy's BLAS, the same maths as torch's."""

import copy
import sys

import pytest
import torch
from torch import nn

from rlhflab.backends import cpu_blas, lean
from rlhflab.config import ConfigError
from rlhflab.infra.runlog import read_jsonl
from rlhflab.trainers.ppo import PPOTrainer
from tests.test_ppo import VOLATILE, make_cfg


@pytest.fixture
def numpy_calls(monkeypatch):
    """Counts the products that went to numpy; every size takes the numpy path."""
    calls = []
    real = cpu_blas.numpy_mm

    def counted(a, b):
        calls.append((tuple(a.shape), tuple(b.shape)))
        return real(a, b)

    monkeypatch.setattr(cpu_blas, "numpy_mm", counted)
    monkeypatch.setattr(cpu_blas, "MIN_ROWS", 1)
    return calls


@pytest.mark.parametrize("bias", [True, False])
def test_numpy_linear_matches_torch_in_float64(numpy_calls, bias):
    torch.manual_seed(0)
    plain = nn.Linear(6, 5, bias=bias).double()
    fast = copy.deepcopy(plain)
    assert cpu_blas.use_numpy_blas(fast) == 1
    x = torch.randn(2, 3, 6, dtype=torch.float64, requires_grad=True)
    g = torch.randn(2, 3, 5, dtype=torch.float64)
    out, want = fast(x), plain(x)
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
    got = torch.autograd.grad((out * g).sum(), (x, *fast.parameters()))
    exp = torch.autograd.grad((want * g).sum(), (x, *plain.parameters()))
    for a, b in zip(got, exp):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    # forward x·Wᵀ, then g·W and gᵀ·x: the three products of a Linear, none recomputed
    assert numpy_calls == [((6, 6), (6, 5)), ((6, 5), (5, 6)), ((5, 6), (6, 6))]


def test_products_leave_the_operands_storage_resizable():
    # FSDP2 frees a gathered weight by resizing its storage to zero after each forward;
    # tensor.numpy() would have made that storage fixed-size for good
    x, w = torch.randn(70, 6, dtype=torch.float64), torch.randn(5, 6, dtype=torch.float64)
    out = cpu_blas.numpy_mm(x[3:], w.t())  # an offset view and a transposed one
    torch.testing.assert_close(out, x[3:] @ w.t())
    for t in (x, w, out):
        t.untyped_storage().resize_(0)


def test_few_rows_stay_on_torch(monkeypatch):
    monkeypatch.setattr(cpu_blas, "numpy_mm", lambda *a: pytest.fail("numpy path taken"))
    layer = nn.Linear(8, 4)
    want = layer(torch.ones(3, 8))
    cpu_blas.use_numpy_blas(layer)
    x = torch.ones(cpu_blas.MIN_ROWS - 1, 8)
    assert torch.equal(layer(x), nn.functional.linear(x, layer.weight, layer.bias))
    assert torch.equal(layer(torch.ones(3, 8)), want)


def test_lean_swiglu_with_a_numpy_down_projection_in_float64(numpy_calls):
    torch.manual_seed(2)
    x = torch.randn(2, 4, 6, dtype=torch.float64, requires_grad=True)
    gate, up, down = (nn.Linear(*s).double() for s in ((6, 10), (6, 10), (10, 6)))
    fast = [copy.deepcopy(m) for m in (gate, up, down)]
    for m in fast:
        cpu_blas.use_numpy_blas(m)
    out = lean.swiglu_mlp(x, *fast)
    want = down(nn.functional.silu(gate(x)) * up(x))
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
    params = [p for m in fast for p in m.parameters()]
    ref_params = [p for m in (gate, up, down) for p in m.parameters()]
    got = torch.autograd.grad(out.sin().sum(), (x, *params))
    exp = torch.autograd.grad(want.sin().sum(), (x, *ref_params))
    for a, b in zip(got, exp):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    # three products per projection; the fused down projection's forward p·Wᵀ and its
    # weight gradient gᵀ·p (p recomputed, never stored) among them
    assert len(numpy_calls) == 9
    assert ((8, 10), (10, 6)) in numpy_calls and ((6, 8), (8, 10)) in numpy_calls


def test_only_plain_float_linears_are_switched():
    model = nn.Sequential(nn.Linear(4, 4), type("Sub", (nn.Linear,), {})(4, 4), nn.Linear(4, 2))
    quantised = torch.ao.quantization.quantize_dynamic(copy.deepcopy(model), {nn.Linear})
    keys = list(model.state_dict())
    assert cpu_blas.use_numpy_blas(model) == 2
    assert [type(m).__name__ for m in model] == ["NumpyBlasLinear", "Sub", "NumpyBlasLinear"]
    assert list(model.state_dict()) == keys  # checkpoints load either way
    assert cpu_blas.use_numpy_blas(quantised) == 0  # int8 layers and subclasses stay


def test_the_switch_is_refused_off_the_cpu(tmp_path):
    layer = nn.Linear(2, 2)
    assert cpu_blas.apply_cpu_matmul("torch", "cuda", [layer]) == 0
    with pytest.raises(ConfigError, match=r"model\.cpu_matmul.*device is cuda"):
        cpu_blas.apply_cpu_matmul("numpy", torch.device("cuda"), [layer])
    assert type(layer) is nn.Linear
    with pytest.raises(ConfigError, match=r"model\.cpu_matmul"):
        make_cfg(tmp_path, "model.cpu_matmul=mkl")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/maps")
def test_numpy_blas_threads_follow_torch():
    assert cpu_blas.set_numpy_blas_threads(1)


def test_ppo_with_numpy_matmul_is_the_same_run(tmp_path, numpy_calls):
    rows = []
    for choice in ("torch", "numpy"):
        t = PPOTrainer(
            make_cfg(
                tmp_path,
                f"log.output_dir={tmp_path / choice}",
                "ppo.iterations=2",
                f"model.cpu_matmul={choice}",
            )
        )
        switched = [type(m) for m in t.cast.policy.modules() if isinstance(m, nn.Linear)]
        assert (cpu_blas.NumpyBlasLinear in switched) == (choice == "numpy")
        t.fit()
        if choice == "numpy":  # sampling, scoring and the update all multiplied there
            assert t.first_minibatch["policy/ratio_mean"] == pytest.approx(1.0, abs=1e-5)
            assert numpy_calls
        metrics = read_jsonl(tmp_path / choice / "metrics.jsonl")
        rows.append([{k: v for k, v in r.items() if not k.startswith(VOLATILE)} for r in metrics])
    for a, b in zip(*rows):
        for key in ("objective/kl", "objective/scores", "policy/entropy", "val/loss"):
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), key
