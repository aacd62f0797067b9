"""``rlhflab sweep``'s flags and its summary line. The search is :mod:`rlhflab.app.sweep`,
imported when the command runs (Optuna is an extra)."""

from __future__ import annotations

import argparse


def add_parser(sub) -> None:
    from rlhflab.app.demo import PRESETS

    p = sub.add_parser(
        "sweep",
        help="hyperparameter search with Optuna: TPE, a median pruner, an SQLite study that "
        "survives kill -9 (docs/sweeps.md)",
    )
    p.add_argument("--config", help="YAML config of the runs (its sweep: section: the space)")
    p.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        help="sweep PPO on the built-in task instead: the demo preset's SFT and reward "
        "models are trained once, the gold reward is the objective",
    )
    p.add_argument(
        "--trials",
        type=int,
        required=True,
        help="the study's total of finished trials; rerunning continues the same study",
    )
    p.add_argument("--jobs", type=int, default=1, help="worker processes on this machine")
    p.add_argument(
        "--storage",
        help="an Optuna RDB URL shared by many machines (default: SQLite in the sweep folder)",
    )
    p.add_argument("--name", help="the study's name (default: the config file's stem)")
    p.add_argument("--out", help="the sweep folder (default runs/sweeps/NAME)")
    p.add_argument(
        "--seed", type=int, default=None, help="the preset's seed (with --preset; default 0)"
    )
    p.add_argument("--worker", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("overrides", nargs="*", metavar="key=value", help="dotted overrides")


def cmd_sweep(args) -> int:
    from rlhflab.app.sweep import run_sweep
    from rlhflab.config import ConfigError

    if args.trials < 1 or args.jobs < 1:
        raise ConfigError("rlhflab sweep: --trials and --jobs must be at least 1")
    result = run_sweep(args)
    if args.worker:
        return 0
    best = result["best"]
    c = result["counts"]
    print(
        f"{c['complete']} complete, {c['pruned']} pruned, {c['fail']} failed trials in "
        f"{result['sweep_dir']}"
    )
    if best:
        settings = ", ".join(f"{k}={v!r}" for k, v in best["params"].items())
        print(f"best: trial {best['number']}, objective {best['value']:.4f}: {settings}")
        print(f"rerun it: {result['best_yaml']}")
    print(f"report: {result['report']}")
    return 0
