"""``rlhflab sweep``: the dozens of small experiments before a big run, on Optuna.

Each trial is an ordinary run directory (``SWEEP/trial-NNN``) of the configured method with
the settings Optuna's TPE sampler picked from ``sweep.space``. Every iteration the trial
reports its running objective (gold where a gold reward is set, else the proxy, minus a
penalty for KL above ``sweep.kl_budget``) through the run loop's step hook, so the median
pruner can stop a hopeless trial early (with a checkpoint). The study lives in an SQLite
file in the sweep's folder (any Optuna RDB URL with ``--storage``): a ``kill -9`` loses at
most the trials in flight, and rerunning the command continues the study until it holds
``--trials`` finished trials. Results: ``sweep.json``, ``best.yaml`` and ``report.html``
(:mod:`rlhflab.app.sweep_report`).
"""

from __future__ import annotations

import copy
import logging
import math
import os
import subprocess
import sys
from pathlib import Path

from rlhflab.app.sweep_study import claim_folder, keep_one_experiment, open_study
from rlhflab.config import (
    DEFAULT_SPACES,
    Config,
    ConfigError,
    load_config,
    validate,
)
from rlhflab.config import base as configbase
from rlhflab.errors import RlhflabError
from rlhflab.infra.child_process import ends_with_parent
from rlhflab.infra.files import WriteFailed
from rlhflab.trainers.common import TrainingHalted

log = logging.getLogger(__name__)

SPEC_KEYS = {"low", "high", "log"}
# what only a critic reads: the same run in every trial of a critic-free method
CRITIC_SETTINGS = ("ppo.critic_lr", "ppo.value_clip", "model.vf_coef", "model.critic_lora_r")
# settings every trial gets from the sweep itself, so a space cannot vary them: the method
# is chosen before any trial (sweep.method), each trial's folder and bar are the sweep's
FIXED_BY_THE_SWEEP = ("sweep.", "log.output_dir", "log.progress")


def require_optuna():
    try:
        import optuna
    except ImportError:
        raise ConfigError("rlhflab sweep needs optuna: pip install 'rlhflab[sweep]'") from None
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    return optuna


def _number(value, where: str) -> float | int:
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ConfigError(f"{where}: expected a number, got {value!r}")
    try:  # YAML 1.1 reads 1e-6 (no dot) as a string
        return value if isinstance(value, (int, float)) else float(value)
    except ValueError:
        raise ConfigError(f"{where}: expected a number, got {value!r}") from None


def _unread(key: str, base: dict, stage: str, space: dict) -> str | None:
    """Why trials of ``stage`` would not differ in setting ``key`` (None: they would)."""
    section = str(key).split(".")[0]
    if section in ("dpo", "sft"):
        return f"rlhflab {stage} never reads {section}.* settings"
    grouped = (base.get("ppo") or {}).get("advantage_estimator") in ("grpo", "rloo")
    if section == "grpo" and not grouped and "ppo.advantage_estimator" not in space:
        return "grpo.* settings are read by grouped estimators (sweep.method grpo or rloo) only"
    if stage in ("grpo", "rloo") and key in CRITIC_SETTINGS:
        return f"rlhflab {stage} trains no critic"
    if stage == "rloo" and key in ("grpo.normalize_std", "grpo.eps"):
        return "RLOO's leave-one-out baseline divides by no std"
    return None


