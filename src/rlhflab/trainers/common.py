"""Pieces every trainer shares: optimisers, schedules, prompt sets, progress bars."""

from __future__ import annotations

import logging
import math
import shutil
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import yaml

from rlhflab.backends.loss_scale import LossScaler
from rlhflab.backends.optim import FusedAdamW, LambdaSchedule
from rlhflab.builtin import tasks
from rlhflab.config import Config
from rlhflab.errors import RlhflabError
from rlhflab.experience.data import PromptStream, load_prompts
from rlhflab.infra import checkpoint as C
from rlhflab.infra.files import share_like_umask, writing
from rlhflab.infra.run_lock import refuse_held
from rlhflab.infra.runlog import refuse_missing_loggers

log = logging.getLogger(__name__)


class TrainingHalted(RlhflabError, RuntimeError):
    """The run stopped on purpose: a loss, gradient or reward that is not finite (raised by
    :meth:`Halt.error` in every trainer). A user error: the command prints the message, one
    line, and exits 2; the last good state is on disk as the message says."""


@dataclass(frozen=True)
class Halt:
    """How a trainer stops on a value that is not finite: one rule for every trainer.

    The message names the trainer's step, what was not finite, the setting to lower and
    ``kept()``: what the run leaves behind intact (called at the halt, so a checkpoint
    written just before is named). Nothing is updated after a non-finite value is seen.
    """

    trainer: str  # as the message names it: "SFT", "RM", "DPO", "PPO"
    setting: str  # the learning rate to lower: "sft.lr"
    kept: Callable[[], str]
    unit: str = "step"

    def error(self, step: int, what: str, hint: str = "") -> TrainingHalted:
        return TrainingHalted(
            f"{self.trainer} {self.unit} {step}: non-finite {what}; lower {self.setting}{hint}. "
            f"{self.kept()}"
        )

    def check(self, value: torch.Tensor, step: int, what: str) -> None:
        if not bool(torch.isfinite(value).all()):
            raise self.error(step, what)


LAST_GOOD = "last-good"


def keep_last_good(model, tokenizer, out: Path) -> Callable[[], str]:
    """A :class:`Halt` ``kept`` for a supervised stage that writes its model once, at the
    end: at a halt the weights are still the last good ones (the bad update was refused), so
    they are saved to ``OUT/last-good`` (written in a temporary folder, then renamed) and
    ``OUT`` itself is left as it was."""

    def kept() -> str:
        final = Path(out) / LAST_GOOD
        tmp = final.with_name(LAST_GOOD + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            with writing(final, "model"):
                model.save_pretrained(tmp, safe_serialization=True)
                tokenizer.save_pretrained(tmp)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)  # a full disk stays no fuller
            raise
        share_like_umask(tmp)
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
        return f"The weights before that step (the last good state) are in {final}."

    return kept


def build_optimizer(groups: list[dict], p):
    """AdamW with the configured ε and weight decay (OAI19/N+ use ε = 1e-5)."""
    return _adamw(groups, eps=p.adam_eps, weight_decay=p.weight_decay)


def _adamw(groups: list[dict], **options):
    """rlhflab's FusedAdamW (torch's fused kernel without torch.optim's import cost,
    rlhflab/backends/optim.py) where it applies, else torch's own AdamW (sharded FSDP2 weights)."""
    params = [q for g in groups for q in g["params"]]
    if fused_ok(params):
        return FusedAdamW(groups, **options)
    return torch.optim.AdamW(groups, **options)


def fused_ok(params) -> bool:
    """Whether torch's fused AdamW applies: plain (not sharded) floating tensors on the CPU
    or CUDA. It updates each tensor in one pass; the default per-tensor loop makes ~10 passes
    over every weight and its two moments, which on a CPU is memory-bound: about 4 % of a
    25M-parameter PPO iteration (benchmarks/vs_trl.py)."""
    # A DTensor exists only once its module is imported (by FSDP2); importing it here would
    # pull in torch's compiler stack (~40 MiB resident) for nothing.
    dtensor = getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)
    return all(
        (dtensor is None or type(q) is not dtensor)
        and q.is_floating_point()
        and q.device.type in ("cpu", "cuda")
        for q in params
    )


