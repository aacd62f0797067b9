"""The cross-field checks of ``reward.refresh_*`` (:func:`rlhflab.config.validate` calls
them): kept apart from the other checks only for the config module's length."""

from __future__ import annotations

from rlhflab.config.base import ConfigError


def check_refresh(cfg) -> None:
    """reward.refresh_*: a trained fp32 reward model to fine-tune, and someone to label."""
    rw = cfg.reward
    if not rw.refresh_every:
        if rw.refresh_labeller:
            raise ConfigError("reward.refresh_labeller: only used with reward.refresh_every")
        return
    if not (rw.model or rw.ensemble):
        raise ConfigError(
            "reward.refresh_every: a refresh fine-tunes a trained reward model (reward.model "
            "or reward.ensemble, folders made by `rlhflab rm`); this run's reward is Python "
            "functions only"
        )
    if cfg.model.reward_precision != "fp32":
        raise ConfigError(
            "reward.refresh_every: the reward model is fine-tuned in place, in fp32; "
            f"model.reward_precision={cfg.model.reward_precision} holds it "
            f"{'quantised' if cfg.model.reward_precision == 'int8' else 'in 16 bits'}, "
            "with no fp32 weights to train; set model.reward_precision=fp32"
        )
    if rw.refresh_labeller is None and cfg.data.prompts:
        raise ConfigError(
            "reward.refresh_every: no labeller for these prompts: the built-in annotator "
            "judges the built-in task's answers only (data.prompts is set); set "
            "reward.refresh_labeller to 'module:function'"
        )
    module, sep, function = (rw.refresh_labeller or "m:f").partition(":")
    if not (module and sep and function):
        raise ConfigError(
            f"reward.refresh_labeller: expected 'module:function', got {rw.refresh_labeller!r}"
        )
    # the same rounding as trainers/ppo_refresh.py: a batch needs a pair of each kind asked for
    n_replay = round(rw.refresh_batch_size * rw.refresh_replay)
    if rw.refresh_batch_size - n_replay < 1:
        raise ConfigError(
            f"reward.refresh_replay: {rw.refresh_replay} of reward.refresh_batch_size="
            f"{rw.refresh_batch_size} leaves no fresh pair in a batch (the refresh would "
            "never train on what it labelled); lower it or raise the batch size"
        )
    if rw.refresh_replay > 0 and n_replay < 1:
        raise ConfigError(
            f"reward.refresh_replay: {rw.refresh_replay} of reward.refresh_batch_size="
            f"{rw.refresh_batch_size} rounds to no replayed pair; set it to 0 or raise the "
            "batch size"
        )
    if rw.refresh_replay > 0 and cfg.data.prompts and not cfg.rm.data:
        raise ConfigError(
            "reward.refresh_replay: replaying the reward model's own training pairs needs "
            "them: set rm.data to them (the built-in pairs belong to the built-in task), or "
            "set reward.refresh_replay=0"
        )