def check_space(space: dict, base: dict, stage: str = "ppo") -> dict[str, dict]:
    """``space`` with its numbers parsed; each entry must name a setting that accepts the
    range's ends (or every choice), and one the trials read, so a typo or a setting of
    another method fails before any trial runs."""
    if not isinstance(space, dict) or not space:
        raise ConfigError("sweep.space: expected a mapping of setting → range, not empty")
    out = {}
    for key, spec in space.items():
        where = f"sweep.space.{key}"
        unread = _unread(key, base, stage, space)
        if unread:  # every trial the same run: the best and the importances would be noise
            raise ConfigError(f"{where}: {unread}, so every trial would be the same run")
        if key == "seed":
            raise ConfigError(
                f"{where}: a search over seeds picks the luckiest one; search the settings on "
                "one seed, then rerun the best on new seeds (docs/sweeps.md)"
            )
        if str(key).startswith(FIXED_BY_THE_SWEEP) or key in ("sweep", "log"):  # or whole
            raise ConfigError(
                f"{where}: set by the sweep for every trial (sweep.*, log.output_dir, "
                "log.progress), so a search space cannot vary it; run one sweep per value"
            )
        if not isinstance(spec, dict):
            raise ConfigError(f"{where}: expected {{low, high[, log]}} or {{choices: [...]}}")
        if "choices" in spec:
            if set(spec) != {"choices"} or not isinstance(spec["choices"], list):
                raise ConfigError(f"{where}: {{choices: [...]}} takes a list and nothing else")
            if not spec["choices"]:
                raise ConfigError(f"{where}: no choices")
            clean, probes = {"choices": list(spec["choices"])}, list(spec["choices"])
        else:
            if not {"low", "high"} <= set(spec) <= SPEC_KEYS:
                raise ConfigError(f"{where}: a range needs low and high (and optionally log)")
            low, high = _number(spec["low"], where + ".low"), _number(spec["high"], where + ".high")
            log_scale = spec.get("log", False)
            if not isinstance(log_scale, bool):  # a quoted 'false' is a true string
                raise ConfigError(f"{where}.log: expected true or false, got {log_scale!r}")
            if not low < high:
                raise ConfigError(f"{where}: low ({low}) must be below high ({high})")
            if log_scale and low <= 0:
                raise ConfigError(f"{where}: a log scale needs low > 0 (it is {low})")
            clean, probes = {"low": low, "high": high, "log": log_scale}, [low, high]
        for probe in probes:
            try:
                configbase.build(
                    Config, configbase.merge_overrides(copy.deepcopy(base), {key: probe})
                )
            except ConfigError as exc:
                raise ConfigError(f"{where}: {exc}") from None
        out[key] = clean
    return out


def suggest(trial, space: dict[str, dict]) -> dict:
    """One value per setting of ``space`` from an Optuna trial (ints where both ends are)."""
    params = {}
    for key, spec in space.items():
        if "choices" in spec:
            params[key] = trial.suggest_categorical(key, spec["choices"])
        elif isinstance(spec["low"], int) and isinstance(spec["high"], int):
            params[key] = trial.suggest_int(key, spec["low"], spec["high"], log=spec["log"])
        else:
            low, high = float(spec["low"]), float(spec["high"])
            params[key] = trial.suggest_float(key, low, high, log=spec["log"])
    return params


def iteration_objective(
    metrics: dict, use_gold: bool, kl_budget: float | None, kl_penalty: float
) -> float:
    """One iteration's objective: the batch's mean gold reward (or proxy score), less
    ``kl_penalty`` per nat of KL to the reference above ``kl_budget``."""
    value = float(metrics["monitor/gold"] if use_gold else metrics["objective/scores"])
    if kl_budget is not None:
        value -= kl_penalty * max(0.0, float(metrics["objective/kl"]) - kl_budget)
    return value


def uses_gold(cfg: Config) -> bool:
    objective = cfg.sweep.objective
    has_gold = bool(cfg.monitor.gold) and cfg.monitor.enabled
    if objective == "gold" and not has_gold:
        raise ConfigError(
            "sweep.objective: 'gold' needs monitor.gold (a gold reward function) and "
            "monitor.enabled; use 'proxy' or 'auto'"
        )
    return objective == "gold" or (objective == "auto" and has_gold)


def run_trial(trial, base: dict, space: dict, sweep_dir: Path, stage: str) -> float:
    """Train one trial's run to its end (or until pruned); its objective."""
    optuna = require_optuna()
    params = suggest(trial, space)
    log.info("trial %d: %s", trial.number, drawn(params))  # its own bar is off: say what runs
    data = configbase.merge_overrides(copy.deepcopy(base), params)
    out = sweep_dir / f"trial-{trial.number:03d}"
    data["log"].update(output_dir=str(out), progress=False)
    cfg = validate(configbase.build(Config, data), stage)
    s, use_gold = cfg.sweep, uses_gold(cfg)
    trial.set_user_attr("run_dir", str(out))
    from rlhflab.trainers.ppo import PPOTrainer

    engine = PPOTrainer(cfg)
    values: list[float] = []
    state = {"pruned": False}

    def report(step: int, metrics: dict) -> bool:
        values.append(iteration_objective(metrics, use_gold, s.kl_budget, s.kl_penalty))
        running = sum(values[-s.last_iterations :]) / len(values[-s.last_iterations :])
        trial.report(running, step)
        state["pruned"] = trial.should_prune()
        return state["pruned"]  # True stops the run here, with a checkpoint

    engine.step_hooks.append(report)
    engine.fit()
    trial.set_user_attr("iterations", len(values))
    if not values:
        raise TrainingHalted(f"trial {trial.number}: the run stopped before its first iteration")
    if state["pruned"]:
        raise optuna.TrialPruned(f"pruned at iteration {len(values)}")
    tail = values[-s.last_iterations :]
    value = sum(tail) / len(tail)
    if not math.isfinite(value):
        raise TrainingHalted(f"trial {trial.number}: the objective is not finite ({value})")
    return value


