"""Defects found from outside in stop 47, each pinned by a test that fails on the old code
(and a few guards of what a fix must leave as it was: labelled pairs, long runs' verdicts)."""

import io
import logging
import math
from pathlib import Path

import pytest
import torch

from rlhflab.trainers import common, ppo_guards


class _Terminal(io.StringIO):
    def isatty(self):
        return True


def test_a_progress_bar_redraws_rarely_when_stderr_is_a_log_file(monkeypatch):
    # a batch job's log got ten carriage-return-joined copies of the bar a second
    monkeypatch.setattr("sys.stderr", io.StringIO())
    bar = common.progress(range(3), True, "train")
    assert bar.mininterval == common.NON_TTY_INTERVAL
    list(bar)
    monkeypatch.setattr("sys.stderr", _Terminal())
    bar = common.progress(range(3), True, "train")
    assert bar.mininterval < 1
    list(bar)
    assert common.progress(range(3), False, "train") == range(3)


def _rollout(old, ref, mask):
    from types import SimpleNamespace

    return SimpleNamespace(
        old_logprobs=torch.tensor(old, dtype=torch.float64),
        ref_logprobs=torch.tensor(ref, dtype=torch.float64),
        response_mask=torch.tensor(mask),
    )


def test_an_int8_reference_that_parts_from_the_unchanged_policy_is_named(caplog):
    # an int8 SmolLM2-135M reference: KL 9.5 nats on a 5-token answer at iteration 1, silently
    far = _rollout([[-1.0, -2.0, 0.0]], [[-2.5, -0.5, 9.0]], [[1, 1, 0]])  # padding ignored
    with caplog.at_level(logging.WARNING):
        gap = ppo_guards.warn_reference_gap(far, "int8", 0, 0.05)
    assert gap == pytest.approx(1.5)
    said = caplog.text
    assert "model.reference_precision=int8" in said and "1.5 nats a token" in said
    assert "k1 KL estimate +0 nats an answer" in said  # (+1.5 − 1.5): the gap is not the k1
    assert "the KL penalty will push" in said and "use bf16" in said
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        ppo_guards.warn_reference_gap(far, "int8", 0, 0.0)
    assert "the penalty itself is off: β = 0" in caplog.text
    caplog.clear()
    near = _rollout([[-1.0, -2.0]], [[-1.03, -1.98]], [[1, 1]])
    with caplog.at_level(logging.WARNING):
        assert ppo_guards.warn_reference_gap(near, "bf16", 0, 0.05) == pytest.approx(0.025)
        assert ppo_guards.warn_reference_gap(far, "int8", 1, 0.05) is None  # moved on
    assert caplog.text == ""


def test_the_first_iteration_of_a_ppo_run_checks_the_reference_gap(tmp_path, monkeypatch, caplog):
    from rlhflab.config import load_config
    from rlhflab.trainers.ppo import PPOTrainer

    cfg = load_config(
        base={
            "model": {"policy": "preset:nano", "value_model": "separate"},
            "reward": {"functions": {"rlhflab.builtin.toy_rewards:vowel_reward": 1.0}},
            "rollout": {"prompts_per_iteration": 4, "max_new_tokens": 4},
            "ppo": {"iterations": 2, "epochs": 1, "minibatches": 1},
            "log": {"output_dir": str(tmp_path / "run"), "progress": False},
        }
    )
    t = PPOTrainer(cfg)
    monkeypatch.setattr(ppo_guards, "REFERENCE_GAP_WARN", -1.0)  # any gap is "large"
    with caplog.at_level(logging.WARNING, logger="rlhflab.trainers.ppo_guards"):
        t.step()
        assert "at the first iteration" in caplog.text
        assert "the policy and the reference compute" in caplog.text  # fp32: not a precision
        caplog.clear()
        t.step()  # step() called again at iteration 0 (no RunLoop): said once
    assert "at the first iteration" not in caplog.text


