"""A sweep's study and its folder: the study opened (created or continued) with its
sampler and pruner, refused where it would mix two experiments, and a sweep folder that
belongs to one study (:mod:`rlhflab.app.sweep` runs the trials)."""

from __future__ import annotations

import json
import math
import os
import socket
import warnings
import zlib
from pathlib import Path

from rlhflab.config import Config, ConfigError, absolute_paths
from rlhflab.infra.files import write_text_atomic
from rlhflab.models.prepare import first_line


def claim_folder(sweep_dir: Path, name: str, record: bool = False) -> None:
    """A sweep folder holds one study: its trial-NNN folders, sweep.json, best.yaml and
    report.html are that study's. A second study there would overwrite them (its trial 0
    replacing the first's), so it is refused, naming the study the folder holds; the name
    is recorded in ``study.json`` (``record``: once the study is open and holds this
    experiment, so that a start refused before then claims nothing; a folder from before
    has its sweep.json's)."""
    owner = None
    for f, key in ((sweep_dir / "study.json", "study"), (sweep_dir / "sweep.json", "name")):
        try:
            owner = json.loads(f.read_text(encoding="utf-8")).get(key)
        except (OSError, ValueError, AttributeError):
            continue
        if owner is not None:
            break
    if owner is not None and owner != name:
        raise ConfigError(
            f"sweep: {sweep_dir} holds study {owner!r} (its trial folders, sweep.json and "
            f"best.yaml); study {name!r} there would overwrite them — give it another --out, "
            f"or --name {owner} to continue that study"
        )
    if owner is None and record:
        write_text_atomic(sweep_dir / "study.json", json.dumps({"study": name}) + "\n")


def check_storage(url: str) -> None:
    """A --storage that is no database URL, refused before any worker starts (Optuna would
    fail deep in SQLAlchemy's URL parser, once per worker)."""
    if "://" not in url:
        raise ConfigError(
            f"--storage {url!r}: not a database URL; give one Optuna can open, such as "
            "sqlite:///sweep.db or postgresql://user@host/db"
        )


def _storage(optuna, url: str):
    """Optuna's storage for ``url``; a database one with heartbeats: a trial whose process
    died (kill -9, a lost machine) stops beating and is marked failed, so it never counts
    towards --trials."""
    if not url.startswith(("sqlite", "postgresql", "mysql")):
        return optuna.storages.get_storage(url)
    with warnings.catch_warnings():  # heartbeats are "experimental" in Optuna's terms
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        return optuna.storages.RDBStorage(url, heartbeat_interval=30, grace_period=90)


def open_study(optuna, storage: str, name: str, cfg: Config, worker: int = 0, shared=False):
    """The study (created or continued), with a TPE sampler whose seed differs per worker,
    per restart and, on a ``shared`` storage (``--storage``), per machine."""
    s = cfg.sweep
    check_storage(storage)
    try:
        storage = _storage(optuna, storage)
    except Exception as exc:  # noqa: BLE001 - SQLAlchemy's many errors, one line each
        raise ConfigError(f"--storage {storage!r}: cannot be opened ({first_line(exc)})") from None
    if s.pruner == "median":
        warmup = int(s.prune_warmup * cfg.ppo.iterations)
        pruner = running_median_pruner(optuna, s.prune_after_trials, warmup)
    else:
        pruner = optuna.pruners.NopPruner()
    study = optuna.create_study(
        storage=storage,
        study_name=name,
        direction="maximize",
        pruner=pruner,
        load_if_exists=True,
    )
    # the sampler's stream: a rerun or another machine must not replay the trials already
    # in the study, so the seed mixes in how many there are (and, for a shared storage,
    # the machine and process)
    seed = cfg.seed + 1000 * worker + len(study.get_trials(deepcopy=False))
    if shared:
        seed += zlib.crc32(f"{socket.gethostname()}:{os.getpid()}".encode()) % 1_000_000
    # numpy's seeds (Optuna's) stop at 2^32; rlhflab's seed goes to 2^63 - 1
    seed %= 2**32
    study.sampler = optuna.samplers.TPESampler(seed=seed, n_startup_trials=s.startup_trials)
    return study


# not compared between starts of a study: changing them changes no trial's objective (the
# space is compared as check_space resolved it, not as written)
NOT_COMPARED = (
    "log",
    "threads",
    "device",
    "dist",
    "sweep.pruner",
    "sweep.prune_",
    "sweep.startup_trials",
    "sweep.space",
)


def keep_one_experiment(study, space: dict, base: dict) -> None:
    """A study ranks trials of one search space over one base config. A rerun under the
    same name that changed either (another space, ppo.iterations, the objective) would rank
    trials of different experiments together, and the report would read only the new
    space: refused, naming what changed. Both are recorded in the study when it starts
    (studies from before this check get them at their next start)."""
    from rlhflab.trainers.resume_checks import config_changes

    # folders absolute: the same sweep started with --out given another way is the same
    base = absolute_paths(base)
    mine = json.loads(json.dumps({"space": space, "base": base}, default=str))
    recorded = study.user_attrs.get("rlhflab_experiment")
    if recorded is None:
        study.set_user_attr("rlhflab_experiment", mine)
        return
    changes = [
        line
        for line in config_changes(recorded, mine)
        if not line.removeprefix("base.").startswith(NOT_COMPARED)
    ]
    if changes:
        shown = "; ".join(changes[:4]) + (f" (and {len(changes) - 4} more)" if changes[4:] else "")
        raise ConfigError(
            f"sweep: study {study.study_name!r} holds trials of another experiment ({shown}); "
            "give this one another --name and --out, or rerun with the study's settings"
        )


def running_median_pruner(optuna, startup_trials: int, warmup_steps: int):
    """Prune a trial whose objective *at this iteration* is below the median of the
    finished trials' at the same iteration, once ``startup_trials`` have finished and after
    ``warmup_steps`` iterations. Not Optuna's MedianPruner: it compares a trial's *best*
    value so far, and every trial's first iteration — the reference policy, KL 0 — is the
    same, often its best: a trial whose gold fell or whose KL ran away from there was never
    pruned (outside testing, stop 46: 8 of 8 ran out, one at −16.6 against a median of −0.5)."""

    class RunningMedianPruner(optuna.pruners.BasePruner):
        def prune(self, study, trial) -> bool:
            step = trial.last_step
            if step is None or step < warmup_steps:
                return False
            finished = study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))
            others = [  # a finished trial's NaN at this step would unorder the sort
                v
                for t in finished
                if t.number != trial.number
                and math.isfinite(v := t.intermediate_values.get(step, math.nan))
            ]
            if len(finished) < startup_trials or not others:
                return False
            others.sort()
            k = len(others)
            median = (others[(k - 1) // 2] + others[k // 2]) / 2
            value = trial.intermediate_values[step]
            return value != value or value < median  # NaN is pruned, as Optuna's does

    return RunningMedianPruner()
