"""The commands around training: ``export`` (a run's policy as a plain Hugging Face folder),
``generate`` (its answers to a prompt file) and ``eval`` (answers scored on held-out
prompts), whose flags are declared here and added to ``rlhflab``'s parser by
:func:`add_parsers`; also ``memory``'s work (the bytes of a configured cast; its flags are
the training commands', in :mod:`rlhflab.app.cli`). The work is in
:mod:`rlhflab.app.answers`, :mod:`rlhflab.infra.runs` and
:func:`rlhflab.models.export.save_policy`. Nothing heavy is imported until a command runs
(the command line may restart itself under another allocator first).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

CHECKPOINT_HELP = (
    "which checkpoint of a run: last (the newest whole one, default), best "
    "(checkpoints/best, where the run kept one) or a folder name such as step-20"
)


def _model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        required=True,
        metavar="FOLDER_OR_RUN_DIR",
        help="a model folder, preset:NAME, a LoRA adapter folder (rlhflab export --adapter) "
        "or a run directory (log.output_dir), whose config.yaml gives the sampling settings",
    )
    p.add_argument("--checkpoint", default="last", help=CHECKPOINT_HELP)
    p.add_argument("--n", type=int, default=1, help="answers per prompt (default 1)")
    p.add_argument(
        "--batch-size",
        type=int,
        default=None,
        help="answers sampled together (default 32); the same seed and batch size give the "
        "same answers",
    )


def add_parsers(sub, config_args: Callable[[argparse.ArgumentParser], None]) -> None:
    """Add export, generate and eval to ``sub`` (their functions: cmd_export, cmd_generate,
    cmd_eval); ``config_args`` adds --config and the dotted overrides."""
    exp = sub.add_parser(
        "export",
        help="a run's policy (ppo, grpo, rloo, dpo; sft's OUT/run) as a plain Hugging Face "
        "folder that AutoModelForCausalLM.from_pretrained loads; LoRA merged unless --adapter",
    )
    exp.add_argument("run_dir", metavar="RUN_DIR", help="the run directory (log.output_dir)")
    exp.add_argument("out_dir", metavar="OUT", help="the folder to write")
    exp.add_argument("--checkpoint", default="last", help=CHECKPOINT_HELP)
    exp.add_argument(
        "--adapter",
        action="store_true",
        help="a LoRA run: write the adapter alone (a PEFT folder), not merged into its base",
    )
    exp.add_argument(
        "--dtype", choices=("fp32", "bf16"), default="fp32", help="of the saved weights"
    )
    exp.add_argument("--force", action="store_true", help="replace OUT when it is not empty")
    gen = sub.add_parser(
        "generate",
        help="answers to a prompt file with the rollout's sampling settings, as JSON lines",
    )
    _model_args(gen)
    gen.add_argument("--prompts", required=True, help="a prompt file (as data.prompts)")
    gen.add_argument(
        "--out",
        help="default answers.jsonl in the current folder (answers-2.jsonl … where that exists: "
        "a default never replaces a file; a named --out does)",
    )
    config_args(gen)
    ev = sub.add_parser(
        "eval",
        help="answers to held-out prompts scored by reward models, reward functions and a gold "
        "function: mean ± s.e. per scorer, length, EOS rate (the built-in task's when no --prompts)",
    )
    _model_args(ev)
    ev.add_argument(
        "--prompts", help="held-out prompts (default: the built-in task's, with its gold reward)"
    )
    ev.add_argument(
        "--reward-model", action="append", metavar="FOLDER", help="a reward model (repeatable)"
    )
    ev.add_argument(
        "--reward",
        action="append",
        metavar="module:function",
        help="a reward function (repeatable)",
    )
    ev.add_argument("--gold", metavar="module:function", help="the gold reward function")
    ev.add_argument("--limit", type=int, help="evaluate on the first N prompts only")
    ev.add_argument(
        "--out",
        help="the summary (JSON; the answers go beside it as .jsonl); default eval.json "
        "(and eval.jsonl) in the current folder, eval-2.json … where those exist",
    )
    config_args(ev)


def run_export(args) -> dict:
    """``rlhflab export``: the run's policy from one checkpoint, written as asked."""
    from rlhflab.config.base import ConfigError
    from rlhflab.infra.runs import RUN_CONFIG, find_policy, is_run_dir
    from rlhflab.models import ModelLoadError, resolve_path
    from rlhflab.models.export import check_out_dir, save_policy

    run, out = Path(args.run_dir).expanduser(), Path(args.out_dir).expanduser()
    if not run.is_dir():
        raise ModelLoadError(f"{args.run_dir}: no such folder")
    if not is_run_dir(run):
        model = " (it is a model folder already)" if (run / "config.json").is_file() else ""
        raise ModelLoadError(f"{run}: not a run directory (no {RUN_CONFIG}){model}")
    check_out_dir(out, args.force, protect=(run,))  # before loading anything
    src = find_policy(str(run), checkpoint=args.checkpoint)
    if args.adapter and not src.is_lora:
        raise ConfigError(
            f"--adapter: {run} trained full weights (model.lora_r is 0); there is no adapter"
        )
    lm = src.load("cpu")
    save_policy(
        lm,
        src.tokenizer,
        out,
        merge_lora=not args.adapter,
        dtype=args.dtype,
        force=args.force,
        protect=(run, src.base),  # the run, and a LoRA run's base model
    )
    model = lm.get_base_model() if src.is_lora else lm
    return {
        "run": str(run),
        "checkpoint": src.checkpoint.name,
        "out": str(out),
        # the class the exported config.json names (the native runtime's own is not one)
        "model_class": getattr(model, "architecture", "") or type(model).__name__,
        "parameters": sum(p.numel() for n, p in model.named_parameters() if "lora_" not in n),
        "dtype": args.dtype,
        "lora": {"r": src.options.lora_r, "alpha": src.options.lora_alpha} if src.is_lora else None,
        "adapter": bool(args.adapter),
        "base": src.base,
        "base_folder": str(resolve_path(src.base)) if src.is_lora else None,
    }


