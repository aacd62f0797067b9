"""Step 11 of a PPO iteration (reward.refresh_every): the reward-model refresh.

After every N-th iteration the current policy answers that iteration's prompts twice; a
labeller judges each pair (a user's ``module:function``, or the built-in annotator with the
rm.* settings); each reward model of the cast (reward.model, or every member of
reward.ensemble) is fine-tuned on the fresh pairs of every refresh so far, with a share of
each batch replayed from its own training pairs; PPO then scores with the refreshed weights
(the cast's reward sources hold these very modules). This is online / iterated RLHF: Bai et
al. 2022 ("Training a Helpful and Harmless Assistant with RLHF") refreshed their reward
models on the newest policy's answers; Touvron et al. 2023 (Llama 2) collected fresh
comparisons from each new model and kept the old ones; Wolf et al. 2025 ("Reward Model
Overoptimisation in Iterated RLHF") compare how such data is carried across iterations.
An ensemble's members are each refreshed on the same pairs, drawing their own batches, so
they stay k different models (Coste et al., ICLR 2024, rely on their disagreement).

A resume needs: the reward models' weights (:class:`~.runstate.CastCheckpoints` writes them
to ``checkpoints/step-N/reward``), the fresh pairs so far and this step's random stream
(:meth:`RewardRefresh.state_dict`). Each refresh starts a new AdamW, so no optimiser state
outlives it.
"""

from __future__ import annotations

import contextlib
import math
import random
import time
from dataclasses import asdict

import torch

from rlhflab import models as M
from rlhflab.backends.loss_scale import LossScaler
from rlhflab.builtin import tasks
from rlhflab.config import Config, ConfigError
from rlhflab.errors import where_raised
from rlhflab.experience.data import PreferencePair, load_preferences
from rlhflab.experience.ensemble import EnsembleReward
from rlhflab.experience.rewards import (
    LENGTH_HEAD,
    FunctionReward,
    ModelReward,
    RewardBatch,
    RewardError,
)
from rlhflab.experience.rollout import Rollout, generate_rollout
from rlhflab.trainers.common import (
    Halt,
    build_optimizer_simple,
    build_scheduler,
    supervised_step,
)
from rlhflab.trainers.rm import builtin_pairs, pair_loss, split_pairs, trained_odin

PREFERENCE = "preference"  # the label every labeller gives: P(answer a ≻ answer b)


def refreshed_models(cast) -> dict[str, ModelReward]:
    """The reward models a refresh trains, by their checkpoint folder name: ``reward`` for
    reward.model, ``reward-i`` for member i of reward.ensemble."""
    out = {}
    for source, _ in cast.reward.sources:
        if isinstance(source, ModelReward):
            out["reward"] = source
        elif isinstance(source, EnsembleReward):
            out.update({f"reward-{i}": m for i, m in enumerate(source.members)})
    return out


def plain_module(model):
    """The reward model itself, out of its :class:`~rlhflab.models.Offloaded` wrapper."""
    return model._modules["model"] if isinstance(model, M.Offloaded) else model


