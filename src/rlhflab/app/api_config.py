"""What the Python API's trainers check and settle before their engine is built: the config
from its many forms, the callbacks, the output folders, and the paths made absolute."""

from __future__ import annotations

import os
from pathlib import Path

from rlhflab.config import PATH_FIELDS, Config, ConfigError, absolute_paths, load_config
from rlhflab.config import validate as validate_config
from rlhflab.config.base import to_dict


def resolve_config(config, overrides, stage: str) -> Config:
    """``config``: None (the stage's defaults), a YAML path, a dict of sections (laid over
    the stage's defaults, as a file is) or a Config (used as it stands); ``overrides``: a
    dict ``{"ppo.lr": 1e-5}`` or a list ``["ppo.lr=1e-5"]``. Not yet validated: the
    trainer sets its inputs first."""
    if overrides is not None and (
        not isinstance(overrides, (dict, list, tuple))
        or not all(isinstance(o, str) for o in overrides)
    ):
        raise ConfigError(  # not a TypeError from deep inside the merge
            "overrides: a dict of dotted keys ({'ppo.lr': 1e-5}) or a list of 'key=value' "
            f"strings (['ppo.lr=1e-5']), got {overrides!r}"
        )
    if isinstance(overrides, (list, tuple)):  # a key given twice is said, as on the command line
        from rlhflab.app.user_errors import say_repeated_overrides

        say_repeated_overrides(list(overrides))
    if isinstance(config, Config):
        from rlhflab.config.base import build, merge_overrides

        _refuse_stray_attributes(config)
        return build(Config, merge_overrides(to_dict(config), overrides))
    if config is not None and not isinstance(config, (dict, str, os.PathLike)):
        raise ConfigError(
            f"config: expected a YAML path, a dict of sections or a Config, got "
            f"{type(config).__name__}"
        )
    path = None if isinstance(config, dict) else config
    base = config if isinstance(config, dict) else None
    # the reward may come from the trainer's arguments: checked in full once they are in
    return load_config(path, overrides, base, stage=stage, reward_given=True)


def _refuse_stray_attributes(obj, prefix: str = "") -> None:
    """A misspelt attribute set on a Config's section (``cfg.ppo.lrr = 1e-3``) is not one of
    its fields, so the dict it is read through dropped it silently: refused, as the same
    key in a file or an override is."""
    import dataclasses

    fields = {f.name: f for f in dataclasses.fields(obj)}
    stray = sorted(set(vars(obj)) - set(fields))
    if stray:
        raise ConfigError(
            f"unknown config key {prefix}{stray[0]} (set on the Config object); known keys "
            f"here: {sorted(fields)}"
        )
    for name, f in fields.items():
        value = getattr(obj, name)
        if f.metadata.get("section") and dataclasses.is_dataclass(value):
            _refuse_stray_attributes(value, f"{prefix}{name}.")


def callback_list(callbacks) -> list:
    """``callbacks`` as a list of callables, or a ConfigError naming what is not one (now,
    not after the first iteration)."""
    if callbacks is None:
        return []
    if callable(callbacks) or isinstance(callbacks, (str, bytes)):
        raise ConfigError(
            f"callbacks: a list of callables, got {type(callbacks).__name__} (write callbacks=[fn])"
        )
    try:
        out = list(callbacks)
    except TypeError:
        raise ConfigError(
            f"callbacks: a list of callables, got {type(callbacks).__name__}"
        ) from None
    for i, cb in enumerate(out):
        if not callable(cb):
            raise ConfigError(f"callbacks[{i}]: {cb!r} is not callable")
    return out


def validate(cfg: Config, stage: str, reward_given: bool = False) -> None:
    """The config's paths made absolute against the directory the trainer is built in — a
    notebook that changes directory before ``train()`` must not split the run over two
    folders, nor record data paths that name the other one — then validated."""
    values = absolute_paths(to_dict(cfg))
    for section, name in PATH_FIELDS:
        setattr(getattr(cfg, section), name, values[section][name])
    validate_config(cfg, stage, reward_given=reward_given)


def absolute_folder(folder) -> str:
    return os.path.abspath(os.path.expanduser(str(folder)))


def check_folder(folder: str, field: str) -> None:
    if not str(folder).strip():  # "" would be the current folder
        raise ConfigError(f"{field}: empty; give a folder")
    if Path(folder).exists() and not Path(folder).is_dir():
        raise ConfigError(f"{field}: {folder} exists and is not a folder")
