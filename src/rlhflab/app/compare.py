"""``rlhflab compare``: PPO, GRPO, RLOO and DPO from the same SFT model, side by side,
with the SFT model itself as the first row.

One SFT model and one reward model (the demo's stages), then each method in its own process
(so each peak-memory figure is its own): PPO, GRPO and RLOO with an equal budget of
generated tokens (same iterations × answers per iteration × answer length), DPO on as many
preference pairs as the reward model was trained on. Every final policy is evaluated on the
same held-out prompts. The table goes to ``compare.json`` / ``compare.md`` in the run folder
and into each method's ``report.html``.
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys
import time
from pathlib import Path

from rlhflab.app.tables import COMPARE_COLUMNS, cell
from rlhflab.config import Config, ConfigError, validate
from rlhflab.config import base as configbase
from rlhflab.infra.child_process import ends_with_parent
from rlhflab.infra.files import write_text_atomic
from rlhflab.infra.run_lock import run_lock

METHODS = ("ppo", "grpo", "rloo", "dpo")
COLUMNS = COMPARE_COLUMNS


def method_config(cfg: Config, method: str, run: Path) -> Config:
    """The demo config adapted to one method; everything else (seed, data, budget) equal."""
    d = configbase.to_dict(copy.deepcopy(cfg))
    d["log"]["output_dir"] = str(run / method)
    if method in ("grpo", "rloo"):
        d["model"]["value_model"] = "none"
        d["ppo"].update(
            {"kl_placement": "loss", "kl_estimator": "k3", "advantage_estimator": method}
        )
    elif method == "dpo":
        d["model"]["value_model"] = "none"
        d["dpo"]["pairs"] = d["rm"]["pairs"]
    return validate(configbase.build(Config, d), method)


def worker_main(argv: list[str]) -> None:
    """A method's process: its row as JSON on stdout; a user error as one ``error:`` line
    on stderr and status 2 (the parent says it as its own)."""
    from rlhflab.app.user_errors import user_errors

    method, config_json, eval_prompts = argv
    try:
        row = worker(method, config_json, int(eval_prompts))
    except user_errors() as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
    print(json.dumps(row))


def worker(method: str, config_json: str, eval_prompts: int) -> dict:
    """Train one method, evaluate it, return its row (runs in a fresh process)."""
    from rlhflab.diagnostics.evaluate import evaluate_policy, heldout_prompts
    from rlhflab.diagnostics.memory import peak_rss_bytes
    from rlhflab.experience.cast import load_frozen_policy

    stage = "ppo" if method == "sft" else method  # sft: the PPO config, nothing trained
    cfg = validate(configbase.build(Config, json.loads(config_json)), stage)
    cfg.log.progress = False
    start = time.perf_counter()
    if method == "sft":  # the SFT policy every method starts from, as a row to beat
        from rlhflab.experience.cast import load_policy_tokenizer

        tok = load_policy_tokenizer(cfg)
        policy, models = load_frozen_policy(cfg, tok), 1
    elif method == "dpo":
        from rlhflab.trainers.dpo import DPOTrainer

        trainer = DPOTrainer(cfg)
        trainer.fit()
        policy, tok, models = trainer.policy, trainer.tokenizer, 2
    else:
        from rlhflab.trainers.ppo import PPOTrainer

        trainer = PPOTrainer(cfg)  # ppo.advantage_estimator says which method
        trainer.fit()
        policy, tok, models = (
            trainer.cast.policy_lm,
            trainer.cast.tokenizer,
            len(trainer.cast.models()),
        )
    wall = time.perf_counter() - start
    # the proxy is the same weighted reward model for every method (DPO never saw it)
    reward = trainer.cast.reward if method not in ("sft", "dpo") else _reward_only(cfg)
    sft = policy if method == "sft" else load_frozen_policy(cfg, tok)
    prompts = heldout_prompts(eval_prompts, cfg.seed, cfg.data.task)
    result = evaluate_policy(
        policy, sft, tok, prompts, reward, cfg.rollout.max_new_tokens, seed=cfg.seed
    )
    return {
        "method": method,
        "gold": result["gold"],
        "proxy": result["proxy"],
        "kl_to_reference": result["kl_to_reference"],
        "accuracy": result["accuracy"],
        # the SFT row: its training's seconds (the parent's), no training peak of its own
        "wall_s": wall if method != "sft" else None,
        "peak_mib": peak_rss_bytes() / 2**20 if method != "sft" else None,
        "models": models,
    }


def _reward_only(cfg: Config):
    """The weighted reward of a config, without building the rest of a cast."""
    from rlhflab.experience.cast import (
        _reward_sources,
        load_frozen_reward_model,
        load_policy_tokenizer,
    )
    from rlhflab.experience.rewards import CompositeReward

    rm, rm_tok = load_frozen_reward_model(cfg, "cpu")
    return CompositeReward(_reward_sources(cfg, load_policy_tokenizer(cfg), "cpu", rm, rm_tok))


def run_compare(
    preset: str = "quick",
    seed: int = 0,
    out_root: str | Path = "runs",
    extra: list[str] | None = None,
    progress: bool = True,
    eval_prompts: int | None = None,
) -> dict:
    """Train SFT and the reward model once, then each method in its own process.

    ``extra`` are config overrides applied to every stage (``ppo.iterations=5``);
    ``eval_prompts`` defaults to the preset's held-out set size.
    """
    from rlhflab.app.demo import demo_config

    run, cfg = demo_config(preset, seed, Path(out_root), extra)
    run = run.with_name(f"compare-{run.name}")
    run.mkdir(parents=True, exist_ok=True)
    with run_lock(run, "--out"):  # one compare at a time in its folder, as the demo
        return _compare(run, cfg, preset, seed, out_root, extra, progress, eval_prompts)


def _compare(run: Path, cfg, preset, seed, out_root, extra, progress, eval_prompts) -> dict:
    """SFT and the reward model, then every method in its own process, into ``run``."""
    from rlhflab.app.demo import PRESETS, sft_stage_config
    from rlhflab.trainers.rm_ensemble import train_rm
    from rlhflab.trainers.sft import train_sft

    cfg.sft.output_dir, cfg.rm.output_dir = str(run / "sft"), str(run / "rm")
    cfg.model.policy, cfg.reward.model = str(run / "sft"), str(run / "rm")
    cfg.log.progress = progress and cfg.log.progress
    # every method's settings checked before SFT and the reward model train (minutes)
    configs = {method: method_config(cfg, method, run) for method in METHODS}
    configs["sft"] = cfg  # evaluated as it is: the policy the others start from
    sft_cfg = sft_stage_config(preset, seed, Path(out_root), extra)
    sft_cfg.sft.output_dir, sft_cfg.log.progress = cfg.sft.output_dir, cfg.log.progress
    start = time.perf_counter()
    train_sft(sft_cfg)
    sft_seconds = time.perf_counter() - start
    train_rm(cfg)
    rows = []
    if progress:  # the rows come as each method finishes: the header first
        header = {"preset": preset, "seed": seed, "overrides": list(extra or []), "rows": []}
        print(format_table(header), flush=True)
    for method in ("sft", *METHODS):
        args = [
            sys.executable,
            "-c",
            "import sys; from rlhflab.app.compare import worker_main; worker_main(sys.argv[1:])",
            method,
            json.dumps(configbase.to_dict(configs[method])),
            str(eval_prompts or PRESETS[preset]["eval_prompts"]),
        ]
        done = subprocess.run(args, capture_output=True, text=True, preexec_fn=ends_with_parent())
        said = done.stderr.strip().splitlines()[-1:] if done.stderr.strip() else []
        if done.returncode == 2 and said and said[0].startswith("error: "):
            # a user error (a reward function that raised, a halt): one line, as the
            # commands say theirs
            raise ConfigError(f"compare: {method}: {said[0].removeprefix('error: ')}")
        if done.returncode != 0:
            raise RuntimeError(f"compare: {method} failed:\n{done.stderr[-2000:]}")
        rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
        if method == "sft":
            rows[-1]["wall_s"] = sft_seconds
        if progress:
            print(format_row(rows[-1]), flush=True)
    # the overrides every stage ran with: a table that says what it measured
    table = {"preset": preset, "seed": seed, "overrides": list(extra or []), "rows": rows}
    write_text_atomic(run / "compare.json", json.dumps(table, indent=2))
    write_text_atomic(run / "compare.md", format_table(table) + "\n")
    from rlhflab.app.report import build_report

    for method in METHODS:
        if (run / method / "metrics.jsonl").exists():
            build_report(run / method)
    table["run_dir"] = str(run)
    table["printed"] = progress  # the rows, as they came
    return table


def format_row(r: dict) -> str:
    return f"| {r['method']} | " + " | ".join(cell(c, r[c]) for c in COLUMNS) + " |"


def format_table(table: dict) -> str:
    head = "| method | " + " | ".join(COLUMNS) + " |"
    sep = "|" + " --- |" * (len(COLUMNS) + 1)
    return "\n".join(
        [
            f"preset {table['preset']}, seed {table['seed']}"
            + (f", overrides {' '.join(table['overrides'])}" if table.get("overrides") else ""),
            "",
            head,
            sep,
            *(format_row(r) for r in table["rows"]),
        ]
    )