class _FailedTrialNoise(logging.Filter):
    """Optuna's two lines for a trial :func:`_trial` marked failed (NaN: "the value nan is
    not acceptable"), which read as a numeric failure where the trial's own line said why;
    and its ~40-line traceback of a trial stopped by Ctrl-C, which the command says in one
    line (``interrupted: ...``), as every command does."""

    def filter(self, record: logging.LogRecord) -> bool:
        said = record.getMessage()
        if record.exc_info and isinstance(record.exc_info[1], KeyboardInterrupt):
            return False
        if "KeyboardInterrupt" in said and "failed" in said:
            return False
        failed = ("failed with value nan", "failed with value None", "value nan is not acceptable")
        return not any(words in said for words in failed)


def _trial(trial, base: dict, space: dict, sweep_dir: Path, stage: str) -> float:
    """:func:`run_trial`, with a trial the trainer refuses (its drawn settings) or whose
    training halts said in one line and marked failed (NaN: Optuna's failed value), where
    Optuna's own catch logs a whole traceback for what is a message."""
    try:
        return run_trial(trial, base, space, sweep_dir, stage)
    except WriteFailed:  # a full disk fails every trial alike: the sweep stops here
        raise
    except RlhflabError as exc:  # its drawn settings refused (a model, data or reward
        # error included: a preset that does not exist), or its training halted
        log.warning("trial %d failed: %s", trial.number, exc)
        return math.nan


def drawn(params: dict) -> str:
    """A trial's settings in one short line."""
    return ", ".join(
        f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in params.items()
    )


def say_trial(study, trial) -> None:
    """Optuna's callback after each trial: how it ended, in one line (the sweep's progress;
    a pruned trial's run only says "a callback (report) asked to stop")."""
    state = trial.state.name.lower()
    how = {
        "complete": f"objective {trial.value:.4g}" if trial.value is not None else "complete",
        "pruned": f"pruned after {trial.user_attrs.get('iterations', '?')} iterations",
    }.get(state, state)
    done = sum(t.state.name in ("COMPLETE", "PRUNED") for t in study.get_trials(deepcopy=False))
    log.info("trial %d %s (%d finished)", trial.number, how, done)


def finished(optuna, study) -> int:
    states = (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED)
    return len(study.get_trials(deepcopy=False, states=states))


def optimise(study, optuna, total: int, objective) -> None:
    """Run trials, one at a time, until the study holds ``total`` finished (complete or
    pruned) ones; a trial whose settings are refused or whose training halts is marked
    failed and replaced, up to ``total`` failed trials in a row."""
    done_cb = optuna.study.MaxTrialsCallback(
        total, states=(optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED)
    )
    failed = (optuna.trial.TrialState.FAIL,)
    in_a_row = 0
    while finished(optuna, study) < total:
        before = len(study.get_trials(deepcopy=False, states=failed))
        study.optimize(
            objective,
            n_trials=1,
            catch=(ConfigError, TrainingHalted),
            callbacks=[done_cb, say_trial],
        )
        new_failures = len(study.get_trials(deepcopy=False, states=failed)) - before
        in_a_row = in_a_row + new_failures if new_failures else 0
        if in_a_row >= max(total, 3):
            raise ConfigError(
                f"sweep: {in_a_row} failed trials in a row; see their messages in the log "
                "(settings the trainer refuses, or training that halts)"
            )


def preset_seed(args) -> int:
    return 0 if args.seed is None else args.seed


