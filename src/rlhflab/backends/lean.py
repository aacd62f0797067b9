"""Leaner activations for the RMSNorm and SwiGLU MLP blocks of Llama-family models.

Training memory of a small or mid-sized model is mostly the activations autograd keeps for
backward. transformers' RMSNorm keeps its input *and* the normalised input; its SwiGLU MLP
keeps the gate projection, SiLU(gate), the up projection and their product (4 tensors of
the intermediate width per token). The two autograd functions here keep only what backward
cannot cheaply recompute:

- RMSNorm keeps its input and one reciprocal RMS per token (the normalised input is
  recomputed: one multiply);
- the MLP keeps the gate and up projections only; SiLU(gate)·up is recomputed in backward
  (a sigmoid and two multiplies) and, when ``down_proj`` is a plain Linear, fed straight
  into its weight gradient, so the product is never stored.

No matmul is recomputed, unlike activation checkpointing. For fp32, bf16 and fp16 the
forward does exactly transformers' operations in the same order (bit-identical outputs;
with or without grad the same values, so the first PPO ratio stays exactly 1); gradients
agree up to float rounding. In float64 (tests only) the norm is computed in float64 where
transformers rounds through float32. Without grad (sampling, scoring, frozen models) the
original expressions run unchanged. Under ``torch.autocast`` (``model.compute_dtype``) the
products run in the autocast dtype, forward and backward, as autograd's would, and the
weights' gradients come back in the weights' (fp32) dtype. The same idea is behind
fused-kernel libraries such as Liger
(arXiv:2410.10989), done here in plain PyTorch so it runs on every device.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from rlhflab.backends import cpu_blas, weight_cast
from rlhflab.backends.input_cast import projection_inputs

# transformers classes whose forward is exactly the Llama RMSNorm / SwiGLU MLP (checked
# against transformers 5.24); any other class is left alone rather than guessed at.
FAMILIES = ("Llama", "Mistral", "Qwen2", "Qwen3", "SmolLM3", "Native")  # Native: native.py
RMSNORM_CLASSES = frozenset(f"{f}RMSNorm" for f in FAMILIES)
MLP_CLASSES = frozenset(f"{f}MLP" for f in FAMILIES)
SILU_CLASSES = frozenset({"SiLU", "SiLUActivation"})  # torch's and transformers' (F.silu both)


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for fp32/bf16/fp16 (transformers' choice); float64 stays float64, so the
    float64 tests compare against exact arithmetic instead of a float32 round trip."""
    return torch.promote_types(dtype, torch.float32)


