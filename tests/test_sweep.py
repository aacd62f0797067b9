"""rlhflab sweep: the space is checked before any trial, trials are ordinary runs, the study
continues where it stopped (also after kill -9), a pruned trial stops early with a
checkpoint and counts towards --trials."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from rlhflab.app.cli import main
from rlhflab.app.sweep import check_space, iteration_objective
from rlhflab.config import ConfigError, load_config
from rlhflab.config.base import to_dict

optuna = pytest.importorskip("optuna")

CONFIG = {
    "model": {"policy": "preset:nano"},
    "reward": {"functions": {"rlhflab.builtin.toy_rewards:vocabulary_reward": 1.0}},
    "rollout": {"prompts_per_iteration": 8, "max_new_tokens": 6},
    "ppo": {"iterations": 3, "epochs": 1},
    "monitor": {
        "gold": "rlhflab.builtin.tasks:gold_reward",
        "flattery_opener_ratio": None,
        "reference_every": 0,
    },
    "log": {"progress": False},
    "sweep": {
        "space": {
            "ppo.lr": {"low": 1e-5, "high": 1e-3, "log": True},
            "ppo.minibatches": {"choices": [1, 2]},
        }
    },
}


def write_config(folder: Path, **sweep) -> Path:
    data = json.loads(json.dumps(CONFIG))
    data["sweep"].update(sweep)
    path = folder / "sw.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def trials(folder: Path) -> list[dict]:
    return json.loads((folder / "sweep.json").read_text())["trials"]


def test_the_space_is_checked_before_any_trial():
    base = to_dict(load_config(reward_given=True))
    ok = check_space({"ppo.lr": {"low": "1e-6", "high": 1e-4, "log": True}}, base)
    assert ok == {"ppo.lr": {"low": 1e-6, "high": 1e-4, "log": True}}
    for space, message in (
        ({"ppo.learning_rate": {"low": 1e-6, "high": 1e-4}}, "unknown config key"),
        ({"ppo.lr": {"low": 1e-4, "high": 1e-6}}, "must be below"),
        ({"ppo.lr": {"low": 0, "high": 1e-4, "log": True}}, "log scale needs low > 0"),
        ({"ppo.minibatches": {"choices": []}}, "no choices"),
        ({"ppo.clip_low": {"low": -1.0, "high": 0.2}}, "ppo.clip_low"),
        ({"ppo.lr": [1e-6, 1e-4]}, "expected {low, high"),
        ({}, "not empty"),
        # a quoted 'false' is a non-empty string: it switched the log scale on
        ({"ppo.lr": {"low": 1e-6, "high": 1e-4, "log": "false"}}, r"ppo.lr.log: expected true"),
        # settings each trial gets from the sweep: "best: sweep.method='grpo'" trained PPO
        ({"sweep.method": {"choices": ["grpo"]}}, "set by the sweep for every trial"),
        ({"log.output_dir": {"choices": ["a", "b"]}}, "set by the sweep for every trial"),
        ({"sweep": {"choices": [{"method": "grpo"}]}}, "set by the sweep for every trial"),
        # settings the method never reads: every trial the same run, its "best" noise
        ({"dpo.beta": {"low": 0.1, "high": 0.5}}, "rlhflab ppo never reads dpo"),
        ({"grpo.group_size": {"choices": [2, 4]}}, "read by grouped estimators"),
        ({"seed": {"low": 0, "high": 3}}, "picks the luckiest"),
    ):
        with pytest.raises(ConfigError, match=message):
            check_space(space, base)
    from rlhflab.config import DEFAULT_SPACES

    for stage in ("ppo", "grpo", "rloo"):  # each method's own space passes
        staged = to_dict(load_config(stage=stage, reward_given=True))
        assert check_space(DEFAULT_SPACES[stage], staged, stage)
    grpo = to_dict(load_config(stage="grpo", reward_given=True))
    assert check_space({"grpo.group_size": {"choices": [2, 4]}}, grpo, "grpo")
    with pytest.raises(ConfigError, match="rlhflab grpo never reads dpo"):
        check_space({"dpo.beta": {"low": 0.1, "high": 0.5}}, grpo, "grpo")
    with pytest.raises(ConfigError, match="rlhflab grpo trains no critic"):
        check_space({"ppo.critic_lr": {"low": 1e-6, "high": 1e-4}}, grpo, "grpo")
    rloo = to_dict(load_config(stage="rloo", reward_given=True))
    with pytest.raises(ConfigError, match="divides by no std"):
        check_space({"grpo.normalize_std": {"choices": [True, False]}}, rloo, "rloo")


def test_a_study_rerun_as_another_experiment_is_refused():
    """Rerunning a sweep under the same name with another space or base config mixed the
    two experiments' trials silently (and the report read the new space only)."""
    import optuna

    from rlhflab.app.sweep_study import keep_one_experiment

    base = to_dict(load_config(reward_given=True))
    space = check_space({"ppo.lr": {"low": 1e-6, "high": 1e-4}}, base)
    study = optuna.create_study(study_name="s", direction="maximize")
    keep_one_experiment(study, space, base)  # the first start records it
    keep_one_experiment(study, space, base)
    moved = {**base, "log": {**base["log"], "progress": False}, "threads": 2, "device": "cuda"}
    keep_one_experiment(study, space, moved)  # no trial's objective changes
    # the same folders given relative or absolute are the same experiment
    relative = {**base, "data": {**base["data"], "prompts": "p.jsonl"}}
    other_study = optuna.create_study(study_name="r", direction="maximize")
    keep_one_experiment(other_study, space, relative)
    absolute = {**relative, "data": {**base["data"], "prompts": os.path.abspath("p.jsonl")}}
    keep_one_experiment(other_study, space, absolute)
    other = check_space({"ppo.kl_coef": {"low": 0.01, "high": 0.1}}, base)
    with pytest.raises(ConfigError, match=r"another experiment \(space.ppo.kl_coef: '<unset>'"):
        keep_one_experiment(study, other, base)
    longer = {**base, "ppo": {**base["ppo"], "iterations": base["ppo"]["iterations"] + 1}}
    with pytest.raises(ConfigError, match=r"base.ppo.iterations: .*another --name"):
        keep_one_experiment(study, space, longer)


