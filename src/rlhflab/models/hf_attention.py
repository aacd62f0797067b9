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
config). A model whose own code tests the name (``_attn_implementation == "sdpa"``: Gemma 4
slices its queries otherwise) keeps ``sdpa``, as does a composite model with a sub-model on
another attention. On a GPU, or with fp32 values, the function calls transformers' SDPA
function as it is, so a switched model computes as before there.
"""

from __future__ import annotations

import inspect
import re
import sys

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
        attention_mask = attention_mask.float()  # SDPA wants a float mask in the queries' dtype
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


# model classes whose own code branches on the attention's name being "sdpa" (Gemma 4
# slices its queries for KV-shared layers unless it is): renamed, they compute otherwise
_NAME_TEST = re.compile(r"""_attn_implementation\s*[!=]=\s*["']sdpa["']""")
_READS_NAME: dict[type, bool] = {}


def _reads_the_name(cls: type) -> bool:
    if cls not in _READS_NAME:
        try:
            source = inspect.getsource(sys.modules[cls.__module__])
        except (KeyError, OSError, TypeError):
            source = None  # unknown code: treat it as reading the name
        _READS_NAME[cls] = source is None or bool(_NAME_TEST.search(source))
    return _READS_NAME[cls]


def _switchable(model: nn.Module, current: str) -> bool:
    """Whether every transformers model inside ``model`` (itself, a composite's towers)
    runs ``current`` attention, can change it, and has no code of its own that tests the
    name: ``set_attn_implementation`` passes the new name to every sub-model, and one
    without SDPA support (Gemma 4's audio tower) makes it raise half-way."""
    inner = [m for m in model.modules() if callable(getattr(m, "set_attn_implementation", None))]
    return all(
        getattr(m.config, "_attn_implementation", None) == current
        and m._can_set_attn_implementation()
        and not _reads_the_name(type(m))
        for m in inner
    )


def set_transformers_cpu_attention_fp32(on: bool, models) -> int:
    """``model.cpu_attention_fp32`` on every transformers model in ``models`` (and inside
    them: a critic's backbone): ``sdpa`` becomes :data:`NAME` when ``on``, and back when off.
    Left as they are: models with another attention (eager, flash), models that cannot
    change it or whose own code tests for the name ``sdpa`` (:func:`_switchable`), None
    entries and non-transformers models. Returns how many models were switched."""
    want = {"sdpa": NAME} if on else {NAME: "sdpa"}
    n = 0
    for model in models:
        decided: set[int] = set()  # the outermost transformers models decide for their insides
        for module in model.modules() if isinstance(model, nn.Module) else ():
            if id(module) in decided or not callable(
                getattr(module, "set_attn_implementation", None)
            ):
                continue
            decided.update(id(m) for m in module.modules())
            impl = getattr(module.config, "_attn_implementation", None)
            if impl not in want or not _switchable(module, impl):
                continue
            if on:
                _register()
            module.set_attn_implementation(want[impl])
            n += 1
    return n


__all__ = ["NAME", "set_transformers_cpu_attention_fp32"]
