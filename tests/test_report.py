"""The run report (issue #28): verdict first, readable charts, the over-optimisation fit,
samples beside the reference, run facts, the user's own settings; and log.keep_best."""

import json
import math
import re

import pytest
import torch
import yaml

from rlhflab.app.charts import Chart, Series, axis_range, nice_ticks, tick_label
from rlhflab.app.report import build_report
from rlhflab.config import ConfigError, load_config
from rlhflab.infra.runs import load_policy, pick_checkpoint
from rlhflab.trainers.ppo import PPOTrainer


def test_ticks_are_round_and_cover_the_range():
    assert nice_ticks(0, 1) == [0, 0.25, 0.5, 0.75, 1.0]
    assert nice_ticks(3, 41) == [0, 10, 20, 30, 40, 50]
    ticks = nice_ticks(-0.93, 1.13)
    assert ticks[0] <= -0.93 and ticks[-1] >= 1.13 and 0 in ticks
    assert tick_label(0.30000000000000004, 0.1) == "0.3" and tick_label(2.5, 2.5) == "2.5"
    assert nice_ticks(1, 2, min_step=1) == [1, 2] and nice_ticks(1, 10, min_step=1)[1] == 5


def test_a_flat_series_gets_a_padded_range_and_memory_keeps_zero():
    lo, hi = axis_range([0.1] * 40, include_zero=True)  # β held at 0.1
    assert lo == 0 and 0.1 < hi < 0.2
    lo, hi = axis_range([0.1] * 40)
    assert lo < 0.1 < hi and hi - lo < 0.05  # not −0.9 … 1.1
    lo, hi = axis_range([0.0] * 5, include_zero=True)
    assert lo == 0 and 1 <= hi < 1.1
    lo, hi = axis_range([521.0, 535.0], include_zero=True)  # 14 MiB of 535
    assert lo == 0 and (535 - 521) / (hi - lo) < 0.05


def test_every_line_has_its_colour_in_an_html_legend_outside_the_plot():
    chart = Chart(
        "t",
        [Series("a", [(1, 1.0), (2, 2.0)]), Series("b", [(1, 0.5), (2, float("nan"))])],
        "unit",
        threshold=(1.5, "above"),
        alerts=[2],
    ).html()
    strokes = dict(re.findall(r'<polyline[^>]*stroke="(#\w+)"[^>]*data-s="(\d)"', chart))
    strokes = {i: c for c, i in strokes.items()}
    legend = chart.split('<ul class="lg">')[1]
    for i, name in (("0", "a"), ("1", "b")):
        item = re.search(rf'<li data-s="{i}">(.*?)</li>', legend).group(1)
        assert f'stroke="{strokes[i]}"' in item and item.endswith(name)
    assert strokes["0"] != strokes["1"]
    assert "threshold 1.5 (alert above)" in legend and "alert (1; first at 2)" in legend
    svg = chart.split("<svg", 1)[1].split("</svg>")[0]
    assert ">a<" not in svg and "nan" not in svg  # names in the legend, not on the data
    assert 'viewBox="0 0 480 270"' in chart and "iteration" in svg and "unit" in svg
    assert Chart("e", [Series("a", [(1, None)])], "u").html() == ""


def _tiny(tmp_path, *over):
    base = {
        "device": "cpu",
        "model": {"policy": "preset:nano", "value_model": "shared"},
        "reward": {"functions": {"rlhflab.builtin.toy_rewards:vowel_reward": 1.0}},
        "rollout": {"prompts_per_iteration": 8, "max_new_tokens": 8},
        "ppo": {"iterations": 6, "epochs": 1, "lr": 1e-3},
        "log": {
            "output_dir": str(tmp_path / "run"),
            "progress": False,
            "sample_every": 2,
            "checkpoint_every": 2,
            "keep_last": 1,
        },
        "monitor": {"gold": "rlhflab.builtin.toy_rewards:vowel_reward"},
    }
    return load_config(base=base, overrides=list(over))


