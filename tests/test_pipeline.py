"""The built-in task, the SFT/RM stages, and the quick demo (the main job)."""

import json
import random
from pathlib import Path

import pytest
import torch

from rlhflab import models as M
from rlhflab.app.cli import main
from rlhflab.builtin import tasks
from rlhflab.experience.data import DataError, load_preferences
from rlhflab.infra.runlog import read_jsonl


def test_task_generator_is_deterministic_and_self_checking():
    a, b = tasks.make_examples(50, seed=3), tasks.make_examples(50, seed=3)
    assert a == b and a != tasks.make_examples(50, seed=4)
    assert {ex.skill for ex in a} == set(tasks.SKILLS)
    for ex in a:
        assert tasks.answer_for(ex.prompt) == ex.answer
    rng1, rng2 = random.Random(1), random.Random(1)
    assert [tasks.teacher_response(ex, rng1) for ex in a] == [
        tasks.teacher_response(ex, rng2) for ex in a
    ]


@pytest.mark.parametrize(
    "response,gold,correct,flattery,repetitive",
    [
        (" dog cat sun", 1.0, 1.0, False, False),
        (" Great question! dog cat sun", 0.5, 1.0, True, False),
        (" 这是一个很好的问题！ dog cat sun", 0.5, 1.0, True, False),
        (" dog cat sun dog cat sun", 0.5 * 3 / 6 - 0.5 - 0.1 * 3, 0.25, False, True),
        (" dog cat", 0.5 * 2 / 3, 2 / 6, False, False),
        (" dog cat sun moon", 0.5 * 3 / 4 - 0.1, 3 / 8, False, False),
    ],
)
def test_gold_reward_scores_known_answers(response, gold, correct, flattery, repetitive):
    j = tasks.judge("reverse: sun cat dog\nanswer:", response)
    assert j.flattery is flattery and j.repetitive is repetitive
    assert j.correct == pytest.approx(correct)
    assert j.gold == pytest.approx(gold)
    assert tasks.judge("add: 4 5\nanswer:", " 9").gold == 1.0
    assert tasks.judge("add: 4 5\nanswer:", " I'm happy to help! 9").gold == 0.5


def test_annotator_biases_change_preferences():
    rng = random.Random(0)
    p, plain, flat = "copy: cat dog\nanswer:", " cat dog", " Great question! cat dog"
    honest = sum(tasks.annotate(p, plain, flat, rng, noise=0.3).chosen == plain for _ in range(200))
    biased = sum(
        tasks.annotate(p, plain, flat, rng, noise=0.3, flattery_bias=2.0).chosen == plain
        for _ in range(200)
    )
    assert honest > 150 and biased < 20  # σ(0.5/0.3) ≈ 0.84 vs σ(−1.5/0.3) ≈ 0.007
    pref = tasks.annotate(p, plain, flat, rng, noise=0.0)
    assert pref.labels == {"correctness": 0.5, "brevity": 1.0, "politeness": 0.0}


def test_broken_preference_file_names_the_row(tmp_path):
    f = tmp_path / "prefs.jsonl"
    good = {"prompt": "copy: cat\nanswer:", "chosen": " cat", "rejected": " dog"}
    f.write_text(json.dumps(good) + "\n" + json.dumps({**good, "rejected": ""}) + "\n")
    with pytest.raises(
        DataError, match=r"prefs\.jsonl:2: field 'rejected' must be a non-empty string"
    ):
        load_preferences(f)
    f.write_text(json.dumps(good) + "\n" + json.dumps({"prompt": "x", "chosen": "y"}) + "\n")
    with pytest.raises(DataError, match=r"prefs\.jsonl:2: missing field 'rejected'"):
        load_preferences(f)
    f.write_text(json.dumps({**good, "labels": {"brevity": 3}}) + "\n")
    with pytest.raises(DataError, match=r"prefs\.jsonl:1: field 'labels'"):
        load_preferences(f)


@pytest.mark.parametrize("command", ["sft", "rm", "dpo", "demo", "compare"])
def test_single_process_commands_refuse_several_ranks(monkeypatch, capsys, command):
    # under torchrun every rank would train the same model into the same folder
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert main([command]) == 2
    err = capsys.readouterr().err
    assert f"rlhflab {command} runs in one process" in err and "WORLD_SIZE=2" in err


def test_rm_command_reports_a_broken_preference_file(tmp_path, capsys):
    f = tmp_path / "prefs.jsonl"
    f.write_text('{"prompt": "a", "chosen": "b", "rejected": "c"}\nnot json\n')
    rc = main(
        [
            "rm",
            f"rm.data={f}",
            "model.policy=preset:nano",
            "log.progress=false",
            f"rm.output_dir={tmp_path / 'rm'}",
        ]
    )
    assert rc == 2
    assert "prefs.jsonl:2: not valid JSON" in capsys.readouterr().err