def format_export(s: dict) -> str:
    head = f"exported {s['run']} ({s['checkpoint']}) → {s['out']}: "
    if s["adapter"]:
        return (
            f"{head}a LoRA adapter (r={s['lora']['r']}), {s['dtype']}, for the base "
            f"{s['base']} ({s['base_folder']}); load it with peft: PeftModel.from_pretrained("
            f"AutoModelForCausalLM.from_pretrained('{s['base_folder']}'), '{s['out']}')"
        )
    merged = f", LoRA (r={s['lora']['r']}) merged into {s['base']}" if s["lora"] else ""
    n = s["parameters"]
    size = f"{n / 1e6:.1f}M" if n >= 1e6 else f"{n:,}"
    return f"{head}{s['model_class']}, {size} parameters, {s['dtype']}{merged}"


def cmd_export(args) -> int:
    print(format_export(run_export(args)))
    return 0


def cmd_generate(args) -> int:
    from rlhflab.app.answers import run_generate

    args.out = args.out or _unused_name("answers", (".jsonl",))
    s = run_generate(args)
    print(
        f"{s['answers']} answers to {s['prompts']} prompts (seed {s['seed']}, temperature "
        f"{s['temperature']}, max_new_tokens {s['max_new_tokens']}) written to {s['out']}"
    )
    return 0


def cmd_eval(args) -> int:
    from rlhflab.app.answers import format_eval, run_eval

    args.out = args.out or _unused_name("eval", (".json", ".jsonl"))
    summary = run_eval(args)
    print(format_eval(summary))
    print(f"written to {args.out} and {summary['answers_file']}")
    return 0


def _unused_name(stem: str, suffixes: tuple[str, ...]) -> str:
    """The default output in the current folder: ``stem`` with the first of its
    ``suffixes``, or ``stem-2``, ``stem-3`` … where a file of that name (any suffix)
    exists: an earlier result is never replaced unasked."""
    name, n = stem, 1
    while any(Path(name + suffix).exists() for suffix in suffixes):
        n += 1
        name = f"{stem}-{n}"
    return name + suffixes[0]


def _no_reward(prompts, responses):
    return [0.0] * len(responses)


def cmd_memory(args) -> int:
    from rlhflab.config import load_config
    from rlhflab.diagnostics.memory import cast_memory, iteration_memory, peak_rss_bytes
    from rlhflab.diagnostics.memory_format import (
        estimated_peak,
        fit_line,
        format_iteration,
        format_table,
        not_counted,
    )
    from rlhflab.experience.cast import build_cast
    from rlhflab.experience.rewards import CallableReward

    # a grpo/rloo config read under PPO's defaults counted a critic those runs never build
    method = getattr(args, "method", "ppo")
    cfg = load_config(args.config, args.overrides, stage=method, reward_given=True)
    rw, extra = cfg.reward, ()
    if method == "ppo" and cfg.model.value_model != "none" and _names_grpo(args.config):
        print("the config has a grpo section: for rlhflab grpo or rloo, which build no critic, "
              "give --method grpo (or rloo)")  # fmt: skip
    if not (rw.model or rw.ensemble or rw.functions):  # the models' table needs none
        print("reward: none set, so no reward model is counted (set reward.model to count one)")
        if cfg.model.reward_precision != "fp32":
            print(f"model.reward_precision={cfg.model.reward_precision}: no reward model to hold")
        extra = ((CallableReward(_no_reward, "no reward"), 1.0),)
    cast = build_cast(cfg, extra_rewards=extra)
    rows = cast_memory(cast)
    print(format_table(rows, peak_rss_bytes()))
    phases = iteration_memory(cast, cfg)
    print(format_iteration(phases, rows))
    for line in not_counted(cast, cfg):
        print(line)
    fits = fit_line(cast.device, estimated_peak(rows, phases)[0])
    if fits:
        print(fits)
    return 0


def _names_grpo(path) -> bool:
    """Whether the YAML file at ``path`` (None: no file) has a ``grpo`` section."""
    import yaml

    try:
        loaded = yaml.safe_load(Path(path).read_text(encoding="utf-8")) if path else None
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return False  # load_config has read it already
    return isinstance(loaded, dict) and "grpo" in loaded