def test_the_python_reward_trainer_trains_an_ensemble_as_the_command_does(tmp_path):
    # RewardTrainer(overrides={"rm.ensemble_size": 2}) trained one model and said nothing
    import rlhflab

    seen = []
    r = rlhflab.RewardTrainer(
        "preset:nano",
        output_dir=tmp_path / "rm",
        overrides={"rm.steps": 2, "rm.ensemble_size": 2, "rm.pairs": 32, "log.progress": False},
        callbacks=[lambda trainer, step, metrics: seen.append(step)],
    )
    out = r.train()
    folders = [tmp_path / "rm" / f"member-{i}" for i in range(2)]
    assert out["ensemble"] == [str(f) for f in folders]
    assert [m["output_dir"] for m in out["members"]] == out["ensemble"]
    assert all((f / "config.json").is_file() for f in folders)
    assert len(seen) == 4  # both members' steps reach the callbacks
    from safetensors.torch import load_file

    a, b = (load_file(f / "model.safetensors") for f in folders)
    assert any(not torch.equal(a[k], b[k]) for k in a)  # seed + i: two models


def test_a_callback_s_stop_ends_the_whole_ensemble(tmp_path, caplog):
    import rlhflab

    r = rlhflab.RewardTrainer(
        "preset:nano",
        output_dir=tmp_path / "rm",
        overrides={"rm.steps": 3, "rm.ensemble_size": 3, "rm.pairs": 32, "log.progress": False},
        callbacks=[lambda trainer, step, metrics: True],
    )
    with caplog.at_level(logging.WARNING, logger="rlhflab.app.api"):
        out = r.train()
    assert out["ensemble"] == [str(tmp_path / "rm" / "member-0")]
    assert "stopped after member 0 (" in caplog.text
    assert not (tmp_path / "rm" / "member-1").exists()


def test_a_stopped_ensemble_resumed_in_the_same_process_finishes_the_stopped_member(tmp_path):
    # train(resume=True) on the same object took the member a callback cut short as done
    import json

    import rlhflab

    asked = []

    def stop_once(trainer, step, metrics):
        asked.append(step)
        return len(asked) == 2  # member 0's step 2 of 4

    r = rlhflab.RewardTrainer(
        "preset:nano",
        output_dir=tmp_path / "rm",
        overrides={"rm.steps": 4, "rm.ensemble_size": 2, "rm.pairs": 32, "log.progress": False},
        callbacks=[stop_once],
    )
    assert len(r.train()["ensemble"]) == 1
    out = r.train(resume=True)
    assert len(out["ensemble"]) == 2
    for member in ("member-0", "member-1"):
        log = (tmp_path / "rm" / member / "run" / "metrics.jsonl").read_text().splitlines()
        assert [json.loads(x)["iteration"] for x in log] == [1, 2, 3, 4]


def test_a_python_ensemble_resumes_on_the_pairs_it_was_given(tmp_path):
    # the resume read run/config.yaml, which an ensemble never writes: built-in pairs, four
    # heads, and a checkpoint of another shape
    import rlhflab

    pairs = [(f"Say {w}.", w, f"{w} {w} no") for w in ("yes", "hi", "ok", "go", "up", "on")] * 3
    over = {"rm.steps": 2, "rm.ensemble_size": 2, "log.progress": False}
    first = rlhflab.RewardTrainer("preset:nano", pairs, output_dir=tmp_path / "rm", overrides=over)
    done = first.train()
    again = rlhflab.RewardTrainer(
        "preset:nano", output_dir=tmp_path / "rm", overrides=over, resume=True
    )
    assert again.config.rm.data == first.config.rm.data
    out = again.train()
    assert out["ensemble"] == done["ensemble"] and out["heldout_pairs"] == done["heldout_pairs"]


def test_plain_pairs_train_a_preference_head_under_the_default_heads(tmp_path, caplog):
    # the documented RewardTrainer(model, pairs) with (prompt, chosen, rejected) tuples was
    # refused: the default rm.heads are the built-in annotator's four labels
    import json

    import yaml

    import rlhflab

    pairs = [(f"Say {w}.", w, f"{w} {w} no") for w in ("yes", "hi", "ok", "go", "up", "on")] * 3
    with caplog.at_level(logging.INFO, logger="rlhflab.trainers.rm"):
        r = rlhflab.RewardTrainer(
            "preset:nano",
            pairs,
            output_dir=tmp_path / "rm",
            overrides={"rm.steps": 2, "log.progress": False},
        )
    assert "the pairs carry no labels" in caplog.text
    r.train()
    config = json.loads((tmp_path / "rm" / "config.json").read_text())
    assert config["id2label"] == {"0": "preference"}
    saved = yaml.safe_load((tmp_path / "rm" / "run" / "config.yaml").read_text())
    assert saved["rm"]["heads"] == {"preference": 1.0}  # a resume reads what was trained


