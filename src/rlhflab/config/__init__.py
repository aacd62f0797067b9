"""The one typed config tree of rlhflab, with every field's default and the reason for it.

Load it with :func:`load_config` (YAML file + dotted ``key=value`` overrides); print it with
``rlhflab config``. References in the docs: ``docs/ppo-details.md`` section numbers.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from rlhflab.config import base as configbase
from rlhflab.config.base import ConfigError, section, setting
from rlhflab.config.models import PRECISIONS, ModelConfig, RewardConfig
from rlhflab.config.refresh_checks import check_refresh
from rlhflab.config.run import DataConfig, DistConfig, LogConfig, MonitorConfig
from rlhflab.config.stages import (
    STAGE_DEFAULTS,
    STAGES,
    DPOConfig,
    GRPOConfig,
    RMConfig,
    SFTConfig,
    with_stage_defaults,
)
from rlhflab.config.sweep import DEFAULT_SPACES, SweepConfig
from rlhflab.config.training import (
    ADVANTAGE_ESTIMATORS,
    CRITIC_FREE_ESTIMATORS,
    LOSS_KL_ESTIMATORS,
    PPOConfig,
    RolloutConfig,
)


@dataclass
class Config:
    seed: int = setting(0, "Seed for sampling, shuffling and initialising.", low=0, high=2**63 - 1)
    device: str = setting(
        "auto",
        "'auto' (cuda when available, else cpu), 'cpu' or 'cuda'; 'cuda' on a machine "
        "without one is an error in every command, not a quiet CPU run.",
        choices=("auto", "cpu", "cuda"),
    )
    threads: int = setting(
        0,
        "torch CPU threads (0 = torch's default).",
        low=0,
        high=4096,  # torch's limit: int32
    )
    model: ModelConfig = section(ModelConfig, "The four-model cast.")
    reward: RewardConfig = section(RewardConfig, "Where scores come from.")
    rollout: RolloutConfig = section(RolloutConfig, "Sampling.")
    ppo: PPOConfig = section(PPOConfig, "The PPO update.")
    data: DataConfig = section(DataConfig, "Prompts.")
    log: LogConfig = section(LogConfig, "Run directory, logging and checkpoints.")
    monitor: MonitorConfig = section(MonitorConfig, "Reward-hacking monitors and alerts.")
    dist: DistConfig = section(DistConfig, "Data parallelism under torchrun.")
    grpo: GRPOConfig = section(GRPOConfig, "Group baselines (rlhflab grpo / rloo).")
    dpo: DPOConfig = section(DPOConfig, "Direct preference optimisation (rlhflab dpo).")
    sft: SFTConfig = section(SFTConfig, "Supervised fine-tuning (rlhflab sft).")
    rm: RMConfig = section(RMConfig, "Reward-model training (rlhflab rm).")
    sweep: SweepConfig = section(SweepConfig, "Hyperparameter search (rlhflab sweep).")


# The short names the settings' documentation cites, spelled out (docs/ppo-details.md §0
# has the same list with what was read of each); `rlhflab config` prints it.
SOURCES = {
    "OAI19": "Ziegler et al. 2019, Fine-Tuning Language Models from Human Preferences",
    "N+": "Huang et al. 2024, The N+ Implementation Details of RLHF with PPO (arXiv 2403.17031)",
    "InstructGPT": "Ouyang et al. 2022, Training language models to follow instructions with "
    "human feedback (arXiv 2203.02155)",
    "MOSS": "Zheng et al. 2023, Secrets of RLHF in Large Language Models Part I: PPO "
    "(arXiv 2307.04964)",
    "DSM": "Shao et al. 2024, DeepSeekMath, where GRPO was introduced (arXiv 2402.03300)",
    "QLoRA": "Dettmers et al. 2023, QLoRA: Efficient Finetuning of Quantized LLMs "
    "(arXiv 2305.14314)",
    "Dr. GRPO": "Liu et al. 2025, Understanding R1-Zero-Like Training (arXiv 2503.20783)",
    "DAPO": "Yu et al. 2025, DAPO: an open-source LLM RL system at scale (arXiv 2503.14476)",
    "k1, k2, k3": "Schulman 2020, Approximating KL Divergence: k1 = log π − log π_ref, "
    "k2 = ½(log π − log π_ref)², k3 = (r − 1) − log r with r = π_ref/π",
    "k3+": "verl's straight-through estimator: k3's value forward, k2's gradient backward",
    "TRL, verl, OpenRLHF, CleanRL": "the huggingface/trl, volcengine/verl, OpenRLHF/OpenRLHF "
    "and vwxyzjn/cleanrl code bases",
}


# Long (about 100 lines): one flat list of the cross-field rules, each a few lines with its
# message, read top to bottom; split, the rules would hide from one another.
def validate(cfg: Config, stage: str = "ppo", reward_given: bool = False) -> Config:
    """Cross-field checks that single-field bounds cannot express (for the given stage).
    ``reward_given``: the caller brings a reward of its own (the Python API's callables),
    so a config without ``reward.model`` or ``reward.functions`` is complete."""
    mc = cfg.model
    lora = mc.lora_r or mc.critic_lora_r
    if mc.runtime == "native" and (lora or mc.trust_remote_code):
        raise ConfigError(
            "model.runtime: 'native' runs rlhflab's own Llama code, which supports neither "
            "LoRA (model.lora_r, model.critic_lora_r) nor model.trust_remote_code; use "
            "'transformers'"
        )
    _check_lora_targets(mc.lora_targets)
    if stage == "rm" and cfg.rm.length_exempt is not None and not cfg.rm.length_head:
        raise ConfigError(
            "rm.length_exempt: names heads ODIN leaves alone, but rm.length_head is off "
            "(no ODIN); set rm.length_head=true or leave rm.length_exempt unset"
        )
    negative = {h: w for h, w in cfg.rm.heads.items() if w < 0}
    if stage == "rm" and negative:
        head, weight = next(iter(negative.items()))
        raise ConfigError(
            f"rm.heads: the loss weight of '{head}' is {weight}; a negative weight trains the "
            "head to prefer the rejected answer (0 leaves it untrained)"
        )
    if stage == "rm" and cfg.rm.length_head and "length" in cfg.rm.heads:
        raise ConfigError(
            "rm.heads: 'length' is the head rm.length_head adds (ODIN); name your heads otherwise"
        )
    if stage in ("sft", "rm") and lora:
        raise ConfigError(
            f"model.lora_r: rlhflab {stage} trains every weight (its folder is the whole "
            "model the next stage starts from); LoRA applies to ppo, grpo, rloo and dpo"
        )
    _check_compute_dtype(cfg, stage)
    if mc.lora_r and mc.reference_precision != "fp32":
        raise ConfigError(
            f"model.reference_precision: {mc.reference_precision!r}, but with LoRA "
            "(model.lora_r) the reference is the policy's own base with the adapters off: it "
            "shares the policy's weights and keeps their precision; leave it at 'fp32'"
        )
    section = getattr(cfg, stage, None)
    micro = getattr(section, "micro_batch_size", None) if stage in ("sft", "dpo") else None
    if micro and section.batch_size % micro:
        raise ConfigError(
            f"{stage}.micro_batch_size: {micro} does not divide {stage}.batch_size "
            f"({section.batch_size}); the parts must make up the batch"
        )
    if stage == "dpo" and cfg.dpo.loss_type == "ipo" and cfg.dpo.label_smoothing:
        raise ConfigError(
            "dpo.label_smoothing: applies to the sigmoid loss only (conservative DPO); "
            "dpo.loss_type is 'ipo'"
        )
    for sec, name in (("log", "output_dir"), (stage, "output_dir")):
        folder = getattr(getattr(cfg, sec, None), name, None)
        if isinstance(folder, str) and not folder.strip():  # "" would be the current folder
            raise ConfigError(f"{sec}.{name}: empty; give a folder")
        if isinstance(folder, str) and os.path.exists(folder) and not os.path.isdir(folder):
            raise ConfigError(f"{sec}.{name}: {folder} exists and is not a folder")
    if stage in ("sft", "rm", "dpo"):
        return cfg
    mon = cfg.monitor
    blank = [i for i, p in enumerate(mon.phrases) if not p.strip()]
    if blank:  # "" is in every answer: flattery_rate would read 1 and alert at once
        raise ConfigError(
            f"monitor.phrases: entry {blank[0]} is blank; it would match every answer"
        )
    if mon.enabled and mon.response == "raise_kl" and mon.kl_coef_max <= cfg.ppo.kl_coef:
        raise ConfigError(
            f"monitor.kl_coef_max: {mon.kl_coef_max} is not above ppo.kl_coef "
            f"({cfg.ppo.kl_coef}), so monitor.response=raise_kl could never raise β"
        )
    if mc.critic_lora_r and mc.value_model in ("shared", "none"):
        raise ConfigError(
            "model.critic_lora_r: adapts a 'separate' or 'from_reward' critic; with "
            f"model.value_model={mc.value_model!r} there is no separate critic to adapt"
        )
    estimator = cfg.ppo.advantage_estimator
    if stage in CRITIC_FREE_ESTIMATORS and estimator != stage:
        raise ConfigError(
            f"ppo.advantage_estimator: rlhflab {stage} runs the {stage!r} estimator, not "
            f"{estimator!r}; run rlhflab {estimator if estimator != 'gae' else 'ppo'} instead "
            f"(from Python: a Config() carries PPO's defaults; load_config(stage={stage!r}) "
            f"gives {stage}'s)"
        )
    if estimator not in CRITIC_FREE_ESTIMATORS and cfg.model.value_model == "none":
        raise ConfigError(
            "model.value_model: PPO needs a critic (ppo.advantage_estimator=gae); 'none' is "
            "for the critic-free estimators grpo and rloo (rlhflab grpo/rloo)"
        )
    if estimator in CRITIC_FREE_ESTIMATORS:
        if cfg.model.value_model != "none":
            raise ConfigError(
                f"model.value_model: ppo.advantage_estimator={estimator} trains no critic; "
                "set it to 'none'"
            )
        if cfg.rollout.prompts_per_iteration % cfg.grpo.group_size:
            raise ConfigError(
                f"grpo.group_size: {cfg.grpo.group_size} does not divide "
                f"rollout.prompts_per_iteration={cfg.rollout.prompts_per_iteration}"
            )
        if estimator == "grpo" and cfg.grpo.normalize_std and cfg.grpo.eps <= 0:
            raise ConfigError(
                "grpo.eps: must be > 0 while grpo.normalize_std divides by the group's std: "
                "a group of nearly equal scores (greedy sampling, a saturated reward) would "
                "have its rounding noise scaled up to whole advantages"
            )
    if cfg.rollout.prompts_per_iteration % cfg.ppo.minibatches:
        raise ConfigError(
            f"ppo.minibatches: {cfg.ppo.minibatches} does not divide "
            f"rollout.prompts_per_iteration={cfg.rollout.prompts_per_iteration}"
        )
    mb = cfg.rollout.prompts_per_iteration // cfg.ppo.minibatches
    if cfg.ppo.micro_batch_size is not None and mb % cfg.ppo.micro_batch_size:
        raise ConfigError(
            f"ppo.micro_batch_size: {cfg.ppo.micro_batch_size} does not divide the minibatch "
            f"of {mb} answers"
        )
    if cfg.ppo.step_in_backward:
        if cfg.ppo.max_grad_norm is not None:
            raise ConfigError(
                "ppo.step_in_backward: a gradient-norm clip needs all of a model's gradients "
                "before any of its weights is updated; set ppo.max_grad_norm to null (it is "
                f"{cfg.ppo.max_grad_norm})"
            )
        if cfg.ppo.micro_batch_size is not None and cfg.ppo.micro_batch_size != mb:
            raise ConfigError(
                "ppo.step_in_backward: gradients accumulated over micro-batches "
                f"(ppo.micro_batch_size={cfg.ppo.micro_batch_size} < minibatch of {mb}) "
                "cannot be applied during the backward; set micro_batch_size to null"
            )
    if cfg.ppo.loss_agg_norm is not None and cfg.ppo.loss_agg != "seq-mean-token-sum-norm":
        raise ConfigError(
            "ppo.loss_agg_norm: only used with ppo.loss_agg=seq-mean-token-sum-norm "
            f"(it is {cfg.ppo.loss_agg!r})"
        )
    if cfg.model.value_model == "from_reward" and not cfg.reward.model:
        raise ConfigError("model.value_model: 'from_reward' needs reward.model to be set")
    if cfg.model.critic and cfg.model.value_model not in ("separate", "auto"):
        raise ConfigError("model.critic: only used with value_model 'separate'")
    rw = cfg.reward
    if rw.model and rw.ensemble:
        raise ConfigError("reward.ensemble: set either reward.model or reward.ensemble, not both")
    if len(rw.ensemble) == 1:
        raise ConfigError("reward.ensemble: one member is no ensemble; set reward.model to it")
    if not (rw.model or rw.ensemble or rw.functions or reward_given):
        raise ConfigError("reward: set reward.model, reward.ensemble or reward.functions")
    if rw.heads and not (rw.model or rw.ensemble):
        raise ConfigError("reward.heads: head weights need reward.model or reward.ensemble")
    if rw.heads and not any(rw.heads.values()) and not (rw.functions or reward_given):
        # (with functions, zero weights watch the heads without optimising them)
        raise ConfigError("reward.heads: every weight is 0, so the reward is constant")
    check_refresh(cfg)
    _check_adaptive_kl(cfg.ppo, cfg.rollout.prompts_per_iteration)
    if cfg.ppo.kl_placement == "reward" and cfg.ppo.kl_estimator not in ("k1", "k3", "abs"):
        raise ConfigError(
            f"ppo.kl_estimator: {cfg.ppo.kl_estimator!r} is a loss-side estimator; in the reward "
            "use k1 (ppo-details §3.4)"
        )
    if cfg.ppo.kl_placement == "loss" and cfg.ppo.kl_estimator not in LOSS_KL_ESTIMATORS:
        # E_π[∇ log π] = 0, so k1 differentiated in the loss has no expected gradient: the
        # KL penalty would silently vanish (abs is no KL gradient either)
        raise ConfigError(
            f"ppo.kl_estimator: {cfg.ppo.kl_estimator!r} in the loss (ppo.kl_placement=loss) "
            "gives no KL gradient; use one of "
            f"{', '.join(repr(e) for e in LOSS_KL_ESTIMATORS)} (ppo-details §3.4)"
        )
    return cfg


def _check_adaptive_kl(ppo, answers: int) -> None:
    """The adaptive controller multiplies β by 1 + e·n/horizon, e in [−0.2, 0.2] (OAI19),
    n the iteration's answers: β must start above 0 (0 stays 0: the control would do
    nothing), and 0.2·n/horizon must stay under 1, else a KL far under target makes the
    factor ≤ 0 — a negative β, a bonus for drifting from the reference."""
    if ppo.kl_target is None:
        return
    if ppo.kl_coef <= 0:
        raise ConfigError(
            "ppo.kl_coef: the adaptive controller (ppo.kl_target) multiplies β, so it must "
            "start above 0 (it is 0); set a starting β such as 0.05, or unset ppo.kl_target"
        )
    if 0.2 * answers >= ppo.kl_horizon:
        raise ConfigError(
            f"ppo.kl_horizon: {ppo.kl_horizon:g} answers against {answers} an iteration "
            f"(rollout.prompts_per_iteration): β would be multiplied by 1 − 0.2·{answers}/"
            f"{ppo.kl_horizon:g} ≤ 0 when the KL is far under ppo.kl_target, turning the KL "
            f"penalty into a bonus; set ppo.kl_horizon above {0.2 * answers:g} (OAI19: 10000)"
        )


def _check_lora_targets(targets: str | list[str]) -> None:
    if isinstance(targets, str) and targets != "all-linear":
        raise ConfigError(
            f"model.lora_targets: {targets!r}: a single string must be 'all-linear'; name "
            "layers as a list, e.g. [q_proj, v_proj]"
        )
    if not targets:
        raise ConfigError("model.lora_targets: empty; name at least one layer or 'all-linear'")


def _check_compute_dtype(cfg: Config, stage: str) -> None:
    """model.compute_dtype against the settings it cannot go with (the device-dependent
    checks are models.precision's, once the device is known)."""
    mc = cfg.model
    ppo_family = stage not in ("sft", "rm", "dpo")  # the stages that read ppo.*
    if mc.compute_dtype == "fp16" and cfg.ppo.step_in_backward and ppo_family:
        raise ConfigError(
            "ppo.step_in_backward: with model.compute_dtype=fp16 an overflow of the scaled "
            "gradients is only known once the backward is over, after some weights were "
            "already updated; set ppo.step_in_backward to false, or compute_dtype to bf16"
        )
    if mc.compute_dtype != "fp32" and mc.cpu_matmul == "numpy":
        raise ConfigError(
            f"model.cpu_matmul: 'numpy' multiplies fp32 matrices, and model.compute_dtype="
            f"{mc.compute_dtype} runs the products in {mc.compute_dtype}; use 'torch'"
        )
    if mc.compute_dtype != "fp32" and cfg.dist.mixed_precision != "none":
        raise ConfigError(
            "dist.mixed_precision: model.compute_dtype already sets the arithmetic of the "
            "trained models (autocast over fp32 weights, on every device and strategy); "
            "set dist.mixed_precision to 'none', or model.compute_dtype to 'fp32'"
        )


# The settings that name local files or folders. A run records them as absolute paths
# (trainers.loop.RunLoop), so that its config.yaml still finds its base model, data and
# output when export, generate, eval or --resume run from another directory.
PATH_FIELDS = (
    ("model", "policy"),
    ("model", "critic"),
    ("reward", "model"),
    ("reward", "ensemble"),
    ("data", "prompts"),
    ("log", "output_dir"),
    ("sft", "data"),
    ("sft", "output_dir"),
    ("rm", "data"),
    ("rm", "init"),
    ("rm", "output_dir"),
    ("dpo", "data"),
)


def absolute_paths(values: dict) -> dict:
    """A copy of a config tree (sections of plain values, as ``to_dict`` gives) with every
    relative path in :data:`PATH_FIELDS` made absolute against the current directory
    (``~`` expanded; symbolic links kept as written); ``preset:NAME``, None and sections
    the tree lacks are left as they are."""

    def absolute(v):
        if isinstance(v, list):
            return [absolute(x) for x in v]
        if not isinstance(v, str) or not v or v.startswith("preset:"):
            return v
        return os.path.abspath(os.path.expanduser(v))

    out = {k: dict(v) if isinstance(v, dict) else v for k, v in values.items()}
    for sec, name in PATH_FIELDS:
        if isinstance(out.get(sec), dict) and name in out[sec]:
            out[sec][name] = absolute(out[sec][name])
    return out


def load_config(
    path=None, overrides=None, base: dict | None = None, stage="ppo", reward_given=False
) -> Config:
    """The config of ``stage`` (a command: ppo, grpo, rloo, dpo, sft, rm): the stage's own
    defaults (:data:`rlhflab.config.stages.STAGE_DEFAULTS`), then ``base``, then the file at
    ``path``, then the dotted ``overrides``; each wins over the ones before it.
    ``reward_given``: see :func:`validate`."""
    if stage not in STAGES:  # else a typo gets the PPO defaults and a later, odder error
        raise ConfigError(f"stage: {stage!r} is not a stage; one of {', '.join(STAGES)}")
    base = with_stage_defaults(stage, base)
    return validate(configbase.load(Config, path, overrides, base), stage, reward_given)


__all__ = [
    "PATH_FIELDS",
    "absolute_paths",
    "PRECISIONS",
    "LOSS_KL_ESTIMATORS",
    "ADVANTAGE_ESTIMATORS",
    "CRITIC_FREE_ESTIMATORS",
    "Config",
    "ConfigError",
    "DPOConfig",
    "DataConfig",
    "DistConfig",
    "GRPOConfig",
    "LogConfig",
    "ModelConfig",
    "MonitorConfig",
    "PPOConfig",
    "RMConfig",
    "RewardConfig",
    "RolloutConfig",
    "SFTConfig",
    "SOURCES",
    "STAGE_DEFAULTS",
    "DEFAULT_SPACES",
    "SweepConfig",
    "load_config",
    "validate",
]
