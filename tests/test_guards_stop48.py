"""Defects found in stop 48, each pinned by a test that fails on the old code."""

import logging

import pytest

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


def test_a_setting_given_twice_in_the_overrides_is_said(capsys, caplog):
    # the last one won without a word; scripts that append to a base list rely on it winning
    assert main(["ppo", "ppo.lr=1e-5", "rollout.max_new_tokens=8", "ppo.lr=3e-5"]) == 2
    assert (
        "ppo.lr: given twice in the overrides ('ppo.lr=1e-5', then 'ppo.lr=3e-5'); the last "
        "is used" in caplog.text
    )
    caplog.clear()
    # the same value twice is harmless
    assert main(["ppo", "ppo.lr=1e-5", "ppo.lr=0.00001"]) == 2
    assert "twice" not in caplog.text
    # from Python, a list of overrides reads as the command line does
    import rlhflab

    trainer = rlhflab.PPOTrainer(
        overrides=["ppo.lr=1e-5", "ppo.lr=3e-5"], reward=lambda p, a: [0.0] * len(a)
    )
    assert trainer.config.ppo.lr == 3e-5 and "given twice in the overrides" in caplog.text


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


def test_a_resume_trains_at_the_lr_and_kl_coef_it_says(tmp_path, caplog):
    # docs/ppo.md: "a resume may change settings (a lower ppo.lr after a spike)"; the
    # checkpoint's optimiser groups and β won, while the log said the new values
    import json

    fast = ["ppo.epochs=1", "ppo.minibatches=1", "log.checkpoint_every=1", "ppo.warmup_steps=0"]
    PPOTrainer(make_cfg(tmp_path, "ppo.iterations=1", *fast)).fit()
    changed = ["ppo.iterations=2", "ppo.lr=2e-4", "ppo.critic_lr=3e-4", "ppo.kl_coef=0.2"]
    changed += ["ppo.weight_decay=0.5", "ppo.adam_eps=1e-3"]
    trainer = PPOTrainer(make_cfg(tmp_path, *fast, *changed))
    trainer.fit(resume=True)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    assert [r["iteration"] for r in rows] == [1, 2]
    assert rows[0]["lr/policy"] == 1e-3 and rows[0]["objective/kl_coef"] == 0.05
    assert rows[1]["lr/policy"] == 2e-4
    assert {g["lr"] for g in trainer.update.guard.critic_opt.param_groups} == {3e-4}
    assert rows[1]["objective/kl_coef"] == pytest.approx(0.2)
    assert "ppo.kl_coef 0.05 → 0.2: β 0.05 → 0.2" in caplog.text
    for opt in (trainer.update.guard.opt, trainer.update.guard.critic_opt):
        assert 0.5 in {g["weight_decay"] for g in opt.param_groups}
        assert {g["eps"] for g in opt.param_groups} == {1e-3}
    # a resume with the recorded settings keeps the checkpoint's state as it was
    again = PPOTrainer(make_cfg(tmp_path, *fast, *changed[1:], "ppo.iterations=3"))
    again.fit(resume=True)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    assert rows[2]["lr/policy"] == 2e-4 and rows[2]["objective/kl_coef"] == pytest.approx(0.2)
    # the report's config tables show config.yaml (the last steps'): it says what changed
    from rlhflab.app.report import build_report

    text = build_report(tmp_path / "run").read_text()
    assert "Settings changed at a resume</b> — after step 1 (config.until-step-1.yaml): " in text
    assert "ppo.kl_coef: 0.05 → 0.2" in text and "ppo.lr: 0.001 → 0.0002" in text
    assert "after step 2 (config.until-step-2.yaml): ppo.iterations: 2 → 3." in text


def test_an_optimiser_state_brings_its_moments_not_its_settings():
    # the same path for SFT, RM and DPO (trainers.common.load_single_model_state)
    import torch

    from rlhflab.backends.optim import FusedAdamW, LambdaSchedule
    from rlhflab.trainers.common import load_keeping_settings

    w = torch.nn.Parameter(torch.ones(3))
    old = FusedAdamW([{"params": [w]}], lr=1.0, weight_decay=0.1, eps=1e-8)
    sched = LambdaSchedule(old, lambda s: 1.0 / (1 + s))
    w.grad = torch.ones(3)
    old.step()
    sched.step()
    saved, saved_sched = old.state_dict(), sched.state_dict()
    new = FusedAdamW([{"params": [w]}], lr=0.5, weight_decay=0.0, eps=1e-6)
    new_sched = LambdaSchedule(new, lambda s: 1.0 / (1 + s))
    load_keeping_settings(new, lambda: new.load_state_dict(saved))
    new_sched.load_state_dict(saved_sched)
    (group,) = new.param_groups
    assert (group["lr"], group["weight_decay"], group["eps"]) == (0.25, 0.0, 1e-6)
    assert torch.equal(new.state[w]["exp_avg"], old.state[w]["exp_avg"])
    assert new_sched.last_epoch == 1