def test_labelled_pairs_still_need_their_heads_named(tmp_path):
    import rlhflab
    from rlhflab.config import ConfigError

    rows = [
        {"prompt": f"Say {w}.", "chosen": w, "rejected": "no", "labels": {"helpful": 1}}
        for w in ("yes", "hi", "ok", "go", "up", "on", "in", "at", "by", "to")
    ]
    with pytest.raises(ConfigError, match="no pair in .* has a label for head 'correctness'"):
        rlhflab.RewardTrainer(
            "preset:nano", rows, output_dir=tmp_path / "rm", overrides={"rm.steps": 1}
        )


def _gold_run(tmp_path, gold, name):
    import rlhflab

    t = rlhflab.PPOTrainer(
        "preset:nano",
        reward=lambda p, r: [1.0] * len(r),
        gold=gold,
        prompts=["a b", "c d"],
        output_dir=tmp_path / name,
        overrides={"ppo.iterations": 2, "rollout.prompts_per_iteration": 2, "log.progress": False},
    )
    return t.train()


def test_a_gold_reward_with_nan_scores_is_said_and_the_finite_ones_still_count(tmp_path, caplog):
    # a NaN gold score poisoned the gold mean, its trend and log.keep_best, without a word
    with caplog.at_level(logging.WARNING, logger="rlhflab.diagnostics.monitor"):
        out = _gold_run(tmp_path, lambda p, r: [float("nan")] + [2.0] * (len(r) - 1), "some")
    assert "1 of 2 gold scores are not finite" in caplog.text
    assert out["last"]["monitor/gold"] == 2.0
    assert (tmp_path / "some" / "checkpoints" / "best").is_dir()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="rlhflab.diagnostics.monitor"):
        out = _gold_run(tmp_path, lambda p, r: [float("nan")] * len(r), "none")
    assert "no gold mean, trend or best checkpoint from this batch" in caplog.text
    assert out["last"]["monitor/gold_drop"] == 0.0


def test_exporting_into_the_current_folder_is_refused_in_one_line(tmp_path, monkeypatch):
    # `rlhflab export RUN .` ended in "ValueError: PosixPath('.') has an empty name"
    from rlhflab.models.export import ExportError, check_out_dir, save_policy

    here = tmp_path / "empty"
    here.mkdir()
    monkeypatch.chdir(here)
    for out, said in ((".", "is the current folder;"), ("..", "is the current folder or holds")):
        with pytest.raises(ExportError, match=said):
            check_out_dir(Path(out), force=True)
    with pytest.raises(ExportError, match="is the current folder;"):
        save_policy(None, None, ".", force=True)  # trainer.save("."): before the model
    assert here.is_dir() and not any(here.iterdir())


def test_an_sft_row_without_its_answer_field_says_missing_not_empty():
    from rlhflab import DataError
    from rlhflab.experience.data import sft_pair

    with pytest.raises(DataError, match=r"f.jsonl:1: missing field 'completion' \(or 'response'\)"):
        sft_pair({"prompt": "What is 1 + 2?", "answer": "3"}, None, "f.jsonl:1")
    with pytest.raises(DataError, match=r"missing field 'prompt' \(or 'messages'\)"):
        sft_pair({"question": "What is 1 + 2?", "response": "3"}, None, "f.jsonl:1")
    with pytest.raises(DataError, match=r"f.jsonl:1: field 'messages' is empty"):
        sft_pair({"messages": "", "response": "3"}, None, "f.jsonl:1")
    with pytest.raises(DataError, match="field 'response' must be a non-empty string"):
        sft_pair({"prompt": "What is 1 + 2?", "response": " "}, None, "f.jsonl:1")


