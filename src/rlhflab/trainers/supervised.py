"""The supervised stages' trainer: SFT and reward-model training on :class:`RunLoop`.

Both draw a random batch, compute one loss and take one AdamW step, for a fixed number of
steps; what differs is the loss (``batch_loss``). Like PPO and DPO, they log to
``metrics.jsonl``, checkpoint (weights, optimiser, schedule, RNG) at
``<stage>.checkpoint_every`` steps and resume exactly with ``--resume``; their run files sit in
``OUTPUT_DIR/run`` so that ``OUTPUT_DIR`` itself stays a plain Hugging Face folder, written
once at the end. A loss or gradient that is not finite halts the run (:class:`Halt`) with the
last good weights in ``OUTPUT_DIR/last-good``.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import torch

from rlhflab import models as M
from rlhflab.backends.loss_scale import LossScaler
from rlhflab.config import Config, ConfigError
from rlhflab.config.base import to_dict
from rlhflab.infra import checkpoint as C
from rlhflab.infra.files import share_like_umask, writing
from rlhflab.models.prepare import restore_dropout
from rlhflab.trainers.common import (
    Halt,
    build_optimizer_simple,
    build_scheduler,
    keep_last_good,
    load_single_model_state,
    single_model_state,
    supervised_step,
)
from rlhflab.trainers.loop import RunLoop, RunResult

RUN = "run"  # OUTPUT_DIR/run: metrics.jsonl, config.yaml, checkpoints/


def check_output_folder(cfg: Config, stage: str, out: Path) -> None:
    """``OUTPUT_DIR`` gets the trained model's files: refused when it is the folder the
    model starts from (``rm.output_dir`` = the SFT model's folder replaced the SFT policy
    with a reward model), or when it holds files this stage did not write (a project's
    own config.json was replaced without a word). An empty folder (but for rlhflab's own
    run/ and inputs/), or one an earlier run of the same stage wrote (its ``run/``), is
    taken."""
    from rlhflab.infra.runinfo import read_run_info

    field = f"{stage}.output_dir"
    starts = [("model.policy", cfg.model.policy)]
    if stage == "rm" and cfg.rm.init:
        starts = [("rm.init", cfg.rm.init)]
    for name, source in starts:
        if isinstance(source, str) and Path(source).expanduser().resolve() == out.resolve():
            raise ConfigError(
                f"{field}: {out} is the folder of {name}, the model this stage starts from; "
                "the trained model would replace it — give another folder"
            )
    # rlhflab's own: the run's logs and checkpoints, the Python API's inputs
    if not out.is_dir() or all(p.name in (RUN, "inputs") for p in out.iterdir()):
        return
    # a stage's output has its run/ beside the model (run.json names the stage; an older
    # run, or one stopped before its start was recorded, may have none)
    wrote = (read_run_info(out / RUN) or {}).get("trainer")
    if (out / RUN).is_dir() and wrote in (None, stage.upper()):
        return
    held = (
        f"the model `rlhflab {wrote.lower()}` wrote"
        if isinstance(wrote, str)
        else "files rlhflab did not write"
    )
    raise ConfigError(
        f"{field}: {out} holds {held}; the {stage} model's files would replace them — "
        "give another (or an empty) folder"
    )


class SupervisedTrainer:
    """``steps`` AdamW steps on ``batch_loss(indices)`` over ``n_examples`` examples.

    ``stage`` names the command ("sft", "rm"): its config section gives ``lr``,
    ``warmup_steps``, ``steps``, ``batch_size``, ``checkpoint_every`` and ``output_dir``.
    """

    def __init__(
        self,
        cfg: Config,
        stage: str,
        model,
        tokenizer,
        n_examples: int,
        batch_loss: Callable[[list[int]], torch.Tensor],
    ):
        self.cfg, self.stage = cfg, stage
        self.section = getattr(cfg, stage)
        self.model, self.tokenizer = model, tokenizer
        self.device = next(model.parameters()).device
        self.n_examples, self.batch_loss = n_examples, batch_loss
        s = self.section
        self.opt = build_optimizer_simple(model.parameters(), s.lr)
        self.sched = build_scheduler(self.opt, s.warmup_steps, s.steps, "cosine", stage)
        self.scaler = LossScaler.for_model(cfg.model)  # model.compute_dtype=fp16's loss scale
        self.gens = {"batch": torch.Generator().manual_seed(cfg.seed)}
        self.out = Path(s.output_dir)
        check_output_folder(cfg, stage, self.out)
        self.run_dir = self.out / RUN
        self.iteration = 0
        self.stop_reason: str | None = None  # a supervised stage runs its steps to the end
        self.step_hooks: list = []  # hook(step, metrics) after it is logged (RunLoop)
        self.losses: list[float] = []
        self.halt = Halt(stage.upper(), f"{stage}.lr", keep_last_good(model, tokenizer, self.out))
        # what the checkpoint code saves: a policy-like model, no critic
        self._cast = SimpleNamespace(
            policy=model, policy_lm=model, critic=None, tokenizer=tokenizer
        )

    def step(self) -> dict[str, float]:
        batch = self.section.batch_size
        idx = torch.randint(self.n_examples, (batch,), generator=self.gens["batch"]).tolist()
        # the forward under model.compute_dtype's autocast; the loss's maths reads fp32
        # log-probs and scores (autocast lowers matrix products only), as does backward
        autocast = functools.partial(M.compute_autocast, self.device, self.cfg.model.compute_dtype)
        with autocast():
            loss = self.batch_loss(idx)  # a tensor, or a generator of the batch's parts
        if not isinstance(loss, torch.Tensor):  # each part's forward under autocast too
            loss = _each_under(autocast, loss)
        used = self.opt.param_groups[0]["lr"]  # this step's (the schedule moves in the step)
        value = supervised_step(
            self.model,
            self.opt,
            self.sched,
            loss,
            self.iteration + 1,
            self.halt,
            scaler=self.scaler,
        )
        self.losses.append(value)
        return {"loss": value, "lr": used}

    def state_dict(self) -> dict:
        return {**single_model_state(self), "losses": list(self.losses)}

    def load_state_dict(self, s: dict) -> None:
        load_single_model_state(self, s)
        self.losses = [float(x) for x in s["losses"]]

    def save(self, step: int) -> Path:
        return C.save_checkpoint(
            self.run_dir, step, self._cast, self.state_dict(), self.cfg.log.keep_last
        )

    def load_checkpoint(self, path: Path) -> None:
        self.load_state_dict(C.load_checkpoint(path, self._cast))

    def fit(self, resume: bool = False) -> RunResult:
        """Run the steps (from the newest whole checkpoint with ``resume``), then write
        the model and tokenizer to ``OUTPUT_DIR``."""
        log_cfg = dataclasses.replace(
            self.cfg.log,
            output_dir=str(self.run_dir),
            checkpoint_every=self.section.checkpoint_every,
        )
        loop = RunLoop(
            self.run_dir,
            self.section.steps,
            log_cfg,
            to_dict(self.cfg),
            self.stage.upper(),
            postfix=lambda m: {"loss": f"{m['loss']:.3f}"},
        )
        start = time.perf_counter()
        done = loop.run(self, resume)
        self.out.mkdir(parents=True, exist_ok=True)
        # written beside, then moved in file by file (OUT also holds run/ and inputs/): a
        # write that fails (a full disk) leaves OUT's model as it was, and no half file
        tmp = self.out / ".model.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            with writing(self.out, "model"):
                self.model.save_pretrained(tmp, safe_serialization=True)
                restore_dropout(tmp, self.model)  # the source's, not the zeros trained with
                self.tokenizer.save_pretrained(tmp)
            share_like_umask(tmp)  # safetensors writes owner-only files
            for f in sorted(tmp.iterdir()):
                os.replace(f, self.out / f.name)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        done.seconds = time.perf_counter() - start
        return done

    def recent_loss(self, n: int = 20) -> float:
        """Mean of the last ``n`` steps' losses (the run's, resumed steps included)."""
        tail = self.losses[-n:]
        return sum(tail) / len(tail)


def _each_under(context, parts):
    """The items of generator ``parts``, each computed inside ``context()`` (the forward
    under model.compute_dtype's autocast), each handed on outside it (backward is not)."""
    while True:
        with context():
            part = next(parts, None)
        if part is None:
            return
        yield part
