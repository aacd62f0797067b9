"""The whole of RLHF on a laptop CPU: SFT → reward model → PPO → held-out evaluation.

``rlhflab demo [--preset NAME] [--seed N]`` runs the three stages on the built-in task and
evaluates the SFT and PPO policies on held-out prompts, against the gold reward (correct,
concise, no filler) and the proxy reward (the reward model PPO optimised). The result is a
table on the terminal and ``runs/<preset>-s<seed>/summary.json``.

"ppo" is the final policy, what a user without a gold reward would ship. The demo has a
gold reward, so PPO also keeps the policy whose smoothed gold was best during training
(``log.keep_best``: ``checkpoints/best``), and that one is evaluated too, as "ppo_best": the
gold reward often peaks before the last iteration (over-optimisation), and the two rows
show by how much. Its training-time gold picked it, its held-out prompts did not.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

from rlhflab.app.tables import DEMO_COLUMNS
from rlhflab.config import load_config
from rlhflab.diagnostics.evaluate import evaluate_policy, heldout_prompts
from rlhflab.experience.cast import load_frozen_policy
from rlhflab.infra.files import write_text_atomic
from rlhflab.infra.run_lock import run_lock
from rlhflab.infra.runinfo import read_run_info
from rlhflab.infra.runs import load_policy

log = logging.getLogger(__name__)

_COMMON = {
    "device": "cpu",
    "model": {"policy": "preset:tiny"},
    "rollout": {"prompts_per_iteration": 64, "max_new_tokens": 24},
    "ppo": {"epochs": 4, "minibatches": 4, "lr": 5e-5, "critic_lr": 2e-4, "kl_coef": 0.1},
    # the demo's stages rerun into their own folders: each rerun replaces the last
    "log": {"sample_every": 5, "checkpoint_every": 1000, "earlier_run": "replace"},
    # the built-in task has a gold reward: the monitors measure the proxy against it
    "monitor": {"gold": "rlhflab.builtin.tasks:gold_reward"},
}

# Each preset is a set of config overrides on top of _COMMON (dotted keys) plus how many
# held-out prompts to evaluate on.
PRESETS: dict[str, dict] = {
    "quick": {
        "doc": "under 2 minutes on 2 cores; used by the tests",
        "eval_prompts": 256,
        "overrides": {
            "sft.steps": 500,
            "rm.steps": 200,
            "rm.pairs": 1500,
            "ppo.iterations": 15,
            "reward.heads": {"preference": 1.0, "correctness": 2.0},
        },
    },
    "default": {
        "doc": "the full demo, about 2 minutes on 2 cores (docs/demo.md)",
        "eval_prompts": 512,
        "overrides": {
            "sft.steps": 1000,
            "rm.steps": 400,
            "ppo.iterations": 40,
            "reward.heads": {"preference": 1.0, "correctness": 2.0},
            # PAR (σ(r − r_ref)): over seeds 0-2 this demo's held-out accuracy goes 0.457 →
            # 0.560 ± 0.037, where the plain reward left it flat, at under half the final
            # KL (docs/demo.md, docs/hacking.md; issue #29)
            "reward.shaping": "par",
        },
    },
    "hacking": {
        "doc": "an annotator that loves long, flattering answers and a tiny β: reward hacking",
        "eval_prompts": 512,
        "overrides": {
            "sft.steps": 1000,
            "rm.steps": 400,
            "ppo.iterations": 50,
            "rm.length_bias": 0.3,
            "rm.flattery_bias": 1.5,
            "reward.heads": {"preference": 1.0, "politeness": 1.0},
            "ppo.kl_coef": 0.001,
            # a tenth of the other presets' lr: the slide takes ~10 iterations instead of 2,
            # so there is time to see it coming (docs/monitors.md)
            "ppo.lr": 5e-6,
        },
    },
}

COLUMNS = DEMO_COLUMNS


# where each stage's output goes, which the pipeline sets (under --out) and wires together
SET_BY_THE_PIPELINE = ("sft.output_dir", "rm.output_dir", "log.output_dir", "reward.model")


def _stage_overrides(preset: str, seed: int, run: Path, extra) -> list[str]:
    """The preset's overrides, then the user's ``extra`` — which reach every stage, the
    SFT stage included — then the stages' folders under ``run``."""
    from rlhflab.config import ConfigError

    if preset not in PRESETS:
        raise ConfigError(f"--preset: unknown preset {preset!r}; choose one of {sorted(PRESETS)}")
    for item in extra or []:
        key, _, value = str(item).partition("=")
        key = key.strip()
        if key in SET_BY_THE_PIPELINE or any(
            f"{key}.{field}" in SET_BY_THE_PIPELINE for field in _section_fields(value)
        ):
            raise ConfigError(
                f"{key}: set by the pipeline (each stage's output goes under --out, and PPO "
                "scores with the reward model it trained); choose the folder with --out"
            )
    preset_items = {**PRESETS[preset]["overrides"], "seed": seed}
    # the folders last: an override of a whole section (sft={steps: 3}) keeps them
    folders = {
        "sft.output_dir": str(run / "sft"),
        "rm.output_dir": str(run / "rm"),
        "log.output_dir": str(run / "ppo"),
    }
    items = [f"{k}={json.dumps(v)}" for k, v in preset_items.items()] + list(extra or [])
    return items + [f"{k}={json.dumps(v)}" for k, v in folders.items()]


