"""The settings of the other stages and methods: `grpo`, `dpo`, `sft`, `rm`."""

from __future__ import annotations

from dataclasses import dataclass

from rlhflab.config.base import setting


@dataclass
class GRPOConfig:
    group_size: int = setting(
        4,
        "Answers sampled per prompt (G); rollout.prompts_per_iteration counts answers and "
        "must be a multiple of G.",
        low=2,
    )
    normalize_std: bool = setting(
        True,
        "Divide by the group's std (DSM). False centres only: Dr. GRPO's fix for the "
        "difficulty bias (pair it with ppo.loss_agg=seq-mean-token-sum-norm).",
    )
    eps: float = setting(
        1e-6, "Added to the group std (verl 1e-6); > 0 while normalize_std is on.", low=0.0
    )


@dataclass
class DPOConfig:
    data: str | None = setting(
        None,
        "Preference pairs (prompt, chosen, rejected; strings or chat messages): a data file "
        "or save_to_disk folder (docs/data.md). None: the built-in annotator's, labelled "
        "with the rm.* annotator settings.",
    )
    pairs: int = setting(3000, "Built-in preference pairs to label.", low=1)
    beta: float = setting(
        0.1, "DPO β: strength of the implicit KL to the reference.", low=0.0, low_open=True
    )
    loss_type: str = setting("sigmoid", "'sigmoid' (DPO) or 'ipo'.", choices=("sigmoid", "ipo"))
    label_smoothing: float = setting(0.0, "Conservative-DPO ε (sigmoid only).", low=0.0, high=0.49)
    steps: int = setting(200, "Optimiser steps.", low=1)
    batch_size: int = setting(32, "Pairs per step.", low=1)
    micro_batch_size: int | None = setting(
        None,
        "Pairs per forward and backward; the step's gradient accumulates over them, the "
        "same update as one pass over dpo.batch_size (each part's loss is its share of the "
        "batch mean) with a part's activations held at a time. None: the whole batch. Must "
        "divide dpo.batch_size.",
        low=1,
    )
    lr: float = setting(1e-4, "Learning rate.", low=0.0, low_open=True)
    warmup_steps: int = setting(10, "Linear warm-up steps, then constant.", low=0)


@dataclass
class SFTConfig:
    data: str | None = setting(
        None,
        "SFT data: .jsonl/.csv/.parquet rows or a save_to_disk folder, with `prompt` and "
        "`response` (or `completion`) strings or chat messages, or a chat conversation in "
        "`messages` (docs/data.md). None: the built-in task's noisy-teacher answers.",
    )
    examples: int = setting(4000, "Built-in teacher examples to generate.", low=1)
    output_dir: str = setting("runs/sft/model", "Where the fine-tuned policy is saved (HF folder).")
    steps: int = setting(600, "Optimiser steps.", low=1)
    batch_size: int = setting(32, "Sequences per step.", low=1)
    micro_batch_size: int | None = setting(
        None,
        "Sequences per forward and backward; the step's gradient accumulates over them, the "
        "same update as one pass over sft.batch_size (each part's summed token loss over the "
        "batch's response tokens) with a part's activations held at a time. None: the whole "
        "batch. Must divide sft.batch_size.",
        low=1,
    )
    lr: float = setting(
        1e-3,
        "Learning rate; high because the presets start from random weights.",
        low=0.0,
        low_open=True,
    )
    warmup_steps: int = setting(30, "Linear warm-up steps, then cosine decay.", low=0)
    checkpoint_every: int = setting(
        200,
        "Checkpoint every N steps (and at the end) into OUTPUT_DIR/run/checkpoints, with "
        "metrics.jsonl beside them, so that --resume continues exactly; log.keep_last applies.",
        low=1,
    )