def test_keep_best_keeps_the_weights_that_sampled_the_best_batch(tmp_path):
    t = PPOTrainer(_tiny(tmp_path))
    assert t.watch.keep_best  # on by default: there is a gold reward
    t.fit()
    run = tmp_path / "run"
    names = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert names == ["best", "step-6"]  # keep_last=1 deleted step-2 and step-4, not best
    info = json.loads((run / "run.json").read_text())
    story = info["gold"]
    assert story["best_iteration"] == t.watch.best.iteration
    assert story["best_checkpoint"] == str(run / "checkpoints" / "best")
    # the best batch's answers came from the weights after best_iteration − 1 updates
    state = torch.load(run / "checkpoints" / "best" / "state.pt", weights_only=True)
    assert state["iteration"] == story["best_iteration"] - 1
    assert torch.load(run / "checkpoints" / "best" / "optimizer.pt", weights_only=True) == {}
    assert pick_checkpoint(run, "best").name == "best"
    best = load_policy(str(run), checkpoint="best").lm  # what `export --checkpoint best` loads
    assert sum(p.numel() for p in best.parameters()) == info["models"]["reference"]["parameters"]
    assert info["finished"] and info["wall_s"] > 0 and info["torch"] == torch.__version__
    # samples carry gold and the reference's answer to the same prompt
    rows = [json.loads(x) for x in (run / "samples.jsonl").read_text().splitlines()]
    assert all(isinstance(r["gold"], float) for r in rows)
    ref = rows[0]["reference"]
    assert isinstance(ref["response"], str) and isinstance(ref["gold"], float)
    assert set(ref["components"]) == set(rows[0]["components"])


def test_keep_best_needs_a_gold_reward_and_can_be_turned_off(tmp_path):
    with pytest.raises(ConfigError, match="log.keep_best"):
        PPOTrainer(_tiny(tmp_path, "log.keep_best=true", "monitor.gold=null"))
    t = PPOTrainer(_tiny(tmp_path, "log.keep_best=false", "ppo.iterations=2"))
    t.fit()
    assert not (tmp_path / "run" / "checkpoints" / "best").exists()


def _gold(i):  # rises to iteration 20, then falls
    return 0.3 + 0.015 * min(i, 20) - 0.012 * max(0, i - 20) + 0.01 * math.sin(7 * i)


def _write_run(root):
    """A run directory as a PPO run of 40 iterations writes it, with gold that peaks and
    falls while the proxy keeps rising, beside a demo summary and a compare table."""
    run = root / "runs" / "demo-s0" / "ppo"
    run.mkdir(parents=True)
    rows = []
    for i in range(1, 41):
        rows.append(
            {
                "iteration": i,
                "objective/scores": 1 + 0.1 * i,
                "objective/scores/rm/preference": 0.5 + 0.05 * i,
                "objective/scores/rm/politeness": -0.02 * i,
                "objective/kl": 0.05 * (i - 1),
                "objective/kl_coef": 0.1,
                "monitor/gold": _gold(i),
                "monitor/length_ratio": 1 + 0.02 * i,
                "policy/loss": -0.01,
                "policy/approx_kl": 0.01,
                "lr/policy": 5e-5,
                "throughput/tokens_per_sec": 3000.0,
                "response/eos_rate": 1.0,
                "faults/skipped_updates": 0,
                "memory/peak_mib": 521.0 + (14 if i > 20 else 0),
            }
        )
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    alert = {"iteration": 31, "signal": "length_ratio", "value": 1.62, "threshold": 1.5}
    alert["message"] = "iteration 31: ... — answers grow longer"
    (run / "alerts.jsonl").write_text(json.dumps(alert) + "\n")
    sample = {
        "iteration": 5,
        "prompt": "add: 1 2\nanswer:",
        "response": " 3",
        "score": 1.5,
        "components": {"rm/preference": 1.0, "rm/politeness": -2.0},
        "kl": 0.1,
        "gold": 1.0,
        "reference": {"response": " 4", "score": 0.2, "components": {}, "gold": 0.0},
    }
    (run / "samples.jsonl").write_text(json.dumps(sample) + "\n")
    cfg = {
        "seed": 3,
        "reward": {"model": "runs/demo-s0/rm", "heads": {"preference": 1.0}},
        "log": {"output_dir": "runs/demo-s0/ppo"},
        "monitor": {"phrases": ["这是一个很好的问题"], "length_ratio": 1.5, "smoothing": 0.8},
    }
    (run / "config.yaml").write_text(yaml.safe_dump(cfg), encoding="utf-8")  # \u escapes
    summary = {"sft": {"gold": 0.3, "proxy": 1.0}, "ppo": {"gold": 0.32, "proxy": 5.0}}
    (run.parent / "summary.json").write_text(json.dumps(summary))
    compare = {"rows": [{"method": "ppo", "gold": 0.5, "wall_s": 35.2, "peak_mib": 612.0}]}
    (run.parent / "compare.json").write_text(json.dumps(compare))
    return run