class RewardRefresh:
    """Step 11: every reward.refresh_every iterations, fresh pairs, labels, a fine-tune."""

    def __init__(self, cfg: Config, ctx, cast, run_dir):
        if ctx.enabled:
            raise ConfigError(
                "reward.refresh_every: a refresh fine-tunes the reward model in one process; "
                "under torchrun every rank holds its own copy. Run on one process or set "
                "reward.refresh_every to null"
            )
        self.cfg, self.cast, self.rw = cfg, cast, cfg.reward
        self.models = refreshed_models(cast)
        # the refreshed reward sources and their weights in the total PPO optimises: the
        # accuracy before and after a refresh is theirs
        self.sources = [
            (s, w) for s, w in cast.reward.sources if isinstance(s, ModelReward | EnsembleReward)
        ]
        self.generator = torch.Generator(device=cast.device).manual_seed(cfg.seed + 3)
        self.labeller = (
            _user_labeller(self.rw.refresh_labeller) if self.rw.refresh_labeller else None
        )
        self.fresh: list[PreferencePair] = []  # every refresh's labelled pairs, a ≻ b oriented
        self.replay = self._replay_pairs() if self.rw.refresh_replay > 0 else []
        self.halt = Halt(
            "PPO",
            "reward.refresh_lr",
            lambda: f"The reward model's last whole state is in {run_dir}/checkpoints.",
            unit="reward-model refresh step",
        )

    @classmethod
    def build(cls, cfg: Config, ctx, cast, run_dir) -> RewardRefresh | None:
        """The refresh of a run with reward.refresh_every set, else None."""
        return cls(cfg, ctx, cast, run_dir) if cfg.reward.refresh_every else None

    def _replay_pairs(self) -> list[PreferencePair]:
        """The reward model's training pairs as ``rlhflab rm`` split them (seed's split),
        labelled as fresh pairs are: preference 1 (chosen ≻ rejected) and its attributes."""
        cfg = self.cfg
        if cfg.rm.data:
            first = next(iter(self.models.values()))
            tokenizer = first.tokenizer  # renders chat rows
            # each pair must fit the reward model's positions, as `rlhflab rm` checks them
            limit = M.positions_of(plain_module(first.model).config)
            pairs = load_preferences(
                cfg.rm.data, tokenizer, cfg.data.split, limit, cfg.data.on_bad_row
            )
        else:
            pairs = builtin_pairs(cfg)
        _, train = split_pairs(pairs, cfg)
        return [
            PreferencePair(p.prompt, p.chosen, p.rejected, {**p.labels, PREFERENCE: 1.0})
            for p in train
        ]

    def due(self, iteration: int) -> bool:
        """Whether iteration ``iteration`` (1-based) ends with a refresh."""
        return iteration % self.rw.refresh_every == 0

    def run(self, prompts: list[str], iteration: int) -> dict[str, float]:
        """Step 11 after iteration ``iteration`` (1-based) on its distinct ``prompts``; the
        ``refresh/`` metrics."""
        t0 = time.perf_counter()
        a, b = self._sample(prompts), self._sample(prompts)
        keep = [i for i in range(len(a)) if a.responses[i] != b.responses[i]]  # no signal
        labels = self._label([prompts[i] for i in keep], a, b, keep, iteration)
        pairs = [
            PreferencePair(
                prompts[i],
                a.responses[i],
                b.responses[i],
                lab,
                bool(a.ended[i]),
                bool(b.ended[i]),
            )
            for i, lab in zip(keep, labels)
        ]
        for member in self.models.values():
            _check_heads(pairs, member.head_names, self.rw.refresh_labeller)
        self.fresh.extend(pairs)
        before = self._accuracy(a, b, keep, labels)
        losses = [self._fine_tune(m) for m in self.models.values()] if self.fresh else []
        after = self._accuracy(a, b, keep, labels)
        out = {"refresh/pairs": len(pairs), "refresh/pool": len(self.fresh)}
        if losses:
            out["refresh/rm_loss"] = sum(map(sum, losses)) / sum(map(len, losses))
        if before is not None:
            out["refresh/rm_accuracy_before"], out["refresh/rm_accuracy_after"] = before, after
        out["time/refresh"] = time.perf_counter() - t0
        return out

    def _sample(self, prompts: list[str]) -> Rollout:
        """One answer per prompt from the current policy, from the refresh's own stream."""
        r, cast = self.cfg.rollout, self.cast
        cast.policy.eval()
        return generate_rollout(
            cast.policy_lm,
            cast.tokenizer,
            prompts,
            r.max_new_tokens,
            r.temperature,
            r.top_k,
            r.top_p,
            self.generator,
            cast.device,
            ignore_eos=r.ignore_eos,
            autocast=cast.autocast,
            sampler=r.sampler,
        )

    def _label(self, prompts, a: Rollout, b: Rollout, keep, iteration) -> list[dict]:
        """Per kept pair: head → P(answer a ≻ answer b), from the configured labeller."""
        answers_a = [a.responses[i] for i in keep]
        answers_b = [b.responses[i] for i in keep]
        if not keep:
            return []
        if self.labeller is not None:
            return self.labeller(prompts, answers_a, answers_b)
        # the built-in annotator's noise: its own stream per refresh (seed, iteration), so a
        # resumed run draws the same labels without carrying a Python RNG state
        rng = random.Random(self.cfg.seed * 1_000_003 + iteration)
        return [
            annotator_labels(q, x, y, rng, self.cfg.rm)
            for q, x, y in zip(prompts, answers_a, answers_b)
        ]

    @torch.no_grad()
    def _accuracy(self, a: Rollout, b: Rollout, keep, labels) -> float | None:
        """Share of the kept pairs with a preference (≠ 0.5) that the refreshed reward
        sources' weighted score (their part of what PPO optimises) orders as the labeller
        did; None when no pair has one."""
        decided = [
            (i, lab[PREFERENCE]) for i, lab in zip(keep, labels) if lab.get(PREFERENCE, 0.5) != 0.5
        ]
        if not decided:
            return None
        sa, sb = self._score(a), self._score(b)
        right = [(sa[i] - sb[i]) * (p - 0.5) > 0 for i, p in decided]
        return sum(map(bool, right)) / len(decided)

    def _score(self, ro: Rollout) -> torch.Tensor:
        batch = RewardBatch(ro.prompts, ro.responses, ro.sequences, ro.attention_mask, ro.ended)
        total = torch.zeros(len(ro))
        for source, weight in self.sources:
            parts = source(batch)
            if isinstance(weight, dict):
                total += sum(w * parts[k] for k, w in weight.items())
            else:
                total += weight * sum(parts.values())
        return total

    def _fine_tune(self, member: ModelReward) -> list[float]:
        """refresh_steps AdamW steps of one reward model on batches of fresh and replayed
        pairs (the Bradley-Terry loss of ``rlhflab rm``, ODIN's with a length head); its
        losses. The model is trainable only meanwhile; a new AdamW each time."""
        rw, rm_cfg = self.rw, self.cfg.rm
        n_replay = round(rw.refresh_batch_size * rw.refresh_replay) if self.replay else 0
        n_fresh = rw.refresh_batch_size - n_replay
        heads = member.head_names
        weights = [0.0 if h == LENGTH_HEAD else float(rm_cfg.heads.get(h, 1.0)) for h in heads]
        odin = trained_odin(plain_module(member.model).config, heads, rm_cfg)
        model = member.model
        on_device = (
            model.on_device() if isinstance(model, M.Offloaded) else contextlib.nullcontext(model)
        )
        losses = []
        with on_device as m:
            params = list(m.parameters())
            for p in params:
                p.requires_grad_(True)
            opt = build_optimizer_simple(params, rw.refresh_lr)
            sched = build_scheduler(opt, 0, rw.refresh_steps, "constant")
            scaler = LossScaler.for_model(self.cfg.model)  # fp16: a fresh scale per refresh
            try:
                for step in range(1, rw.refresh_steps + 1):
                    batch = self._draw(self.fresh, n_fresh) + self._draw(self.replay, n_replay)
                    targets = head_targets(batch, heads)
                    with self.cast.autocast():  # model.compute_dtype, as every trained model
                        loss, _ = pair_loss(
                            m,
                            member.tokenizer,
                            batch,
                            targets,
                            weights,
                            rm_cfg.margin,
                            self.cast.device,
                            odin,
                        )
                    losses.append(
                        supervised_step(m, opt, sched, loss, step, self.halt, scaler=scaler)
                    )
            finally:
                for p in params:
                    p.requires_grad_(False)
                del opt
        return losses

    def _draw(self, pool: list[PreferencePair], n: int) -> list[PreferencePair]:
        if not n:
            return []
        g = self.generator
        return [
            pool[i] for i in torch.randint(len(pool), (n,), generator=g, device=g.device).tolist()
        ]

    def state_dict(self) -> dict:
        return {"rng": self.generator.get_state(), "fresh": [asdict(p) for p in self.fresh]}

    def load_state_dict(self, s: dict) -> None:
        self.generator.set_state(s["rng"])
        self.fresh = [PreferencePair(**p) for p in s["fresh"]]