def _section_fields(value: str) -> list[str]:
    """The fields an override of a whole section sets (``sft={output_dir: X}``)."""
    import yaml

    try:
        parsed = yaml.safe_load(value)
    except yaml.YAMLError:
        return []  # load_config names the bad value
    return [str(k) for k in parsed] if isinstance(parsed, dict) else []


def demo_config(preset: str, seed: int, out_root: str | Path = "runs", extra=None):
    """The resolved config of a demo preset's reward-model and PPO stages, with every
    stage's output in the run folder. Both start from the SFT stage's model, whatever
    ``model.policy`` the user gave: that one is where SFT starts (:func:`sft_stage_config`)."""
    run = Path(out_root) / f"{preset}-s{seed}"
    items = _stage_overrides(preset, seed, run, extra)
    items += [f"model.policy={json.dumps(str(run / 'sft'))}"]
    items += [f"reward.model={json.dumps(str(run / 'rm'))}"]
    return run, load_config(base=_COMMON, overrides=items)


def sft_stage_config(preset: str, seed: int, out_root: str | Path = "runs", extra=None):
    """The SFT stage's config: the same preset and overrides as :func:`demo_config` (a
    ``model.policy``, ``data.task``, ``device`` or ``threads`` given to the demo reach it
    too), starting from the preset's model or the user's ``model.policy``."""
    run = Path(out_root) / f"{preset}-s{seed}"
    items = _stage_overrides(preset, seed, run, extra)
    return load_config(base=_COMMON, overrides=items, stage="sft")


def run_demo(
    preset: str = "default",
    seed: int = 0,
    out_root: str | Path = "runs",
    extra: list[str] | None = None,
    progress: bool = True,
) -> dict:
    run, cfg = demo_config(preset, seed, out_root, extra)
    cfg.log.progress = progress and cfg.log.progress  # `log.progress=false` wins
    run.mkdir(parents=True, exist_ok=True)
    # one demo at a time in its folder: a second one would train the SFT and reward models
    # again under the first one's PPO stage (each stage's own lock covers that stage only)
    with run_lock(run, "--out"):
        return _demo_stages(run, cfg, preset, seed, out_root, extra)


