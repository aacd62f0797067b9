"""``model.compute_dtype``: the arithmetic of the trained models' forward and backward passes.

Trained weights stay fp32 master weights (:func:`rlhflab.models.require_fp32_trainable`), and
so do their gradients and AdamW moments. With ``bf16`` every forward of a trained model (and
of an fp32 reference) runs under ``torch.autocast(device_type, torch.bfloat16)``: the matrix
products (Linear layers, attention) take bf16 copies of the weights and activations, the rest
(RMSNorm, RoPE, the residual stream) stays fp32 as autocast leaves it, and backward repeats
each product in the dtype its forward used. What the PPO maths reads is upcast before any
of it runs: logits go to fp32 before the log-softmax (``core.algorithms``), and the scalar
heads (value heads, a reward model's ``score``) run in fp32 (:func:`fp32_head`), so
log-probs, ratios, KL, advantages, values and losses are fp32 numbers. ``fp16`` does the
same with ``torch.float16``; its narrow exponent range needs the loss scaled before
backward (:mod:`rlhflab.backends.loss_scale`, which every trainer's update runs).

:func:`compute_autocast` is the one context every trainer enters; for ``fp32`` it is a no-op.
"""

from __future__ import annotations

import contextlib
import functools
import logging

import torch
from torch import nn

from rlhflab.config.base import ConfigError

log = logging.getLogger(__name__)

COMPUTE_DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def autocast_dtype(device, compute_dtype: str) -> torch.dtype | None:
    """The autocast dtype of ``compute_dtype`` on ``device`` (None: fp32, no autocast), or a
    :class:`ConfigError` naming ``model.compute_dtype`` for what cannot train here."""
    if compute_dtype not in COMPUTE_DTYPES:
        raise ConfigError(
            f"model.compute_dtype: {compute_dtype!r} is not one of {list(COMPUTE_DTYPES)}"
        )
    device = torch.device(device)
    if compute_dtype == "fp16" and device.type == "cpu":
        _warn_fp16_on_cpu()
    if compute_dtype == "bf16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise ConfigError(
            f"model.compute_dtype: this GPU ({torch.cuda.get_device_name(device)}) has no "
            "bf16 arithmetic; use fp16 (loss-scaled) or fp32"
        )
    return COMPUTE_DTYPES[compute_dtype]


@functools.cache
def _warn_fp16_on_cpu() -> None:
    """Said once per process: fp16 on a CPU runs, but without native fp16 products."""
    log.warning(
        "model.compute_dtype=fp16 on a CPU: most CPUs have no native fp16 matrix products "
        "(measured ~10x slower than fp32 on this project's Xeon VM); bf16 is the CPU's "
        "reduced precision"
    )


def compute_autocast(device, compute_dtype: str = "fp32") -> contextlib.AbstractContextManager:
    """The context a trained model's forward runs in: ``torch.autocast(device type, dtype)``
    for bf16, ``contextlib.nullcontext()`` for fp32 (the forward is then untouched). Enter a
    fresh one per use. Backward needs no context: it follows what the forward recorded."""
    dtype = autocast_dtype(device, compute_dtype)
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(torch.device(device).type, dtype=dtype)


def frozen_compute_dtype(compute_dtype: str, precision: str) -> str:
    """The compute dtype of a frozen model whose weights are in ``precision``
    (model.reference_precision): the trained models' for fp32 weights, so that the
    reference computes as the policy does and an unchanged policy's KL to it is 0; 'fp32'
    (no autocast) for bf16, fp16 or int8 weights, which compute in their own precision."""
    return compute_dtype if precision == "fp32" else "fp32"


def fp32_head(head: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """``head(hidden)`` in fp32 with autocast off: a value head or a reward model's score
    head (H → a few outputs) costs nothing next to the backbone, and values and scores in
    bf16 would carry 3 significant digits into GAE, the value loss and the reward. Without
    autocast it is ``head(hidden)`` itself (same dtype, same result as before)."""
    device_type = hidden.device.type
    if not torch.is_autocast_enabled(device_type):
        return head(hidden)
    with torch.autocast(device_type, enabled=False):
        return head(hidden.float())
