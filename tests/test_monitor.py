"""Reward-hacking monitors and the HTML report."""

import json

import pytest
import torch

from rlhflab.app.charts import Chart, Series
from rlhflab.app.report import build_report
from rlhflab.config import load_config
from rlhflab.diagnostics.monitor import HackingMonitor, distinct_n, pearson, repeated_ngram_rate
from rlhflab.experience.rollout import Rollout
from rlhflab.trainers.ppo import PPOTrainer
from rlhflab.trainers.ppo_watch import raised_kl_coef


def test_the_report_shows_bidirectional_controls_instead_of_obeying_them():
    # a prompt's right-to-left override reversed the report's text after it
    from rlhflab.app.report_parts import esc

    assert esc("a\u202eb<c\u2066") == "a[U+202E]b&lt;c[U+2066]"


def test_an_axis_of_whole_iterations_has_no_tick_between_them():
    two = Chart("t", [Series("a", [(1, 10.0), (2, 20.0)])], "unit").html()  # not 1.25, 1.5
    assert ">1.25<" not in two and ">1.5<" not in two and ">2<" in two


def test_repetition_and_correlation_signals():
    assert repeated_ngram_rate([1, 2, 3, 4], 2) == 0.0
    assert repeated_ngram_rate([1, 2, 1, 2, 1, 2], 2) == pytest.approx(3 / 5)
    assert distinct_n([[1, 2, 3], [1, 2, 3]], 2) == pytest.approx(2 / 4)
    assert pearson(torch.tensor([1.0, 2, 3]), torch.tensor([2.0, 4, 6])) == pytest.approx(1.0)
    assert pearson(torch.tensor([1.0, 1, 1]), torch.tensor([2.0, 4, 6])) == 0.0


def fake_rollout(responses, scores, lengths):
    B, T = len(responses), max(lengths)
    mask = (torch.arange(T)[None] < torch.tensor(lengths)[:, None]).long()
    ids = torch.arange(B * T).reshape(B, T) % 7
    return Rollout(
        torch.zeros(B, 1, dtype=torch.long),
        torch.ones(B, 1, dtype=torch.long),
        ids,
        mask,
        torch.ones(B, dtype=torch.bool),
        ["p"] * B,
        responses,
        scores=torch.tensor(scores),
    )


def test_monitor_thresholds_fire_and_warmup_is_respected():
    cfg = load_config(
        overrides=[
            "reward.functions={'rlhflab.builtin.toy_rewards:vowel_reward': 1}",
            "monitor.warmup_iterations=1",
        ]
    )
    mon = HackingMonitor(cfg.monitor)
    ro = fake_rollout(["Great question! a", "Great question! b"], [1.0, 2.0], [3, 6])
    metrics = {"objective/scores": 1.5, "objective/kl": 0.1, "policy/entropy": 2.0}
    ref = fake_rollout(["Great question! a", "plain b"], [0.0, 0.0], [2, 2])
    sig = mon.signals(ro, metrics, reference=ref)
    assert sig["flattery_rate"] == 1.0 and sig["length_ratio"] == pytest.approx(4.5 / 2)
    assert sig["flattery_excess"] == pytest.approx(0.5)
    assert sig["reward_length_corr"] == pytest.approx(1.0)
    assert mon.check(1, sig) == []  # warm-up
    fired = {a.signal for a in mon.check(2, sig)}
    assert fired == {"flattery_rate", "flattery_excess", "length_ratio", "reward_length_corr"}
    sig = mon.signals(ro, {**metrics, "policy/entropy": 0.1}, None)
    assert "entropy_ratio" in {a.signal for a in mon.check(3, sig)}


def test_gold_drop_signal_tracks_proxy_versus_gold(monkeypatch):
    cfg = load_config(
        overrides=[
            "reward.functions={'rlhflab.builtin.toy_rewards:vowel_reward': 1}",
            "monitor.gold=rlhflab.builtin.toy_rewards:vowel_reward",
            "monitor.smoothing=0",
        ]
    )
    from rlhflab.experience.rewards import FunctionReward

    mon = HackingMonitor(cfg.monitor, FunctionReward(cfg.monitor.gold))
    drops = []
    for proxy, text in ((1.0, "aaaa"), (2.0, "aab"), (3.0, "bbbb")):
        ro = fake_rollout([text], [proxy], [2])
        sig = mon.signals(
            ro, {"objective/scores": proxy, "objective/kl": 0.0, "policy/entropy": 1.0}, None
        )
        drops.append(sig["gold_drop"])
    assert drops[0] == 0.0 and drops[1] == pytest.approx(1 - 2 / 3) and drops[2] == 1.0


