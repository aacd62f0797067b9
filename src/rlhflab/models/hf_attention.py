"""``model.cpu_attention_fp32`` for the transformers runtime.

torch 2.13's CPU attention kernels are several times slower in bf16 than in fp32 (the
backward 5.9 against 1.5 ms a call at SmolLM2-135M's (8, 9, 68, 64) on an AMX Xeon:
docs/real-models.md, "Precision"), while attention's own products are a small share of a
layer's work. The native runtime's attention therefore runs in fp32 on a CPU when its
projections come out in 16 bits (``backends/native.NativeAttention``). A transformers model
gets the same through transformers' attention-function registry (its
``AttentionInterface``): the function registered here under :data:`NAME` is transformers'
own SDPA function with q, k and v (and a float mask or position bias) in fp32 and autocast
off around it — CPU autocast lists SDPA among the operations it lowers to 16 bits — and the
output cast back to the values' dtype, which is what the output projection expects (the
held dtype of a frozen 16-bit model; autocast's dtype under ``model.compute_dtype``). The
mask is the one transformers builds for SDPA. Everything else (rotary embedding, KV cache)
stays as the model computes it; under autocast transformers' Llama-family rotary already
yields fp32 queries and keys (16-bit q times fp32 cos), which autocast then lowered for SDPA.

Only models loaded with ``sdpa`` (transformers' default where a model supports it) are
switched, and only through ``set_attn_implementation``, the public way to change it; the name
is not written into a saved ``config.json`` (transformers keeps it out of the serialised
config). On a GPU, or with fp32 values, the function is transformers' SDPA unchanged.
"""

from __future__ import annotations

import torch
from torch import nn

NAME = "rlhflab_sdpa_fp32_on_cpu"
_HALF = (torch.bfloat16, torch.float16)
_REGISTERED = False


def _sdpa_fp32_on_cpu(module, query, key, value, attention_mask, *args, **kwargs):
    """transformers' ``sdpa_attention_forward`` (same arguments: q/k/v (B, heads, L, head_dim),
    mask (B, 1, L, T) or None), computed in fp32 when the values are 16-bit on a CPU; the
    output (B, L, heads, head_dim) in the values' dtype."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    narrow = value.dtype
    if value.device.type != "cpu" or narrow not in _HALF:
        return sdpa_attention_forward(module, query, key, value, attention_mask, *args, **kwargs)
    if attention_mask is not None and attention_mask.is_floating_point():
        attention_mask = attention_mask.float()  # an additive mask: fp32's minimum, not bf16's
    if kwargs.get("position_bias") is not None:
        kwargs["position_bias"] = kwargs["position_bias"].float()
    with torch.autocast("cpu", enabled=False):  # CPU autocast would lower SDPA's inputs again
        out, weights = sdpa_attention_forward(
            module, query.float(), key.float(), value.float(), attention_mask, *args, **kwargs
        )
    return out.to(narrow), weights


def _register() -> None:
    """Registers :data:`NAME` with transformers' attention and mask registries (once)."""
    global _REGISTERED
    if _REGISTERED:
        return
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(NAME, _sdpa_fp32_on_cpu)
    AttentionMaskInterface.register(NAME, sdpa_mask)
    _REGISTERED = True


def set_transformers_cpu_attention_fp32(on: bool, models) -> int:
    """``model.cpu_attention_fp32`` on every transformers model in ``models`` (and inside
    them: a critic's backbone): ``sdpa`` becomes :data:`NAME` when ``on``, and back when off.
    Models with another attention (eager, flash) or that cannot change it, None entries and
    non-transformers models are left as they are. Returns how many models were switched."""
    n = 0
    for model in models:
        for module in model.modules() if isinstance(model, nn.Module) else ():
            impl = getattr(getattr(module, "config", None), "_attn_implementation", None)
            can_set = getattr(module, "_can_set_attn_implementation", None)
            want = {"sdpa": NAME} if on else {NAME: "sdpa"}
            if impl not in want or can_set is None or not can_set():
                continue  # also a sub-model its parent switched already
            if on:
                _register()
            module.set_attn_implementation(want[impl])
            n += 1
    return n


__all__ = ["NAME", "set_transformers_cpu_attention_fp32"]
