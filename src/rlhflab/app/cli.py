"""The `rlhflab` command line: one sub-command per stage.

Every command that takes ``--config FILE`` also takes dotted overrides after it, e.g.
``rlhflab ppo --config examples/tiny_ppo.yaml ppo.lr=3e-5 rollout.max_new_tokens=16``.
Known user errors (bad config, data, model folder, reward function, a training run halted
on a loss that is not finite) print one clear line and exit with status 2 — never a bare traceback.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

from rlhflab.app.around import add_parsers, cmd_eval, cmd_export, cmd_generate, cmd_memory
from rlhflab.app.user_errors import (
    every_rank_errors,
    say_repeated_overrides,
    storage_error,
    user_errors,
)
from rlhflab.backends.allocator import CHOICES, ENV_CHOICE, AllocatorError, in_use, restart_under


def _config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="YAML config file")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="dotted overrides")


# Long (about 85 lines) because it declares every subcommand and its flags in one place,
# a few lines each; the commands themselves are the cmd_* functions below.
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(  # no abbreviations: --resum is a typo, not --resume
        prog="rlhflab",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    parser.add_argument("--version", action="store_true", help="print the version and exit")
    parser.add_argument(
        "--allocator",
        choices=CHOICES,
        default=os.environ.get(ENV_CHOICE, "auto"),
        help="malloc of this process (default: $RLHFLAB_ALLOCATOR or auto = mimalloc where "
        "installed, Linux only; it fragments less under PPO: docs/memory.md)",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    memory = sub.add_parser(
        "memory", help="bytes of each model in the configured cast, and what one iteration adds"
    )
    _config_args(memory)
    memory.add_argument(
        "--method", choices=("ppo", "grpo", "rloo"), default="ppo",
        help="the command whose defaults the config is read under (grpo and rloo: no critic)",
    )  # fmt: skip
    sub.add_parser(
        "config",
        help="print every config field of every command with its default and why, and the "
        "defaults that differ by command",
    )
    sft = sub.add_parser("sft", help="supervised fine-tuning on response tokens")
    _config_args(sft)
    sft.add_argument(
        "--resume", action="store_true", help="continue from the last checkpoint (OUT/run)"
    )
    rm = sub.add_parser("rm", help="Bradley-Terry reward-model training")
    _config_args(rm)
    rm.add_argument(
        "--resume", action="store_true", help="continue from the last checkpoint (OUT/run)"
    )
    rm.add_argument(
        "--check",
        action="store_true",
        help="only check the reward model at reward.model on held-out pairs (no training); "
        "writes log.output_dir/rm_checks.json",
    )
    demo = sub.add_parser("demo", help="SFT → RM → PPO on the built-in task, then evaluate")
    from rlhflab.app.demo import PRESETS

    demo.add_argument(
        "--preset",
        default="default",
        choices=sorted(PRESETS),
        help="; ".join(f"{k}: {v['doc']}" for k, v in PRESETS.items()),
    )
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--out", default="runs", help="folder for runs/<preset>-s<seed>/")
    demo.add_argument("overrides", nargs="*", metavar="key=value", help="dotted overrides")
    for name, text in (
        ("grpo", "GRPO: group-normalised advantages, no critic"),
        ("rloo", "RLOO: leave-one-out baseline, no critic"),
    ):
        q = sub.add_parser(name, help=text)
        _config_args(q)
        q.add_argument("--resume", action="store_true", help="continue from the last checkpoint")
    dpo = sub.add_parser("dpo", help="DPO on preference pairs (policy + reference)")
    _config_args(dpo)
    dpo.add_argument("--resume", action="store_true", help="continue from the last checkpoint")
    cmp_ = sub.add_parser("compare", help="PPO, GRPO, RLOO and DPO side by side on the task")
    cmp_.add_argument("--preset", default="quick", choices=sorted(PRESETS))
    cmp_.add_argument("--seed", type=int, default=0)
    cmp_.add_argument("--out", default="runs", help="folder for runs/compare-<preset>-s<seed>/")
    cmp_.add_argument("overrides", nargs="*", metavar="key=value", help="dotted overrides")
    conv = sub.add_parser(
        "convert-gguf",
        help="write a GGUF file (e.g. a quantised llama.cpp model) as a plain Hugging Face "
        "folder that both runtimes load (docs/real-models.md)",
    )
    conv.add_argument("gguf_file", metavar="FILE.gguf", help="the GGUF file (local)")
    conv.add_argument("out_dir", metavar="OUT_DIR", help="the folder to write")
    conv.add_argument(
        "--dtype", choices=("fp32", "bf16"), default="fp32", help="of the saved weights"
    )
    conv.add_argument(
        "--force", action="store_true", help="replace OUT_DIR when it exists and is not empty"
    )
    report = sub.add_parser("report", help="write RUN_DIR/report.html (self-contained)")
    report.add_argument("run_dir", help="a PPO run directory (log.output_dir)")
    ppo = sub.add_parser("ppo", help="PPO against a reward model")
    _config_args(ppo)
    ppo.add_argument("--resume", action="store_true", help="continue from the last checkpoint")
    from rlhflab.app.sweep_cli import add_parser as add_sweep

    add_sweep(sub)
    # export, generate, eval: the commands around training (app/around.py)
    add_parsers(sub, _config_args)
    for command in sub.choices.values():  # argparse checks it when parsing: each parser's own
        command.allow_abbrev = False
    return parser


def cmd_config(args) -> int:
    from rlhflab.config import SOURCES, STAGE_DEFAULTS, Config
    from rlhflab.config.base import describe

    print("\n".join(describe(Config)))
    print("\ndefaults that differ by command (under the config file and the overrides):")
    for stage, sections in STAGE_DEFAULTS.items():
        fields = [
            f"{section}.{key}={value!r}"
            for section, values in sections.items()
            for key, value in values.items()
        ]
        print(f"  rlhflab {stage}: {', '.join(fields)}")
    print("\nsources cited above (docs/ppo-details.md):")
    for short, full in SOURCES.items():
        print(f"  {short}: {full}")
    return 0


def _load_to_resume(args, stage: str):
    """The command's config; where it is refused and ``--resume`` reads a run's own
    config.yaml that a Python caller's rewards left without any reward (they cannot be
    named in it), the refusal says that, not that the config lacks a reward."""
    from rlhflab.app.python_rewards import refuse_resume_without_python_rewards
    from rlhflab.config import ConfigError, load_config

    try:
        return load_config(args.config, args.overrides, stage=stage)
    except ConfigError:
        if args.resume and args.config:
            refuse_resume_without_python_rewards(Path(args.config).parent)
        raise


MONITOR_STOP = 3  # the exit status of a run that monitor.response=stop stopped


def cmd_ppo(args) -> int:
    """ppo, grpo and rloo: the command names the advantage estimator
    (ppo.advantage_estimator), one loop for all; grpo's and rloo's other defaults are the
    stage's (config.stages.STAGE_DEFAULTS)."""
    from rlhflab.app.python_rewards import refuse_resume_without_python_rewards
    from rlhflab.trainers.ppo import train

    cfg = _load_to_resume(args, stage=args.command)
    if args.resume:
        refuse_resume_without_python_rewards(cfg.log.output_dir)
    summary = train(cfg, resume=args.resume)
    n, stopped = summary["iterations"], summary.get("stop_reason")
    if _rank() == 0:  # under torchrun, said once
        what = f"stopped by the monitor after {n}" if stopped else f"done: {n}"
        print(f"{what} iteration{'s' * (n != 1)}, output in {cfg.log.output_dir}")
    # a guard's stop is no finished run: `rlhflab ppo ... && rlhflab export ...` must not
    # export a policy stopped for hacking (outside testing, stop 46)
    return MONITOR_STOP if stopped else 0