def _demo_stages(run: Path, cfg, preset: str, seed: int, out_root, extra) -> dict:
    """SFT, the reward model, PPO and the held-out evaluation, into ``run``."""
    from rlhflab.trainers.ppo import PPOTrainer
    from rlhflab.trainers.rm_ensemble import train_rm
    from rlhflab.trainers.sft import train_sft

    timing, t_all = {}, time.perf_counter()

    # Stage 1: SFT from the randomly initialised preset on the noisy teacher's answers.
    t0 = time.perf_counter()
    sft_cfg = sft_stage_config(preset, seed, out_root, extra)
    sft_cfg.log.progress = cfg.log.progress
    sft = train_sft(sft_cfg)
    timing["sft"] = time.perf_counter() - t0

    # Stage 2: a multi-head Bradley-Terry reward model, initialised from the SFT model.
    t0 = time.perf_counter()
    rm = train_rm(cfg)
    timing["rm"] = time.perf_counter() - t0

    # Stage 3: PPO from the SFT policy against the reward model.
    t0 = time.perf_counter()
    trainer = PPOTrainer(cfg)
    ppo = trainer.fit()
    timing["ppo"] = time.perf_counter() - t0

    # Evaluation on held-out prompts (a seed the training prompts never use).
    t0 = time.perf_counter()
    prompts = heldout_prompts(PRESETS[preset]["eval_prompts"], seed, cfg.data.task)
    tok = trainer.cast.tokenizer
    sft_model = load_frozen_policy(cfg, tok, trainer.device)
    kw = {
        "reward": trainer.cast.reward,
        "max_new_tokens": cfg.rollout.max_new_tokens,
        "seed": seed,
        "device": trainer.device,
    }
    results = {
        "sft": evaluate_policy(sft_model, sft_model, tok, prompts, **kw),
        "ppo": evaluate_policy(trainer.cast.policy_lm, sft_model, tok, prompts, **kw),
    }
    gold_curve = (read_run_info(cfg.log.output_dir) or {}).get("gold")
    if trainer.watch.keep_best and (Path(cfg.log.output_dir) / "checkpoints" / "best").is_dir():
        # read back as `rlhflab export --checkpoint best` reads it
        best = load_policy(cfg.log.output_dir, checkpoint="best", device=trainer.device)
        results["ppo_best"] = evaluate_policy(best.lm, sft_model, tok, prompts, **kw)
    timing["eval"] = time.perf_counter() - t0
    timing["total"] = time.perf_counter() - t_all

    summary = {
        "preset": preset,
        "seed": seed,
        **results,
        "evaluated": {
            "ppo": f"the final policy (iteration {ppo['iterations']})",
            **(
                {"ppo_best": f"checkpoints/best (iteration {gold_curve['best_iteration']})"}
                if "ppo_best" in results and gold_curve
                else {}
            ),
        },
        "eval_prompts": len(prompts),
        "gold_curve": gold_curve,
        "rm": {
            "heldout_accuracy": rm["heldout_accuracy"],
            "pairs": rm["pairs"],
            "checks": rm["heldout_checks"],
        },
        "sft_training": {"loss_first": sft["loss_first"], "loss_last": sft["loss_last"]},
        "ppo_training": {"iterations": ppo["iterations"], "stop_reason": ppo["stop_reason"]},
        "timing": timing,
    }
    write_text_atomic(run / "summary.json", json.dumps(summary, indent=2, ensure_ascii=False))
    from rlhflab.app.report import build_report

    summary["report"] = str(build_report(cfg.log.output_dir))
    return summary


def format_summary(summary: dict) -> str:
    lines = [f"rlhflab demo — preset {summary['preset']}, seed {summary['seed']}", ""]
    lines.append(f"{'policy':<9}" + "".join(f"{c:>17}" for c in COLUMNS))
    for name in ("sft", "ppo", "ppo_best"):
        row = summary.get(name)
        if row:
            values = "".join(f"{row.get(c, float('nan')):>17.3f}" for c in COLUMNS)
            lines.append(f"{name:<9}" + values)
    for name, what in (summary.get("evaluated") or {}).items():
        lines.append(f"  {name}: {what}")
    d = summary["ppo"]["gold"] - summary["sft"]["gold"]
    p = summary["ppo"]["proxy"] - summary["sft"]["proxy"]
    lines.append("")
    lines.append(
        f"gold reward {d:+.3f}, proxy reward {p:+.3f} "
        + ("(proxy up, gold down: reward hacking)" if p > 0 > d else "")
    )
    lines += _gold_curve_lines(summary.get("gold_curve"))
    acc = ", ".join(f"{k} {v:.2f}" for k, v in summary["rm"]["heldout_accuracy"].items())
    lines.append(f"reward model held-out accuracy: {acc}")
    gold = summary["rm"].get("checks", {}).get("reward_vs_gold")
    keys = ("accuracy", "longer_preferred", "longer_preferred_by_labels")
    if gold and all(gold.get(k) is not None for k in keys):
        lines.append(
            f"reward model vs gold: agrees on {gold['accuracy']:.2f} of held-out pairs, "
            f"prefers the longer answer in {gold['longer_preferred']:.2f} (gold: "
            f"{gold['longer_preferred_by_labels']:.2f})"
        )
    t = summary["timing"]
    lines.append("wall time: " + ", ".join(f"{k} {v:.0f}s" for k, v in t.items()))
    return "\n".join(lines)


def _gold_curve_lines(story: dict | None) -> list[str]:
    """What the gold reward did during training (run.json's story), in two lines."""
    if not story:
        return []
    out = [
        f"training gold (smoothed): best {story['best']:.3f} at iteration "
        f"{story['best_iteration']}, {story['final']:.3f} at the end"
        + (" (a significant fall)" if story["fell"] else "")
    ]
    peak = (story.get("fit") or {}).get("peak")
    if peak:
        out.append(
            f"over-optimisation fit (Gao et al. 2022): gold peaks near KL {peak['kl']:.2f}; "
            f"the run ended at KL {story['fit']['final_kl']:.2f}"
        )
    return out