def test_a_model_path_that_does_not_exist_or_is_an_adapter_is_named_so(tmp_path, monkeypatch):
    import json

    from rlhflab.models import ModelLoadError
    from rlhflab.models.loading import resolve_path

    monkeypatch.chdir(tmp_path)
    with pytest.raises(ModelLoadError, match=f"does not exist .*looked for at {tmp_path}/typo"):
        resolve_path("typo", "model.policy")
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": "/m"}))
    with pytest.raises(ModelLoadError, match="is a LoRA adapter .*its base model is '/m'"):
        resolve_path(str(adapter), "model.policy")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError, match=r"not a local Hugging Face model folder"):
        resolve_path("empty", "model.policy")


def test_a_gpt2_row_too_long_is_not_told_of_max_position_embeddings(monkeypatch):
    import rlhflab.experience.data as data
    from rlhflab import DataError

    class Tok:  # one token a word
        def __call__(self, text, add_special_tokens=False):
            return {"input_ids": text.split()}

    monkeypatch.setattr(data, "encode_prompt", lambda tok, text: text.split())
    with pytest.raises(DataError) as err:
        data.check_fits(Tok(), 4, "f.jsonl:2", "a b c", {"response": "d e"})
    assert "over the 4 positions" in str(err.value)
    assert "max_position_embeddings" not in str(err.value)  # GPT-2 calls it n_positions


def test_a_misspelt_chat_role_is_named_with_its_row_and_message():
    # a prompt row's role 'usr' rendered as "<|im_start|>usr": a turn of nobody's
    from rlhflab import DataError
    from rlhflab.experience.chat import render_prompt

    class Tok:
        chat_template = "{% for m in messages %}<|im_start|>{{ m['role'] }}{% endfor %}"

        def apply_chat_template(self, messages, tokenize, add_generation_prompt):
            return "".join(f"<|im_start|>{m['role']}\\n{m['content']}" for m in messages)

    ok = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "1 + 2?"}]
    assert render_prompt(ok, Tok(), "p.jsonl:1", "messages").endswith("1 + 2?")
    bad = [ok[0], {"role": "usr", "content": "1 + 2?"}]
    with pytest.raises(DataError, match=r"p.jsonl:3: field 'messages': message 2's role 'usr'"):
        render_prompt(bad, Tok(), "p.jsonl:3", "messages")
    Tok.chat_template += "{% if m['role'] == 'model' %}{% endif %}"  # a role it names
    render_prompt([{"role": "model", "content": "x"}], Tok(), "p.jsonl:4", "messages")
    Tok.chat_template = {"default": Tok.chat_template + '{{ "it\'s" }}'}  # named templates
    render_prompt([{"role": "model", "content": "x"}], Tok(), "p.jsonl:5", "messages")


def test_the_gold_agreement_warning_says_how_many_pairs_it_rests_on():
    from rlhflab.diagnostics.rm_checks import gold_warning

    one = gold_warning({"accuracy": 0.0, "pairs": 1})
    assert "on 0% of 1 held-out pair (chance" in one and "1 pair says little" in one
    many = gold_warning({"accuracy": 0.3, "pairs": 400})
    assert "on 30% of 400 held-out pairs" in many and "little" not in many
    assert gold_warning({"accuracy": 0.9, "pairs": 3}) is None


def test_a_two_iteration_run_s_alerts_are_hints_not_a_hacking_verdict():
    # 2 iterations × 4 answers got "needs a look — signs of a gamed reward" from one
    # reward–length correlation, where a 3-iteration run without alerts got "too short"
    from rlhflab.app.report_parts import verdict

    rows = [{"iteration": i, "objective/scores": 0.5, "objective/kl": 0.0} for i in (1, 2)]
    alert = {"iteration": 2, "signal": "reward_length_corr", "value": 0.9}
    short = verdict(rows, [alert], {}, None)
    assert "alerts</span>" in short and "needs a look" not in short
    assert "hints to look at, not a verdict" in short and "reward_length_corr" in short
    stop = "iteration 2: monitor 'reward_length_corr' = 0.9 crossed 0.5 (monitor.response=stop)"
    assert "signs of a gamed reward" in verdict(rows, [alert], {}, None, stop)
    fit = {"points": 4, "final_kl": 0.0, "peak": {"kl": 0.0}, "past_peak": True}
    story = {"fit": fit, "fell": False, "first": 0.1, "final": 0.1, "best": 0.1}
    story |= {"best_iteration": 1, "final_iteration": 6, "smoothing": 0.8}
    six = [{"iteration": i, "objective/scores": 0.5, "objective/kl": 0.0} for i in range(1, 7)]
    assert "Over-optimisation fit" not in verdict(six, [], story, None)  # KL 0, 4 batches
    long = [{"iteration": i, "objective/scores": 0.5, "objective/kl": 0.0} for i in range(1, 9)]
    assert "signs of a gamed reward: reward_length_corr" in verdict(long, [alert], {}, None)