def lr_factor(step: int, warmup: int, total: int, schedule: str) -> float:
    """Multiplier of the base learning rate at optimiser step ``step`` (0-based)."""
    if warmup and step < warmup:
        return (step + 1) / warmup
    if schedule == "constant":
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    if schedule == "linear":
        return 1.0 - progress
    return 0.5 * (1.0 + math.cos(math.pi * progress))


def build_optimizer_simple(params, lr: float):
    """AdamW with torch's defaults, for the supervised stages (SFT, reward model)."""
    return _adamw([{"params": list(params)}], lr=lr)


def supervised_step(
    model,
    opt,
    sched,
    loss,
    step: int,
    halt: Halt,
    max_norm: float = 1.0,
    scaler: LossScaler | None = None,
) -> float:
    """Backward, clip, step and clear for SFT, RM and DPO; returns the loss value. ``loss``:
    the batch's loss, or an iterable of its parts (``*.micro_batch_size``: each part's share
    of the batch's loss, backpropagated as it comes, so that one part's activations are held
    at a time; the value returned is their sum). A loss or gradient that is not finite
    raises ``halt``'s error before the weights change (a NaN gradient would make every
    weight NaN and the next loss too). With an enabled ``scaler`` (model.compute_dtype=fp16)
    each loss is scaled before backward and the gradients unscaled before the clip; an
    overflow then skips this step's update (weights and schedule unchanged) and lowers the
    scale instead of halting."""
    scaler = scaler or LossScaler(enabled=False)
    total = 0.0
    for part in [loss] if isinstance(loss, torch.Tensor) else loss:
        try:
            halt.check(part, step, "loss")
        except BaseException:
            opt.zero_grad(set_to_none=True)  # an earlier part's gradients: not this step's
            raise
        scaler.scaled(part).backward()
        total += part.item()
    scaler.unscale_(model.parameters())
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    overflow = not bool(torch.isfinite(norm))
    if scaler.update(overflow):
        opt.zero_grad(set_to_none=True)
        log.info(
            "step %d: fp16 gradients overflowed; step skipped, loss scale now %g",
            step,
            scaler.scale,
        )
        return total
    if overflow:
        opt.zero_grad(set_to_none=True)
        raise halt.error(step, "gradient")
    opt.step()
    sched.step()
    opt.zero_grad(set_to_none=True)
    return total


def build_scheduler(
    opt, warmup_steps: int, total_steps: int, schedule: str, section: str | None = None
) -> LambdaSchedule:
    """The learning-rate schedule; ``section`` (the config section whose ``warmup_steps``
    and ``lr`` these are) is named when the warm-up outlasts the run, which then never
    trains at its learning rate (sft.steps=3 under the default 30 warm-up steps: 10 %)."""
    if section is not None and warmup_steps > total_steps > 0:
        log.warning(
            "%s.warmup_steps=%d is more than the run's %d optimiser steps: the learning rate "
            "rises for the whole run and ends at %.0f%% of %s.lr; lower %s.warmup_steps",
            section,
            warmup_steps,
            total_steps,
            100 * total_steps / warmup_steps,
            section,
            section,
        )
    return LambdaSchedule(opt, lambda s: lr_factor(s, warmup_steps, total_steps, schedule))


def load_prompt_set(cfg: Config, tokenizer) -> PromptStream:
    """Prompts from ``data.prompts`` or, when unset, the built-in task's training prompts.

    A forgotten key falls back to a built-in default: said aloud when the other half of
    the config is the user's own (their model on the toy prompts, or their prompts on a
    random preset), which is rarely what was meant (issue #31)."""
    own_model = not cfg.model.policy.startswith("preset:")
    if own_model and not cfg.data.prompts and not _sft_on_builtin_task(cfg.model.policy):
        log.warning(
            "data.prompts is not set: %s trains on the built-in task's prompts; set "
            "data.prompts to a file (or a dataset folder) of your own",
            cfg.model.policy,
        )
    if cfg.data.prompts and not own_model:
        log.warning(
            "model.policy is not set to a folder: %s is a randomly initialised built-in "
            "model; set model.policy to your model's folder",
            cfg.model.policy,
        )
    if cfg.data.prompts:
        prompts, _ = load_prompts(
            cfg.data.prompts,
            tokenizer,
            cfg.rollout.max_prompt_tokens,
            cfg.data.prompt_field,
            cfg.data.messages_field,
            cfg.data.on_bad_row,
            cfg.data.split,
        )
    else:
        skills = tasks.skills_of(cfg.data.task)
        prompts = [ex.prompt for ex in tasks.make_examples(2000, cfg.seed + 101, skills)]
    return PromptStream(prompts, cfg.rollout.prompts_per_iteration, cfg.seed)