def test_a_misspelt_attribute_on_a_config_object_is_refused():
    # `cfg.ppo.lrr = 1e-3` trained at the default lr: the dict it was read through lost it
    import pytest

    import rlhflab
    from rlhflab.config import ConfigError

    cfg = rlhflab.Config()
    cfg.ppo.lrr = 1e-3
    with pytest.raises(ConfigError, match=r"unknown config key ppo.lrr \(set on the Config"):
        rlhflab.PPOTrainer(config=cfg, reward=lambda prompts, answers: [0.0] * len(answers))
    cfg = rlhflab.Config()
    cfg.ppo.lr = 1e-3  # a field: taken
    trainer = rlhflab.PPOTrainer(config=cfg, reward=lambda prompts, answers: [0.0] * len(answers))
    assert trainer.config.ppo.lr == 1e-3


def test_a_halted_run_says_its_error_in_run_json_and_the_report(tmp_path):
    # the log ends the step before a halt: the report said "2 updates were skipped" for a
    # run halted on its third, and run.json only "TrainingHalted"
    import json

    import pytest

    from rlhflab.app.report import build_report
    from rlhflab.trainers.common import TrainingHalted

    calls = []

    def flaky(prompts, answers):
        calls.append(1)
        return [float("nan") if len(calls) > 1 else 0.5] * len(answers)

    cfg = make_cfg(tmp_path, "ppo.iterations=6", "ppo.epochs=1", "ppo.minibatches=1")
    cfg.reward.functions = {}
    trainer = PPOTrainer(cfg, rewards=((_named(flaky), 1.0),))
    with pytest.raises(TrainingHalted):
        trainer.fit()
    info = json.loads((tmp_path / "run" / "run.json").read_text())
    assert info["error"] == "TrainingHalted"
    assert info["error_message"].startswith("PPO iteration 4: non-finite reward in 3 updates")
    text = build_report(tmp_path / "run").read_text()
    said = "The run ended with an error: PPO iteration 4: non-finite reward in 3"
    assert said in text
    assert "<td>TrainingHalted: PPO iteration 4: non-finite reward in 3" in text  # The run
    # a run that scores no answers (SFT, DPO, RM) says it too, first
    from rlhflab.app.report_parts import verdict

    loss_only = verdict([{"iteration": 1, "loss": 2.0}], [], {}, None, None, "halted here")
    assert "</span></h2><p class='say'>The run ended with an error: halted here</p>" in loss_only


def _named(fn):
    from rlhflab.experience.rewards import CallableReward

    return CallableReward(fn, "flaky")


def test_sft_logs_the_learning_rate_each_step_trained_at(tmp_path):
    # it logged the next step's: 1e-3 for a first step that trained at 5e-4 in warm-up
    import json

    args = ["sft", "model.policy=preset:nano", "sft.examples=20", "sft.batch_size=4"]
    args += ["sft.steps=3", "sft.warmup_steps=2", "sft.lr=1e-3", "device=cpu"]
    args += ["log.progress=false", f"sft.output_dir={tmp_path / 'sft'}"]
    assert main(args) == 0
    rows = [json.loads(x) for x in (tmp_path / "sft" / "run" / "metrics.jsonl").open()]
    assert [r["lr"] for r in rows] == [5e-4, 1e-3, 1e-3]


def test_a_too_long_sft_row_names_its_own_answer_field(tmp_path):
    # an answer in 'completion' was called 'response' in the message
    import pytest

    from rlhflab.config import load_config
    from rlhflab.experience.data import DataError
    from rlhflab.models.build import load_tokenizer_for
    from rlhflab.trainers.sft import load_sft_pairs

    rows = tmp_path / "sft.jsonl"
    rows.write_text('{"prompt": "say", "completion": "a b c d e f g h i j k l m n o p"}\n')
    cfg = load_config(overrides=["model.policy=preset:nano"], reward_given=True)
    tokenizer = load_tokenizer_for(cfg.model.policy, cfg.model)
    with pytest.raises(DataError, match=r"sft\.jsonl:1: prompt \+ 'completion' \+ EOS is"):
        load_sft_pairs(str(rows), tokenizer, None, 6, "error")


