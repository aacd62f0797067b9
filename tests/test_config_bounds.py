"""Settings whose values can mean nothing are refused naming the field (an outside tester
found them accepted: thresholds that alert every iteration or never, a clip below zero,
a thread count that overflowed deep in torch), with what a value out of bounds may have
meant where there is a likely intent."""

import pytest

from rlhflab.app.cli import main
from rlhflab.config import ConfigError, load_config

REWARD = "reward.functions={'rlhflab.builtin.toy_rewards:cat_reward': 1}"


@pytest.mark.parametrize(
    "override, message",
    [
        ("threads=1000000000000000000000", "threads: must be <= 4096"),
        ("monitor.flattery_rate=1.5", "monitor.flattery_rate: must be <= 1.0"),
        ("monitor.flattery_excess=-5.5", "monitor.flattery_excess: must be >= 0.0"),
        ("monitor.length_ratio=-5.5", "monitor.length_ratio: must be > 0.0"),
        ("monitor.repeated_ngram_rate=1e30", "monitor.repeated_ngram_rate: must be <= 1.0"),
        ("monitor.reward_length_corr=2", "monitor.reward_length_corr: must be <= 1.0"),
        ("monitor.gold_drop=-1", "monitor.gold_drop: must be >= 0.0"),
        ("ppo.clip_low=1.5", "ppo.clip_low: must be <= 1.0"),
        ("rollout.temperature=0", "rollout.temperature: must be > 0.0, got 0.0 (for greedy"),
    ],
)
def test_settings_that_mean_nothing_are_refused_naming_the_field(override, message):
    with pytest.raises(ConfigError) as err:
        load_config(overrides=[REWARD, override])
    assert str(err.value).startswith(message), str(err.value)


def test_the_thresholds_still_take_none_and_their_whole_range():
    cfg = load_config(
        overrides=[
            REWARD,
            "monitor.flattery_rate=null",
            "monitor.reward_length_corr=-1",
            "monitor.flattery_excess=0",
            "ppo.clip_low=1",
        ]
    )
    assert cfg.monitor.flattery_rate is None and cfg.monitor.reward_length_corr == -1


def test_an_override_without_a_setting_name_is_one_line(capsys):
    for bad in ("=5", "ppo..lr=1"):
        assert main(["ppo", REWARD, bad]) == 2
        assert f"override {bad!r}: no setting named before '='" in capsys.readouterr().err


def test_lengths_past_the_policys_positions_are_refused_before_any_model_loads(
    tmp_path, monkeypatch
):
    # read from its config.json: SmolLM2 built four models before saying so
    from rlhflab.trainers import ppo

    def no_models(*args, **kwargs):
        raise AssertionError("the models were built first")

    monkeypatch.setattr(ppo, "build_cast", no_models)
    cfg = load_config(
        overrides=[REWARD, "model.policy=preset:nano", "rollout.max_prompt_tokens=20000"]
    )
    with pytest.raises(ConfigError, match=r"rollout.max_new_tokens: .* exceeds the model's"):
        ppo.PPOTrainer(cfg)


def test_settings_that_would_do_nothing_are_refused_or_said(caplog):
    from rlhflab.trainers.runstate import warn_about_settings

    rm = "reward.model=preset:nano"
    with pytest.raises(ConfigError, match="reward.heads: every weight is 0"):
        load_config(overrides=[rm, "reward.heads={preference: 0}"])
    # beside reward functions zero weights watch the heads without optimising them
    load_config(overrides=[rm, "reward.heads={preference: 0}", REWARD])
    with caplog.at_level("WARNING"):
        warn_about_settings(load_config(overrides=[rm, "reward.ensemble_combine=uwo"]))
    assert "reward.ensemble_combine=uwo combines the members of reward.ensemble" in caplog.text