def test_a_warm_up_longer_than_the_run_is_said(tmp_path, caplog):
    # sft.steps=3 under the default 30 warm-up steps trained at 3-10 % of sft.lr, unsaid
    import rlhflab

    with caplog.at_level(logging.WARNING, logger="rlhflab.trainers.common"):
        rlhflab.SFTTrainer("preset:nano", output_dir=tmp_path / "sft", overrides={"sft.steps": 3})
    assert "sft.warmup_steps=30 is more than the run's 3 optimiser steps" in caplog.text
    assert "ends at 10% of sft.lr" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="rlhflab.trainers.common"):
        rlhflab.SFTTrainer("preset:nano", output_dir=tmp_path / "ok", overrides={"sft.steps": 30})
    assert "warmup_steps" not in caplog.text


def test_a_callback_that_writes_into_its_metrics_changes_no_record(tmp_path):
    # it changed the summary train() returns (999.0) but not metrics.jsonl (1.5)
    import json

    import rlhflab

    def meddle(trainer, step, metrics):
        metrics["objective/scores"] = 999.0

    t = rlhflab.PPOTrainer(
        "preset:nano",
        reward=lambda p, r: [1.5] * len(r),
        prompts=["a b", "c d"],
        output_dir=tmp_path / "ppo",
        overrides={"ppo.iterations": 1, "rollout.prompts_per_iteration": 2, "log.progress": False},
        callbacks=[meddle],
    )
    out = t.train()
    logged = [json.loads(x) for x in (tmp_path / "ppo" / "metrics.jsonl").open()]
    assert out["last"]["objective/scores"] == logged[-1]["objective/scores"] == 1.5


def test_a_relative_data_path_that_is_missing_names_the_working_directory(tmp_path, monkeypatch):
    # a --config file's relative paths are read from the working directory, not its folder
    from rlhflab import DataError
    from rlhflab.experience.rows import open_rows

    monkeypatch.chdir(tmp_path)
    with pytest.raises(DataError, match=f"prompts.jsonl: no such file .*directory {tmp_path}"):
        open_rows("prompts.jsonl")
    with pytest.raises(DataError, match=r"/nowhere/p.jsonl: no such file$"):
        open_rows("/nowhere/p.jsonl")


def test_a_reward_module_not_found_says_where_it_was_looked_for(tmp_path, monkeypatch):
    # `rlhflab ppo --resume` from another folder: "No module named 'rmod'" and no more
    from rlhflab import RewardError
    from rlhflab.experience.rewards import FunctionReward

    monkeypatch.chdir(tmp_path)
    with pytest.raises(RewardError, match=f"working directory {tmp_path}.*PYTHONPATH"):
        FunctionReward("rmod_nowhere:score")
    (tmp_path / "rmod_here.py").write_text("import a_package_not_installed\n")
    with pytest.raises(RewardError, match="No module named 'a_package_not_installed'") as err:
        FunctionReward("rmod_here:score")
    assert "PYTHONPATH" not in str(err.value)  # found; a package it imports is missing


def test_the_gold_mean_over_ranks_keeps_the_finite_scores_of_every_rank():
    # each rank's own mean averaged: a rank with only NaN made the global mean NaN
    from rlhflab.diagnostics.monitor import finite_mean

    other_rank = {"sum": 4.0, "count": 2.0}  # [1.0, 3.0]

    def mean_over_ranks(mine):
        return {k: (mine[k] + other_rank[k]) / 2 for k in mine}

    assert finite_mean(torch.tensor([float("nan")] * 2), mean_over_ranks) == 2.0
    assert finite_mean(torch.tensor([5.0, float("inf")]), mean_over_ranks) == 3.0
    assert math.isnan(finite_mean(torch.tensor([float("nan")])))


