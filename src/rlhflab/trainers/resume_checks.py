"""What a --resume compares between a run's recorded config.yaml and the one it resumes
with: every change (warned, :func:`config_changes`), and the model settings that change
which models and tensors a checkpoint holds (refused, :func:`refuse_other_models`)."""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path

import yaml

from rlhflab.config import ConfigError

log = logging.getLogger(__name__)

# model settings that decide which models and tensors a checkpoint holds
# (a folder setting such as model.critic is not one: an old run recorded it relative)
STRUCTURE = ("value_model", "critic_lora_r", "lora_r", "lora_targets")


def read_recorded_config(path: Path) -> dict:
    """A run's config.yaml as a dict; {} (warned) where it cannot be read."""
    try:
        loaded = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:  # a torn or edited file
        log.warning("%s cannot be read (%s); its settings are not compared", path, exc)
        return {}
    return loaded if isinstance(loaded, dict) else {}


def config_changes(old: dict, new: dict, prefix: str = "") -> list[str]:
    """``key: old → new`` for every dotted setting that differs between two config trees."""
    out = []
    for key in sorted(set(old) | set(new), key=str):
        a, b = old.get(key, "<unset>"), new.get(key, "<unset>")
        name = f"{prefix}{key}"
        if isinstance(a, dict) and isinstance(b, dict):
            out += config_changes(a, b, name + ".")
        elif a != b:
            out.append(f"{name}: {a!r} → {b!r}")
    return out


def refuse_other_models(run_dir: Path, config: dict) -> None:
    """--resume with settings that change which models and tensors a checkpoint holds
    (a shared value head for a separate critic, LoRA for full weights) cannot load it:
    said as the setting, not as the missing file it leads to; a ConfigError, which every
    rank meets alike and rank 0 alone says under torchrun."""
    saved = run_dir / "config.yaml"
    old = read_recorded_config(saved).get("model") if saved.is_file() else None
    new = config.get("model") or {}
    if not isinstance(old, dict):
        return
    for key in STRUCTURE:
        if "auto" in (old.get(key), new.get(key)):
            continue  # resolved per run; load_checkpoint names what is then missing
        if key in old and key in new and old[key] != new[key]:
            raise ConfigError(
                f"--resume: model.{key} is {new[key]!r}, but {run_dir} was trained with "
                f"{old[key]!r}: its checkpoints hold other models; resume with the run's "
                "setting (or start a new run elsewhere)"
            )
    adapters = old.get("lora_r") or old.get("critic_lora_r")
    if adapters and "lora_alpha" in old and old["lora_alpha"] != new.get("lora_alpha"):
        raise ConfigError(
            f"--resume: model.lora_alpha is {new.get('lora_alpha')!r}, but {run_dir} "
            f"was trained with {old['lora_alpha']!r}: its adapters would be scaled by "
            "another alpha/r and the policy would not be the one trained; resume with "
            "the run's setting"
        )


# the folders whose architecture the checkpoint's trained tensors are loaded into
TRAINED_FOLDERS = ("policy", "critic")


@contextlib.contextmanager
def checkpoint_of_this_run(run_dir: Path, config: dict):
    """Around loading a checkpoint for --resume: refuses other model settings first
    (:func:`refuse_other_models`); a checkpoint whose tensors then do not fit the models
    built, where a model folder differs from the one the run recorded, is said as that
    setting (``model.policy=preset:tiny`` for a nano run met a shape error naming a tensor)."""
    from rlhflab.infra.checkpoint import CheckpointError  # torch: not for the report's import

    refuse_other_models(run_dir, config)
    try:
        yield
    except CheckpointError as exc:
        saved = run_dir / "config.yaml"
        old = read_recorded_config(saved).get("model") if saved.is_file() else None
        new = config.get("model") or {}
        changed = [
            f"model.{key} is {new.get(key)!r}, but the run was trained from {old[key]!r}"
            for key in TRAINED_FOLDERS
            if isinstance(old, dict) and old.get(key) and old.get(key) != new.get(key)
        ]
        if not changed or not any(w in str(exc) for w in ("has shape", "do not match")):
            raise  # not a tensor that misfits the model (a file missing, a precision)
        raise CheckpointError(
            f"--resume: {'; '.join(changed)}: the checkpoint does not fit that model ({exc}); "
            "resume with the run's setting (or start a new run elsewhere)"
        ) from exc