def test_the_monitor_state_is_global_on_every_rank():
    # only rank 0's state is checkpointed and every rank reads it back on --resume, so what
    # it accumulates (the reference's flattery counts, the gold's moving average) must be
    # the same on every rank: two "ranks" (threads) exchange their means as all-reduce does
    import threading

    from rlhflab.experience.rewards import FunctionReward

    cfg = load_config(
        overrides=[
            "reward.functions={'rlhflab.builtin.toy_rewards:vowel_reward': 1}",
            "monitor.gold=rlhflab.builtin.toy_rewards:vowel_reward",
        ]
    )
    answers = [["Great question! aa", "b"], ["bb", "ab"]]
    refs = [["Great question! a", "Great question! e"], ["plain", "plain"]]
    posted, barrier = [{}, {}], threading.Barrier(2)

    def mean_over_ranks(rank):
        def mean(values):
            posted[rank] = dict(values)
            barrier.wait()
            out = {k: (posted[0][k] + posted[1][k]) / 2 for k in values}
            barrier.wait()  # both read before either posts again
            return out

        return mean

    monitors = [
        HackingMonitor(cfg.monitor, FunctionReward(cfg.monitor.gold), None, mean_over_ranks(r))
        for r in (0, 1)
    ]
    metrics = {"objective/scores": 1.0, "objective/kl": 0.1, "policy/entropy": 2.0}
    signals = [None, None]

    def rank(r):
        ro, ref = (
            fake_rollout(answers[r], [1.0, 2.0], [2, 2]),
            fake_rollout(refs[r], [0, 0], [2, 2]),
        )
        signals[r] = monitors[r].signals(ro, metrics, reference=ref)

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    states = [m.state.state_dict() for m in monitors]
    assert states[0] == states[1]
    # the reference flattered in 2 of all 4 answers, the gold is the mean of all 4
    assert states[0]["ref_flattering"] / states[0]["ref_answers"] == pytest.approx(0.5)
    one = HackingMonitor(cfg.monitor, FunctionReward(cfg.monitor.gold))
    whole = one.signals(
        fake_rollout(answers[0] + answers[1], [1.0, 2.0] * 2, [2] * 4),
        metrics,
        reference=fake_rollout(refs[0] + refs[1], [0] * 4, [2] * 4),
    )
    assert states[0]["gold_ema"] == pytest.approx(one.state.gold_ema)
    # the ranks' signals averaged (as mean_metrics does next) are the whole batch's
    for name in ("flattery_excess", "gold", "flattery_rate"):
        assert (signals[0][name] + signals[1][name]) / 2 == pytest.approx(whole[name]), name


def tiny_cfg(tmp_path, *over):
    base = {
        "device": "cpu",
        "model": {"policy": "preset:nano", "value_model": "shared"},
        "reward": {"functions": {"rlhflab.builtin.toy_rewards:vowel_reward": 1.0}},
        "rollout": {"prompts_per_iteration": 8, "max_new_tokens": 8},
        "ppo": {"iterations": 4, "epochs": 1, "lr": 1e-3},
        "log": {"output_dir": str(tmp_path / "run"), "progress": False, "sample_every": 1},
        "monitor": {"gold": "rlhflab.builtin.toy_rewards:vowel_reward", "warmup_iterations": 0},
    }
    return load_config(base=base, overrides=list(over))


def test_raise_kl_response_multiplies_beta(tmp_path):
    t = PPOTrainer(
        tiny_cfg(
            tmp_path, "monitor.response=raise_kl", "monitor.entropy_ratio=10", "ppo.iterations=2"
        )
    )
    t.fit()
    rows = [r for r in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2
    assert t.kl_ctl.value == pytest.approx(0.05 * 2.0**2)  # an alert each iteration


def test_raise_kl_once_per_iteration_up_to_the_ceiling(tmp_path):
    # three signals alert every iteration (entropy, length, correlation thresholds that
    # always fire), yet β moves once an iteration, and stops at monitor.kl_coef_max
    over = ["monitor.response=raise_kl", "monitor.entropy_ratio=10", "monitor.kl_factor=3"]
    over += ["monitor.length_ratio=0.001", "monitor.reward_length_corr=-1", "ppo.iterations=3"]
    t = PPOTrainer(tiny_cfg(tmp_path, *over, "monitor.kl_coef_max=1.0"))
    t.fit()
    alerts = [json.loads(r) for r in (tmp_path / "run" / "alerts.jsonl").read_text().splitlines()]
    assert {a["iteration"] for a in alerts} == {1, 2, 3}
    assert len(alerts) >= 6  # several alerts an iteration
    beta = [
        json.loads(r)["objective/kl_coef"]
        for r in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    ]
    assert beta == pytest.approx([0.05, 0.15, 0.45])  # the β each iteration trained with
    assert t.kl_ctl.value == pytest.approx(1.0)  # 1.35 capped


def test_raised_kl_coef_never_lowers_a_beta_above_the_ceiling():
    assert raised_kl_coef(0.1, 2.0, 10.0) == pytest.approx(0.2)
    assert raised_kl_coef(8.0, 2.0, 10.0) == 10.0
    assert raised_kl_coef(20.0, 2.0, 10.0) == 20.0


def test_stop_response_checkpoints_and_names_the_signal(tmp_path):
    t = PPOTrainer(tiny_cfg(tmp_path, "monitor.response=stop", "monitor.entropy_ratio=10"))
    out = t.fit()
    assert out["iterations"] == 1
    assert "entropy_ratio" in out["stop_reason"] and "lower ppo.lr" in out["stop_reason"]
    assert (tmp_path / "run" / "checkpoints" / "step-1").exists()


def test_a_monitor_stop_exits_3_from_the_command(tmp_path, capsys):
    # a guard's stop is no finished run: exit 0 let `rlhflab ppo ... && rlhflab export`
    # export a policy stopped for hacking
    import yaml

    from rlhflab.app.cli import main
    from rlhflab.config.base import to_dict

    cfg = tiny_cfg(tmp_path, "monitor.response=stop", "monitor.entropy_ratio=10")
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(to_dict(cfg)))
    assert main(["ppo", "--config", str(tmp_path / "c.yaml")]) == 3
    assert "stopped by the monitor after 1 iteration, output in" in capsys.readouterr().out
    assert (
        main(
            [
                "ppo",
                "--config",
                str(tmp_path / "c.yaml"),
                "monitor.response=warn",
                "ppo.iterations=1",
            ]
        )
        == 0
    )


