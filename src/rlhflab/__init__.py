"""rlhflab: RLHF centred on PPO.

The Python API (docs/python-api.md) is importable from here: ``rlhflab.PPOTrainer``,
``GRPOTrainer``, ``RLOOTrainer``, ``DPOTrainer``, ``SFTTrainer``, ``RewardTrainer``, ``Config``
and ``load_config``, and the errors a user can act on: ``RlhflabError``, the base of all of
them, and ``ConfigError``, ``DataError``, ``ModelLoadError``, ``CheckpointError``,
``RewardError`` and ``TrainingHalted``. They are imported on first use, so that ``import
rlhflab`` (and the command line's start) stays cheap.
"""

__version__ = "0.1.0"

_API = {
    "PPOTrainer": "rlhflab.app.api",
    "GRPOTrainer": "rlhflab.app.api",
    "RLOOTrainer": "rlhflab.app.api",
    "DPOTrainer": "rlhflab.app.api",
    "SFTTrainer": "rlhflab.app.api",
    "RewardTrainer": "rlhflab.app.api",
    "Config": "rlhflab.config",
    "ConfigError": "rlhflab.config",
    "load_config": "rlhflab.config",
    "RlhflabError": "rlhflab.errors",
    "DataError": "rlhflab.experience.rows",
    "ModelLoadError": "rlhflab.models.prepare",
    "CheckpointError": "rlhflab.infra.checkpoint",
    "RewardError": "rlhflab.experience.rewards",
    "TrainingHalted": "rlhflab.trainers.common",
}

__all__ = ["__version__", *_API]


def __getattr__(name: str):
    if name in _API:
        import importlib

        return getattr(importlib.import_module(_API[name]), name)
    raise AttributeError(f"module 'rlhflab' has no attribute {name!r}")


def __dir__():
    return sorted(__all__)
