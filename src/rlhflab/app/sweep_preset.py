"""``rlhflab sweep --preset NAME``: the built-in task's base models for a sweep.

The demo's SFT model and reward model, trained once into ``SWEEP/base``, are every trial's
starting point and reward; the task's gold reward is the objective. A later start of the
same sweep reuses them only if they were trained with the settings this start gives their
stage (:func:`reusable`).
"""

from __future__ import annotations

from pathlib import Path

import yaml

from rlhflab.config import Config, ConfigError, absolute_paths
from rlhflab.config import base as configbase
from rlhflab.trainers.resume_checks import config_changes


def _complete(folder: Path) -> bool:
    return (folder / "config.json").is_file() and any(folder.glob("*.safetensors"))


# what each base stage's training reads: section → its fields (None: all of them), less
# the model fields only PPO reads; a change elsewhere (ppo.*, reward.clip) leaves it valid
_PPO_ONLY_MODEL = {
    "value_model", "critic", "vf_coef", "reference_precision", "reward_precision",
    "offload_frozen", "lora_r", "lora_alpha", "lora_targets", "critic_lora_r",
}  # fmt: skip
STAGE_READS = {
    "sft": {"seed": None, "data": None, "sft": None, "model": None},
    "rm": {
        "seed": None, "data": None, "rm": None, "model": None,
        "reward": ("model", "heads"), "monitor": ("gold",),
    },
}  # fmt: skip


def _read_by(stage: str, values: dict) -> dict:
    """The part of a config tree (``to_dict``'s) that ``stage``'s training reads."""
    out = {}
    for section, fields in STAGE_READS[stage].items():
        value = values.get(section)
        if isinstance(value, dict):
            keep = fields or [k for k in value if not (section == "model" and k in _PPO_ONLY_MODEL)]
            value = {k: value.get(k) for k in keep}
        out[section] = value
    return out


def reusable(folder: Path, stage: str, cfg: Config) -> bool:
    """Whether ``folder`` holds the ``stage`` model this start would train: whole, and
    trained with the settings ``cfg`` gives that stage (its ``run/config.yaml``). A folder
    trained under other overrides is refused, not reused: every trial would start from a
    model the sweep's settings never asked for."""
    if not _complete(folder):
        return False
    recorded_file = folder / "run" / "config.yaml"
    if not recorded_file.is_file():  # trained before runs recorded their config: as before
        return True
    try:
        recorded = yaml.safe_load(recorded_file.read_text()) or {}
    except (OSError, yaml.YAMLError) as e:
        raise ConfigError(f"sweep: cannot read {recorded_file}: {e}") from None
    mine = absolute_paths(configbase.to_dict(cfg))
    recorded = absolute_paths(recorded) if isinstance(recorded, dict) else {}
    changes = config_changes(_read_by(stage, recorded), _read_by(stage, mine))
    if changes:
        shown = "; ".join(changes[:4]) + (f" (and {len(changes) - 4} more)" if changes[4:] else "")
        raise ConfigError(
            f"sweep: {folder} was trained with other settings than this start gives its "
            f"{stage} stage ({shown}); give this sweep another --out, or delete {folder.parent} "
            "to train the base models again"
        )
    return True


def preset_base(
    preset: str, seed: int, out: str | None, overrides: list[str]
) -> tuple[Config, str, Path, str]:
    """(base config, stage, sweep folder, study name): the demo preset's PPO config, its SFT
    and reward models trained unless a previous start of the sweep left them whole."""
    from rlhflab.app.compare import method_config
    from rlhflab.app.demo import demo_config, sft_stage_config
    from rlhflab.trainers.rm_ensemble import train_rm
    from rlhflab.trainers.sft import train_sft

    name = f"{preset}-s{seed}"
    sweep_dir = Path(out or Path("runs") / "sweeps" / name)
    run, cfg = demo_config(preset, seed, sweep_dir.parent, overrides)
    base_dir = sweep_dir / "base"
    cfg.sft.output_dir, cfg.rm.output_dir = str(base_dir / "sft"), str(base_dir / "rm")
    cfg.model.policy, cfg.reward.model = cfg.sft.output_dir, cfg.rm.output_dir
    sft_cfg = sft_stage_config(preset, seed, sweep_dir.parent, overrides)
    sft_cfg.sft.output_dir, sft_cfg.log.progress = cfg.sft.output_dir, cfg.log.progress
    if not reusable(base_dir / "sft", "sft", sft_cfg):
        train_sft(sft_cfg)
    if not reusable(base_dir / "rm", "rm", cfg):
        train_rm(cfg)
    stage = cfg.sweep.method
    if stage != "ppo":
        cfg = method_config(cfg, stage, sweep_dir)
    return cfg, stage, sweep_dir, name