def test_a_storage_that_is_no_database_url_is_one_line(tmp_path, capsys):
    config = write_config(tmp_path)
    args = ["sweep", "--config", str(config), "--trials", "1", "--storage", "notaurl"]
    assert main([*args, "--out", str(tmp_path / "sw")]) == 2
    assert "--storage 'notaurl': not a database URL" in capsys.readouterr().err


def test_a_storage_optuna_cannot_open_is_one_line(tmp_path, capsys):
    config = write_config(tmp_path)
    args = ["sweep", "--config", str(config), "--trials", "1", "--storage", "foo://bar"]
    assert main([*args, "--out", str(tmp_path / "sw")]) == 2
    err = capsys.readouterr().err
    assert "--storage 'foo://bar': cannot be opened" in err and "Traceback" not in err
    assert not (tmp_path / "sw").exists()  # no empty folder left behind


def test_a_preset_and_a_config_together_are_refused(tmp_path, capsys):
    config = write_config(tmp_path)
    args = ["sweep", "--config", str(config), "--preset", "quick", "--trials", "1"]
    assert main([*args, "--out", str(tmp_path / "sw")]) == 2
    assert "give --config FILE or --preset NAME, not both" in capsys.readouterr().err
    assert not (tmp_path / "sw").exists()


def test_a_trial_the_trainer_refuses_is_one_line_and_replaced(tmp_path, capsys, caplog):
    # 8 prompts do not split into 3 minibatches: the trainer refuses those draws
    config = write_config(tmp_path, space={"ppo.minibatches": {"choices": [1, 3]}})
    out = tmp_path / "sw"
    with caplog.at_level("WARNING"):
        assert main(["sweep", "--config", str(config), "--trials", "2", "--out", str(out)]) == 0
    said = caplog.text + capsys.readouterr().err
    states = [t["state"] for t in trials(out)]
    assert states.count("complete") == 2 and "fail" in states  # seeded: TPE draws 3
    assert "trial 0 failed: ppo.minibatches" in said and "Traceback" not in said, said
    # and Optuna's own lines for it ("the value nan is not acceptable") are dropped
    import logging

    from rlhflab.app.sweep import _FailedTrialNoise

    noise = logging.LogRecord("optuna", 30, "", 0, "Trial 1 failed with value nan.", None, None)
    assert not _FailedTrialNoise().filter(noise)
    # Ctrl-C: Optuna logged the trial's whole traceback above the command's one line
    try:
        raise KeyboardInterrupt
    except KeyboardInterrupt:
        import sys

        stopped = logging.LogRecord(
            "optuna", 30, "", 0, "Trial 3 failed with parameters: {} because of the "
            "following error: KeyboardInterrupt().", None, sys.exc_info()
        )  # fmt: skip
    assert not _FailedTrialNoise().filter(stopped)
    kept = logging.LogRecord("optuna", 30, "", 0, "Trial 2 finished with value: 0.5", None, None)
    assert _FailedTrialNoise().filter(kept)
    assert any(
        isinstance(f, _FailedTrialNoise)
        for h in optuna.logging.get_logger("optuna").handlers
        for f in h.filters
    )


