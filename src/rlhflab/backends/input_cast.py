"""One 16-bit copy of a layer's input for all the projections that read it (``model.cast_once``).

Under ``torch.autocast`` (``model.compute_dtype`` bf16/fp16) every Linear layer casts its
fp32 input to 16 bits itself; autocast caches the casts of weights, never of activations.
A Llama decoder layer feeds one normalised input to three projections (q, k, v) and another
to two (gate, up), so the same (tokens, hidden) tensor is cast five times a layer in every
forward: at 25M in bf16 (``benchmarks/bf16_speedup.py``'s work, an AMX Xeon) ~867 such casts
an iteration, ~0.28 s of a profiled 6.4 s (docs/real-models.md, "Precision"). Here the
input is cast once and each projection gets that copy through its own autograd node
(:class:`weight_cast._KeptCast`), whose backward returns that projection's 16-bit gradient
converted to fp32 — what autocast's per-call cast (``ToCopyBackward``) returns — so the
gradients are still summed in fp32, in the same order: forward and backward the same
arithmetic bit for bit, with the same cast (``x.to(dtype)``) done once instead of per call.

Plain ``nn.Linear`` projections only (a LoRA, int8 or numpy-BLAS layer handles its input
itself: handing it a 16-bit input could change its arithmetic), and only where autocast is
on and the input is fp32; everything else gets ``x`` as it is.
"""

from __future__ import annotations

import torch
from torch import nn

from rlhflab.backends.weight_cast import _KeptCast, autocast_dtype_of

_HALF = (torch.bfloat16, torch.float16)


def projection_inputs(x: torch.Tensor, projections, on: bool = True) -> list[torch.Tensor]:
    """What each of ``projections`` (Linear layers that all read ``x``) should be called
    with: ``x`` for every one, or — under a 16-bit autocast with ``on``, for fp32 ``x`` and
    plain ``nn.Linear`` layers — one 16-bit copy of ``x``, seen by each layer through its
    own autograd node when ``x`` needs a gradient."""
    n = len(projections)
    low_dtype = autocast_dtype_of(x) if on and x.dtype == torch.float32 else None
    if low_dtype not in _HALF or any(type(p) is not nn.Linear for p in projections):
        return [x] * n
    low = x.detach().to(low_dtype)
    if not (torch.is_grad_enabled() and x.requires_grad):
        return [low] * n
    return [_KeptCast.apply(x, low) for _ in range(n)]


def set_cast_once(on: bool, models) -> int:
    """``model.cast_once`` on every module of ``models`` that casts its projections' input
    (``cast_once`` attribute: the native runtime's attention, the lean SwiGLU MLP); None
    entries and non-modules are skipped. Returns how many were set."""
    n = 0
    for model in models:
        for module in model.modules() if isinstance(model, nn.Module) else ():
            if hasattr(type(module), "cast_once"):
                module.cast_once = bool(on)
                n += 1
    return n
