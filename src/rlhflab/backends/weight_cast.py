"""16-bit copies of a trained model's fp32 weights, kept between forwards (``model.cast_cache``).

Why: under ``torch.autocast`` (``model.compute_dtype`` bf16/fp16) every Linear layer casts
its fp32 weight to 16 bits in every forward; autocast's own cache lasts one autocast
context, so PPO casts each trained weight again for sampling, for the critic's values,
for every epoch's forward and for the opener probe, although the weights change only at an
optimiser step. On SmolLM2-135M (an AMX Xeon, bf16, the PPO work of
``benchmarks/bf16_speedup.py``) those casts were ~0.5 s of a profiled iteration, the tied
49152 × 576 output embedding 38-61 ms a cast; keeping them took the iteration from 4.75 to
4.62 s in an A/B (docs/real-models.md, "Precision"). Here each fp32 weight's 16-bit copy
is made once and reused until the weight changes: its ``_version`` (bumped by in-place
updates such as ``load_state_dict``'s copy on a resume) or its storage differs from the
copy's, or the optimiser dropped the copy (:func:`forget`: torch's fused AdamW kernel
writes weights without bumping their versions).

The arithmetic is autocast's, bit for bit: the copy is ``weight.to(dtype)``, the same
rounding autocast applies, and the gradient flows back to the fp32 weight as autocast's
cast sends it (the 16-bit gradient converted to fp32). The price: the copies stay in
memory between forwards — half the trained fp32 weights' bytes, which autocast also holds
while a training forward's graph is alive, so the training phase's peak does not grow;
sampling's and scoring's do (``rlhflab memory`` counts them with the weights).

Every ``nn.Linear`` layer of a trained model whose weight is fp32 takes part, through an
instance-level ``forward`` (the class stays ``nn.Linear``, so quantisation, LoRA and the
lean MLP still recognise it; module hooks still run). That includes a LoRA policy's frozen
base, which the adapter-disabled reference shares: autocast's own cache keeps only the
casts of weights that train, so without a kept copy every forward — each of a sampling
pass's decoding steps — cast the whole frozen base again (SmolLM2-135M, LoRA r=8, bf16
compute: 5.50 → 4.02 s an iteration, peak +31 MiB; docs/real-models.md, "Precision"). Its
copies cost half the base's fp32 bytes between forwards, which the training forward's
graph holds anyway while it lives — except under activation checkpointing, where the
frozen weights keep no copies (``keep_weight_casts``'s ``frozen_too``). Whatever changes a
frozen weight in place must :func:`forget` its copy (peft's in-place merge would; rlhflab
merges adapters out of place, models/export.py).
Not under ``torch.distributed``: FSDP re-gathers unsharded weights into storage this cannot
track.
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F
from torch import nn

FLAG = "_rlhflab_keeps_casts"  # set on every Linear whose forward is cached_linear_forward
COPY = "_rlhflab_low_copy"  # on the weight: (its version, storage and dtype then, the copy)
FROZEN_TOO = "_rlhflab_keeps_frozen_casts"  # on the Linear: a frozen weight keeps one too


class _KeptCast(torch.autograd.Function):
    """``weight`` seen as its kept 16-bit copy ``low``; backward: the gradient in fp32, as
    autocast's own cast (``ToCopyBackward``) returns it."""

    @staticmethod
    def forward(ctx, weight, low):
        ctx.dtype = weight.dtype
        return low.view_as(low)

    @staticmethod
    def backward(ctx, grad):
        return grad.to(ctx.dtype), None


def autocast_dtype_of(x: torch.Tensor) -> torch.dtype | None:
    """The autocast dtype active for ``x``'s device, or None when autocast is off there."""
    kind = x.device.type
    return torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else None


def kept_copy(weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The 16-bit copy of fp32 ``weight``, remade only when the weight changed."""
    if torch.is_inference_mode_enabled():  # an inference tensor could never serve a backward
        return weight.detach().to(dtype)
    stamp = (weight._version, weight.data_ptr(), dtype)
    entry = getattr(weight, COPY, None)
    if entry is None or entry[0] != stamp:
        with torch.no_grad():
            low = weight.detach().to(dtype)
        setattr(weight, COPY, (stamp, low))  # dies with the weight
    else:
        low = entry[1]
    if torch.is_grad_enabled() and weight.requires_grad:
        return _KeptCast.apply(weight, low)
    return low


def forget(weights) -> None:
    """Drop the kept copies of ``weights``: for writers that change a weight in place
    without bumping its version counter (``torch._fused_adamw_``, backends/optim.py)."""
    for w in weights:
        if COPY in w.__dict__:
            delattr(w, COPY)


def low_weight(layer: nn.Module, x: torch.Tensor) -> torch.Tensor | None:
    """The kept copy of ``layer.weight`` for a product with ``x`` under autocast, or None
    where autocast would not cast it (autocast off, a 16-bit weight, no keeping)."""
    if not getattr(layer, FLAG, False) or not _keeps(layer, layer.weight):
        return None
    dtype = autocast_dtype_of(x)
    return None if dtype is None else kept_copy(layer.weight, dtype)


def cached_linear_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """nn.Linear's forward with the weight's kept 16-bit copy under autocast (autocast
    casts ``x`` and the bias as it would)."""
    low = low_weight(self, x)
    return F.linear(x, self.weight if low is None else low, self.bias)


def kept_weights(model: nn.Module) -> list[torch.Tensor]:
    """The weights of ``model`` that keep a copy under a 16-bit compute dtype (each once:
    a tied weight is one tensor)."""
    seen: dict[int, torch.Tensor] = {}
    for module in model.modules():
        w = getattr(module, "weight", None)
        if getattr(module, FLAG, False) and _keeps(module, w):
            seen.setdefault(id(w), w)
    return list(seen.values())


def make_copies(model: nn.Module, dtype: torch.dtype) -> int:
    """Make every kept copy of ``model`` now (``rlhflab memory`` measures the phases
    after them); returns their bytes."""
    with torch.no_grad():
        return sum(kept_copy(w, dtype).nbytes for w in kept_weights(model))


def _keeps(layer: nn.Module, weight) -> bool:
    # a frozen fp32 weight inside a trained model (a LoRA base) is what autocast casts most
    # often, as its cache keeps only the casts of weights that train (every sampling step
    # cast the whole base again); kept unless the layer was told otherwise (FROZEN_TOO)
    if weight is None or weight.dtype != torch.float32:
        return False
    return weight.requires_grad or getattr(layer, FROZEN_TOO, True)


def keep_weight_casts(model: nn.Module, frozen_too: bool = True) -> int:
    """Give every plain ``nn.Linear`` of ``model`` the kept-copy forward; returns how many.
    ``frozen_too``: frozen fp32 weights (a LoRA base) keep copies as well — not with
    activation checkpointing, whose training forward holds no casts for its backward, so
    there the copies would add half the base's fp32 bytes to the training phase's peak.
    A no-op under ``torch.distributed`` (see the module docstring)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return 0
    n = 0
    for module in model.modules():
        if type(module) is nn.Linear and not getattr(module, FLAG, False):
            module.forward = types.MethodType(cached_linear_forward, module)
            setattr(module, FLAG, True)
            setattr(module, FROZEN_TOO, frozen_too)
            n += 1
    return n