def _sections(text):
    return re.findall(r"<(?:h2|section)[^>]* id='(\w+)'", text)


def test_report_says_at_a_glance_how_the_run_went(tmp_path, monkeypatch):
    run = _write_run(tmp_path)
    monkeypatch.chdir(tmp_path / "runs")  # not where the run was started
    text = build_report(run).read_text(encoding="utf-8")
    assert '<meta name="viewport"' in text
    assert "<title>demo-s0/ppo: run report, 40 iterations, 1 alert</title>" in text
    order = _sections(text)
    assert order[:3] == ["verdict", "alerts", "run"]  # verdict first, alerts before plots
    assert order.index("curves") > order.index("overopt")
    for anchor in order:
        assert f"href='#{anchor}'" in text  # the table of contents
    verdict = text.split("<section class='verdict bad'", 1)[1].split("</section>")[0]
    assert "Reward hacking suspected" in verdict and "iteration 2" in verdict
    assert "set log.keep_best to keep it" in verdict
    assert "1 monitor alert</b>, the first at iteration 31 (length_ratio)" in verdict
    assert "Final KL</b> to the reference: 1.950" in verdict
    assert "Held-out evaluation" in verdict and "40 noisy batches): gold peaks near KL" in verdict
    # the curves the issue found missing, and the heads outside the objective apart
    for title in ("Policy loss", "approx KL", "Learning rate", "Sampling throughput"):
        assert f"<figcaption>{title}" in text
    for title in ("Answers that ended with EOS", "Skipped updates", "Peak memory"):
        assert f"<figcaption>{title}" in text
    outside = text.split("<figcaption>Reward-model heads outside")[1].split("</figure>")[0]
    assert "rm/politeness" in outside and "rm/preference" not in outside
    assert "rm/preference <small>× 1</small>" in text
    # samples: gold, parts and the reference's answer
    assert "reference, same prompt" in text and "gold <b>1.000</b>" in text
    assert "not optimised: politeness -2.00" in text
    # the config: own settings first, non-ASCII as text, the rest folded
    own = text.split("Your settings")[1].split("<details>")[0]
    assert "<td>monitor.phrases</td><td>[&quot;这是一个很好的问题&quot;]</td>" in own
    assert "<td>seed</td><td>3</td><td>0</td>" in own
    assert "\\u" not in text and "<details><summary>The whole config" in text
    # reward-model checks that are not there: where they were looked for
    rm = text.split("<h2 id='rm'>")[1].split("<h2")[0]
    assert str(tmp_path / "runs" / "demo-s0" / "rm" / "rm_checks.json") in rm
    assert "612 MiB" in text and "35 s" in text and "612.000" not in text
    assert "has no run.json" in text
    assert "http://" not in text and "https://" not in text and "<script" not in text