def head_targets(pairs: list[PreferencePair], heads: list[str]) -> torch.Tensor:
    """(N, K) targets P(first answer ≻ second) per head, NaN where a pair has no label for
    it (the head then takes no loss from that pair). A one-head model's head takes the
    preference when no label names it; the ODIN length head is trained through the sums."""
    out = torch.full((len(pairs), len(heads)), math.nan)
    for i, p in enumerate(pairs):
        for k, h in enumerate(heads):
            label = p.labels.get(h, p.labels.get(PREFERENCE) if len(heads) == 1 else None)
            if label is not None and h != LENGTH_HEAD:
                out[i, k] = float(label)
    return out


def _check_heads(pairs: list[PreferencePair], heads: list[str], labeller: str | None) -> None:
    """A refresh's fresh pairs must label some head of each reward model: else they would
    add nothing, silently, beside the replayed pairs. ``labeller``: reward.refresh_labeller,
    or None for the built-in annotator (whose heads are fixed: the reward model's must be
    among them)."""
    if pairs and torch.isnan(head_targets(pairs, heads)).all():
        if labeller is None:
            raise RewardError(
                f"reward.refresh_every: the built-in annotator labels {sorted(pairs[0].labels)}, "
                f"none of the reward model's heads {heads}; set reward.refresh_labeller to a "
                "function that labels them"
            )
        raise RewardError(
            f"reward.refresh_labeller: the labels name {sorted(pairs[0].labels)}, none of the "
            f"reward model's heads {heads}; return a dict keyed by those head names"
        )


