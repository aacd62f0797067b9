"""The Python API's inputs across a run's starts: a new start never writes over an
earlier run's inputs or its record of Python-only rewards, and a resume reads the inputs
its own config.yaml names."""

import json
from pathlib import Path

import pytest
import yaml

import rlhflab
from rlhflab.app.run_inputs import inputs_folder
from rlhflab.config import ConfigError
from tests.test_python_api import FAST, PROMPTS, short


def refused_start(run, prompt: str) -> None:
    """A start that writes its inputs, then is refused (a gold reward with the monitor off)."""
    with pytest.raises(ConfigError, match="gold: the gold reward is measured by the monitor"):
        rlhflab.PPOTrainer(
            "preset:nano",
            reward=short,
            prompts=[prompt] * 4,
            gold=short,
            overrides=FAST,
            output_dir=run,
        )


def test_a_new_start_never_writes_over_an_earlier_runs_inputs(tmp_path, caplog):
    # inputs are written when the trainer is built: over the earlier run's, before its
    # logs were set aside (whose config.yaml then named the new data), even by a start
    # that was refused and never trained
    run = tmp_path / "run"
    first = rlhflab.PPOTrainer(
        "preset:nano", reward=short, prompts=PROMPTS, overrides=FAST, output_dir=run
    )
    first.train()
    recorded = first.config.data.prompts
    assert recorded == str(run / "inputs" / "prompts.jsonl")
    refused_start(run, "Z?")
    later = ["Count to three.", "Name a tree.", "Say goodbye.", "What is 1 + 1?"]
    python_only = lambda p, r: short(p, r)  # noqa: E731 - no config can name it
    second = rlhflab.PPOTrainer(
        "preset:nano", reward=python_only, prompts=later, overrides=FAST, output_dir=run
    )
    assert second.config.data.prompts != recorded
    second.train()
    kept = [json.loads(line)["prompt"] for line in Path(recorded).open()]
    assert kept == PROMPTS  # what the earlier run's config.yaml (set aside) names
    (aside,) = run.glob("earlier-*")
    assert yaml.safe_load((aside / "config.yaml").read_text())["data"]["prompts"] == recorded
    # a later start that is refused leaves the run's record of its Python-only reward (its
    # command-line resume refusal) and its inputs: the resume below reads them
    record = run / "inputs" / "python_rewards.json"
    assert record.is_file()
    refused_start(run, "Y?")
    assert record.is_file()
    # resumed without its prompts, the run goes on with its own, not the built-in task's
    again = rlhflab.PPOTrainer(
        "preset:nano",
        reward=python_only,
        overrides={**FAST, "ppo.iterations": 3, "log.sample_every": 1},
        output_dir=run,
        resume=True,
    )
    assert again.config.data.prompts == second.config.data.prompts
    again.train()
    rows = [json.loads(line) for line in (run / "samples.jsonl").open()]
    assert rows and {r["prompt"] for r in rows} <= set(later), rows[:1]


def test_a_resume_reads_the_inputs_its_config_names_not_the_newest(tmp_path):
    # a refused start after the run made inputs-<later>/: a resume took that one's model
    run = tmp_path / "run"
    for name in ("inputs", "inputs-20261207-120000", "inputs-20261207-130000"):
        (run / name).mkdir(parents=True)
        (run / name / "prompts.jsonl").write_text('{"prompt": "p"}\n')
    named = run / "inputs-20261207-120000"
    (run / "config.yaml").write_text(
        yaml.safe_dump({"data": {"prompts": str(named / "prompts.jsonl")}})
    )
    assert inputs_folder(run, resume=True) == named
    # a resume given other data wrote them to a newer folder: the policy's copy decides
    both = {"model": {"policy": str(run / "inputs" / "policy")}, "data": {"prompts": str(named)}}
    (run / "config.yaml").write_text(yaml.safe_dump(both))
    assert inputs_folder(run, resume=True) == run / "inputs"
    (run / "config.yaml").write_text(yaml.safe_dump({"data": {"prompts": None}}))
    assert inputs_folder(run, resume=True) == run / "inputs-20261207-130000"  # the newest
    assert inputs_folder(run, resume=False).name.startswith("inputs-2")  # a fresh one


def test_a_resume_given_data_never_writes_over_what_the_run_trained_on(tmp_path):
    run = tmp_path / "run"
    rlhflab.PPOTrainer(
        "preset:nano", reward=short, prompts=PROMPTS, overrides=FAST, output_dir=run
    ).train()
    trained_on = (run / "inputs" / "prompts.jsonl").read_text()
    refused = rlhflab.PPOTrainer(  # refused when it trains: its checkpoints hold no LoRA
        "preset:nano",
        reward=short,
        prompts=["Other?"] * 4,
        output_dir=run,
        resume=True,
        overrides={**FAST, "ppo.iterations": 3, "model.lora_r": 8},
    )
    with pytest.raises(ConfigError, match="model.lora_r is 8"):
        refused.train()
    assert (run / "inputs" / "prompts.jsonl").read_text() == trained_on
    same = rlhflab.PPOTrainer(  # the same rows again: the run's own file, nothing new
        "preset:nano",
        reward=short,
        prompts=PROMPTS,
        output_dir=run,
        resume=True,
        overrides={**FAST, "ppo.iterations": 3},
    )
    assert same.config.data.prompts == str(run / "inputs" / "prompts.jsonl")