@dataclass
class RMConfig:
    data: str | None = setting(
        None,
        "Preference pairs: file or save_to_disk folder rows with `prompt`, `chosen`, "
        "`rejected` (strings or chat messages, docs/data.md) and optional `labels` "
        "(attribute → 1/0/0.5). None: the built-in simulated annotator.",
    )
    init: str | None = setting(
        None,
        "Model folder the reward model starts from. None: model.policy (the SFT model, as "
        "InstructGPT does).",
    )
    heads: dict[str, float] = setting(
        {"preference": 1.0, "correctness": 1.0, "brevity": 1.0, "politeness": 1.0},
        "Heads and their training-loss weights. 'preference' learns the annotator's overall "
        "choice; any other head learns the pair's per-attribute label of that name. The "
        "default is the built-in annotator's labels; left at it, a data file whose pairs "
        "carry no labels trains the one head they have, {preference: 1.0} (logged).",
    )
    margin: float | None = setting(
        None,
        "Bradley-Terry margin subtracted from chosen − rejected (Llama-2). None: off.",
        low=0.0,
    )
    pairs: int = setting(3000, "Built-in preference pairs to label.", low=2)
    heldout_fraction: float = setting(
        0.1, "Share of pairs held out for accuracy.", low=0.0, high=0.9, low_open=True
    )
    noise: float = setting(
        0.3,
        "Built-in annotator temperature on gold-reward differences (0 = noiseless).",
        low=0.0,
    )
    length_bias: float = setting(
        0.0, "Built-in annotator's extra utility per answer word (a known flaw).", low=0.0
    )
    flattery_bias: float = setting(
        0.0,
        "Built-in annotator's extra utility for a flattering opener (a known flaw).",
        low=0.0,
    )
    output_dir: str = setting("runs/rm/model", "Where the reward model is saved (HF folder).")
    steps: int = setting(400, "Optimiser steps.", low=1)
    batch_size: int = setting(32, "Pairs per step.", low=1)
    lr: float = setting(5e-4, "Learning rate.", low=0.0, low_open=True)
    warmup_steps: int = setting(20, "Linear warm-up steps, then cosine decay.", low=0)
    ensemble_size: int = setting(
        1,
        "Train k reward models in one command, for reward.ensemble: member i goes to "
        "OUTPUT_DIR/member-i with seed = seed + i (the head's initialisation, the batch order "
        "and, with the built-in pairs, the pairs and their held-out split differ). 1: one "
        "model in OUTPUT_DIR.",
        low=1,
    )
    length_head: bool = setting(
        False,
        "ODIN (Chen et al. 2024, 'ODIN: Disentangled Reward Mitigates Hacking in RLHF'): add "
        "a head 'length'; each other head's Bradley-Terry loss is taken on its score plus "
        "the length head's, and a batch Pearson-correlation loss decorrelates the other "
        "heads from answer length (tokens) while pushing the length head's correlation up, "
        "with an orthogonality loss between their weight rows. PPO gives the 'length' head "
        "weight 0 unless reward.heads names it. Cost: negligible (one more output).",
    )
    length_exempt: list[str] | None = setting(
        None,
        "Heads ODIN leaves alone (rm.length_head): heads whose label is about length itself, "
        "such as the built-in task's 'brevity' (the shorter of two answers that say the "
        "same), which decorrelated from length could learn nothing. Their Bradley-Terry "
        "loss is on their own score, and they are out of the correlation and orthogonality "
        "losses. None: 'brevity' where rm.heads has it, else none (without it, ODIN cost the "
        "default demo its brevity signal; docs/hacking.md). Each name must be in rm.heads.",
    )
    length_loss_weight: float = setting(
        1.0, "Weight of ODIN's correlation loss (rm.length_head); not tuned here.", low=0.0
    )
    orthogonal_weight: float = setting(
        1.0, "Weight of ODIN's head-orthogonality loss (rm.length_head); not tuned here.", low=0.0
    )
    checkpoint_every: int = setting(
        200,
        "Checkpoint every N steps (and at the end) into OUTPUT_DIR/run/checkpoints, with "
        "metrics.jsonl beside them, so that --resume continues exactly; log.keep_last applies.",
        low=1,
    )


# Defaults that differ by command. They lie under the caller's base, the config file and the
# overrides (each wins over them), and over the fields' own defaults; `rlhflab config`
# prints them. The critic-free methods put a k3 KL in the loss, as GRPO did (DeepSeekMath,
# β = 0.04), and each command writes to its own run directory.
CRITIC_FREE_BASE = {
    "model": {"value_model": "none"},
    "ppo": {"kl_placement": "loss", "kl_estimator": "k3", "kl_coef": 0.04},
}
# the commands that train, each a stage a config is built for (load_config's ``stage``)
STAGES = ("ppo", "grpo", "rloo", "dpo", "sft", "rm")
STAGE_DEFAULTS: dict[str, dict] = {
    "grpo": {
        "model": {"value_model": "none"},
        "ppo": {**CRITIC_FREE_BASE["ppo"], "advantage_estimator": "grpo"},
        "log": {"output_dir": "runs/grpo"},
    },
    "rloo": {
        "model": {"value_model": "none"},
        "ppo": {**CRITIC_FREE_BASE["ppo"], "advantage_estimator": "rloo"},
        "log": {"output_dir": "runs/rloo"},
    },
    "dpo": {"model": {"value_model": "none"}, "log": {"output_dir": "runs/dpo"}},
}


def with_stage_defaults(stage: str, base: dict | None) -> dict:
    """``base`` laid over the defaults of ``stage`` (section by section: a base that sets
    one field of a section keeps the stage's other fields of it)."""
    out = {
        k: dict(v) if isinstance(v, dict) else v for k, v in STAGE_DEFAULTS.get(stage, {}).items()
    }
    for key, value in (base or {}).items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = {**out[key], **value}
        else:
            out[key] = value
    return out
