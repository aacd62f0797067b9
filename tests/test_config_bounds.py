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
    with pytest.raises(ConfigError, match=r"rollout.max_prompt_tokens: .* exceeds the model.s"):
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
    # no phrases: the flattery signals would read 0 for ever, silently
    with caplog.at_level("WARNING"):
        warn_about_settings(load_config(overrides=[rm, "monitor.phrases=[]"]))
    assert "monitor.phrases is empty" in caplog.text
    # a blank phrase is in every answer: flattery_rate 1 and an alert at once
    with pytest.raises(ConfigError, match="monitor.phrases: entry 1 is blank"):
        load_config(overrides=[rm, "monitor.phrases=[Great question, ' ']"])


def test_a_value_an_older_run_recorded_is_named_with_its_file(tmp_path, capsys):
    # generate/eval read the run's config.yaml: a value today's bounds refuse was said as if
    # the user had typed it
    import yaml

    from rlhflab.trainers.ppo import PPOTrainer

    run = tmp_path / "run"
    fast = ["ppo.iterations=1", "rollout.prompts_per_iteration=4", "rollout.max_new_tokens=4"]
    over = [REWARD, "model.policy=preset:nano", f"log.output_dir={run}", "log.progress=false"]
    PPOTrainer(load_config(overrides=over + fast)).fit()
    recorded = yaml.safe_load((run / "config.yaml").read_text())
    recorded["ppo"]["clip_low"] = 1.5  # as an older rlhflab took it
    (run / "config.yaml").write_text(yaml.safe_dump(recorded))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "hi"}\n')
    args = ["generate", "--model", str(run), "--prompts", str(prompts)]
    assert main([*args, "--out", str(tmp_path / "a.jsonl")]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith(f"error: {run / 'config.yaml'}: ppo.clip_low: must be <= 1.0"), err
    assert "give another with ppo.clip_low=..." in err
    assert main([*args, "--out", str(tmp_path / "a.jsonl"), "ppo.clip_low=0.2"]) == 0


def test_an_unknown_key_in_a_file_names_the_file(tmp_path, capsys):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("monitor:\n  thresholds:\n    flattery_rate: 2\n")
    assert main(["ppo", "--config", str(cfg)]) == 2
    assert f"error: {cfg}: unknown config key monitor.thresholds;" in capsys.readouterr().err


def test_numbers_are_read_as_yaml_1_2_decimals_in_files_and_overrides(tmp_path):
    # PyYAML's YAML 1.1 took `seed: 010` as octal 8, `1:30` as 90 and `0x10` as 16 without a
    # word, and `1e-5` as a string; numbers are decimal now, the rest refused by name
    for text, want in (("010", 10), ("1_000", 1000), ("-0", 0)):
        assert load_config(overrides=[REWARD, f"seed={text}"]).seed == abs(want)
    assert load_config(overrides=[REWARD, "ppo.lr=1e-5"]).ppo.lr == 1e-5
    assert load_config(overrides=[REWARD, "ppo.lr=.5e-5"]).ppo.lr == 5e-6
    for text in ("0x10", "0o10", "1:30"):
        with pytest.raises(ConfigError, match=f"ppo.iterations: expected int, got '{text}'"):
            load_config(overrides=[REWARD, f"ppo.iterations={text}"])
    config = tmp_path / "c.yaml"
    config.write_text("seed: 010\nppo:\n  lr: 3e-6\n  iterations: 1:30\n")
    with pytest.raises(ConfigError, match="ppo.iterations: expected int, got '1:30'"):
        load_config(config, overrides=[REWARD])
    config.write_text("seed: 010\nppo:\n  lr: 3e-6\n  kl_target: null\n")
    cfg = load_config(config, overrides=[REWARD])
    assert (cfg.seed, cfg.ppo.lr, cfg.ppo.kl_target) == (10, 3e-6, None)
    # what a run records reads back the same, with this reader and with PyYAML's
    import yaml

    from rlhflab.config.base import dump_yaml_text, load_yaml_text

    strings = {"data": {"prompt_field": "1e5", "messages_field": "010"}, "x": [".5", 3e-6]}
    text = dump_yaml_text(strings)
    assert load_yaml_text(text) == strings == yaml.safe_load(text)
    # PyYAML itself is left as it was for everyone else
    assert yaml.safe_load("010") == 8
