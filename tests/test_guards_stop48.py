"""Defects found in stop 48, each pinned by a test that fails on the old code."""

import logging

from rlhflab.app.cli import main
from rlhflab.trainers.ppo import PPOTrainer
from tests.test_ppo import make_cfg

FAST = ["ppo.iterations=1", "ppo.epochs=1", "ppo.minibatches=1", "log.checkpoint_every=1"]


def test_resuming_a_finished_run_with_other_settings_keeps_its_record(tmp_path, caplog):
    caplog.set_level(logging.INFO)
    # config.yaml is the record of the settings the steps ran with (the report reads it):
    # a --resume with nothing left to run rewrote it with settings no step ran under
    PPOTrainer(make_cfg(tmp_path, *FAST)).fit()
    run = tmp_path / "run"
    recorded = (run / "config.yaml").read_text()
    config = str(tmp_path / "copy.yaml")
    (tmp_path / "copy.yaml").write_text(recorded)
    assert main(["ppo", "--config", config, "ppo.lr=0.5", "--resume"]) == 0
    assert "already at step 1 of 1" in caplog.text
    assert "ppo.lr: 0.001 → 0.5" in caplog.text  # the change is still said
    assert (run / "config.yaml").read_text() == recorded
    assert not list(run.glob("config.until-step-*.yaml"))
    # with a step left to run, the new settings are the record and the old ones kept aside
    assert main(["ppo", "--config", config, "ppo.lr=0.5", "ppo.iterations=2", "--resume"]) == 0
    assert "lr: 0.5" in (run / "config.yaml").read_text()
    assert (run / "config.until-step-1.yaml").read_text() == recorded


def test_a_setting_given_twice_on_the_command_line_is_refused(capsys):
    # the last one won without a word (a config file that sets a key twice is refused)
    assert main(["ppo", "ppo.lr=1e-5", "rollout.max_new_tokens=8", "ppo.lr=3e-5"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err == (
        "error: ppo.lr: given twice on the command line ('ppo.lr=1e-5', then 'ppo.lr=3e-5'); "
        "keep one"
    )
    # the same value twice is harmless: it goes on to the next check (the missing reward)
    assert main(["ppo", "ppo.lr=1e-5", "ppo.lr=0.00001"]) == 2
    assert "twice" not in capsys.readouterr().err


def test_memory_says_a_critic_free_estimate_is_not_checked_against_a_run():
    # docs/memory.md says GRPO's group batches are not covered; the command said nothing
    from rlhflab.config import load_config
    from rlhflab.diagnostics.memory_format import not_counted

    for estimator in ("grpo", "rloo"):
        cfg = load_config(
            overrides=[f"ppo.advantage_estimator={estimator}", "model.value_model=none"],
            reward_given=True,
        )
        (line,) = not_counted(None, cfg)
        assert f"rlhflab {estimator}'s own group batches are not yet measured" in line
    assert not_counted(None, load_config(reward_given=True)) == []


def test_the_report_groups_alerts_by_signal_and_folds_the_full_list():
    # 387 rows of the same two signals filled a long run's report before its curves
    from rlhflab.app.report_sections import alerts_table

    alerts = [
        {"iteration": i, "signal": "entropy_ratio", "value": 0.5 - i / 1000, "threshold": 0.6,
         "message": "entropy fell — raise ppo.entropy_coef"}
        for i in range(199, 400)
    ] + [
        {"iteration": i, "signal": "repeated_ngram_rate", "value": v, "threshold": 0.3,
         "message": "repetition — lower the reward's length bonus"}
        for i, v in ((200, 0.35), (250, 0.9), (399, 0.4))
    ]  # fmt: skip
    html = alerts_table(alerts)
    grouped, folded = html.split("<details>")
    assert grouped.count("<tr>") == 3  # header + one row per signal
    assert (
        "<td>entropy_ratio</td><td>201</td><td>199–399</td><td>0.101</td><td>0.600</td>" in grouped
    )
    assert "<td>repeated_ngram_rate</td><td>3</td><td>200–399</td><td>0.900</td>" in grouped
    assert "raise ppo.entropy_coef" in grouped and grouped.count("raise ppo.entropy_coef") == 1
    assert "every alert (204)" in folded and folded.count("<tr>") == 205
    assert alerts_table([]) == "<p>No monitor fired.</p>"


def test_memory_reads_a_grpo_config_under_grpo_defaults(tmp_path, capsys):
    # `rlhflab memory --config grpo.yaml` counted a critic GRPO never builds (value layout
    # separate: 29.5 MiB where the run holds 16.4)
    config = tmp_path / "g.yaml"
    config.write_text("model:\n  policy: preset:nano\ngrpo:\n  group_size: 4\n")
    assert main(["memory", "--config", str(config)]) == 0
    out = capsys.readouterr().out
    assert "\ncritic " in out and "give --method grpo (or rloo)" in out
    assert main(["memory", "--config", str(config), "--method", "grpo"]) == 0
    out = capsys.readouterr().out
    assert "\ncritic " not in out and "--method" not in out
    assert "rlhflab grpo's own group batches are not yet measured" in out
