"""`rlhflab compare`: four methods from one SFT model, one table, written where the docs say."""

import json
import math

from rlhflab.app.compare import METHODS, run_compare

# A shrunken quick preset: the point is the plumbing (equal budgets, one process per method,
# the table in the run folder and in each report), not the learning; the trainers' own
# quick-preset tests check that reward rises.
SMALL = [
    "sft.steps=40",
    "rm.steps=20",
    "rm.pairs=120",
    "dpo.steps=8",
    "ppo.iterations=2",
    "rollout.prompts_per_iteration=16",
    "rollout.max_new_tokens=12",
]


def test_compare_writes_one_row_per_method_and_the_report_shows_it(tmp_path):
    table = run_compare(
        "quick", seed=3, out_root=tmp_path, extra=SMALL, progress=False, eval_prompts=16
    )
    run = tmp_path / "compare-quick-s3"
    assert table["run_dir"] == str(run)
    rows = {r["method"]: r for r in table["rows"]}
    assert tuple(rows) == ("sft", *METHODS)  # the SFT policy first: the row to beat
    # PPO keeps policy, reference, reward and critic; GRPO/RLOO drop the critic; DPO keeps
    # only policy and reference.
    assert [rows[m]["models"] for m in ("sft", *METHODS)] == [1, 4, 3, 3, 2]
    assert rows["sft"]["kl_to_reference"] == 0.0 and rows["sft"]["peak_mib"] is None
    for r in rows.values():
        assert -1.0 <= r["gold"] <= 1.0
        assert r["wall_s"] > 0 and (r["peak_mib"] or 1) > 0
        assert math.isfinite(r["kl_to_reference"])  # a sampled k1 estimate: may dip below 0
    # equal budget: every online method generated the same number of answers
    counts = {}
    for m in ("ppo", "grpo", "rloo"):
        lines = (run / m / "metrics.jsonl").read_text().splitlines()
        assert len(lines) == 2, m
        counts[m] = [json.loads(x)["response/count"] for x in lines]
    assert counts["ppo"] == counts["grpo"] == counts["rloo"] == [16.0, 16.0]
    saved = json.loads((run / "compare.json").read_text())
    assert [r["method"] for r in saved["rows"]] == ["sft", *METHODS]
    assert saved["overrides"] == SMALL  # what the table measured, not only the preset
    table_md = (run / "compare.md").read_text()
    assert table_md.startswith(f"preset quick, seed 3, overrides {' '.join(SMALL)}\n")
    assert "| dpo |" in table_md and "| method | gold | proxy | accuracy |" in table_md
    assert "| sft |" in table_md and table_md.count("| method |") == 1
    html = (run / "grpo" / "report.html").read_text()
    assert "Methods compared" in html and "rloo" in html


def test_a_method_that_cannot_run_is_said_before_training_in_one_line(tmp_path, capsys):
    """A setting only GRPO refuses was found after SFT, the reward model and the whole PPO
    run (minutes); and a method's user error came back as the worker's traceback."""
    import pytest

    from rlhflab.app.compare import worker_main
    from rlhflab.config import ConfigError, load_config
    from rlhflab.config.base import to_dict

    with pytest.raises(ConfigError, match=r"grpo.group_size: 3 does not divide"):
        run_compare("quick", 3, tmp_path, [*SMALL, "grpo.group_size=3"], progress=False)
    assert not (tmp_path / "compare-quick-s3" / "sft").exists()
    bad = to_dict(load_config(reward_given=True))
    bad["ppo"]["minibatches"] = 5  # refused by the worker's own check of its config
    with pytest.raises(SystemExit) as stop:
        worker_main(["ppo", json.dumps(bad), "4"])
    assert stop.value.code == 2
    said = capsys.readouterr().err.strip().splitlines()
    assert len(said) == 1 and said[0].startswith("error: ppo.minibatches: 5 does not divide")
