"""The run around any trainer: resume, config.yaml, the run log, progress, checkpoints.

:class:`RunLoop` drives a *job* for a fixed number of steps. The job is any object with

- ``iteration``: steps done so far (the loop adds 1 after each step; a resume restores it);
- ``step() -> dict[str, float]``: one step (a PPO iteration, an optimiser step), its metrics;
- ``save(step) -> Path``: write ``checkpoints/step-N`` (collective under torchrun);
- ``load_checkpoint(path)``: restore weights and state from such a folder;
- ``stop_reason``: None, or why the run should stop after this step;
- optionally ``step_hooks``: callables ``hook(step, metrics)`` run after each step is logged
  (the Python API's callbacks); one that returns a true value stops the run there, with a
  checkpoint, as a stop reason would.

What a step adds to the log beyond its metrics (sample answers, monitor alerts), the
progress bar's summary and the facts the job adds to ``run.json`` (:mod:`rlhflab.infra.runinfo`:
dates, wall time, versions, machine; written at the start and the end) are optional hooks
of the loop. Under torchrun every rank runs the loop (steps and saves are collective); only
rank 0 writes files.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from rlhflab.config import PATH_FIELDS, ConfigError, LogConfig, absolute_paths
from rlhflab.config.base import dump_yaml_text
from rlhflab.infra import checkpoint as C
from rlhflab.infra import runinfo
from rlhflab.infra.files import write_text_atomic
from rlhflab.infra.run_lock import rank_zero_lock
from rlhflab.infra.runlog import (
    EARLIER_RUN_FILES,
    RunLog,
    earlier_run_files,
    holds_something,
    last_logged_metrics,
)
from rlhflab.trainers.common import progress
from rlhflab.trainers.resume_checks import (
    checkpoint_of_this_run,
    config_changes,
    read_recorded_config,
)

log = logging.getLogger(__name__)


class Job(Protocol):
    iteration: int
    stop_reason: str | None

    def step(self) -> dict[str, float]: ...
    def save(self, step: int) -> Path: ...
    def load_checkpoint(self, path: Path) -> None: ...


class NullLog:
    """What ranks other than 0 write: nothing."""

    def metrics(self, *a) -> None: ...
    def samples(self, *a) -> None: ...
    def alerts(self, *a) -> None: ...
    def close(self) -> None: ...


@dataclass
class RunResult:
    steps: int  # steps done, resumed ones included
    last: dict[str, float]  # the last step's metrics ({} when none ran)
    stop_reason: str | None
    seconds: float  # wall time of this call


@dataclass
class RunLoop:
    run_dir: Path
    total: int  # the step the run ends at
    log: LogConfig  # checkpoint_every, samples, progress, tensorboard, wandb
    config: dict  # the resolved config, written to config.yaml and to the run log
    name: str  # the progress bar's label
    is_main: bool = True  # rank 0 (or a single process): the one that writes files
    # (n) -> up to n sample answers of the last step, logged every log.sample_every steps
    samples: Callable[[int], list[dict]] | None = None
    alerts: Callable[[int], list[dict]] | None = None  # (step) -> alerts raised at that step
    postfix: Callable[[dict], dict[str, str]] | None = None  # (metrics) -> the bar's summary
    # () -> facts the job adds to run.json (model sizes, the gold reward's story), called
    # when the run starts and when it ends
    facts: Callable[[], dict] | None = None
    # (run_dir, set_aside) -> the newest checkpoint that is whole, or None: by default
    # rlhflab's checkpoint format's check; a job that writes another format brings its own
    latest: Callable[[Path, bool], Path | None] = C.latest_checkpoint

    def __post_init__(self):
        # absolute: export, generate, eval and --resume find base model and data from anywhere
        self.config = absolute_paths(self.config)

    def run(self, job: Job, resume: bool = False) -> RunResult:
        field = f"{_OUTPUT.get(self.name, 'log')}.output_dir"
        with rank_zero_lock(self.run_dir, field, self.is_main):
            # what a job writes into the run folder before it runs (the Python API's
            # record of its rewards) waits for the lock: a refused start writes nothing
            if self.is_main and getattr(job, "on_locked", None) is not None:
                job.on_locked()
            return self._run(job, resume)

    def _run(self, job: Job, resume: bool) -> RunResult:
        start = time.perf_counter()
        ran = job.iteration  # > 0: this job object trained before, in this process
        if ran and not resume:
            raise ConfigError(
                f"{self.name}: this trainer has already run in {self.run_dir} (to iteration "
                f"{ran} of {self.total}); training it afresh would delete the logs and "
                "checkpoints of the model it holds. Continue it from its newest checkpoint "
                "with resume (train(resume=True)), or make a new trainer to start over"
            )
        resume_step = self._resume(job) if resume else None
        if ran and resume_step is None:
            raise ConfigError(
                f"{self.name}: resume: {self.run_dir} has no checkpoint to continue this "
                f"trainer from (it ran to iteration {ran}, before its first checkpoint); make "
                "a new trainer to start over"
            )
        _every_rank_here()  # each rank has read the checkpoints before rank 0 moves any
        runlog = self._open_log(resume_step, asked_resume=resume)
        bar = progress(
            range(job.iteration, self.total),
            self.log.progress and self.is_main,
            self.name,
            initial=job.iteration,
            total=self.total,
        )
        metrics: dict = {}
        reason = None
        info, died = self._start_info(job, resume_step), None
        try:
            for _ in bar:
                metrics = job.step()
                job.iteration += 1
                logged = self._record(runlog, job.iteration, metrics)
                if hasattr(bar, "set_postfix") and self.postfix is not None:
                    # drawn at the bar's pace (a refresh here redrew every step into a log)
                    bar.set_postfix(refresh=False, **self.postfix(metrics))
                asked = _hooks_stop(job, metrics)  # every step, the trainer's last one too
                reason = job.stop_reason or asked
                if reason and not logged:  # the answers that the run ends on, too
                    self._log_samples(runlog, job.iteration)
                if self._checkpoint_due(job, reason):
                    job.save(job.iteration)
                    self._note_progress(info, job, time.perf_counter() - start)
                if reason:
                    log.warning("stopped: %s", reason)
                    break
        except BaseException as exc:  # this run's own (sys.exc_info() in the finally also
            died = exc  # gave one a caller was handling around this fit(): "failed")
            raise
        finally:
            runlog.close()
            self._end_info(info, job, reason, time.perf_counter() - start, died)
        if resume_step is not None and job.iteration == resume_step:
            # resumed where the run had already ended: no step ran in this call, and what
            # it returns is the last step's logged metrics, not {} (a KeyError in the
            # command's closing line, an empty summary from Python)
            log.info(
                "%s: already at step %d of %d; nothing left to run",
                self.name,
                resume_step,
                self.total,
            )
            metrics = last_logged_metrics(self.run_dir, resume_step) if self.is_main else {}
        return RunResult(job.iteration, metrics, reason, time.perf_counter() - start)

    def _start_info(self, job: Job, resume_step: int | None) -> dict:
        """run.json as the run starts (rank 0): a resume keeps its first start, wall time."""
        if not self.is_main:
            return {}
        old = (runinfo.read_run_info(self.run_dir) or {}) if resume_step is not None else {}
        info = {
            "trainer": self.name,
            "started": old.get("started") or runinfo.now(),
            "finished": None,
            "total": self.total,  # a report of a killed run still knows what it aimed at
            # what the run's relative defaults were made absolute against (config.PATH_FIELDS)
            "started_in": old.get("started_in") or os.getcwd(),
            "wall_s_before": _wall_before(old) if resume_step is not None else 0.0,
            **({"resumed_at": resume_step} if resume_step is not None else {}),
            **runinfo.machine_facts(),
            **self._facts(),
            "data": runinfo.data_fingerprints(self.config, self.name),
        }
        for changed in runinfo.data_changes(old.get("data"), info["data"]):
            log.warning("--resume: %s changed since the steps so far read it", changed)
        runinfo.write_run_info(self.run_dir, info)
        return info

    def _note_progress(self, info: dict, job: Job, seconds: float) -> None:
        """run.json at a checkpoint: wall time and steps so far, which a resume after a
        ``kill -9`` adds its own to (time after the last checkpoint is not counted)."""
        if self.is_main:
            with contextlib.suppress(OSError):  # a record; the checkpoint itself is written
                # not wall_s/steps: a report of the run still going (or killed) reads those
                # as its end, where its logs go on past this checkpoint
                wall = info["wall_s_before"] + seconds
                note = {"wall_s_at_checkpoint": wall, "checkpoint_step": job.iteration}
                runinfo.write_run_info(self.run_dir, {**info, **note})

    def _end_info(self, info, job: Job, reason, seconds: float, exc=None) -> None:
        if not self.is_main:
            return
        info = {
            **info,
            "finished": runinfo.now(),
            "wall_s": info["wall_s_before"] + seconds,
            "steps": job.iteration,
            "total": self.total,
            "stop_reason": reason,
            "error": type(exc).__name__ if exc is not None else None,
            "error_message": str(exc)[:2000] if exc is not None else None,
            **self._facts(),
        }
        try:
            runinfo.write_run_info(self.run_dir, info)
        except OSError as exc:  # never hide the exception a run may be ending with
            log.warning("run.json: not written (%s)", exc)

    def _facts(self) -> dict:
        if self.facts is None:
            return {}
        try:
            return self.facts()
        except Exception as exc:  # noqa: BLE001 - run.json is a record; never fail a run for it
            log.warning("run.json: the trainer's facts are left out (%s)", exc)
            return {}

    def _resume(self, job: Job) -> int | None:
        """Load the newest whole checkpoint, if any; the step it was written at, or None.
        Every rank picks the same one (``latest``, by default
        :func:`rlhflab.infra.checkpoint.latest_checkpoint`, skips damaged ones); rank 0 alone
        sets a damaged one aside. A run another command wrote is refused: its steps would
        count as this one's (an SFT run's steps as DPO steps, a PPO run's β in GRPO)."""
        other = (runinfo.read_run_info(self.run_dir) or {}).get("trainer")
        if isinstance(other, str) and other != self.name:
            raise ConfigError(
                f"--resume: {self.run_dir} holds a {other} run, not a {self.name} run; resume "
                f"it with `rlhflab {other.lower()} --resume`, or give this run another folder"
            )
        last = self.latest(self.run_dir, self.is_main)
        if last is None:  # _set_earlier_run_aside says so
            return None
        with checkpoint_of_this_run(self.run_dir, self.config):  # refuses other models
            job.load_checkpoint(last)
        log.info("resumed from %s", last)
        return job.iteration

    def _open_log(self, resume_step: int | None, asked_resume: bool = False):
        if not self.is_main:
            return NullLog()
        self.run_dir.mkdir(parents=True, exist_ok=True)
        saved = self.run_dir / "config.yaml"
        # a resume with no step left to run keeps the run's record (changes are only said)
        rewrite = resume_step is None or resume_step < self.total or not saved.is_file()
        if resume_step is not None and saved.is_file():
            changes = config_changes(read_recorded_config(saved), self.config)
            for line in changes:
                log.warning("--resume: the config differs from the run's: %s", line)
            kept = self.run_dir / f"config.until-step-{resume_step}.yaml"
            # config.yaml is replaced next: keep the settings the steps so far ran with (the
            # first copy for step N is the true one: a later resume at N again may follow a
            # resume whose own steps were lost)
            if changes and rewrite and not kept.exists():
                shutil.copy2(saved, kept)
                log.warning(
                    "--resume: the settings of steps 1-%d are kept in %s", resume_step, kept
                )
        if resume_step is None and (asked_resume or self.log.earlier_run == "keep"):
            self._set_earlier_run_aside(asked_resume)
        elif resume_step is None:
            self._clear_earlier_run()
        if rewrite:  # whole or not at all: a resume reads it back
            write_text_atomic(saved, dump_yaml_text(self.config))
        return RunLog(self.run_dir, self.log.tensorboard, self.log.wandb, self.config, resume_step)

    def _clear_earlier_run(self) -> None:
        """``log.earlier_run=replace``: the earlier run goes whole — logs (RunLog), checkpoints
        and report (a newer step-N of it would be what --resume, export, generate pick)."""
        stale = earlier_run_files(self.run_dir, ("checkpoints", "report.html", "tensorboard"))
        if not stale:
            return
        self._refuse_reading_from_checkpoints("delete")
        log.warning(
            "%s holds an earlier run: starting afresh replaces its checkpoints and logs "
            "(--resume would have continued it)",
            self.run_dir,
        )
        for p in stale:
            shutil.rmtree(p) if p.is_dir() else p.unlink()

    def _set_earlier_run_aside(self, asked_resume: bool) -> None:
        """A fresh start in a folder that holds a run (``log.earlier_run=keep``), or a
        --resume with no step-N checkpoint to continue (it starts afresh, as a job script
        that always passes --resume expects): the earlier run's logs, checkpoints and
        report move into ``earlier-<time>/`` (with a copy of its config.yaml), not deleted."""
        found = earlier_run_files(self.run_dir, EARLIER_RUN_FILES)
        # run.json alone is a start that logged nothing (killed while loading its models)
        if not any(holds_something(p) for p in found if p.name != "run.json"):
            if asked_resume:
                log.info("--resume: no checkpoint in %s; starting fresh", self.run_dir)
            return
        self._refuse_reading_from_checkpoints("move")
        stamp = time.strftime("earlier-%Y%m%d-%H%M%S", time.gmtime())
        aside, n = self.run_dir / stamp, 1
        while aside.exists():  # two restarts within a second
            n += 1
            aside = self.run_dir / f"{stamp}-{n}"
        aside.mkdir()
        for p in found:
            p.rename(aside / p.name)
        if (self.run_dir / "config.yaml").is_file():  # this run's replaces it next
            shutil.copy2(self.run_dir / "config.yaml", aside / "config.yaml")
        why = (
            "--resume: %s holds no checkpoint to continue from; starting afresh"
            if (asked_resume)
            else "%s holds an earlier run; starting afresh (--resume continues it; log.earlier_run)"
        )
        log.warning(
            why + " — the earlier run's logs and checkpoints are kept in %s",
            self.run_dir,
            aside,
        )

    def _refuse_reading_from_checkpoints(self, verb: str) -> None:
        """Never delete or move the checkpoints a setting of this run reads from."""
        kept = (self.run_dir / "checkpoints").resolve()
        for sec, name in PATH_FIELDS:
            values = (self.config.get(sec) or {}).get(name)
            for value in values if isinstance(values, list) else [values]:
                if isinstance(value, str) and kept in Path(value).resolve().parents:
                    raise ConfigError(
                        f"{sec}.{name}: {value} is inside {kept}, which starting afresh in "
                        f"{self.run_dir} would {verb}; give this run another "
                        f"{_OUTPUT.get(self.name, 'log')}.output_dir (or --resume the old one)"
                    )

    def _record(self, runlog, step: int, metrics: dict) -> bool:
        """The step's metrics and alerts; its sample answers every log.sample_every steps
        and at the last (a run shorter than that had none). Whether samples were logged."""
        runlog.metrics(step, metrics)
        if self.alerts is not None:
            runlog.alerts(self.alerts(step))
        if step % self.log.sample_every == 0 or step == self.total:
            return self._log_samples(runlog, step)
        return False

    def _log_samples(self, runlog, step: int) -> bool:
        n = self.log.samples_per_log
        if self.samples is None or not n:
            return False
        runlog.samples(step, self.samples(n))
        return True

    def _checkpoint_due(self, job: Job, stop_reason: str | None) -> bool:
        """Every log.checkpoint_every steps, at the last step, and before a stop."""
        return bool(
            job.iteration % self.log.checkpoint_every == 0
            or job.iteration == self.total
            or stop_reason
        )


def _wall_before(old: dict) -> float:
    """The wall time of the runs before a resume, from their run.json: the end's, or for
    a run killed before its end its last checkpoint's note (or the runs before it)."""
    return old.get("wall_s") or old.get("wall_s_at_checkpoint") or old.get("wall_s_before") or 0.0


_OUTPUT = {"SFT": "sft", "RM": "rm"}  # where SFT and RM name their folder (run/ in it)


def _every_rank_here() -> None:  # under torchrun (nothing without a process group)
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _hooks_stop(job: Job, metrics: dict) -> str | None:
    """Run the job's step hooks; the stop reason when one of them asks to stop (returns
    a true value). Each gets its own copy of the logged metrics: one that wrote into them
    changed the summary ``train()`` returns but not metrics.jsonl."""
    for hook in getattr(job, "step_hooks", ()):
        if hook(job.iteration, dict(metrics)):
            return f"a callback ({getattr(hook, '__name__', hook)}) asked to stop"
    return None