def test_report_finds_the_reward_model_checks_from_any_directory(tmp_path, monkeypatch):
    run = _write_run(tmp_path)
    rm = tmp_path / "runs" / "demo-s0" / "rm"
    rm.mkdir()
    (rm / "rm_checks.json").write_text(json.dumps({"reward": {"accuracy": 0.8}}))
    for cwd in (tmp_path, tmp_path / "runs", run):
        monkeypatch.chdir(cwd)
        text = build_report(run).read_text(encoding="utf-8")
        assert "<td>reward</td><td>0.800</td>" in text, cwd


def test_demo_summary_names_the_final_and_the_best_policy():
    from rlhflab.app.demo import format_summary

    row = {"gold": 0.4, "proxy": 2.0, "accuracy": 0.5, "kl_to_reference": 1.0}
    story = {"best": 0.62, "best_iteration": 27, "final": 0.53, "fell": True}
    story["fit"] = {"peak": {"kl": 1.72}, "final_kl": 1.8}
    summary = {
        "preset": "default",
        "seed": 0,
        "sft": {**row, "gold": 0.3},
        "ppo": row,
        "ppo_best": {**row, "gold": 0.45},
        "evaluated": {"ppo": "the final policy (iteration 40)", "ppo_best": "checkpoints/best"},
        "gold_curve": story,
        "rm": {"heldout_accuracy": {"preference": 0.8}},
        "timing": {"total": 100.0},
    }
    text = format_summary(summary)
    assert re.search(r"^ppo_best +0\.450", text, re.M)
    assert "  ppo: the final policy (iteration 40)" in text
    assert "best 0.620 at iteration 27, 0.530 at the end (a significant fall)" in text
    assert "gold peaks near KL 1.72; the run ended at KL 1.80" in text


def test_a_killed_run_is_reported_as_unfinished_with_its_best_policy_found(tmp_path):
    """run.json of a run killed mid-way holds only what its start wrote: the report said
    "stopped because: it was done", "iterations: 40 of ?" and advised setting
    log.keep_best beside the checkpoints/best the run had kept; skipped updates went
    unmentioned."""
    run = _write_run(tmp_path)
    info = {"trainer": "PPO", "started": "2026-12-07T02:00:00Z", "finished": None, "total": 60}
    (run / "run.json").write_text(json.dumps(info))
    (run / "checkpoints" / "best").mkdir(parents=True)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    rows[-1]["faults/skipped_updates"] = 3
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    text = build_report(run).read_text(encoding="utf-8")
    facts = text.split("<h2 id='run'>")[1].split("<h2")[0]
    assert "<td>iterations</td><td>40 of 60</td>" in facts
    assert "<td>stopped because</td><td>-</td>" in facts
    assert "not finished (still running, or killed)" in facts
    verdict = text.split("<section class='verdict", 1)[1].split("</section>")[0]
    assert "it is kept in checkpoints/best" in verdict and "log.keep_best" not in verdict
    assert "3 updates were skipped for a non-finite reward" in verdict


def test_a_one_iteration_run_draws_its_points_and_gives_no_all_clear(tmp_path):
    """A line through one point draws nothing: every chart of a one-iteration run looked
    empty, under a green "No sign of reward hacking" verdict drawn from one batch."""
    run = tmp_path / "ppo"
    run.mkdir()
    row = {"iteration": 1, "objective/scores": 0.5, "objective/kl": 0.0, "monitor/gold": 0.3}
    (run / "metrics.jsonl").write_text(json.dumps({**row, "policy/loss": -0.01}) + "\n")
    text = build_report(run).read_text(encoding="utf-8")
    loss = text.split("<figcaption>Policy loss")[1].split("</figure>")[0]
    assert "<circle" in loss
    verdict = text.split("<section class='verdict", 1)[1].split("</section>")[0]
    assert "too short" in verdict and "Too few iterations (1)" in verdict
    assert "No sign of reward hacking" not in verdict