def _sft_on_builtin_task(folder: str) -> bool:
    """Whether ``folder`` is a policy that ``rlhflab sft`` trained on the built-in task (its
    run/config.yaml names no sft.data): the demo's own pipeline, where the built-in prompts
    are the point and the warning would be noise."""
    try:
        saved = yaml.safe_load((Path(folder) / "run" / "config.yaml").read_text())
    except (OSError, yaml.YAMLError):
        return False
    sft = saved.get("sft") if isinstance(saved, dict) else None
    return isinstance(sft, dict) and "data" in sft and sft["data"] is None


# seconds between a progress bar's redraws when stderr is a file or a pipe (a batch job's
# log, CI): each redraw there is another carriage-return-joined copy of the line, ten a
# second by default; one every half minute still shows a run is alive
NON_TTY_INTERVAL = 30.0


def progress(iterable, enabled: bool, desc: str, **kwargs):
    if not enabled:
        return iterable
    from tqdm.auto import tqdm

    if not _stderr_is_terminal() and "ipykernel" not in sys.modules:  # a notebook's widget
        # redraws in place; maxinterval too, or tqdm's monitor thread redraws every 10 s
        kwargs.setdefault("mininterval", NON_TTY_INTERVAL)
        kwargs.setdefault("maxinterval", NON_TTY_INTERVAL)
    return tqdm(iterable, desc=desc, dynamic_ncols=True, **kwargs)


def _stderr_is_terminal() -> bool:
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):  # replaced by an object without it, or closed
        return False


def single_model_state(trainer) -> dict:
    """The training state of a one-optimiser trainer (SFT, RM, DPO): its step count,
    optimiser, schedule and random generators, as its checkpoints hold them."""
    return {
        "iteration": trainer.iteration,
        "optim": trainer.opt.state_dict(),
        "sched": trainer.sched.state_dict(),
        "rng": C.rng_state(trainer.gens),
        "loss_scale": trainer.scaler.state_dict(),
    }


def load_keeping_settings(optimizer, load: Callable[[], None]) -> None:
    """Restore ``optimizer``'s moments and step counts with ``load()`` (its or FSDP's
    state-dict loader), keeping the settings this run's config gave its parameter groups
    (lr, weight decay, eps, betas): a state dict carries the settings of the run that wrote
    it, and a resume that changed them trained on with the old ones while saying the new."""
    kept = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    load()
    for group, settings in zip(optimizer.param_groups, kept):
        group.update(settings)


def load_single_model_state(trainer, s: dict) -> None:
    """Restore what :func:`single_model_state` saved."""
    trainer.iteration = int(s["iteration"])
    # moments and step counts from the checkpoint; lr, weight decay, eps: the config's
    load_keeping_settings(trainer.opt, lambda: trainer.opt.load_state_dict(s["optim"]))
    trainer.sched.load_state_dict(s["sched"])
    C.restore_rng(s["rng"], trainer.gens)
    trainer.scaler.load_state_dict(s.get("loss_scale", {}))  # fp16 runs; older checkpoints


def refuse_before_models(cfg: Config, run_dir: Path, field: str, is_main: bool = True) -> None:
    """What refuses a start before any model loads — seconds, not minutes: another run
    holding ``run_dir`` (``field`` chose it; collective under torchrun), and a logger
    (``log.tensorboard``/``log.wandb``) asked for without its package."""
    refuse_held(run_dir, field, is_main)
    refuse_missing_loggers(cfg.log.tensorboard, cfg.log.wandb)