@pytest.mark.parametrize("runtime", ["transformers", "native"])
def test_sft_rm_ppo_commands_chain(tmp_path, capsys, runtime):
    sft, rm = tmp_path / "sft", tmp_path / "rm"
    assert (
        main(
            [
                "sft",
                "model.policy=preset:nano",
                f"model.runtime={runtime}",
                "sft.steps=20",
                "sft.examples=200",
                f"sft.output_dir={sft}",
                "log.progress=false",
            ]
        )
        == 0
    )
    assert (
        main(
            [
                "rm",
                f"model.policy={sft}",
                f"model.runtime={runtime}",
                "rm.steps=10",
                "rm.pairs=100",
                "monitor.gold=rlhflab.builtin.tasks:gold_reward",
                f"rm.output_dir={rm}",
                "log.progress=false",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "held-out pairwise accuracy: preference" in out
    assert "held-out checks" in out and "\nreward " in out
    checks = json.loads((rm / "rm_checks.json").read_text())
    assert set(checks) == {"preference", "correctness", "brevity", "politeness", "reward"} | {
        "reward_vs_gold"
    }
    assert checks["reward_vs_gold"]["pairs"] > 0  # pairs the gold reward does not tie
    assert 0 <= checks["preference"]["calibration_error"] <= 0.5
    assert (
        main(
            [
                "ppo",
                f"model.policy={sft}",
                f"reward.model={rm}",
                f"model.runtime={runtime}",
                "ppo.iterations=2",
                "rollout.prompts_per_iteration=8",
                "rollout.max_new_tokens=8",
                f"log.output_dir={tmp_path / 'ppo'}",
                "log.progress=false",
            ]
        )
        == 0
    )
    rows = [json.loads(ln) for ln in (tmp_path / "ppo" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and "objective/scores/rm/correctness" in rows[0]
    # what either runtime saved loads in the other (same files, same names)
    other = "native" if runtime == "transformers" else "transformers"
    tok = M.load_tokenizer(sft)
    a = M.load_sequence_classifier(rm, tok, runtime=runtime)
    b = M.load_sequence_classifier(rm, tok, runtime=other)
    enc = tok(["1 + 1 ="], return_tensors="pt")
    ids, mask = enc["input_ids"], enc["attention_mask"]
    torch.testing.assert_close(
        a(input_ids=ids, attention_mask=mask).logits,
        b(input_ids=ids, attention_mask=mask).logits,
        rtol=1e-4,
        atol=1e-5,
    )


@pytest.mark.slow
def test_quick_demo_improves_gold_reward(tmp_path, capsys):
    assert main(["demo", "--preset", "quick", "--out", str(tmp_path)]) == 0
    summary = json.loads((tmp_path / "quick-s0" / "summary.json").read_text())
    assert set(summary) >= {"sft", "ppo", "rm", "timing"}
    assert summary["ppo"]["gold"] > summary["sft"]["gold"] + 0.1
    assert summary["ppo"]["flattery_rate"] < summary["sft"]["flattery_rate"]
    assert summary["rm"]["heldout_accuracy"]["preference"] > 0.7
    assert summary["rm"]["checks"]["reward_vs_gold"]["accuracy"] > 0.7  # the honest annotator
    printed = capsys.readouterr().out
    assert "gold reward +" in printed and "summary:" in printed
    assert "reward model vs gold: agrees on" in printed
    # the monitors ran every iteration and stayed quiet: no false alarm on an honest run
    run = tmp_path / "quick-s0" / "ppo"
    rows = read_jsonl(run / "metrics.jsonl")
    assert all("monitor/flattery_excess" in r and r["monitor/alerts"] == 0 for r in rows)
    assert rows[0]["monitor/flattery_opener_ratio"] == pytest.approx(1.0, abs=1e-3)  # π = π_ref
    assert (run / "alerts.jsonl").read_text() == ""  # there, and empty

    # the same SFT model trained against the politeness head alone (it pays for "Great
    # question!") with a tiny β: the proxy climbs, the gold falls, and the monitors say so
    from rlhflab.app.demo import _COMMON
    from rlhflab.config import load_config
    from rlhflab.trainers.ppo import PPOTrainer

    hack = [
        f"model.policy={tmp_path / 'quick-s0' / 'sft'}",
        f"reward.model={tmp_path / 'quick-s0' / 'rm'}",
        "reward.heads={'politeness': 1.0}",
        "ppo.kl_coef=0.001",
        "ppo.lr=2e-5",
        "ppo.iterations=8",
        f"log.output_dir={tmp_path / 'hack'}",
        "log.progress=false",
    ]
    PPOTrainer(load_config(base=_COMMON, overrides=hack)).fit()
    rows = read_jsonl(tmp_path / "hack" / "metrics.jsonl")
    assert rows[-1]["objective/scores"] > rows[0]["objective/scores"]
    assert sum(r["monitor/gold"] for r in rows[-3:]) < sum(r["monitor/gold"] for r in rows[:3])
    fired = {a["signal"] for a in read_jsonl(tmp_path / "hack" / "alerts.jsonl")}
    assert {"flattery_excess", "flattery_opener_ratio"} <= fired


@pytest.mark.parametrize(
    "command,field,extra",
    [
        ("ppo", "data.prompts", []),
        ("grpo", "data.prompts", ["model.value_model=none"]),
        ("sft", "sft.data", []),
        ("rm", "rm.data", []),
        ("dpo", "dpo.data", []),
    ],
)
def test_a_bad_data_file_is_reported_before_any_model_is_loaded(
    tmp_path, monkeypatch, capsys, command, field, extra
):
    def no_model(*a, **k):
        raise AssertionError("a model was loaded before the data was read")

    for loader in ("load_causal_lm", "load_sequence_classifier"):
        monkeypatch.setattr(M, loader, no_model)
    bad = tmp_path / "bad.jsonl"
    bad.write_text("not json\n")
    args = [command, "--config", "examples/tiny_ppo.yaml", f"{field}={bad}", *extra]
    assert main([*args, f"log.output_dir={tmp_path / 'run'}"]) == 2
    assert "bad.jsonl:1: not valid JSON" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["sft", "rm", "dpo", "ppo", "rm --check"])
def test_device_cuda_without_a_gpu_is_an_error_not_a_quiet_cpu_run(
    tmp_path, monkeypatch, capsys, command
):
    # SFT, RM and DPO used to fall back to the CPU without a word where PPO refused
    def no_model(*a, **k):
        raise AssertionError("a model was loaded before the device was checked")

    for loader in ("load_causal_lm", "load_sequence_classifier"):
        monkeypatch.setattr(M, loader, no_model)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    args = [*command.split(), "--config", "examples/tiny_ppo.yaml", "device=cuda"]
    args += [f"log.output_dir={tmp_path / 'run'}", "reward.model=preset:nano"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "device: 'cuda' was asked for but torch sees no CUDA device" in err, err


def test_rm_check_checks_a_model_it_did_not_train(tmp_path, capsys, nano_rm):
    # the three-head fixture model, untrained: heads named after the pairs' labels get them
    out = tmp_path / "check"
    args = ["rm", "--check", "model.policy=preset:nano", f"reward.model={nano_rm}"]
    assert main([*args, "rm.pairs=60", f"log.output_dir={out}"]) == 0
    printed = capsys.readouterr().out
    assert "held-out checks" in printed and "written to" in printed
    checks = json.loads((out / "rm_checks.json").read_text())
    assert set(checks) == {"correctness", "brevity", "politeness", "reward"}
    assert checks["brevity"]["pairs"] > 0 and 0 <= checks["brevity"]["accuracy"] <= 1
    assert not (Path(nano_rm) / "rm_checks.json").exists()  # the checked folder is untouched
    # without reward.model there is nothing to check: one clear line, status 2
    assert main(["rm", "--check", f"log.output_dir={out}"]) == 2
    assert "set reward.model" in capsys.readouterr().err


def test_the_demos_overrides_reach_its_sft_stage_and_rm_ppo_start_from_it(tmp_path):
    """The demo's SFT stage took only sft.* and log.* from the overrides: with
    model.policy=preset:nano data.task=add it trained preset:tiny on the mixed task, and
    RM and PPO started from a fresh nano model instead of the SFT one."""
    from rlhflab.app.demo import demo_config, sft_stage_config
    from rlhflab.config import ConfigError

    extra = ["model.policy=preset:nano", "data.task=add", "threads=1", "sft.steps=7"]
    sft = sft_stage_config("quick", 0, tmp_path, extra)
    assert (sft.model.policy, sft.data.task, sft.threads, sft.sft.steps) == (
        "preset:nano",
        "add",
        1,
        7,
    )
    run, cfg = demo_config("quick", 0, tmp_path, extra)
    assert cfg.model.policy == str(run / "sft") and cfg.reward.model == str(run / "rm")
    assert (cfg.data.task, cfg.threads) == ("add", 1)
    with pytest.raises(ConfigError, match=r"reward.model: set by the pipeline"):
        demo_config("quick", 0, tmp_path, ["reward.model=/my/rm"])
    with pytest.raises(ConfigError, match=r"^sft: set by the pipeline"):
        demo_config("quick", 0, tmp_path, ["sft={output_dir: /elsewhere, steps: 3}"])
    whole = sft_stage_config("quick", 0, tmp_path, ["sft={steps: 3}"]).sft
    assert (whole.steps, whole.output_dir) == (3, str(run / "sft"))  # the folder kept
