"""Reward sources behind one small interface, and their weighted mix.

A reward source maps a batch of finished answers to named score components:
``source(batch) -> {name: Tensor(B)}``. :class:`CompositeReward` combines the components of
all sources with weights into the one scalar the policy optimises, and keeps every
component so each head can be reported separately.
"""

from __future__ import annotations

import importlib
import os
import sys
from dataclasses import dataclass, field
from typing import Protocol

import torch

from rlhflab.errors import RlhflabError, where_raised
from rlhflab.models import (
    Offloaded,
    encode_prompt,
    fp32_head,
    last_real_index,
    last_token_hidden,
    same_tokenizer,
    stop_ids,
)


class RewardError(RlhflabError, RuntimeError):
    """A reward source failed or returned something unusable; the message names it."""


@dataclass
class RewardBatch:
    """Finished answers to score.

    prompts, responses: decoded text, length B. ``sequences``/``attention_mask``: (B, L)
    policy-tokenizer ids of prompt + response (left-padded prompt, right-padded answer),
    used by a reward model that shares the policy's tokenizer. ``ended``: (B,) whether each
    answer ended with EOS (False: cut off at max_new_tokens); a reward model that re-encodes
    the text needs it, to append EOS to those answers only.
    """

    prompts: list[str]
    responses: list[str]
    sequences: torch.Tensor | None = None
    attention_mask: torch.Tensor | None = None
    ended: torch.Tensor | list[bool] | None = None


def encode_for_reward(
    tokenizer, prompts: list[str], answers: list[str], ended
) -> tuple[torch.Tensor, torch.Tensor]:
    """Ids (B, P + T) and attention mask of prompt + answer for a reward model, laid out as a
    rollout is: each prompt encoded on its own and left-padded to P, each answer encoded on
    its own, followed by EOS where ``ended[i]`` (an answer cut off at max_new_tokens gets
    none), and right-padded to T.

    The one encoding for reward-model training, its held-out checks and PPO's re-encoded
    scoring: encoding prompt + answer as one string would merge tokens across the boundary
    ("answer: " + "red" → " red") that a rollout keeps apart, so the reward model would be
    trained on tokens it never sees at PPO time.
    """
    ended = [bool(e) for e in (ended.tolist() if torch.is_tensor(ended) else ended)]
    if not len(prompts) == len(answers) == len(ended):
        raise ValueError(
            f"encode_for_reward: {len(prompts)} prompts, {len(answers)} answers, "
            f"{len(ended)} ended flags"
        )
    pad, eos = tokenizer.pad_token_id, tokenizer.eos_token_id
    heads = [encode_prompt(tokenizer, p) for p in prompts]
    tails = [
        tokenizer(a, add_special_tokens=False)["input_ids"] + ([eos] if e else [])
        for a, e in zip(answers, ended)
    ]
    P, T = max(map(len, heads)), max(map(len, tails))
    ids = torch.full((len(heads), P + T), pad, dtype=torch.long)
    mask = torch.zeros((len(heads), P + T), dtype=torch.long)
    for i, (h, t) in enumerate(zip(heads, tails)):
        ids[i, P - len(h) : P + len(t)] = torch.tensor(h + t, dtype=torch.long)
        mask[i, P - len(h) : P + len(t)] = 1
    return ids, mask