def base_config(args) -> tuple[Config, str, Path, str]:
    """(base config, stage, sweep folder, study name) from --config or --preset."""
    overrides = list(args.overrides or [])
    if args.preset and args.config:  # the preset's own config would silently win
        raise ConfigError("rlhflab sweep: give --config FILE or --preset NAME, not both")
    if args.preset:
        from rlhflab.app.sweep_preset import preset_base

        # before the base models train (minutes): the folder's study first
        name = f"{args.preset}-s{preset_seed(args)}"
        claim_folder(Path(args.out or Path("runs") / "sweeps" / name), args.name or name)
        return preset_base(args.preset, preset_seed(args), args.out, overrides)
    if not args.config:
        raise ConfigError("rlhflab sweep: give --config FILE or --preset NAME")
    if args.seed is not None:  # else dropped: the user would think the trials ran seed N
        raise ConfigError(
            f"--seed: the preset's seed (with --preset); with --config set the runs' seed "
            f"as an override: seed={args.seed}"
        )
    # the method first, unvalidated: a grpo/rloo file is checked with its method's
    # defaults (model.value_model=none is theirs, and PPO's validation refuses it)
    stage = configbase.load(Config, args.config, overrides).sweep.method
    cfg = load_config(args.config, overrides, stage=stage)
    name = args.name or Path(args.config).stem
    return cfg, stage, Path(args.out or Path("runs") / "sweeps" / name), name


def run_sweep(args) -> dict:
    """``rlhflab sweep``: set up, optimise (with ``--jobs`` worker processes), report."""
    optuna = require_optuna()
    cfg, stage, sweep_dir, name = base_config(args)
    name = args.name or name
    uses_gold(cfg)  # an impossible objective fails here, not in every trial
    base = configbase.to_dict(cfg)
    space = check_space(cfg.sweep.space or DEFAULT_SPACES[stage], base, stage)
    made = not sweep_dir.exists()
    if sweep_dir.exists() and not sweep_dir.is_dir():
        raise ConfigError(f"--out: {sweep_dir} exists and is not a folder")
    sweep_dir.mkdir(parents=True, exist_ok=True)
    claim_folder(sweep_dir, name)
    storage = args.storage or f"sqlite:///{(sweep_dir / 'study.db').resolve()}"
    # the study (and a new storage's tables) made before any worker opens it: J processes
    # creating one SQLite schema at once can fail in SQLAlchemy's CREATE TABLE
    try:
        study = open_study(optuna, storage, name, cfg, args.worker, shared=bool(args.storage))
    except ConfigError:
        if made and not any(sweep_dir.iterdir()):  # a storage that cannot open: no trace
            sweep_dir.rmdir()
        raise
    keep_one_experiment(study, space, base)
    claim_folder(sweep_dir, name, record=True)
    workers = [] if args.worker else _spawn_workers(args, sweep_dir, storage, name)
    for handler in logging.getLogger("optuna").handlers:  # Optuna's own, on its root logger
        if not any(isinstance(f, _FailedTrialNoise) for f in handler.filters):
            handler.addFilter(_FailedTrialNoise())
    optimise(study, optuna, args.trials, lambda t: _trial(t, base, space, sweep_dir, stage))
    for w in workers:
        w.wait()
    if args.worker:
        return {}
    from rlhflab.app.sweep_report import write_results

    return write_results(study, optuna, cfg, space, sweep_dir, name, describe_objective(cfg))


def describe_objective(cfg: Config) -> str:
    s = cfg.sweep
    what = "gold reward (monitor/gold)" if uses_gold(cfg) else "proxy reward (objective/scores)"
    text = f"mean {what} of the last {s.last_iterations} iterations"
    if s.kl_budget is not None:
        text += f", less {s.kl_penalty} per nat of KL above {s.kl_budget}"
    return text


def _spawn_workers(args, sweep_dir: Path, storage: str, name: str) -> list:
    """``--jobs J``: J − 1 more processes on the same study (one per core or machine)."""
    procs = []
    for k in range(1, args.jobs):
        cmd = [sys.executable, "-m", "rlhflab", "sweep", "--trials", str(args.trials)]
        cmd += ["--storage", storage, "--name", name, "--out", str(sweep_dir)]
        cmd += ["--worker", str(k)]
        if args.preset:
            cmd += ["--preset", args.preset, "--seed", str(preset_seed(args))]
        else:
            cmd += ["--config", args.config]
        cmd += list(args.overrides or [])
        logfile = open(sweep_dir / f"worker-{k}.log", "w")  # noqa: SIM115 (kept for the child)
        env = {**os.environ, "RLHFLAB_ALLOCATOR": os.environ.get("RLHFLAB_ALLOCATOR", "auto")}
        procs.append(
            subprocess.Popen(
                cmd,
                stdout=logfile,
                stderr=subprocess.STDOUT,
                env=env,
                preexec_fn=ends_with_parent(),  # no orphan trains on after the parent died
            )
        )
    return procs
