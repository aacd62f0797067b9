"""Reward sources behind one small interface, and their weighted mix.

A reward source maps a batch of finished answers to named score components:
``source(batch) -> {name: Tensor(B)}``. :class:`CompositeReward` combines the components of
all sources with weights into the one scalar the policy optimises, and keeps every
component so each head can be reported separately.
"""

from __future__ import annotations

import importlib
import math
from dataclasses import dataclass, field
from typing import Protocol

import torch

from rlhflab.models import Offloaded, last_token_hidden, same_tokenizer


class RewardError(RuntimeError):
    """A reward source failed or returned something unusable; the message names it."""


@dataclass
class RewardBatch:
    """Finished answers to score.

    prompts, responses: decoded text, length B. ``sequences``/``attention_mask``: (B, L)
    policy-tokenizer ids of prompt + response (left-padded prompt, right-padded answer),
    used by a reward model that shares the policy's tokenizer.
    """

    prompts: list[str]
    responses: list[str]
    sequences: torch.Tensor | None = None
    attention_mask: torch.Tensor | None = None


class RewardSource(Protocol):
    name: str

    def __call__(self, batch: RewardBatch) -> dict[str, torch.Tensor]: ...


class ModelReward:
    """A sequence-classification reward model with one output per head.

    The score is read at the last real token. When the reward model's tokenizer differs from
    the policy's (detected by :func:`same_tokenizer`), answers are decoded and re-encoded
    with the reward model's own tokenizer; otherwise the policy's token ids are used as is.
    """

    def __init__(self, model, tokenizer, policy_tokenizer, device="cpu", micro_batch=32, name="rm"):
        self.model, self.tokenizer, self.name = model, tokenizer, name
        self.device, self.micro_batch = torch.device(device), micro_batch
        self.reencode = not same_tokenizer(tokenizer, policy_tokenizer)
        cfg = model.config
        self.head_names = [cfg.id2label[i] for i in range(cfg.num_labels)]

    def _encode(self, batch: RewardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.reencode and batch.sequences is not None:
            return batch.sequences, batch.attention_mask
        eos = self.tokenizer.eos_token or ""
        texts = [p + r + eos for p, r in zip(batch.prompts, batch.responses)]
        enc = self.tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        return enc["input_ids"], enc["attention_mask"]

    @torch.no_grad()
    def __call__(self, batch: RewardBatch) -> dict[str, torch.Tensor]:
        ids, mask = self._encode(batch)
        outs = []
        model = self.model
        ctx = model.on_device() if isinstance(model, Offloaded) else _Same(model)
        with ctx as m:
            for s in range(0, ids.shape[0], self.micro_batch):
                i, a = (
                    ids[s : s + self.micro_batch].to(self.device),
                    mask[s : s + self.micro_batch].to(self.device),
                )
                outs.append(m.score(last_token_hidden(m, i, a)).float().cpu())
        scores = torch.cat(outs)
        return {
            f"{self.name}/{h}" if self.name else h: scores[:, k]
            for k, h in enumerate(self.head_names)
        }


class _Same:
    def __init__(self, m):
        self.m = m

    def __enter__(self):
        return self.m

    def __exit__(self, *exc):
        return False


class FunctionReward:
    """A Python function ``module:function`` taking (prompts, responses).

    It returns one float per answer, or a dict mapping component names to lists of floats.
    A function that raises, returns the wrong number of values or non-numbers gets a
    :class:`RewardError` that names it.
    """

    def __init__(self, spec: str):
        self.name = spec
        module_name, sep, func_name = spec.partition(":")
        if not sep or not module_name or not func_name:
            raise RewardError(f"reward function {spec!r}: expected 'module:function'")
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            raise RewardError(
                f"reward function {spec!r}: cannot import {module_name}: {exc}"
            ) from None
        self.fn = getattr(module, func_name, None)
        if not callable(self.fn):
            raise RewardError(
                f"reward function {spec!r}: {module_name} has no function {func_name}"
            )

    def __call__(self, batch: RewardBatch) -> dict[str, torch.Tensor]:
        try:
            out = self.fn(list(batch.prompts), list(batch.responses))
        except Exception as exc:
            raise RewardError(
                f"reward function {self.name} raised {type(exc).__name__}: {exc}"
            ) from exc
        parts = out if isinstance(out, dict) else {self.name: out}
        return {name: self._check(name, vals, len(batch.prompts)) for name, vals in parts.items()}

    def _check(self, name, values, n) -> torch.Tensor:
        try:
            t = torch.as_tensor(values, dtype=torch.float32).reshape(-1)
        except (TypeError, ValueError, RuntimeError):
            raise RewardError(
                f"reward function {self.name}: component {name!r} is not a list of numbers"
            ) from None
        if t.numel() != n:
            raise RewardError(
                f"reward function {self.name}: component {name!r} returned "
                f"{t.numel()} values for {n} answers"
            )
        return t


@dataclass
class RewardOutput:
    """score: (B,) the weighted total; components: every named part, (B,) each."""

    score: torch.Tensor
    components: dict[str, torch.Tensor] = field(default_factory=dict)


class CompositeReward:
    """Weighted sum of the components of any number of reward sources.

    ``sources`` is a list of ``(source, weight)``: a float weights every component the source
    returns; a dict weights components by name (a component without a weight is reported but
    not optimised). Non-finite values pass through unchanged so the trainer can count them.
    """

    def __init__(self, sources: list[tuple[object, float | dict[str, float]]]):
        if not sources:
            raise RewardError("no reward source configured")
        self.sources = sources

    def __call__(self, batch: RewardBatch) -> RewardOutput:
        components: dict[str, torch.Tensor] = {}
        total = torch.zeros(len(batch.prompts))
        for source, weight in self.sources:
            parts = source(batch)
            if isinstance(weight, dict):
                missing = [k for k in weight if k not in parts]
                if missing:
                    raise RewardError(
                        f"reward weights name {missing} but {source.name} produced {sorted(parts)}"
                    )
                for name, w in weight.items():
                    total = total + w * parts[name]
            else:
                for value in parts.values():
                    total = total + weight * value
            components.update(parts)
        return RewardOutput(total, components)


class RunningMoments:
    """Running count, mean and sum of squared deviations of scores (Chan et al.'s parallel
    update), for 'running' normalisation. Under data parallelism feed :meth:`merge` the
    batch moments over every rank (:func:`rlhflab.distributed.global_batch_moments`), so
    each rank holds the same, global moments and scales its scores identically."""

    def __init__(self):
        self.count, self.mean, self.m2 = 0, 0.0, 0.0

    def update(self, x: torch.Tensor) -> None:
        """Add this process's scores (single process)."""
        x = x.double().reshape(-1)
        n = x.numel()
        if n:
            mean = x.mean().item()
            self.merge(n, mean, ((x - mean) ** 2).sum().item())

    def merge(self, n: int, mean: float, m2: float) -> None:
        """Add a batch given as its count, mean and sum of squared deviations from it."""
        if n < 0 or m2 < 0 or not (math.isfinite(mean) and math.isfinite(m2)):
            raise ValueError(f"RunningMoments.merge: bad batch moments n={n} mean={mean} m2={m2}")
        if n == 0:
            return
        delta, total = mean - self.mean, self.count + n
        self.mean += delta * n / total
        self.m2 += m2 + delta**2 * self.count * n / total
        self.count = total

    @property
    def var(self) -> float:
        """Unbiased variance of every score seen; 1.0 while it measures no scale yet (fewer
        than two scores, or all equal, e.g. a 0/1 reward nobody earned): dividing by a
        zero spread would blow the scores up, and there is nothing to normalise by."""
        if self.count < 2 or self.m2 <= 0.0:
            return 1.0
        return self.m2 / (self.count - 1)

    @property
    def std(self) -> float:
        return math.sqrt(self.var)

    def state_dict(self) -> dict:
        return {"count": self.count, "mean": self.mean, "m2": self.m2}

    def load_state_dict(self, s: dict) -> None:
        self.count, self.mean, self.m2 = int(s["count"]), float(s["mean"]), float(s["m2"])