def cmd_dpo(args) -> int:
    from rlhflab.config import load_config
    from rlhflab.trainers.dpo import train

    cfg = load_config(args.config, args.overrides, stage="dpo")
    summary = train(cfg, resume=args.resume)
    last = summary["last"]
    said = ""
    if last.get("rewards/accuracy") is not None and last.get("rewards/margin") is not None:
        said = (
            f"reward accuracy {last['rewards/accuracy']:.3f}, margin {last['rewards/margin']:.3f}; "
        )
    print(f"done: {summary['steps']} steps; {said}output in {cfg.log.output_dir}")
    return 0


def cmd_sft(args) -> int:
    from rlhflab.config import load_config
    from rlhflab.trainers.sft import train_sft

    result = train_sft(load_config(args.config, args.overrides, stage="sft"), args.resume)
    print(
        f"SFT loss {result['loss_first']:.3f} (first step) → {result['loss_last']:.3f} "
        f"(mean of the last {min(20, result['steps'])} steps); "
        f"model saved to {result['output_dir']}"
    )
    return 0


def cmd_rm(args) -> int:
    from rlhflab.config import load_config
    from rlhflab.trainers.rm import check_reward_model, format_checks
    from rlhflab.trainers.rm_ensemble import train_rm

    cfg = load_config(args.config, args.overrides, stage="rm")
    if args.check:
        print(format_checks(check_reward_model(cfg)))
        print(f"written to {os.path.join(cfg.log.output_dir, 'rm_checks.json')}")
        return 0
    result = train_rm(cfg, args.resume)
    for member in result.get("members", [result]):
        acc = ", ".join(f"{k} {v:.3f}" for k, v in member["heldout_accuracy"].items())
        print(f"held-out pairwise accuracy: {acc}; model saved to {member['output_dir']}")
        print(format_checks(member["heldout_checks"]))
    if "ensemble" in result:
        print(f"reward.ensemble: {json.dumps(result['ensemble'])}")
    return 0


def cmd_demo(args) -> int:
    from rlhflab.app.demo import format_summary, run_demo

    summary = run_demo(args.preset, args.seed, args.out, args.overrides)
    print(format_summary(summary))
    print(f"summary: {args.out}/{args.preset}-s{args.seed}/summary.json")
    print(f"report:  {summary['report']}")
    return 0