class _RMSNormFn(torch.autograd.Function):
    """y = w · (x · rstd), rstd = 1/sqrt(mean(x², -1) + eps), in at least float32."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        xc = x.to(_compute_dtype(x.dtype))
        rstd = torch.rsqrt(xc.pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, weight, rstd)
        return weight * (xc * rstd).to(x.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight, rstd = ctx.saved_tensors
        xhat = x.to(rstd.dtype) * rstd
        gc = grad.to(rstd.dtype)
        grad_w = None
        if ctx.needs_input_grad[1]:
            grad_w = (gc * xhat).reshape(-1, xhat.shape[-1]).sum(0).to(weight.dtype)
        grad_x = None
        if ctx.needs_input_grad[0]:
            gw = gc * weight.to(rstd.dtype)
            grad_x = (rstd * (gw - xhat * (gw * xhat).mean(-1, keepdim=True))).to(x.dtype)
        return grad_x, grad_w, None


def _swiglu_backward(grad_p, gate, up, want_p: bool = False):
    """Gradients of p = SiLU(gate)·up with respect to gate and up (and p itself when asked),
    written in place where possible so backward holds few intermediate-width temporaries."""
    sig = torch.sigmoid(gate)
    silu = gate * sig
    p = silu * up if want_p else None
    # d SiLU(g)/dg = σ(g)·(1 + g·(1 − σ(g))) = σ(g)·(1 − SiLU(g)) + SiLU(g): with addcmul
    # that is 7 passes over intermediate-width tensors for both gradients instead of 10
    grad_gate = torch.sub(1, silu)
    torch.addcmul(silu, sig, grad_gate, out=grad_gate).mul_(up).mul_(grad_p)
    grad_up = silu.mul_(grad_p)  # silu is not needed again
    return grad_gate, grad_up, p


class _SwiGLUFn(torch.autograd.Function):
    """p = SiLU(gate)·up, keeping gate and up only (used when down_proj is not a plain
    Linear, e.g. a LoRA or quantised layer, which then keeps p itself)."""

    @staticmethod
    def forward(ctx, gate, up):
        ctx.save_for_backward(gate, up)
        return F.silu(gate) * up

    @staticmethod
    def backward(ctx, grad):
        grad_gate, grad_up, _ = _swiglu_backward(grad, *ctx.saved_tensors)
        return grad_gate, grad_up


class _SwiGLUDownFn(torch.autograd.Function):
    """out = Linear(SiLU(gate)·up; W, b), keeping gate and up only: p is recomputed in
    backward for W's gradient. The same matmuls as autograd's, none recomputed; with
    ``numpy_blas`` (a ``cpu_blas.NumpyBlasLinear`` down projection) they run where its
    forward would run them."""

    @staticmethod
    def forward(ctx, gate, up, weight, bias, numpy_blas: bool = False, low=None):
        # low: the weight's kept 16-bit copy under autocast (backends/weight_cast.py), or None
        ctx.save_for_backward(gate, up, weight, low)
        ctx.has_bias = bias is not None
        p = F.silu(gate) * up
        ctx.numpy_blas = numpy_blas and cpu_blas.takes_numpy_path(p, weight)
        if ctx.numpy_blas:
            return cpu_blas.numpy_linear(p, weight, bias)
        return F.linear(p, weight if low is None else low, bias)

    @staticmethod
    def backward(ctx, grad):
        gate, up, weight, low = ctx.saved_tensors
        mm = cpu_blas.numpy_mm if ctx.numpy_blas else torch.mm
        # under torch.autocast (model.compute_dtype) the forward's product ran in the
        # autocast dtype, which is the output's and so grad's: backward's products do too,
        # as autograd's would, and the weight's gradients come back in the weight's dtype
        if low is not None and low.dtype == grad.dtype:
            w = low
        else:
            w = weight if weight.dtype == grad.dtype else weight.to(grad.dtype)
        flat_grad = grad.reshape(-1, grad.shape[-1])
        grad_p = mm(flat_grad, w).view(*grad.shape[:-1], weight.shape[1])
        need_w = ctx.needs_input_grad[2]
        grad_gate, grad_up, p = _swiglu_backward(grad_p, gate, up, want_p=need_w)
        del grad_p
        grad_w = grad_b = None
        if need_w:
            grad_w = mm(flat_grad.t(), p.reshape(-1, p.shape[-1])).to(weight.dtype)
        if ctx.has_bias and ctx.needs_input_grad[3]:
            grad_b = flat_grad.sum(0).to(weight.dtype)
        return grad_gate, grad_up, grad_w, grad_b, None, None


def rms_norm_plain(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' Llama RMSNorm expression (float32 for 16-bit x), for forwards without
    grad and for the native runtime's own norm: autograd keeps what it keeps."""
    xc = x.to(_compute_dtype(x.dtype))
    xc = xc * torch.rsqrt(xc.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xc.to(x.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama RMSNorm of x (..., H) with weight (H,), keeping only x and rstd (..., 1)."""
    return _RMSNormFn.apply(x, weight, eps)


def swiglu_mlp(x: torch.Tensor, gate_proj, up_proj, down_proj, cast_once=True) -> torch.Tensor:
    """down_proj(SiLU(gate_proj(x)) · up_proj(x)) for x (..., H), keeping gate and up;
    ``cast_once``: see :func:`input_cast.projection_inputs`."""
    xg, xu = projection_inputs(x, (gate_proj, up_proj), cast_once)
    gate, up = gate_proj(xg), up_proj(xu)
    if type(down_proj) in (nn.Linear, cpu_blas.NumpyBlasLinear):
        numpy_blas = type(down_proj) is cpu_blas.NumpyBlasLinear
        with torch.no_grad():  # the copy itself; its gradient is the Function's grad_w
            low = weight_cast.low_weight(down_proj, gate)
        weight = down_proj.weight
        return _SwiGLUDownFn.apply(gate, up, weight, down_proj.bias, numpy_blas, low)
    return down_proj(_SwiGLUFn.apply(gate, up))


class LeanRMSNorm(nn.Module):
    """Drop-in for a Llama-family RMSNorm: same ``weight`` parameter (same state-dict key)."""

    def __init__(self, weight: nn.Parameter, eps: float):
        super().__init__()
        self.weight = weight
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad):
            return rms_norm(x, self.weight, self.variance_epsilon)
        return rms_norm_plain(x, self.weight, self.variance_epsilon)


class LeanSwiGLU(nn.Module):
    """Drop-in for a Llama-family MLP: the same three projections under the same names, so
    state-dict keys, LoRA target names and saved checkpoints do not change."""

    cast_once = True  # model.cast_once: backends/input_cast.py

    def __init__(self, gate_proj: nn.Module, up_proj: nn.Module, down_proj: nn.Module):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = gate_proj, up_proj, down_proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled():
            return swiglu_mlp(x, self.gate_proj, self.up_proj, self.down_proj, self.cast_once)
        xg, xu = projection_inputs(x, (self.gate_proj, self.up_proj), self.cast_once)
        return self.down_proj(F.silu(self.gate_proj(xg)) * self.up_proj(xu))


def make_activations_lean(model: nn.Module) -> int:
    """Swap every Llama-family RMSNorm and SiLU MLP of ``model`` for its lean twin, in
    place (the parameters are the same objects). Returns how many modules were swapped;
    0 for other architectures, which are left exactly as they were."""
    swaps = []
    for name, module in model.named_modules():
        cls = type(module).__name__
        if cls in RMSNORM_CLASSES and hasattr(module, "variance_epsilon"):
            swaps.append((name, LeanRMSNorm(module.weight, module.variance_epsilon)))
        elif cls in MLP_CLASSES and type(getattr(module, "act_fn", None)).__name__ in SILU_CLASSES:
            swaps.append((name, LeanSwiGLU(module.gate_proj, module.up_proj, module.down_proj)))
    for name, lean in swaps:
        parent_name, _, child = name.rpartition(".")
        model.get_submodule(parent_name).register_module(child, lean)
    return len(swaps)