def test_a_dpo_run_report_draws_what_it_logged_and_judges_no_reward(tmp_path):
    """A DPO run's report drew only its learning rate, told a gold-and-proxy story it has
    no data for, and guessed samples_per_log = 0 for the samples it never takes."""
    run = tmp_path / "dpo"
    run.mkdir()
    rows = [
        {
            "iteration": i,
            "loss": 0.7 - 0.05 * i,
            "rewards/chosen": 0.1 * i,
            "rewards/rejected": -0.1 * i,
            "rewards/margin": 0.2 * i,
            "rewards/accuracy": 0.5 + 0.05 * i,
            "lr/policy": 1e-5,
        }
        for i in range(1, 7)
    ]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    info = {"trainer": "DPO", "started": "2026-12-07T02:00:00Z", "finished": None, "total": 6}
    (run / "run.json").write_text(json.dumps(info))
    text = build_report(run).read_text(encoding="utf-8")
    for key in ("loss", "rewards/chosen", "rewards/rejected", "rewards/margin"):
        assert f"<figcaption>{key}</figcaption>" in text, key
    verdict = text.split("<section class='verdict", 1)[1].split("</section>")[0]
    assert "no reward" in verdict and "gold" in verdict and "monitor alert" not in verdict
    assert "<b>Loss</b>: 0.650 → 0.525 (the mean of the last 6 steps; 0.400 at" in verdict
    assert "<b>Preference accuracy</b>: 0.550 → 0.800" in verdict
    assert "a DPO run samples no answers" in text and "samples_per_log = 0?" not in text


def test_cosmetics_of_settings_and_runs_with_nothing_logged(tmp_path):
    """A relative default recorded absolute is not the user's setting; a run killed
    before its first iteration is said as that, not as 'is this a run directory?'."""
    from rlhflab.app.report_sections import config_section

    config = {"sft": {"output_dir": str(tmp_path / "runs" / "sft")}, "seed": 3}
    own = config_section(config, {"sft.output_dir": "runs/sft", "seed": 0}).split("<details>")[0]
    assert "seed" in own and "sft.output_dir" not in own
    elsewhere = {"sft": {"output_dir": "/data/other"}}
    assert "sft.output_dir" in config_section(elsewhere, {"sft.output_dir": "runs/sft"})
    # with the folder the run started in (run.json), exact: a user's own path that merely
    # ends like the default is still theirs
    started = str(tmp_path)
    section = config_section(config, {"sft.output_dir": "runs/sft"}, started)
    assert "sft.output_dir" not in section.split("<details>")[0]
    theirs = {"sft": {"output_dir": "/data/x/runs/sft"}}
    section = config_section(theirs, {"sft.output_dir": "runs/sft"}, started)
    assert "sft.output_dir" in section.split("<details>")[0]
    run = tmp_path / "killed"
    run.mkdir()
    (run / "config.yaml").write_text("seed: 3\n")
    with pytest.raises(FileNotFoundError, match="no iteration logged yet"):
        build_report(run)


def test_a_metrics_file_that_is_not_a_runs_log_is_one_line(tmp_path):
    from rlhflab.infra.runlog import RunLogError

    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"iteration": 1}\n{"prompt": "hi", "answer": "a"}\n')
    with pytest.raises(RunLogError, match=r"metrics.jsonl: row 2 has no iteration"):
        build_report(run)


def test_a_gold_fall_without_a_finite_proxy_is_not_called_over_training(tmp_path):
    run = _write_run(tmp_path)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    for r in rows:
        r["objective/scores"] = None  # every batch's proxy scores skipped
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    verdict = build_report(run).read_text(encoding="utf-8").split("<section class='verdict")[1]
    verdict = verdict.split("</section>")[0]
    assert "the proxy has no finite score there" in verdict
    assert "fell with it" not in verdict and "Reward hacking suspected" not in verdict


