"""rlhflab from Python: one trainer class per command (docs/python-api.md).

    import rlhflab
    trainer = rlhflab.PPOTrainer(model="my-sft-folder", reward=my_function, prompts=[...])
    trainer.train()
    trainer.save("my-policy")

Each class takes models as folders or Hugging Face model objects (with their tokenizer),
rewards as reward-model folders or objects, ``module:function`` names or plain callables
``(prompts, responses) -> list[float]``, data as a path, a list or a ``datasets.Dataset``,
and the config as a YAML path, a dict of sections or a :class:`~rlhflab.config.Config`, with
dotted ``overrides``. Objects go through :mod:`rlhflab.app.inputs`: written once into the
run's ``inputs/`` folder and read from there by the same code as the command's, so they get
the same preparation and the run can be resumed from the command line. The trainer the class
drives is ``trainer.engine`` (the one the command runs).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from pathlib import Path

from rlhflab.app import inputs as I
from rlhflab.app import python_rewards as PR
from rlhflab.app import run_inputs as RI
from rlhflab.app.api_config import (
    absolute_folder,
    callback_list,
    check_folder,
    resolve_config,
    validate,
)
from rlhflab.config import ConfigError
from rlhflab.trainers.supervised import check_output_folder

log = logging.getLogger(__name__)

# callback(trainer, step, metrics) after every logged step; a true return stops the run there
Callback = Callable[["Trainer", int, dict], object]


class Trainer:
    """What every trainer class shares: the config, the engine, callbacks, train and save."""

    stage = ""

    def __init__(self, config, overrides, callbacks, resume: bool):
        # resume: continue the run in the output folder; its inputs/ are kept as the run's
        # first start wrote them (models are loaded here, before train() is called)
        self.resume = resume
        if isinstance(overrides, str):
            raise ConfigError(
                f"overrides: a dict of dotted keys or a list of 'key=value' strings, got the "
                f"string {overrides!r} (write [{overrides!r}])"
            )
        self.config = resolve_config(config, overrides, self.stage)
        self.callbacks: list[Callback] = callback_list(callbacks)
        self.engine = None

    def _protected(self) -> tuple:
        """What :meth:`save` must never replace: the run, and the model it started from."""
        return (self.config.log.output_dir, self.config.model.policy)

    def _hooks(self) -> list:
        def wrap(cb):
            @functools.wraps(cb)
            def hook(step, metrics):
                return cb(self, step, metrics)

            return hook

        return [wrap(cb) for cb in self.callbacks]

    def _run_inputs(self, output_dir, model, tokenizer) -> Path:
        """The run directory (``log.output_dir``) set, the policy given as ``model`` (None:
        the config's ``model.policy``) put where the config can name it; the run's
        ``inputs/`` folder."""
        cfg = self.config
        if output_dir is not None:
            cfg.log.output_dir = str(output_dir)
        check_folder(cfg.log.output_dir, "log.output_dir")  # before inputs/ is written
        cfg.log.output_dir = absolute_folder(cfg.log.output_dir)
        inputs = RI.inputs_folder(Path(cfg.log.output_dir), self.resume)
        if model is not None:
            folder = I.model_folder(model, tokenizer, inputs / "policy", "model", self.resume)
            cfg.model.policy = folder
        return inputs

    def _start(self, engine) -> None:
        self.engine = engine
        engine.step_hooks = self._hooks()

    def train(self, resume: bool | None = None) -> dict:
        """Train to the configured number of steps; with ``resume`` (default: the
        constructor's), from the run's newest checkpoint. The summary the command prints."""
        self.engine.step_hooks = self._hooks()  # callbacks added after construction count
        return self._train(self.resume if resume is None else resume)

    def _train(self, resume: bool) -> dict:
        raise NotImplementedError

    @property
    def model(self):
        """The trained model (a causal LM, maybe with LoRA adapters; the reward model for
        :class:`RewardTrainer`)."""
        raise NotImplementedError

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def save(self, out_dir, merge_lora: bool = True, force: bool = False, dtype=None) -> Path:
        """Write the trained model as a plain Hugging Face folder (LoRA merged into the
        weights, or kept as a PEFT adapter with ``merge_lora=False``); refuses a folder that
        is not empty unless ``force``. ``dtype``: 'fp32', 'bf16' or a torch dtype for the
        saved weights (as ``rlhflab export --dtype``); None keeps them as trained (fp32)."""
        from rlhflab.models.export import save_policy

        kept = self._protected()  # never over the run itself or the model it started from
        return save_policy(
            self.model,
            self.tokenizer,
            out_dir,
            merge_lora=merge_lora,
            dtype=dtype,
            force=force,
            protect=kept,
        )


class PPOTrainer(Trainer):
    """PPO against a reward: ``rlhflab ppo`` from Python.

    ``model``: the policy (a folder, ``preset:NAME`` or a model object with ``tokenizer``;
    None: the config's ``model.policy``).
    ``reward``: a reward-model folder or object, ``module:function``, a callable
    ``(prompts, responses) -> list[float] | dict[str, list[float]]``, or a list of these or a
    dict of these to weights. ``prompts``: a path, a list of strings or chat message lists,
    or a ``datasets.Dataset``/``DatasetDict`` (split ``data.split``); None: the built-in
    task. ``reward_tokenizer``: the tokenizer of a reward-model object (default: ``tokenizer``).
    ``gold``: a gold reward for the monitor and the report. ``output_dir``: the run
    directory (``log.output_dir``).
    """

    stage = "ppo"

    def __init__(
        self,
        model=None,
        reward=None,
        prompts=None,
        *,
        tokenizer=None,
        reward_tokenizer=None,
        gold=None,
        config=None,
        overrides=None,
        output_dir=None,
        callbacks=None,
        resume: bool = False,
    ):
        super().__init__(config, overrides, callbacks, resume)
        cfg = self.config
        inputs = self._run_inputs(output_dir, model, tokenizer)
        rewards = I.apply_rewards(cfg, reward, reward_tokenizer or tokenizer, inputs, resume)
        split = cfg.data.split
        prompt_file = I.rows_file(prompts, inputs / "prompts.jsonl", "prompts", split, I.prompt_row)
        RI.set_data(cfg, prompt_file, "data.prompts", cfg.log.output_dir, resume)
        if gold is not None and not cfg.monitor.enabled:
            raise ConfigError(
                "gold: the gold reward is measured by the monitor; set monitor.enabled"
            )
        gold_fn = I.gold_source(cfg, gold)
        if resume:
            configured = bool(cfg.reward.model or cfg.reward.ensemble or cfg.reward.functions)
            PR.check_resumed_python_rewards(cfg.log.output_dir, rewards.extra, gold_fn, configured)
        validate(cfg, self.stage, reward_given=bool(rewards.extra))
        from rlhflab.trainers.ppo import PPOTrainer as Engine

        self._start(Engine(cfg, rewards=rewards.extra, gold=gold_fn))
        self._python = (rewards.extra, gold_fn)

    def _train(self, resume: bool) -> dict:
        # recorded when this run trains — once it holds its folder (RunLoop calls
        # on_locked) — not when it is built: a start that is refused or never trains
        # must leave an earlier run's record (its resume refusal) as it was
        run_dir = Path(self.config.log.output_dir)
        if resume and not self.resume:  # train(resume=True) of a trainer built to start
            PR.check_resumed_python_rewards(run_dir, *self._python, configured=True)
        self.engine.on_locked = lambda: PR.note_python_rewards(run_dir, *self._python)
        return {**self.engine.fit(resume), "output_dir": self.config.log.output_dir}

    @property
    def model(self):
        return self.engine.cast.policy_lm

    @property
    def tokenizer(self):
        return self.engine.cast.tokenizer

    @property
    def last_rollout(self):
        """The last iteration's answers, scores and KL (:class:`~rlhflab.experience.rollout.Rollout`)."""
        return self.engine.last_rollout


class GRPOTrainer(PPOTrainer):
    """GRPO (group-normalised advantages, no critic): ``rlhflab grpo`` from Python; the
    arguments of :class:`PPOTrainer`."""

    stage = "grpo"


class RLOOTrainer(PPOTrainer):
    """RLOO (leave-one-out baseline, no critic): ``rlhflab rloo`` from Python; the arguments
    of :class:`PPOTrainer`."""

    stage = "rloo"


class DPOTrainer(Trainer):
    """DPO on preference pairs: ``rlhflab dpo`` from Python. ``pairs``: a path, a list of
    ``(prompt, chosen, rejected)`` or of dicts, or a ``datasets.Dataset``; None: the built-in
    annotator's pairs."""

    stage = "dpo"

    def __init__(
        self,
        model=None,
        pairs=None,
        *,
        tokenizer=None,
        config=None,
        overrides=None,
        output_dir=None,
        callbacks=None,
        resume: bool = False,
    ):
        super().__init__(config, overrides, callbacks, resume)
        cfg = self.config
        inputs = self._run_inputs(output_dir, model, tokenizer)
        split = cfg.data.split
        data = I.rows_file(pairs, inputs / "pairs.jsonl", "pairs", split, I.pair_row)
        RI.set_data(cfg, data, "dpo.data", cfg.log.output_dir, resume)
        validate(cfg, self.stage)
        from rlhflab.trainers.dpo import DPOTrainer as Engine

        self._start(Engine(cfg))

    def _train(self, resume: bool) -> dict:
        return {**self.engine.fit(resume), "output_dir": self.config.log.output_dir}

    @property
    def model(self):
        return self.engine.policy


class _ModelOut(Trainer):
    """SFT and RM write their model folder (``<stage>.output_dir``) at the end; their run
    files (and ``inputs/``) sit in its ``run/`` folder."""

    def _setup(self, output_dir, model, tokenizer, resume, current, run="run"):
        """(the inputs folder, the model setting): ``current`` (the config's) when ``model``
        is None. ``run``: where in the output folder a resume reads config.yaml."""
        section = getattr(self.config, self.stage)
        if output_dir is not None:
            section.output_dir = str(output_dir)
        # refused before inputs/ (or a copy of a model object) is written into it
        check_folder(section.output_dir, f"{self.stage}.output_dir")
        section.output_dir = absolute_folder(section.output_dir)
        check_output_folder(self.config, self.stage, Path(section.output_dir))
        out = Path(section.output_dir)
        inputs = RI.inputs_folder(out / "run", resume, out / run)
        if model is None:
            return inputs, current
        return inputs, I.model_folder(model, tokenizer, inputs / "model", "model", resume)

    @property
    def model(self):
        return self.engine.model

    def _protected(self) -> tuple:
        section = getattr(self.config, self.stage)
        return (Path(section.output_dir) / "run", self.config.model.policy)


class SFTTrainer(_ModelOut):
    """Supervised fine-tuning on response tokens: ``rlhflab sft`` from Python. ``data``: a
    path, a list of ``(prompt, response)`` or of dicts (also chat ``messages``), or a
    ``datasets.Dataset``; None: the built-in task's teacher answers."""

    stage = "sft"

    def __init__(
        self,
        model=None,
        data=None,
        *,
        tokenizer=None,
        config=None,
        overrides=None,
        output_dir=None,
        callbacks=None,
        resume: bool = False,
    ):
        super().__init__(config, overrides, callbacks, resume)
        cfg = self.config
        inputs, cfg.model.policy = self._setup(
            output_dir, model, tokenizer, resume, cfg.model.policy
        )
        split = cfg.data.split
        rows = I.rows_file(data, inputs / "sft.jsonl", "data", split, I.sft_row)
        RI.set_data(cfg, rows, "sft.data", Path(cfg.sft.output_dir) / "run", resume)
        validate(cfg, self.stage)
        from rlhflab.trainers.sft import sft_trainer

        self._start(sft_trainer(cfg))

    def _train(self, resume: bool) -> dict:
        from rlhflab.trainers.sft import run_sft

        return run_sft(self.engine, resume)


class RewardTrainer(_ModelOut):
    """Bradley-Terry reward-model training: ``rlhflab rm`` from Python. ``model``: the
    model to start from (a causal LM gets a fresh head per ``rm.heads``); ``pairs`` as for
    :class:`DPOTrainer`. The result scores answers as ``reward=`` of the other trainers.
    ``rm.ensemble_size=k`` trains k members as the command does (``output_dir``/member-i,
    seed + i); ``train()`` returns member 0's result with ``members`` and ``ensemble``;
    ``model`` is the member trained last. A callback's stop ends the ensemble; a failed
    ``train()`` goes on from the member it failed in."""

    stage = "rm"

    def __init__(
        self,
        model=None,
        pairs=None,
        *,
        tokenizer=None,
        config=None,
        overrides=None,
        output_dir=None,
        callbacks=None,
        resume: bool = False,
    ):
        super().__init__(config, overrides, callbacks, resume)
        cfg = self.config
        k = cfg.rm.ensemble_size
        run = "member-0/run" if k > 1 else "run"  # whose config.yaml a resume reads
        inputs, cfg.rm.init = self._setup(output_dir, model, tokenizer, resume, cfg.rm.init, run)
        rows = I.rows_file(pairs, inputs / "pairs.jsonl", "pairs", cfg.data.split, I.pair_row)
        RI.set_data(cfg, rows, "rm.data", Path(cfg.rm.output_dir) / run, resume)
        validate(cfg, self.stage)
        from rlhflab.trainers.rm import rm_trainer
        from rlhflab.trainers.rm_ensemble import member_configs

        # members are built one at a time as they train (one model in memory)
        self._members = member_configs(cfg) if k > 1 else [cfg]
        self._results: list[dict] = []  # of the members trained so far, in order
        self._start(rm_trainer(self._members[0]))
        self._engine_of = 0  # the member self.engine trains

    def _train(self, resume: bool) -> dict:
        from rlhflab.trainers.rm import rm_trainer, run_rm
        from rlhflab.trainers.rm_ensemble import ensemble_result

        if len(self._members) == 1:
            return run_rm(self.engine, resume)
        if resume and self._results and self._results[-1].get("stop_reason"):
            self._results.pop()  # the member a stop cut short goes on, as in a new process
        while len(self._results) < len(self._members):
            i = len(self._results)
            if self._engine_of != i:  # the last member's model is freed before the next loads
                self.engine, self._engine_of = None, None
                self._start(rm_trainer(self._members[i]))
                self._engine_of = i
            self._results.append(run_rm(self.engine, resume))
            reason = self._results[-1].get("stop_reason")
            if reason and i + 1 < len(self._members):
                n = len(self._members)
                log.warning("rm.ensemble_size=%d: stopped after member %d (%s)", n, i, reason)
                break
        return ensemble_result(self._results)


__all__ = [
    "DPOTrainer",
    "GRPOTrainer",
    "PPOTrainer",
    "RLOOTrainer",
    "RewardTrainer",
    "SFTTrainer",
    "Trainer",
    "resolve_config",
]