def test_the_objective_is_gold_or_proxy_less_kl_over_the_budget():
    m = {"monitor/gold": 0.5, "objective/scores": 2.0, "objective/kl": 6.0}
    assert iteration_objective(m, True, None, 0.1) == 0.5
    assert iteration_objective(m, False, None, 0.1) == 2.0
    assert iteration_objective(m, True, 4.0, 0.1) == pytest.approx(0.3)
    assert iteration_objective(m, True, 8.0, 0.1) == 0.5


def test_a_sweep_runs_its_trials_and_a_rerun_continues_the_study(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    config = write_config(tmp_path)
    assert main(["sweep", "--config", str(config), "--trials", "3", "--out", "sw"]) == 0
    first = trials(tmp_path / "sw")
    assert [t["state"] for t in first] == ["complete"] * 3
    for t in first:  # every trial is an ordinary run directory
        assert (Path(t["run_dir"]) / "metrics.jsonl").is_file()
        assert t["iterations"] == 3
    best = yaml.safe_load((tmp_path / "sw/best.yaml").read_text())
    rerun = load_config(base=best)  # loads as a config of the method, ready to rerun
    winner = max(first, key=lambda t: t["value"])
    assert rerun.ppo.lr == winner["params"]["ppo.lr"]
    assert "Best: trial" in (tmp_path / "sw/report.html").read_text()
    assert main(["sweep", "--config", str(config), "--trials", "4", "--out", "sw"]) == 0
    again = trials(tmp_path / "sw")
    assert [t["number"] for t in again] == [0, 1, 2, 3]
    assert again[:3] == first  # the finished trials were not run again
    # the restarted sampler does not replay the first start's stream
    assert again[3]["params"] != first[0]["params"]
    # the folder is that study's: another one there (another --name, or a config file of
    # another name) would overwrite its trial folders and best.yaml
    best_before = (tmp_path / "sw/best.yaml").read_text()
    other = tmp_path / "sw2.yaml"
    other.write_text(config.read_text())
    for args in (["--config", str(config), "--name", "other"], ["--config", str(other)]):
        assert main(["sweep", *args, "--trials", "1", "--out", "sw"]) == 2
    assert "sw holds study 'sw'" in capsys.readouterr().err
    assert (tmp_path / "sw/best.yaml").read_text() == best_before
    assert trials(tmp_path / "sw") == again


def test_a_pruned_trial_stops_early_with_a_checkpoint_and_counts(tmp_path, monkeypatch):
    class PruneLaterTrials(optuna.pruners.BasePruner):
        def prune(self, study, trial):
            return trial.number > 0 and max(trial.intermediate_values) >= 2

    from rlhflab.app import sweep_study

    monkeypatch.setattr(sweep_study, "running_median_pruner", lambda *a: PruneLaterTrials())
    config = write_config(tmp_path)
    out = tmp_path / "sw"
    args = [
        "sweep",
        "--config",
        str(config),
        "--trials",
        "2",
        "--out",
        str(out),
        "ppo.iterations=5",
    ]
    assert main(args) == 0
    rows = trials(out)
    assert [t["state"] for t in rows] == ["complete", "pruned"]
    assert rows[0]["iterations"] == 5
    pruned = Path(rows[1]["run_dir"])
    assert len((pruned / "metrics.jsonl").read_text().splitlines()) == 2
    assert (pruned / "checkpoints" / "step-2").is_dir()


@pytest.mark.slow
def test_a_sweep_killed_mid_trial_resumes_to_its_total(tmp_path):
    config = write_config(tmp_path)
    out = tmp_path / "sw"
    cmd = [sys.executable, "-m", "rlhflab", "--allocator", "system", "sweep", "--config"]
    cmd += [str(config), "--trials", "3", "--out", str(out)]
    log = tmp_path / "sweep.log"  # read when the sweep never gets as far as it should
    with log.open("w") as sink:
        proc = subprocess.Popen(
            [*cmd, "ppo.iterations=12"],
            cwd=tmp_path,
            start_new_session=True,
            stdout=sink,
            stderr=subprocess.STDOUT,
        )
    storage = f"sqlite:///{out / 'study.db'}"
    deadline = time.time() + 240
    complete = optuna.trial.TrialState.COMPLETE
    states, error = [], None
    while time.time() < deadline and proc.poll() is None:
        # kill -9 once trial 0 is done and trial 1 is running
        time.sleep(0.5)
        try:
            # reading only: creating the tables here raced the sweep's own CREATE TABLE
            reader = optuna.storages.RDBStorage(storage, skip_table_creation=True)
            study = optuna.load_study(study_name="sw", storage=reader)
            states = [t.state for t in study.get_trials(deepcopy=False)]
        except Exception as exc:  # the database or the study is not created yet
            error = exc
            continue
        if states[:1] == [complete] and len(states) == 2:
            break
    exited = proc.poll()
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:  # the sweep had already ended, and its group with it
        pass
    proc.wait()
    why = f"states {states}, exit {exited}, last error {error!r}, log:\n{log.read_text()[-2000:]}"
    assert states[:1] == [complete], why
    # the same experiment (another ppo.iterations would be another: refused)
    again = [*cmd, "ppo.iterations=12"]
    done = subprocess.run(again, cwd=tmp_path, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = trials(out)
    states = [t["state"] for t in rows]
    assert states.count("complete") == 3 and len(rows) == 4
    assert states[1] in ("running", "fail")  # the killed trial: never counted


def test_the_objective_chart_keeps_a_negative_labels_minus_sign_in_the_picture():
    """The y labels are right-aligned before the axis; at a 40 px margin -0.00833 lost its
    minus sign and first digits off the picture's left edge, reading as positive."""
    import re

    from rlhflab.app.sweep_report import _svg_over_trials

    svg = _svg_over_trials([{"number": 0, "value": -0.00833}, {"number": 1, "value": -0.0167}])
    labels = re.findall(r'<text x="([\d.]+)"[^>]*text-anchor="end"[^>]*>([^<]+)</text>', svg)
    assert sorted(t for _, t in labels) == ["-0.00833", "-0.0167"]
    for x, text in labels:  # font-size 11: at most ~0.6 em a character
        assert float(x) - 0.6 * 11 * len(text) >= 0, (x, text)


def test_a_preset_sweeps_base_models_are_reused_only_if_trained_as_this_start_asks(
    tmp_path, monkeypatch
):
    """A later start reuses SWEEP/base/sft and rm when their stages' settings are the same
    (a change to PPO's alone leaves them valid); an SFT or RM setting changed between
    starts is refused, where it was reused silently: every trial would have started from a
    model trained without the override."""
    from rlhflab.app.sweep_preset import preset_base

    monkeypatch.chdir(tmp_path)
    small = [
        "model.policy=preset:nano",
        "sft.steps=2",
        "rm.steps=2",
        "rm.pairs=16",
        "log.progress=false",
    ]
    out = str(tmp_path / "sw")
    preset_base("quick", 0, out, small)
    weights = [tmp_path / "sw" / "base" / s / "model.safetensors" for s in ("sft", "rm")]
    stamps = [w.stat().st_mtime_ns for w in weights]
    # settings their training never reads leave them valid too
    unread = [
        "ppo.lr=1e-5",
        "reward.clip=5.0",
        "monitor.opener_every=7",
        "model.offload_frozen=true",
    ]
    cfg, stage, _, _ = preset_base("quick", 0, out, small + unread)
    assert stage == "ppo" and cfg.ppo.lr == 1e-5
    assert [w.stat().st_mtime_ns for w in weights] == stamps  # reused, not trained again
    with pytest.raises(ConfigError, match=r"base/sft was trained with other settings.*sft\.lr"):
        preset_base("quick", 0, out, small + ["sft.lr=5e-4"])
    with pytest.raises(ConfigError, match=r"base/rm was trained with other settings.*rm\.lr"):
        preset_base("quick", 0, out, small + ["rm.lr=2e-4"])
    assert [w.stat().st_mtime_ns for w in weights] == stamps


def test_a_seed_beyond_numpys_makes_a_sampler(tmp_path):
    # rlhflab's seed goes to 2^63 - 1; Optuna's TPE sampler (numpy) refused one over 2^32
    from rlhflab.app.sweep_study import open_study

    cfg = load_config(base=CONFIG, overrides=[f"seed={2**40}"])
    study = open_study(optuna, f"sqlite:///{tmp_path / 's.db'}", "big-seed", cfg)
    assert isinstance(study.sampler, optuna.samplers.TPESampler)


def test_a_preset_sweep_into_another_studys_folder_is_refused_before_training(tmp_path, capsys):
    # it trained the preset's SFT and reward models (minutes) first, into that folder
    out = tmp_path / "sw"
    out.mkdir()
    (out / "study.json").write_text(json.dumps({"study": "sw"}))
    assert main(["sweep", "--preset", "quick", "--trials", "1", "--out", str(out)]) == 2
    assert "holds study 'sw'" in capsys.readouterr().err
    assert sorted(p.name for p in out.iterdir()) == ["study.json"]  # no base/ trained


def test_the_pruner_compares_a_trials_value_now_not_its_best_so_far():
    # Optuna's MedianPruner compares a trial's best value so far: every trial's first
    # iteration (the reference policy) is the same, so one that fell from there never was
    from rlhflab.app.sweep_study import running_median_pruner

    def study_with(pruner):
        study = optuna.create_study(direction="maximize", pruner=pruner)
        for values in ([1.0, 0.5, 0.6], [1.0, 0.4, 0.5], [1.0, 0.3, 0.7], [1.0, float("nan")]):
            trial = study.ask()
            for step, v in enumerate(values):
                trial.report(v, step)
            study.tell(trial, values[-1] if values[-1] == values[-1] else 0.0)
        return study

    def prunes(study, values) -> list[bool]:
        trial, said = study.ask(), []
        for step, v in enumerate(values):
            trial.report(v, step)
            said.append(trial.should_prune())
        return said

    ours = study_with(running_median_pruner(optuna, 2, 1))
    # step 0 is in the warm-up; at step 1 it fell to 0.3, under the median (0.4, the NaN
    # of the fourth trial left out), though its best so far (1.0) is above it
    assert prunes(ours, [1.0, 0.3]) == [False, True]
    assert prunes(ours, [1.0, 0.45]) == [False, False]
    # Optuna's own MedianPruner, on the same values, keeps the falling trial
    theirs = study_with(optuna.pruners.MedianPruner(n_startup_trials=2, n_warmup_steps=1))
    assert prunes(theirs, [1.0, 0.3]) == [False, False]


def test_a_trial_whose_drawn_model_fails_to_load_fails_alone(tmp_path, capsys, caplog):
    # a ModelLoadError (a preset that does not exist) ended the whole study at its first
    # draw with Optuna's traceback; now each such trial fails in one line and another is
    # drawn, until as many fail in a row as the sweep's minimum (3)
    config = write_config(tmp_path, space={"model.policy": {"choices": ["preset:nope"]}})
    out = tmp_path / "sw"
    with caplog.at_level("WARNING"):
        code = main(["sweep", "--config", str(config), "--trials", "1", "--out", str(out)])
    said = caplog.text + capsys.readouterr().err
    assert code == 2 and "3 failed trials in a row" in said, said
    assert "trial 0 failed: model.policy: unknown preset 'nope'" in said
    assert "trial 2 failed" in said and "Traceback" not in said
    study = optuna.load_study(study_name="sw", storage=f"sqlite:///{out / 'study.db'}")
    assert [t.state.name for t in study.trials] == ["FAIL"] * 3


def test_seed_with_a_config_and_an_out_that_is_a_file_are_refused(tmp_path, capsys):
    config = write_config(tmp_path)
    args = ["sweep", "--config", str(config), "--trials", "1", "--out", str(tmp_path / "sw")]
    assert main([*args, "--seed", "3"]) == 2
    assert "--seed: the preset's seed (with --preset); with --config set" in capsys.readouterr().err
    (tmp_path / "afile").write_text("x")
    assert main([*args[:-1], str(tmp_path / "afile")]) == 2
    assert "afile exists and is not a folder" in capsys.readouterr().err
