"""Misuse of the Python API that a user commits (outside testing, stop 46): a directory
change between building a trainer and training it, a tokenizer that would be ignored or is
not one, a reward-model object whose head was never trained, a resume that brings other
Python rewards or none, errors that one ``except`` catches, a stage that is not one."""

from __future__ import annotations

import json
import logging
import os

import pytest

import rlhflab
from rlhflab.app import python_rewards as PR
from rlhflab.config import ConfigError, load_config
from rlhflab.experience.rewards import CallableReward
from tests.test_python_api import FAST, PROMPTS, nano_object, short


def test_paths_are_absolute_once_the_trainer_is_built(tmp_path, monkeypatch):
    # a notebook that changes directory before train() split the run over two folders and
    # recorded a data path in the other one
    monkeypatch.chdir(tmp_path)
    (tmp_path / "p.jsonl").write_text('{"prompt": "Say hi."}\n' * 4)
    trainer = rlhflab.PPOTrainer(
        "preset:nano", reward=short, prompts="p.jsonl", output_dir="runs/cd", overrides=FAST
    )
    sft = rlhflab.SFTTrainer("preset:nano", data=[("a", "b")] * 4, output_dir="m/sft")
    assert trainer.config.log.output_dir == str(tmp_path / "runs" / "cd")
    assert trainer.config.data.prompts == str(tmp_path / "p.jsonl")
    assert sft.config.sft.output_dir == str(tmp_path / "m" / "sft")
    assert sft.config.sft.data == str(tmp_path / "m" / "sft" / "run" / "inputs" / "sft.jsonl")
    (tmp_path / "elsewhere").mkdir()
    os.chdir(tmp_path / "elsewhere")
    summary = trainer.train()
    assert summary["output_dir"] == str(tmp_path / "runs" / "cd")
    assert (tmp_path / "runs" / "cd" / "metrics.jsonl").is_file()
    assert not (tmp_path / "elsewhere" / "runs").exists()


def test_a_tokenizer_that_is_not_one_or_would_be_ignored(tmp_path, caplog):
    model, tokenizer = nano_object()
    with pytest.raises(ConfigError, match="tokenizer passed must be a tokenizer object.*str"):
        rlhflab.PPOTrainer(model, tokenizer="some/folder", reward=short, prompts=PROMPTS)
    # with a folder the tokenizer passed is not used: said at WARNING, which Python shows
    with caplog.at_level(logging.WARNING):
        rlhflab.PPOTrainer(
            "preset:nano",
            tokenizer=tokenizer,
            reward=short,
            prompts=PROMPTS,
            overrides=FAST,
            output_dir=tmp_path / "r",
        )
    (warned,) = [r for r in caplog.records if "is not used with a model folder" in r.message]
    assert warned.levelno == logging.WARNING and "preset:nano" in warned.message


def test_a_reward_model_object_with_a_fresh_head_is_refused_as_its_folder_is(tmp_path):
    from transformers import AutoModelForSequenceClassification

    from rlhflab.models.presets import preset_path

    causal_lm = preset_path("nano")  # a causal LM's checkpoint: no score head in it
    fresh = AutoModelForSequenceClassification.from_pretrained(causal_lm, num_labels=1)
    _, tokenizer = nano_object()
    with pytest.raises(
        ConfigError, match="LlamaForCausalLM checkpoint: its score head was freshly initialised"
    ):
        rlhflab.PPOTrainer(
            "preset:nano",
            reward=fresh,
            reward_tokenizer=tokenizer,
            prompts=PROMPTS,
            output_dir=tmp_path / "r",
        )
    assert not (tmp_path / "r" / "inputs" / "reward").exists()
    # a classifier's own checkpoint is taken (whether its head was trained is not known
    # here: saving it as a classifier is what says so, as setting architectures would)
    fresh.save_pretrained(tmp_path / "rm")
    trained = AutoModelForSequenceClassification.from_pretrained(tmp_path / "rm")
    rlhflab.PPOTrainer(
        "preset:nano",
        reward=trained,
        reward_tokenizer=tokenizer,
        prompts=PROMPTS,
        overrides=FAST,
        output_dir=tmp_path / "r2",
    )


def _record(run, *fns, gold=None):
    extra = [(CallableReward(fn, fn.__name__), 1.0) for fn in fns]
    PR.note_python_rewards(run, extra, CallableReward(gold, gold.__name__) if gold else None)
    return extra