def test_a_grpo_sweep_file_is_validated_with_grpo_s_defaults(tmp_path):
    # `rlhflab sweep` validated the file as PPO first: value_model none refused
    from types import SimpleNamespace

    from rlhflab.app.sweep import base_config

    f = tmp_path / "sw.yaml"
    f.write_text(
        "model: {policy: 'preset:nano', value_model: none}\nsweep: {method: grpo}\n"
        "reward: {functions: {'rlhflab.builtin.toy_rewards:vowel_reward': 1.0}}\n"
    )
    args = SimpleNamespace(preset=None, config=str(f), overrides=[], seed=None, out=None, name=None)
    cfg, stage, _, _ = base_config(args)
    assert stage == "grpo" and cfg.ppo.advantage_estimator == "grpo"


def test_an_int8_model_counts_its_packed_weights():
    # an int8 reference's run.json said 14,176 parameters where its policy had 40,800
    import warnings

    from torch import nn
    from torch.ao.quantization import quantize_dynamic

    from rlhflab.trainers.ppo_metrics import _packed_weights

    model = nn.Sequential(nn.Linear(4, 3), nn.LayerNorm(3))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        q = quantize_dynamic(model, {nn.Linear}, dtype=torch.qint8)
    assert _packed_weights(q) == 4 * 3 + 3 and _packed_weights(model) == 0
    assert sum(p.numel() for p in q.parameters()) + _packed_weights(q) == 15 + 6


def test_a_sweep_says_each_trial_s_settings_and_end_and_hides_optuna_s_none_line(caplog):
    from types import SimpleNamespace

    from rlhflab.app import sweep

    def trial(n, state, value=None, iterations=None):
        attrs = {"iterations": iterations} if iterations else {}
        return SimpleNamespace(
            number=n, state=SimpleNamespace(name=state), value=value, user_attrs=attrs
        )

    trials = [trial(0, "COMPLETE", 0.25), trial(1, "PRUNED", iterations=2), trial(2, "FAIL")]
    study = SimpleNamespace(get_trials=lambda deepcopy=False: trials)
    with caplog.at_level(logging.INFO, logger="rlhflab.app.sweep"):
        for t in trials:
            sweep.say_trial(study, t)
    assert "trial 0 objective 0.25 (2 finished)" in caplog.text
    assert "trial 1 pruned after 2 iterations" in caplog.text and "trial 2 fail" in caplog.text
    assert sweep.drawn({"ppo.lr": 1.23456e-6, "grpo.group_size": 4}) == (
        "ppo.lr=1.23e-06, grpo.group_size=4"
    )
    record = logging.LogRecord(
        "optuna", logging.WARNING, "", 0, "Trial 2 failed with value None.", None, None
    )
    assert not sweep._FailedTrialNoise().filter(record)


def test_a_run_s_progress_bar_in_a_log_file_is_not_redrawn_every_step(tmp_path, monkeypatch):
    # the PPO bar's postfix redrew it every iteration into a redirected log (make demo)
    import rlhflab

    err = io.StringIO()
    monkeypatch.setattr("sys.stderr", err)
    t = rlhflab.PPOTrainer(
        "preset:nano",
        reward=lambda p, r: [1.0] * len(r),
        prompts=["a b", "c d"],
        output_dir=tmp_path / "ppo",
        overrides={"ppo.iterations": 4, "rollout.prompts_per_iteration": 2},
    )
    t.train()
    drawn = err.getvalue().count("PPO:")
    assert 1 <= drawn <= 3  # the start, maybe one, the end — not one per iteration and more


def test_rloo_says_that_normalize_std_does_nothing_for_it(caplog):
    from rlhflab.config import load_config
    from rlhflab.trainers.runstate import warn_about_settings

    fn = "reward.functions={rlhflab.builtin.toy_rewards:vowel_reward: 1.0}"
    with caplog.at_level(logging.WARNING):
        warn_about_settings(load_config(overrides=[fn, "grpo.normalize_std=false"], stage="rloo"))
    assert "grpo.normalize_std=false: RLOO's advantage" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        warn_about_settings(load_config(overrides=[fn, "grpo.normalize_std=false"], stage="grpo"))
        warn_about_settings(load_config(overrides=[fn], stage="rloo"))
    assert "normalize_std" not in caplog.text
