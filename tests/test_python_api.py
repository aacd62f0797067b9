"""The Python API (docs/python-api.md): every trainer from Python alone, with model objects,
reward callables, prompt lists and datasets; objects prepared as the command prepares
folders; the page's first example runs as it stands."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

import rlhflab
from rlhflab.app import inputs as I
from rlhflab.app.api import resolve_config
from rlhflab.config import ConfigError, load_config
from rlhflab.models.export import ExportError

ROOT = Path(__file__).resolve().parents[1]
FAST = {
    "ppo.iterations": 2,
    "rollout.prompts_per_iteration": 4,
    "rollout.max_new_tokens": 6,
    "log.progress": False,
    "monitor.enabled": False,
}
PROMPTS = ["Name a colour.", "What is 2 + 3?", "Say hello.", "Describe the sea."]


def short(prompts, responses):
    """Importable by name: the config can record it."""
    return [float(len(r) < 12) for r in responses]


def nano_object(dropout: float = 0.0):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlhflab.models.presets import preset_path

    path = preset_path("nano")
    model = AutoModelForCausalLM.from_pretrained(path, attention_dropout=dropout)
    return model, AutoTokenizer.from_pretrained(path)


def test_a_model_object_with_a_larger_tokenizer_is_refused_naming_what_was_passed(tmp_path):
    model, tokenizer = nano_object()
    tokenizer.add_tokens(["brandnewword"])
    with pytest.raises(ConfigError, match="the tokenizer passed has .* model object's"):
        rlhflab.PPOTrainer(
            model, reward=short, prompts=PROMPTS, tokenizer=tokenizer, output_dir=tmp_path / "r"
        )
    assert not (tmp_path / "r" / "inputs" / "policy").exists()  # refused before the copy


def test_ppo_from_python_with_a_model_object_a_lambda_and_a_prompt_list(tmp_path, capsys, caplog):
    model, tokenizer = nano_object(dropout=0.1)
    model.train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    seen = []
    trainer = rlhflab.PPOTrainer(
        model,
        reward={(lambda prompts, responses: [len(r) / 10 for r in responses]): 2.0},
        prompts=PROMPTS,
        tokenizer=tokenizer,
        overrides=FAST,
        output_dir=tmp_path / "run",
        callbacks=[lambda t, step, m: seen.append((step, m["objective/scores"]))],
    )
    # said at the default level (a warning): the run cannot be resumed from the command
    said = [r for r in caplog.records if "cannot be imported by name" in r.message]
    assert said and said[0].levelname == "WARNING"
    # the object went through the command's loader: a folder in inputs/, dropout off
    assert trainer.config.model.policy == str(tmp_path / "run" / "inputs" / "policy")
    assert trainer.model.config.attention_dropout == 0.0
    assert all(p.dtype == torch.float32 for p in trainer.model.parameters())
    summary = trainer.train()
    assert summary["iterations"] == 2 and [s for s, _ in seen] == [1, 2]
    assert "objective/scores/<lambda>" in summary["last"]  # logged under its own name
    first = trainer.engine.first_minibatch
    assert first["policy/ratio_mean"] == pytest.approx(1.0, abs=1e-6)
    assert first["policy/approx_kl"] == pytest.approx(0.0, abs=1e-7)
    # the caller's object is left as it was
    assert model.config.attention_dropout == 0.1
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    rows = [json.loads(line) for line in (tmp_path / "run/inputs/prompts.jsonl").open()]
    assert [r["prompt"] for r in rows] == PROMPTS
    saved = yaml.safe_load((tmp_path / "run/config.yaml").read_text())
    assert saved["reward"]["functions"] == {}  # a lambda cannot be named in a file
    # but its weight is kept beside the run, and the report shows it
    from rlhflab.app.report import build_report

    report = build_report(tmp_path / "run").read_text(encoding="utf-8")
    assert "&lt;lambda&gt; <small>× 2</small>" in report
    # so the command line, which cannot bring it, refuses to resume the run
    from rlhflab.app.cli import main

    argv = ["ppo", "--config", str(tmp_path / "run/config.yaml"), "--resume"]
    capsys.readouterr()
    assert main(argv) == 2
    # saying why (its config.yaml names no reward: that refusal came first, and blamed it)
    assert "was trained with Python rewards its config.yaml cannot name" in capsys.readouterr().err
    for kept in (tmp_path / "run", tmp_path):  # never over the run, forced or not
        with pytest.raises(ExportError, match="would delete"):
            trainer.save(kept, force=True)
    assert (tmp_path / "run" / "config.yaml").is_file()
    out = trainer.save(tmp_path / "policy")
    from transformers import AutoModelForCausalLM

    again = AutoModelForCausalLM.from_pretrained(out)
    ids = torch.tensor([[1, 5, 7, 9]])
    with torch.no_grad():
        a = again(ids).logits
        b = trainer.model.eval()(ids).logits
    torch.testing.assert_close(a, b)


def test_an_importable_reward_is_named_in_the_config_and_resumes_from_the_command(
    tmp_path, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    trainer = rlhflab.PPOTrainer(
        "preset:nano", reward=short, prompts=PROMPTS, overrides=FAST, output_dir="run"
    )
    trainer.train()
    saved = yaml.safe_load(Path("run/config.yaml").read_text())
    assert saved["reward"]["functions"] == {f"{__name__}:short": 1.0}
    from rlhflab.app.cli import main

    monkeypatch.syspath_prepend(str(Path(__file__).parent))
    assert main(["ppo", "--config", "run/config.yaml", "--resume", "ppo.iterations=3"]) == 0
    metrics = [json.loads(line) for line in Path("run/metrics.jsonl").open()]
    assert [m["iteration"] for m in metrics] == [1, 2, 3]


def test_a_callback_that_returns_true_stops_the_run_with_a_checkpoint(tmp_path):
    trainer = rlhflab.GRPOTrainer(
        "preset:nano",
        reward=short,
        prompts=PROMPTS,
        overrides={**FAST, "ppo.iterations": 5},
        output_dir=tmp_path,
        callbacks=[lambda t, step, m: step == 2],
    )
    summary = trainer.train()
    assert summary["iterations"] == 2 and "callback" in summary["stop_reason"]
    assert (tmp_path / "checkpoints" / "step-2").is_dir()


def test_prompts_from_a_dataset_and_a_dataset_dict_split(tmp_path):
    datasets = pytest.importorskip("datasets")
    from rlhflab.experience.data import iter_rows

    ds = datasets.Dataset.from_dict({"prompt": PROMPTS, "id": [1, 2, 3, 4]})
    both = datasets.DatasetDict({"train": ds, "test": ds.select([0])})
    for data, split, n in ((ds, "train", 4), (both, "train", 4), (both, "test", 1)):
        path = I.rows_file(data, tmp_path / f"{split}.jsonl", "prompts", split, I.prompt_row)
        rows = [row for _, row in iter_rows(path)]  # a save_to_disk folder, types kept
        assert len(rows) == n and rows[0] == {"prompt": PROMPTS[0], "id": 1}
    with pytest.raises(ConfigError, match="no split 'validation'"):
        I.rows_file(both, tmp_path / "r.jsonl", "prompts", "validation", I.prompt_row)
    trainer = rlhflab.RLOOTrainer(
        "preset:nano", reward=short, prompts=both, overrides=FAST, output_dir=tmp_path / "run"
    )
    assert trainer.config.data.prompts == str(tmp_path / "run" / "inputs" / "prompts")
    assert trainer.train()["iterations"] == 2


def test_sft_rm_and_dpo_from_python_then_ppo_on_their_folders(tmp_path):
    sft = rlhflab.SFTTrainer(
        "preset:nano",
        data=[(p, " fine") for p in PROMPTS] * 4,
        output_dir=tmp_path / "sft",
        overrides={"sft.steps": 3, "sft.batch_size": 4, "log.progress": False},
    )
    assert sft.train()["steps"] == 3
    assert (tmp_path / "sft" / "config.json").is_file()
    pairs = [(p, " yes", " no no no") for p in PROMPTS] * 6
    rm = rlhflab.RewardTrainer(
        tmp_path / "sft",
        pairs=pairs,
        output_dir=tmp_path / "rm",
        overrides={
            "rm.steps": 3,
            "rm.batch_size": 4,
            "rm.heads": {"preference": 1.0},
            "log.progress": False,
        },
    )
    assert set(rm.train()["heldout_accuracy"]) == {"preference"}
    dpo = rlhflab.DPOTrainer(
        tmp_path / "sft",
        pairs=[{"prompt": p, "chosen": c, "rejected": r} for p, c, r in pairs],
        output_dir=tmp_path / "dpo",
        overrides={"dpo.steps": 2, "dpo.batch_size": 4, "log.progress": False},
    )
    assert dpo.train()["steps"] == 2
    ppo = rlhflab.PPOTrainer(
        tmp_path / "sft",
        reward={tmp_path / "rm": 2.0, short: 0.5},
        prompts=PROMPTS,
        overrides={**FAST, "ppo.iterations": 1},
        output_dir=tmp_path / "ppo",
    )
    assert ppo.config.reward.heads == {"preference": 2.0}
    assert ppo.config.reward.functions == {f"{__name__}:short": 0.5}
    metrics = ppo.train()["last"]
    assert "objective/scores/rm/preference" in metrics


def test_without_model_the_configs_policy_is_kept(tmp_path):
    trainer = rlhflab.PPOTrainer(
        reward=short,
        prompts=PROMPTS,
        overrides={**FAST, "model.policy": "preset:nano"},
        output_dir=tmp_path,
    )
    assert trainer.config.model.policy == "preset:nano"
    assert trainer.model.config.hidden_size == trainer.engine.cast.policy_lm.config.hidden_size
    with pytest.raises(ConfigError, match="gold: the gold reward is measured by the monitor"):
        rlhflab.PPOTrainer(reward=short, gold=short, overrides=FAST, output_dir=tmp_path)


def test_list_items_with_numpy_values_are_written_and_bad_ones_named(tmp_path):
    import numpy as np

    rows = [{"prompt": "a", "chosen": "b", "rejected": "c", "labels": {"x": np.float32(1.0)}}]
    path = I.rows_file(rows, tmp_path / "p.jsonl", "pairs", "train", I.pair_row)
    assert json.loads(open(path).read())["labels"] == {"x": 1.0}
    with pytest.raises(ConfigError, match="pairs: item 2"):
        I.rows_file(
            [*rows, {"prompt": object()}], tmp_path / "q.jsonl", "pairs", "train", I.pair_row
        )


def test_config_forms_and_a_reward_brought_by_the_caller(tmp_path):
    with pytest.raises(ConfigError, match="reward: set reward.model"):
        load_config(overrides=["model.policy=preset:nano"])
    assert load_config(overrides=["model.policy=preset:nano"], reward_given=True)
    path = tmp_path / "c.yaml"
    path.write_text("ppo: {lr: 3.0e-6}\n")
    for config in (path, {"ppo": {"lr": 3e-6}}, load_config(path, reward_given=True)):
        cfg = resolve_config(config, {"ppo.epochs": 2}, "ppo")
        assert (cfg.ppo.lr, cfg.ppo.epochs) == (3e-6, 2)
    grpo = resolve_config({"ppo": {"lr": 3e-6}}, ["ppo.epochs=2"], "grpo")
    assert grpo.model.value_model == "none"  # the stage's defaults under a dict
    with pytest.raises(ConfigError, match="config: expected"):
        resolve_config(3, None, "ppo")
    with pytest.raises(ConfigError, match="unknown config key ppo.learning_rate"):
        rlhflab.PPOTrainer("preset:nano", reward=short, overrides={"ppo.learning_rate": 1})


def test_bad_arguments_are_refused_with_their_name(tmp_path):
    model, tokenizer = nano_object()
    with pytest.raises(ConfigError, match="model: a model object needs its tokenizer"):
        rlhflab.PPOTrainer(model, reward=short, output_dir=tmp_path)
    with pytest.raises(ConfigError, match="reward: a model object needs its tokenizer"):
        rlhflab.PPOTrainer("preset:nano", reward=model, output_dir=tmp_path)
    peft = pytest.importorskip("peft")
    wrapped = peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules=["q_proj"]))
    with pytest.raises(ConfigError, match="PEFT model object"):
        rlhflab.PPOTrainer(wrapped, tokenizer=tokenizer, reward=short, output_dir=tmp_path)
    with pytest.raises(ConfigError, match="reward: expected"):
        rlhflab.PPOTrainer("preset:nano", reward=42, output_dir=tmp_path)
    with pytest.raises(ConfigError, match="one reward model at most"):
        rlhflab.PPOTrainer("preset:nano", reward=["a", "b"], output_dir=tmp_path)
    with pytest.raises(ConfigError, match="prompts: each must be"):
        rlhflab.PPOTrainer("preset:nano", reward=short, prompts=[3], output_dir=tmp_path)
    with pytest.raises(ConfigError, match="prompts: no rows"):
        rlhflab.PPOTrainer("preset:nano", reward=short, prompts=[], output_dir=tmp_path)
    with pytest.raises(ConfigError, match="reward: the weight of short must be a number"):
        rlhflab.PPOTrainer("preset:nano", reward={short: "x"}, output_dir=tmp_path)
    with pytest.raises(ConfigError, match=r"callbacks: a list of callables, got function"):
        rlhflab.PPOTrainer("preset:nano", reward=short, callbacks=short, output_dir=tmp_path)
    with pytest.raises(ConfigError, match=r"callbacks\[1\]: 1 is not callable"):
        rlhflab.PPOTrainer("preset:nano", reward=short, callbacks=[short, 1], output_dir=tmp_path)
    with pytest.raises(ConfigError, match="overrides: a dict .* got the string 'ppo.lr=1'"):
        rlhflab.PPOTrainer("preset:nano", reward=short, overrides="ppo.lr=1", output_dir=tmp_path)


def test_importable_spec_names_only_what_imports_back():
    from rlhflab.builtin.tasks import gold_reward
    from rlhflab.experience.rewards import importable_spec

    assert importable_spec(gold_reward) == "rlhflab.builtin.tasks:gold_reward"
    assert importable_spec(short) == f"{__name__}:short"
    assert importable_spec(lambda p, r: r) is None

    def inner(p, r):
        return r

    assert importable_spec(inner) is None


@pytest.mark.slow
def test_the_first_python_block_of_the_api_page_runs_as_it_stands(tmp_path):
    text = (ROOT / "docs" / "python-api.md").read_text()
    block = re.search(r"```python\n(.*?)```", text, re.S).group(1)
    (tmp_path / "example.py").write_text(block)
    done = subprocess.run(
        [sys.executable, "example.py"], cwd=tmp_path, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "score at the last iteration:" in done.stdout
    assert (tmp_path / "runs/python-api/policy/config.json").is_file()


def test_a_lora_adapter_saved_from_python_names_its_base_absolutely(tmp_path, monkeypatch):
    """A model object with a relative output folder: the adapter saved with
    merge_lora=False names its base (RUN/inputs/policy) by an absolute path, so PEFT finds
    it from any directory."""
    monkeypatch.chdir(tmp_path)
    model, tokenizer = nano_object()
    trainer = rlhflab.PPOTrainer(
        model,
        reward=short,
        prompts=PROMPTS,
        tokenizer=tokenizer,
        overrides={**FAST, "ppo.iterations": 1, "model.lora_r": 4},
        output_dir="run",
    )
    trainer.train()
    out = trainer.save("adapter", merge_lora=False)
    base = json.loads((Path(out) / "adapter_config.json").read_text())["base_model_name_or_path"]
    assert base == str(tmp_path / "run" / "inputs" / "policy")


def test_an_unusable_output_folder_is_refused_before_anything_is_written(tmp_path, monkeypatch):
    # the API wrote inputs/ (or a model object's copy) into the folder before the trainer
    # refused it: into the current folder for output_dir=""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match="sft.output_dir: empty"):
        rlhflab.SFTTrainer("preset:nano", data=[("a", " b")] * 4, output_dir="")
    with pytest.raises(ConfigError, match="log.output_dir: empty"):
        rlhflab.PPOTrainer("preset:nano", reward=short, prompts=PROMPTS, output_dir="")
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "config.json").write_text("{}")
    with pytest.raises(ConfigError, match="holds files rlhflab did not write"):
        rlhflab.SFTTrainer("preset:nano", data=[("a", " b")] * 4, output_dir=mine)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine"]
    assert [p.name for p in mine.iterdir()] == ["config.json"]
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match="log.output_dir: .*file exists and is not a folder"):
        rlhflab.PPOTrainer("preset:nano", reward=short, prompts=PROMPTS, output_dir="file")
