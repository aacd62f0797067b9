"""Dynamic loss scaling for ``model.compute_dtype=fp16``.

fp16 keeps 5 exponent bits: a gradient below ~6e-8 flushes to zero and one above 65504
overflows. Under autocast the backward of every fp16 matrix product computes in fp16, and
the small gradients of a fine-tuning run (PPO's learning rates of 1e-6..1e-5 meet
gradients of that order) vanish there. Multiplying the loss by a large scale S lifts them
into fp16's range; the gradients are divided by S before anyone reads them (the clip, the
norms, AdamW), so the update is the unscaled one. When S is too large a product overflows:
the update is skipped and S halved; after ``growth_interval`` clean updates in a row S
doubles again. The rule is ``torch.amp.GradScaler``'s (Micikevicius et al., "Mixed
Precision Training", ICLR 2018), held here as plain Python numbers so that it fits the
trainers' own non-finite guard and goes into their checkpoints for a bit-exact resume
(tests/test_compute_dtype.py drives it against ``GradScaler``).

With ``enabled=False`` (fp32 or bf16 compute: bf16 has fp32's exponent range) every method
leaves the loss and gradients as they are.
"""

from __future__ import annotations

import logging

import torch

log = logging.getLogger(__name__)


class LossScaler:
    """The loss scale of one optimiser's (or one update's) gradients.

    ``min_scale``: an overflow at this scale or below is not the scale's fault — scaling by
    less than 1 would only push small gradients into underflow — so :meth:`update` reports
    it as a real non-finite gradient, for the trainer's guard to count and halt on."""

    def __init__(
        self,
        enabled: bool,
        init_scale: float = 2.0**16,
        growth_interval: int = 2000,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        min_scale: float = 1.0,
    ):
        self.enabled = enabled
        self.scale = float(init_scale) if enabled else 1.0
        self.growth_interval = growth_interval
        self.growth_factor, self.backoff_factor = growth_factor, backoff_factor
        self.min_scale = min_scale
        self.clean_steps = 0  # updates in a row without an overflow (GradScaler's tracker)
        self.overflows = 0  # updates skipped for an overflow, in total

    @classmethod
    def for_model(cls, model_cfg) -> LossScaler:
        """The scaler that ``model.compute_dtype`` asks for (``model.loss_scale`` and
        ``model.loss_scale_growth_interval``)."""
        return cls(
            model_cfg.compute_dtype == "fp16",
            model_cfg.loss_scale,
            model_cfg.loss_scale_growth_interval,
        )

    def scaled(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss to backpropagate: ``loss × S`` (the loss itself when disabled)."""
        return loss * self.scale if self.enabled else loss

    @torch.no_grad()
    def unscale_(self, params) -> None:
        """Divide the gradients of ``params`` that exist by S, in place (fp32 gradients of
        fp32 master weights; exact when S is a power of two, as the default and its halvings
        and doublings are)."""
        if not self.enabled:
            return
        grads = [q.grad for q in params if q.grad is not None]
        if not grads:
            return
        inv = 1.0 / self.scale
        if all(type(g) is torch.Tensor for g in grads):
            torch._foreach_mul_(grads, inv)
        else:  # sharded (FSDP2's DTensor) gradients: one at a time
            for g in grads:
                g.mul_(inv)

    def update(self, overflow: bool) -> bool:
        """After an update's gradients were checked: on ``overflow`` halve S (not below
        ``min_scale``) and return True when the overflow was the scale's to absorb (the
        caller skips the update quietly), False when S was already at ``min_scale`` (a real
        non-finite gradient). Without overflow, count a clean update and grow S every
        ``growth_interval`` of them; returns False. Disabled: always False."""
        if not self.enabled:
            return False
        if overflow:
            self.clean_steps = 0
            if self.scale <= self.min_scale:
                return False
            self.scale = max(self.scale * self.backoff_factor, self.min_scale)
            self.overflows += 1
            if self.scale == self.min_scale:
                # from here an overflow is a non-finite gradient: say so before the guard
                # counts the next ones toward its halt
                log.warning(
                    "fp16 loss scale down to %g after %d overflows: the next non-finite "
                    "gradient counts as a bad update",
                    self.scale,
                    self.overflows,
                )
            return True
        self.clean_steps += 1
        if self.clean_steps == self.growth_interval:
            self.scale *= self.growth_factor
            self.clean_steps = 0
        return False

    def state_dict(self) -> dict:
        """The scale and its counters; empty when disabled, so that an fp32/bf16 checkpoint
        resumed under fp16 starts from ``init_scale``, not from a disabled scaler's 1."""
        if not self.enabled:
            return {}
        return {"scale": self.scale, "clean_steps": self.clean_steps, "overflows": self.overflows}

    def load_state_dict(self, s: dict) -> None:
        """Restore :meth:`state_dict`; an empty dict (a checkpoint from before fp16, or of
        an fp32/bf16 run) leaves the scaler as built."""
        if s and self.enabled:
            self.scale = float(s["scale"])
            self.clean_steps = int(s["clean_steps"])
            self.overflows = int(s["overflows"])