def test_a_python_resume_is_told_when_its_rewards_are_not_the_runs(tmp_path, caplog):
    run = tmp_path
    first = lambda p, r: [float(len(x)) for x in r]  # noqa: E731
    _record(run, first)
    same_again = lambda p, r: [float(len(x)) for x in r]  # noqa: E731 - a re-run cell
    other_code = lambda p, r: [-5.0] * len(r)  # noqa: E731 - same name, other objective

    def check(*fns, configured=False):
        caplog.clear()
        extra = [(CallableReward(fn, fn.__name__), 1.0) for fn in fns]
        with caplog.at_level(logging.WARNING):
            PR.check_resumed_python_rewards(run, extra, None, configured)
        return " ".join(r.message for r in caplog.records)

    assert check(same_again) == ""
    assert "<lambda> passed again with other code" in check(other_code)
    assert "trained with the Python rewards <lambda>; this start passes short" in check(short)
    # none passed again and nothing else to score with: refused naming them, not the
    # generic "set reward.model" of a config without rewards
    with pytest.raises(ConfigError, match=r"trained with Python rewards .*\(<lambda>\); pass"):
        check()
    assert "this start passes none" in check(configured=True)  # a config reward instead
    record = json.loads((run / "inputs" / PR.PYTHON_REWARDS).read_text())
    assert record["code"]["<lambda>"] == PR.code_digest(first)


def test_the_api_refuses_a_resume_that_drops_its_python_reward(tmp_path):
    run = tmp_path / "run"
    rlhflab.PPOTrainer(
        "preset:nano",
        reward=lambda p, r: short(p, r),
        prompts=PROMPTS,
        overrides=FAST,
        output_dir=run,
    ).train()
    with pytest.raises(ConfigError, match="pass them again"):
        rlhflab.PPOTrainer("preset:nano", output_dir=run, resume=True, overrides=FAST)


def test_one_except_catches_every_error_rlhflab_raises_on_purpose(tmp_path):
    for name in (
        "ConfigError",
        "DataError",
        "ModelLoadError",
        "CheckpointError",
        "RewardError",
        "TrainingHalted",
    ):
        assert issubclass(getattr(rlhflab, name), rlhflab.RlhflabError), name
    assert issubclass(rlhflab.DataError, ValueError)  # the built-in type it always was
    with pytest.raises(rlhflab.RlhflabError, match=r"bad.jsonl:1: not valid JSON"):  # a DataError
        (tmp_path / "bad.jsonl").write_text("{not json\n")
        rlhflab.PPOTrainer(
            "preset:nano",
            reward=short,
            prompts=str(tmp_path / "bad.jsonl"),
            output_dir=tmp_path / "r",
        )
    with pytest.raises(rlhflab.RlhflabError):  # a missing model folder
        rlhflab.PPOTrainer(
            str(tmp_path / "nowhere"), reward=short, prompts=PROMPTS, output_dir=tmp_path / "r2"
        )


def test_a_stage_that_is_not_one_is_refused():
    with pytest.raises(ConfigError, match="'ppx' is not a stage; one of ppo, grpo"):
        load_config(stage="ppx")


def test_a_models_config_json_given_as_the_model_names_its_folder(tmp_path):
    from rlhflab.models.presets import preset_path

    config_json = preset_path("nano") / "config.json"
    with pytest.raises(rlhflab.ModelLoadError, match="is a file, not a model folder; give .*nano"):
        rlhflab.PPOTrainer(
            str(config_json), reward=short, prompts=PROMPTS, output_dir=tmp_path / "r"
        )


def test_save_writes_the_dtype_asked_for(tmp_path):
    import torch
    from safetensors.torch import load_file

    trainer = rlhflab.PPOTrainer(
        "preset:nano", reward=short, prompts=PROMPTS, overrides=FAST, output_dir=tmp_path / "r"
    )
    out = trainer.save(tmp_path / "bf16", dtype="bf16")
    weights = load_file(out / "model.safetensors")
    assert {t.dtype for t in weights.values()} == {torch.bfloat16}


def test_a_functions_code_digest_is_the_same_in_every_process_and_sees_nested_code():
    import subprocess
    import sys

    script = (
        "from rlhflab.app.python_rewards import code_digest\n"
        "def r(p, a): return [float(x in {'yes', 'no', 'maybe', 'ok'}) for x in a]\n"
        "print(code_digest(r))"
    )
    digests = {
        subprocess.run(
            [sys.executable, "-c", script],
            env={**os.environ, "PYTHONHASHSEED": seed},
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        for seed in ("1", "2", "3")
    }
    assert len(digests) == 1  # a set literal's order follows the hash seed; its digest not
    twice = PR.code_digest(lambda p, a: [len(x) * 2.0 for x in a])
    thrice = PR.code_digest(lambda p, a: [len(x) * 3.0 for x in a])
    assert twice != thrice  # a constant inside the comprehension's own code