def reward_scores(model, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(B, K) head scores at each row's last real token: the reward model's pooling, the
    same in training and in scoring."""
    return fp32_head(model.score, last_token_hidden(model, ids, mask)).float()


# the head rm.length_head adds (ODIN): it holds the length preference, so PPO leaves it out
LENGTH_HEAD = "length"


def default_head_weights(names: list[str], heads: dict[str, float]) -> dict[str, float]:
    """reward.heads resolved over a model's head ``names``: the named weights (0 for a head
    left out), or, when ``heads`` is empty, 1 for every head but ``length`` (0: ODIN trains
    it to absorb the length preference the quality heads are kept free of)."""
    if heads:
        return {n: float(heads.get(n, 0.0)) for n in names}
    return {n: 0.0 if n == LENGTH_HEAD else 1.0 for n in names}


class RewardSource(Protocol):
    name: str

    def __call__(self, batch: RewardBatch) -> dict[str, torch.Tensor]: ...


class ModelReward:
    """A sequence-classification reward model with one output per head.

    The score is read at the last real token. When the reward model's tokenizer differs from
    the policy's (detected by :func:`same_tokenizer`), answers are decoded and re-encoded
    with the reward model's own tokenizer by :func:`encode_for_reward` (as in its
    training); otherwise the policy's token ids are used as is — they have that layout.
    """

    def __init__(self, model, tokenizer, policy_tokenizer, device="cpu", micro_batch=32, name="rm"):
        self.model, self.tokenizer, self.name = model, tokenizer, name
        self.device, self.micro_batch = torch.device(device), micro_batch
        self.reencode = not same_tokenizer(tokenizer, policy_tokenizer)
        # answers that ended at a stop id other than EOS (a chat turn's end) are read at
        # EOS in its place, as encode_for_reward (training, refresh) builds every input
        eos = tokenizer.eos_token_id
        self.other_stops = [t for t in stop_ids(policy_tokenizer) if t != eos]
        cfg = model.config
        self.head_names = [cfg.id2label[i] for i in range(cfg.num_labels)]

    def _encode(self, batch: RewardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.reencode and batch.sequences is not None:
            ids, mask = batch.sequences, batch.attention_mask
            if self.other_stops:
                last = last_real_index(mask)[:, None]
                ended = torch.isin(
                    ids.gather(1, last), torch.tensor(self.other_stops, device=ids.device)
                )
                eos = torch.full_like(last, self.tokenizer.eos_token_id)
                ids = ids.scatter(1, last, torch.where(ended, eos, ids.gather(1, last)))
            return ids, mask
        if batch.ended is None:
            raise RewardError(
                f"reward model {self.name}: re-encoding answers needs to know which ended "
                "with EOS (RewardBatch.ended); a cut-off answer gets none"
            )
        return encode_for_reward(self.tokenizer, batch.prompts, batch.responses, batch.ended)

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
                outs.append(reward_scores(m, i, a).cpu())
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


# Built-in reward modules that moved when the package was split into layers (2026-12):
# configs written for the flat layout name them by their old paths, and keep working.
MOVED_MODULES = {
    "rlhflab.tasks": "rlhflab.builtin.tasks",
    "rlhflab.toy_rewards": "rlhflab.builtin.toy_rewards",
}


class CallableReward:
    """A Python callable ``fn(prompts, responses)`` as a reward source.

    It returns one float per answer, or a dict mapping component names to lists of floats.
    One that raises, returns the wrong number of values or non-numbers gets a
    :class:`RewardError` that names it (``name``: how the config or the log calls it).
    """

    def __init__(self, fn, name: str | None = None):
        if not callable(fn):
            raise RewardError(f"reward {name or fn!r}: not callable")
        self.fn = fn
        self.name = name or callable_name(fn)

    def __call__(self, batch: RewardBatch) -> dict[str, torch.Tensor]:
        try:
            out = self.fn(list(batch.prompts), list(batch.responses))
        except Exception as exc:
            raise RewardError(
                f"reward function {self.name} raised {type(exc).__name__}: {exc}{where_raised(exc)}"
            ) from exc
        parts = out if isinstance(out, dict) else {self.name: out}
        if not parts:  # else it adds 0 to every score and trains on nothing, silently
            raise RewardError(
                f"reward function {self.name} returned an empty dict: no component to score "
                "the answers with"
            )
        odd = [k for k in parts if not isinstance(k, str) or not k]
        if odd:
            raise RewardError(
                f"reward function {self.name}: component names must be non-empty strings, "
                f"got {odd[0]!r}"
            )
        return {name: self._check(name, vals, len(batch.prompts)) for name, vals in parts.items()}

    def _check(self, name, values, n) -> torch.Tensor:
        try:
            t = torch.as_tensor(values, dtype=torch.float32)
        except (TypeError, ValueError, RuntimeError):
            raise RewardError(
                f"reward function {self.name}: component {name!r} is not a list of numbers"
            ) from None
        if t.dim() > 1 and tuple(t.shape) not in ((n, 1), (1, n)):  # a grid would misalign
            raise RewardError(
                f"reward function {self.name}: component {name!r} has shape "
                f"{tuple(t.shape)}; return one number per answer ({n})"
            )
        t = t.reshape(-1)
        if t.numel() != n:
            raise RewardError(
                f"reward function {self.name}: component {name!r} returned "
                f"{t.numel()} values for {n} answers"
            )
        return t


def callable_name(fn) -> str:
    """``module:qualname`` of a function (the config's spelling), else its repr."""
    module, qualname = getattr(fn, "__module__", None), getattr(fn, "__qualname__", None)
    return f"{module}:{qualname}" if module and qualname else repr(fn)


def importable_spec(fn) -> str | None:
    """``module:function`` when importing it gives back ``fn`` itself (so a config can name
    it and a later process can load it); None for a lambda, a closure, a bound method or a
    function defined in ``__main__`` (a script or a notebook)."""
    module, qualname = getattr(fn, "__module__", None), getattr(fn, "__qualname__", "")
    if not module or module == "__main__" or not qualname or "<" in qualname or "." in qualname:
        return None
    try:
        found = getattr(importlib.import_module(module), qualname, None)
    except ImportError:
        return None
    return f"{module}:{qualname}" if found is fn else None


class FunctionReward(CallableReward):
    """A Python function named ``module:function`` taking (prompts, responses), as
    :class:`CallableReward` calls it.

    The module is looked for on ``sys.path`` and, always, in the current working directory
    (as ``python -m`` would, however the command started: the console script puts its own
    folder first, the allocator's restart the working one).
    """

    def __init__(self, spec: str):
        module_name, sep, func_name = spec.partition(":")
        if not sep or not module_name or not func_name:
            raise RewardError(f"reward function {spec!r}: expected 'module:function'")
        cwd = os.getcwd()
        if cwd not in sys.path and "" not in sys.path:
            sys.path.append(cwd)  # after the installed packages: a local file shadows none
        try:
            module = importlib.import_module(MOVED_MODULES.get(module_name, module_name))
        except ImportError as exc:
            # the module itself not found (not a package it imports): say where it was sought
            missing = getattr(exc, "name", None) in (module_name, module_name.split(".")[0])
            where = (
                f" (modules are looked for on sys.path and in the working directory {cwd}: "
                "start from the folder that holds it, or add that folder to PYTHONPATH)"
            )
            raise RewardError(
                f"reward function {spec!r}: cannot import {module_name}: {exc}"
                + (where if missing else where_raised(exc))
            ) from None
        except Exception as exc:  # the module's own code failed: a syntax error, a raise
            raise RewardError(
                f"reward function {spec!r}: importing {module_name} failed: "
                f"{type(exc).__name__}: {exc}{'' if isinstance(exc, SyntaxError) else where_raised(exc)}"
            ) from None
        fn = getattr(module, func_name, None)
        if not callable(fn):
            raise RewardError(
                f"reward function {spec!r}: {module_name} has no function {func_name}"
            )
        super().__init__(fn, spec)


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
        owner: dict[str, str] = {}  # component → the source that gave it
        total = torch.zeros(len(batch.prompts))
        for source, weight in self.sources:
            parts = source(batch)
            name = getattr(source, "name", repr(source))
            clash = sorted(k for k in parts if k in owner)
            if clash:  # both would count in the score, but the log and samples keep one
                raise RewardError(
                    f"reward component {clash[0]!r} comes from both {owner[clash[0]]} and "
                    f"{name}: give one of them another name"
                )
            owner.update(dict.fromkeys(parts, name))
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