def test_a_bad_value_inside_a_mapping_setting_of_a_file_names_the_file(tmp_path, capsys):
    # "reward.functions.mod:fn: expected float" lost the file's name (others had it)
    config = tmp_path / "c8.yaml"
    config.write_text(
        "model:\n  policy: preset:nano\nreward:\n  functions:\n"
        "    rlhflab.builtin.toy_rewards:vowel_reward: x\n"
    )
    assert main(["ppo", "--config", str(config)]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith(f"error: {config}: reward.functions.rlhflab.builtin.toy_rewards"), err
    assert err.endswith("expected float, got 'x'"), err


def test_python_overrides_of_another_type_and_yaml_booleans_for_text_are_one_line(capsys):
    import pytest

    import rlhflab
    from rlhflab.config import ConfigError

    for bad in (5, [1], ["ppo.lr=1e-5", None]):
        with pytest.raises(ConfigError, match=r"overrides: a dict of dotted keys .* got "):
            rlhflab.PPOTrainer(overrides=bad, reward=lambda p, a: [0.0] * len(a))
    # YAML 1.1 reads yes as true: the message says so (it said only "expected str, got True")
    assert main(["ppo", "reward.normalize=yes"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err == (
        "error: reward.normalize: expected str, got True (YAML reads it as true/false "
        "(yes, no, on, off); quote it)"
    )


def test_prompts_whose_messages_end_with_an_answer_are_said(tmp_path, caplog):
    # an SFT conversation given as PPO prompts was trained on silently: the policy answered
    # after the answer
    import json

    from rlhflab.config import load_config
    from rlhflab.experience.data import load_prompts
    from rlhflab.models.build import load_tokenizer_for

    rows = tmp_path / "p.jsonl"
    user = {"role": "user", "content": "add 2 and 3"}
    lines = [{"messages": [user]}, {"messages": [user, {"role": "assistant", "content": "5"}]}]
    lines.append({"prompt": [user, {"role": "assistant", "content": "5"}]})
    rows.write_text("".join(json.dumps(r) + "\n" for r in lines))
    cfg = load_config(overrides=["model.policy=preset:nano"], reward_given=True)
    tokenizer = load_tokenizer_for(cfg.model.policy, cfg.model)
    prompts, _ = load_prompts(str(rows), tokenizer, 64)
    assert len(prompts) == 3
    assert "p.jsonl: 2 prompts end with the assistant's turn (first: " in caplog.text
    assert "p.jsonl:2)" in caplog.text


def test_a_negative_final_kl_is_said_as_a_sampled_estimate():
    from rlhflab.app.report_parts import verdict

    row = {"iteration": 1, "objective/scores": 0.5, "objective/kl_coef": 0.05}
    said = verdict([{**row, "objective/kl": -0.004}], [], {}, None)
    assert "-0.004 nats per answer (β 0.05) — below 0: k1 is a sampled estimate" in said
    assert "below 0" not in verdict([{**row, "objective/kl": 0.2}], [], {}, None)


def test_a_run_that_ends_well_inside_a_callers_except_is_not_recorded_as_failed(tmp_path):
    # sys.exc_info() in the loop's finally also saw the exception the caller was handling
    # (the "lower the lr after a halt" pattern): a finished run got error=TrainingHalted
    import json

    cfg = make_cfg(tmp_path, *FAST)
    try:
        raise ValueError("the caller's own")
    except ValueError:
        PPOTrainer(cfg).fit()
    info = json.loads((tmp_path / "run" / "run.json").read_text())
    assert info["error"] is None and info["error_message"] is None


def test_a_resume_with_fewer_updates_an_iteration_keeps_the_schedule_s_iteration(tmp_path):
    # the schedule counts optimiser steps: 2 updates an iteration resumed as 1 put a linear
    # decay past its end (lr 0 for the rest of the run), silently
    import json

    fast = ["ppo.minibatches=1", "log.checkpoint_every=1", "ppo.lr_schedule=linear"]
    PPOTrainer(make_cfg(tmp_path, "ppo.iterations=2", "ppo.epochs=2", *fast)).fit()
    # the step-2 checkpoint: 4 of 8 optimiser steps; as 1 update an iteration of 4 iterations
    # that is iteration 2 of 4 (step 2 of 4): lr 1e-3 × (1 − 2/4) after iteration 3's update
    PPOTrainer(make_cfg(tmp_path, "ppo.iterations=4", "ppo.epochs=1", *fast)).fit(resume=True)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    assert [r["iteration"] for r in rows] == [1, 2, 3, 4]
    assert rows[2]["lr/policy"] == pytest.approx(1e-3 * (1 - 3 / 4))
    assert rows[3]["lr/policy"] == pytest.approx(0.0)


def test_a_reward_error_raised_inside_a_library_names_the_user_s_line():
    # json.loads raises deep in the json module: that frame is not the line to fix
    from rlhflab.experience.rewards import CallableReward, RewardBatch
    from tests import reward_fns

    line = reward_fns.bad_json.__code__.co_firstlineno + 3
    with pytest.raises(Exception, match=rf"reward_fns\.py:{line}, in bad_json\)$"):
        CallableReward(reward_fns.bad_json, "bad")(RewardBatch(["p"], ["a"]))


def test_a_reward_module_that_fails_to_import_names_its_line(tmp_path, monkeypatch):
    from rlhflab.experience.rewards import FunctionReward, RewardError

    (tmp_path / "broken_at_two.py").write_text("import json\nX = json.loads('{')\n")
    (tmp_path / "needs_more.py").write_text("import no_such_module_here\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(RewardError, match=r"broken_at_two\.py:2, in <module>\)$"):
        FunctionReward("broken_at_two:r")
    with pytest.raises(
        RewardError, match=r"no_such_module_here'.*needs_more\.py:1, in <module>\)$"
    ):
        FunctionReward("needs_more:r")