def test_report_is_self_contained_html_with_curves_alerts_and_samples(tmp_path):
    PPOTrainer(tiny_cfg(tmp_path, "monitor.entropy_ratio=10")).fit()
    path = build_report(tmp_path / "run")
    text = path.read_text()
    assert text.count('<svg class="pl"') >= 10
    assert "Monitor: entropy_ratio" in text and "threshold 10 (alert below)" in text
    assert "<h2 id='alerts'>Alerts</h2><div class=\"tw\"><table>" in text
    assert "<h2 id='samples'>Samples</h2>" in text and "reference, same prompt" in text
    assert "http://" not in text and "https://" not in text and "<script" not in text


def test_chart_skips_non_finite_points():
    points = [(1, 1.0), (2, float("nan")), (3, 2.0)]
    fig = Chart("x", [Series("a", points)], "u", alerts=[2], threshold=(1.5, "above")).html()
    assert fig.startswith("<figure") and "nan" not in fig
    assert Chart("empty", [Series("a", [(1, None)])], "u").html() == ""


def test_flattery_opener_ratio_is_a_ratio_of_means_and_alerts_above_threshold():
    from rlhflab.diagnostics.monitor import opener_ratio

    pol, ref = torch.tensor([0.5, 0.1]).log(), torch.tensor([0.25, 0.05]).log()
    assert opener_ratio(pol, ref) == pytest.approx(2.0)
    assert opener_ratio(torch.tensor([0.0, 0.9]).log(), torch.tensor([1e-9, 0.3]).log()) == (
        pytest.approx(0.45 / (0.15 + 5e-10))
    )
    cfg = load_config(
        overrides=["reward.functions={'rlhflab.builtin.toy_rewards:vowel_reward': 1}"]
    )
    mon = HackingMonitor(cfg.monitor)
    ro = fake_rollout(["plain a", "plain b"], [1.0, 2.0], [3, 3])
    metrics = {"objective/scores": 1.5, "objective/kl": 0.1, "policy/entropy": 2.0}
    sig = mon.signals(ro, metrics, openers=(pol, ref))
    assert sig["flattery_opener_ratio"] == pytest.approx(2.0)
    assert "flattery_opener_ratio" in {a.signal for a in mon.check(2, sig)}
    sig = mon.signals(ro, metrics, openers=(ref, ref))
    assert "flattery_opener_ratio" not in {a.signal for a in mon.check(3, sig)}


def test_report_shows_the_reward_models_checks_and_their_warning(tmp_path):
    run, rm = tmp_path / "run", tmp_path / "rm"
    run.mkdir()
    rm.mkdir()
    (run / "metrics.jsonl").write_text(json.dumps({"iteration": 1, "objective/kl": 0.1}) + "\n")
    (run / "config.yaml").write_text(f"reward:\n  model: {rm}\n")
    row = {
        "accuracy": 0.84,
        "calibration_error": 0.05,
        "longer_preferred": 0.75,
        "longer_preferred_by_labels": 0.73,
        "score_length_corr": 0.64,
    }
    (rm / "rm_checks.json").write_text(
        json.dumps(
            {
                "preference": {**row, "score_length_corr": None},
                "reward": row,
                "reward_vs_gold": {**row, "accuracy": 0.5},
            }
        )
    )
    text = build_report(run).read_text()
    assert "<h2 id='rm'>Reward model checks</h2>" in text and "<td>0.750</td>" in text
    assert "prefers the longer answer in 75%" in text and "<td>-</td>" in text
    assert "agrees with the gold reward on 50%" in text
    (rm / "rm_checks.json").unlink()  # a reward model from before the checks: where looked
    text = build_report(run).read_text()
    assert "No rm_checks.json" in text and str(rm / "rm_checks.json") in text