def test_under_par_the_verdict_names_the_score_before_shaping_and_the_shaped_one(tmp_path):
    """Under reward.shaping=par the proxy line said "the optimised score" of the unshaped
    score; PPO optimises σ(score − reference score)."""
    run = _write_run(tmp_path)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    for r in rows:
        r["objective/shaped_scores"] = 0.5 + 0.005 * r["iteration"]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    verdict = build_report(run).read_text(encoding="utf-8").split("<section class='verdict")[1]
    verdict = verdict.split("</section>")[0]
    assert "<b>Proxy reward</b> (the reward's score before PAR shaping" in verdict
    assert "<b>Shaped reward</b> (PAR's σ(score − reference score), what PPO optimises" in verdict


def test_a_missing_or_broken_config_is_said_not_shown_as_all_defaults(tmp_path, caplog):
    # "Every setting is at its default ... {}" for a run whose config.yaml was torn
    with pytest.raises(FileNotFoundError, match="nowhere/at/all: no such folder"):
        build_report("/nowhere/at/all")  # not "no metrics.jsonl — is this a run directory?"
    run = _write_run(tmp_path)
    for text, said in (("ppo: [", "is unreadable"), (None, "is missing")):
        path = run / "config.yaml"
        if text is None:
            path.unlink()
        else:
            path.write_text(text)
        caplog.clear()
        with caplog.at_level("WARNING", logger="rlhflab.app.report"):
            page = build_report(run).read_text(encoding="utf-8")
        config = page.split("<h2 id='config'>")[1]
        assert said in config and "settings are unknown" in config
        assert "Every setting is at its default" not in page
        assert said in caplog.text


def test_a_null_value_is_a_gap_and_long_tick_labels_get_room():
    # a skipped update's null loss was joined over; ticks near 1 read 1.002e0 under the
    # axis title
    from rlhflab.app.report_sections import series_of

    rows = [{"iteration": i, "loss": 1.0 + i / 1000} for i in range(1, 10)]
    rows[4]["loss"] = None  # iteration 5: null
    del rows[7]["loss"]  # iteration 8: not logged there (every N-th)
    chart = Chart("t", [series_of(rows, "loss")], "u").html()
    lines = re.findall(r'<polyline[^>]*points="([^"]*)"', chart)
    assert [len(p.split()) for p in lines] == [4, 3]  # 1-4 | 6, 7, 9
    for r in rows[7:]:  # a skipped update at 8 logs no loss: a gap too (the count stays)
        r["faults/skipped_updates"] = 1
    lines = re.findall(r'<polyline[^>]*points="([^"]*)"', series_of_chart(rows))
    assert [len(p.split()) for p in lines] == [4, 2, 1]
    del rows[8]["loss"]  # 9: not logged, no new skip (the running count): passed over
    lines = re.findall(r'<polyline[^>]*points="([^"]*)"', series_of_chart(rows))
    assert [len(p.split()) for p in lines] == [4, 2]
    labels = re.findall(r'class="tk">([^<]*)</text>', chart)
    assert "1.0050" in labels and not any("e" in t for t in labels)
    left = float(re.search(r'<rect x="(\d+)"', chart).group(1))
    assert left >= 23 + 6.3 * max(len(t) for t in labels)
    assert tick_label(0.004, 0.002, 0.008) == "4e-3" and tick_label(0.998, 0.002, 1.0) == "0.998"


def series_of_chart(rows):
    from rlhflab.app.report_sections import series_of

    return Chart("t", [series_of(rows, "loss")], "u").html()


def test_a_table_cell_never_reads_minus_zero():
    # compare's KL column printed -0.000 for a k1 estimate of -2e-4
    from rlhflab.app.tables import cell

    assert cell("kl", -0.0002) == "0.000" and cell("kl", -0.0012) == "-0.001"
    assert cell("kl", 0.0) == "0.000" and cell("kl", float("nan")) == "-"