def annotator_labels(prompt: str, a: str, b: str, rng: random.Random, rm) -> dict[str, float]:
    """The built-in annotator's judgement of answers a and b (``rm.noise``,
    ``rm.length_bias``, ``rm.flattery_bias``), as P(a ≻ b) per head: preference and the
    attributes."""
    pref = tasks.annotate(prompt, a, b, rng, rm.noise, rm.length_bias, rm.flattery_bias)
    a_first = pref.chosen == a
    flip = (lambda v: v) if a_first else (lambda v: 1.0 - v)
    return {PREFERENCE: flip(1.0), **{k: flip(float(v)) for k, v in pref.labels.items()}}


def _user_labeller(spec: str):
    """reward.refresh_labeller's function, wrapped to check and shape what it returns."""
    try:
        fn = FunctionReward(spec).fn
    except RewardError as exc:
        raise ConfigError(f"reward.refresh_labeller: {exc}") from None

    def label(prompts, answers_a, answers_b) -> list[dict[str, float]]:
        n = len(prompts)
        try:
            out = fn(list(prompts), list(answers_a), list(answers_b))
        except Exception as exc:
            raise RewardError(
                f"reward.refresh_labeller {spec} raised {type(exc).__name__}: {exc}"
                f"{where_raised(exc)}"
            ) from exc
        per_head = out if isinstance(out, dict) else {PREFERENCE: out}
        columns = {h: _check_labels(spec, h, v, n) for h, v in per_head.items()}
        return [{h: col[i] for h, col in columns.items()} for i in range(n)]

    return label


def _check_labels(spec: str, head: str, values, n: int) -> list[float]:
    try:
        out = [float(v) for v in values]
    except (TypeError, ValueError):
        raise RewardError(
            f"reward.refresh_labeller {spec}: labels of {head!r} are not a list of numbers"
        ) from None
    if len(out) != n:
        raise RewardError(
            f"reward.refresh_labeller {spec}: {len(out)} labels of {head!r} for {n} pairs"
        )
    bad = [v for v in out if not 0.0 <= v <= 1.0]  # NaN fails too
    if bad:
        raise RewardError(
            f"reward.refresh_labeller {spec}: label {bad[0]!r} of {head!r} is outside [0, 1] "
            "(1: answer a is better, 0: answer b is, 0.5: a tie)"
        )
    return out