def cmd_compare(args) -> int:
    from rlhflab.app.compare import format_table, run_compare

    table = run_compare(args.preset, args.seed, args.out, args.overrides)
    if not table.get("printed"):
        print(format_table(table))
    print(f"written to {table['run_dir']}/compare.json and compare.md")
    return 0


def cmd_convert_gguf(args) -> int:
    from rlhflab.models.gguf import convert_gguf, format_summary

    summary = convert_gguf(args.gguf_file, args.out_dir, dtype=args.dtype, force=args.force)
    print(format_summary(summary))
    return 0


def cmd_report(args) -> int:
    from rlhflab.app.report import build_report

    try:
        path = build_report(args.run_dir)
    except FileNotFoundError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"report: {path}")
    return 0


def cmd_sweep(args) -> int:
    from rlhflab.app.sweep_cli import cmd_sweep as run

    return run(args)


COMMANDS = {
    "memory": cmd_memory,
    "config": cmd_config,
    "ppo": cmd_ppo,
    "sft": cmd_sft,
    "rm": cmd_rm,
    "demo": cmd_demo,
    "report": cmd_report,
    "convert-gguf": cmd_convert_gguf,
    "grpo": cmd_ppo,
    "rloo": cmd_ppo,
    "dpo": cmd_dpo,
    "compare": cmd_compare,
    "sweep": cmd_sweep,
    "export": cmd_export,
    "generate": cmd_generate,
    "eval": cmd_eval,
}


# the commands whose trainers split work over torchrun's ranks (rlhflab.infra.distributed)
ON_SEVERAL_RANKS = ("ppo", "grpo", "rloo")


def _rank() -> int:
    """This process's rank under torchrun (0 outside it)."""
    return int(os.environ.get("RANK", "0"))


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    # overrides after an option (`ppo --config F --resume lr=1e-5`): argparse stops taking
    # positionals at the first option; key=value words left over are overrides still
    if (
        rest
        and hasattr(args, "overrides")
        and all("=" in w and not w.startswith("-") for w in rest)
    ):
        args.overrides = [*(args.overrides or []), *rest]
    elif rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    if args.version:
        from rlhflab import __version__

        print(__version__)
        return 0
    if args.command is None:
        parser.print_help()
        return 0
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and args.command not in ON_SEVERAL_RANKS:
        print(
            f"error: rlhflab {args.command} runs in one process; under torchrun "
            f"(WORLD_SIZE={world}) every rank would do the same work into the same output "
            f"folder. Run it without torchrun ({', '.join(ON_SEVERAL_RANKS)} run on several "
            "ranks: docs/distributed.md)",
            file=sys.stderr,
        )
        return 2
    if argv is None:  # the real command line, not a call from Python: may restart itself
        try:
            restart_under(args.allocator, sys.argv[1:])
        except AllocatorError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    # under torchrun rank 0 says what happens; the other ranks only warnings, named
    rank = _rank()
    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,
        format="%(message)s" if rank == 0 else f"[rank {rank}] %(message)s",
    )
    if rank == 0:  # and a key given twice in the overrides, once
        logging.getLogger(__name__).info("allocator: %s", in_use())
        say_repeated_overrides(getattr(args, "overrides", None))
    else:  # each process has its own: every rank says which
        print(f"[rank {rank}] allocator: {in_use()}", file=sys.stderr)
    try:
        code = COMMANDS[args.command](args)
    except user_errors() as exc:
        # under torchrun every rank meets the same config errors and halts: rank 0 says
        # them, once. Others (a reward function raising on one rank's answers, a file
        # missing on one node) a rank may meet alone: each rank says those, with its rank
        if rank == 0:
            print(f"error: {exc}", file=sys.stderr)
        elif not isinstance(exc, every_rank_errors()):
            print(f"error (rank {rank}): {exc}", file=sys.stderr)
        code = 2
    except Exception as exc:  # a failed write (safetensors' error is a plain Exception)
        said = storage_error(exc)
        if said is None:
            raise
        print(f"error{f' (rank {rank})' if rank else ''}: {said}", file=sys.stderr)
        code = 2
    except KeyboardInterrupt:
        # Ctrl-C: checkpoints and result files are written whole or not at all, so what is
        # on disk is the last one finished; a traceback would only say where Python was
        if rank == 0:
            resumable = args.command in ("ppo", "grpo", "rloo", "dpo", "sft", "rm")
            after = "; --resume continues from its newest whole checkpoint" if resumable else ""
            print(f"interrupted: rlhflab {args.command} stopped{after}", file=sys.stderr)
        code = 130
    from rlhflab.infra.distributed import exit_without_teardown, shutdown_distributed

    # under torchrun: leave the process group (a failed rank without waiting for the
    # others: shutdown_distributed); as the command line, then also skip the interpreter's
    # teardown, where gloo's threads can abort a finished run
    if shutdown_distributed(wait=code == 0) and (argv is None or code != 0):
        exit_without_teardown(code)
    return code


if __name__ == "__main__":
    sys.exit(main())
