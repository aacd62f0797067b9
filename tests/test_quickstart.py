"""docs/quickstart.md's examples: the two configs load, and the reward-function one runs from
its own folder, where its module lives (with a built-in model and prompts standing in for
the user's)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from rlhflab.app.cli import main
from rlhflab.config import load_config

EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "quickstart"


def test_the_reward_model_config_names_the_three_settings():
    cfg = load_config(EXAMPLES / "ppo_reward_model.yaml")
    assert (cfg.model.policy, cfg.reward.model, cfg.data.prompts) == (
        "my-sft-model",
        "my-reward-model",
        "prompts.jsonl",
    )


def test_the_reward_function_config_runs_from_the_folder_of_its_module(tmp_path, monkeypatch):
    folder = tmp_path / "quickstart"
    shutil.copytree(EXAMPLES, folder)
    (folder / "prompts.jsonl").write_text(
        "".join(json.dumps({"prompt": p}) + "\n" for p in ("Say thanks.", "Ask politely."))
    )
    monkeypatch.chdir(folder)
    code = main(
        [
            "ppo",
            "--config",
            "ppo_reward_function.yaml",
            "model.policy=preset:nano",
            "ppo.iterations=1",
            "rollout.prompts_per_iteration=4",
            "rollout.max_new_tokens=6",
            "log.progress=false",
        ]
    )
    assert code == 0
    row = json.loads(Path("runs/my-ppo/metrics.jsonl").read_text().splitlines()[0])
    assert "objective/scores/my_rewards:concise_and_polite" in row
