"""GRPO, RLOO and DPO on the shared infrastructure (nano/tiny presets, seconds each)."""

import math

import pytest
import torch

from rlhflab.config import ConfigError, load_config
from rlhflab.infra.runlog import read_jsonl
from rlhflab.trainers.dpo import DPO_BASE, DPOTrainer
from rlhflab.trainers.grpo import GRPO_BASE, GRPOTrainer

VOLATILE = ("time/", "throughput/", "memory/")


def grpo_cfg(tmp_path, *over, out="run"):
    base = {
        **GRPO_BASE,
        "device": "cpu",
        "model": {"policy": "preset:tiny", "value_model": "none"},
        "reward": {"functions": {"rlhflab.builtin.toy_rewards:vowel_reward": 1.0}},
        "rollout": {"prompts_per_iteration": 16, "max_new_tokens": 8},
        "ppo": {**GRPO_BASE["ppo"], "iterations": 4, "epochs": 2, "minibatches": 2, "lr": 1e-3},
        "grpo": {"group_size": 4},
        "log": {"output_dir": str(tmp_path / out), "progress": False, "checkpoint_every": 2},
    }
    return load_config(base=base, overrides=list(over), stage="grpo")


@pytest.mark.parametrize("estimator", ["grpo", "rloo"])
def test_group_trainers_raise_reward_with_ratio_one_at_first(tmp_path, estimator):
    t = GRPOTrainer(grpo_cfg(tmp_path, "ppo.iterations=20", "ppo.epochs=4"), estimator=estimator)
    assert t.cast.critic is None and not t.cast.shared
    t.fit()
    assert t.first_minibatch["policy/ratio_mean"] == pytest.approx(1.0, abs=1e-6)
    assert t.first_minibatch["policy/approx_kl"] == pytest.approx(0.0, abs=1e-7)
    rows = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    scores = [r["objective/scores"] for r in rows]
    assert sum(scores[-5:]) / 5 > sum(scores[:5]) / 5 + 0.05, scores
    assert f"{estimator}/zero_std_fraction" in rows[0] and "val/loss" not in rows[0]


def test_dr_grpo_divides_by_one_constant_not_the_batch_width(tmp_path, monkeypatch):
    """seq-mean-token-sum-norm weighs an answer by a constant that no batch changes:
    rollout.max_new_tokens by default, ppo.loss_agg_norm when set (every loss term)."""
    import rlhflab.core.losses as L

    seen, real = [], L.aggregate

    def spy(loss_matrix, mask, mode="token-mean", norm=None, **kw):
        seen.append(norm)
        return real(loss_matrix, mask, mode, norm, **kw)

    monkeypatch.setattr(L, "aggregate", spy)
    for over, expect in (((), 8), (("ppo.loss_agg_norm=50",), 50)):
        seen.clear()
        cfg = grpo_cfg(
            tmp_path,
            "model.policy=preset:nano",
            "ppo.iterations=1",
            "ppo.epochs=1",
            "ppo.loss_agg=seq-mean-token-sum-norm",
            "grpo.normalize_std=false",
            *over,
        )
        GRPOTrainer(cfg).step()
        assert seen and set(seen) == {expect}, over


def test_group_prompts_are_consecutive(tmp_path):
    t = GRPOTrainer(grpo_cfg(tmp_path))
    prompts = t.next_prompts()
    assert len(prompts) == 16
    assert all(len(set(prompts[i : i + 4])) == 1 for i in range(0, 16, 4))


def test_the_group_estimators_are_a_config_choice_of_the_one_trainer(tmp_path):
    import copy

    from rlhflab.config import validate
    from rlhflab.trainers.ppo import PPOTrainer

    cfg = grpo_cfg(tmp_path, "model.policy=preset:nano")
    t = GRPOTrainer(cfg, estimator="rloo")  # the old entry point: a PPOTrainer, configured
    assert type(t) is PPOTrainer and t.estimator.name == "rloo" and t.cast.critic is None
    assert cfg.ppo.advantage_estimator == "grpo"  # the caller's config is left as it was
    # on `rlhflab ppo` the field alone makes it RLOO: prompts come in groups of G
    on_ppo = copy.deepcopy(cfg)
    on_ppo.ppo.advantage_estimator = "rloo"
    prompts = PPOTrainer(validate(on_ppo)).next_prompts()
    assert len(prompts) == 16 and all(len(set(prompts[i : i + 4])) == 1 for i in range(0, 16, 4))


@pytest.mark.parametrize("runtime", ["transformers", "native"])
def test_grpo_resume_is_bit_identical(tmp_path, runtime):
    rt = f"model.runtime={runtime}"
    straight = GRPOTrainer(grpo_cfg(tmp_path, rt, out="a"), estimator="rloo")
    straight.fit()
    half = GRPOTrainer(grpo_cfg(tmp_path, rt, out="b"), estimator="rloo")
    half.cfg.ppo.iterations = 2
    half.fit()
    resumed = GRPOTrainer(grpo_cfg(tmp_path, rt, out="b"), estimator="rloo")
    resumed.fit(resume=True)
    for a, b in zip(
        straight.cast.policy.state_dict().values(), resumed.cast.policy.state_dict().values()
    ):
        assert torch.equal(a, b)
    strip = lambda rows: [{k: v for k, v in r.items() if not k.startswith(VOLATILE)} for r in rows]  # noqa: E731
    assert strip(read_jsonl(tmp_path / "a" / "metrics.jsonl")) == strip(
        read_jsonl(tmp_path / "b" / "metrics.jsonl")
    )


def test_reused_training_forward_replaces_the_scoring_forward(tmp_path):
    """μ = 1 GRPO: old log-probs from the training forward (one policy forward fewer per
    iteration) give the update and the metrics a scoring forward gives."""
    runs = {}
    for reuse in (True, False):
        over = ["ppo.epochs=1", "ppo.minibatches=1", "ppo.iterations=3"]
        t = GRPOTrainer(
            grpo_cfg(tmp_path, *over, f"ppo.reuse_training_forward={reuse}", out=str(reuse))
        )
        calls, seen = [], [0]  # policy-LM forwards per iteration
        t.cast.policy_lm.register_forward_hook(
            lambda *a, seen=seen: seen.__setitem__(0, seen[0] + 1)
        )
        t.callbacks.append(
            lambda *a, seen=seen, calls=calls: (calls.append(seen[0]), seen.clear(), seen.append(0))
        )
        t.fit()
        runs[reuse] = (t, calls, read_jsonl(tmp_path / str(reuse) / "metrics.jsonl"))
    (t_on, calls_on, rows_on), (t_off, calls_off, rows_off) = runs[True], runs[False]
    assert t_on.reuses_training_forward() and not t_off.reuses_training_forward()
    # sampling (a prefill and 7 cached steps), [scoring], training; opener probe off
    scoring = math.ceil(16 / t_off.cfg.rollout.score_micro_batch)
    assert [b - a for a, b in zip(calls_on, calls_off)] == [scoring] * 3, (calls_on, calls_off)
    assert t_on.first_minibatch["policy/ratio_max"] == 1.0  # exactly: old = this forward
    for a, b in zip(t_on.cast.policy.parameters(), t_off.cast.policy.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    for row_on, row_off in zip(rows_on, rows_off):
        for key in ("objective/kl", "objective/entropy", "policy/entropy", "objective/scores"):
            assert row_on[key] == pytest.approx(row_off[key], rel=1e-4, abs=1e-6), key


def test_grpo_config_errors_name_the_field(tmp_path):
    with pytest.raises(ConfigError, match=r"grpo\.group_size"):
        grpo_cfg(tmp_path, "grpo.group_size=3")
    with pytest.raises(ConfigError, match=r"grpo\.eps: must be > 0 while grpo.normalize_std"):
        grpo_cfg(tmp_path, "grpo.eps=0")
    grpo_cfg(tmp_path, "grpo.eps=0", "grpo.normalize_std=false")  # nothing divides then
    with pytest.raises(ConfigError, match=r"model\.value_model"):
        grpo_cfg(tmp_path, "model.value_model=shared")
    with pytest.raises(ConfigError, match=r"model\.value_model: PPO needs a critic"):
        load_config(
            overrides=[
                "model.value_model=none",
                "reward.functions={'rlhflab.builtin.toy_rewards:vowel_reward': 1}",
            ]
        )


def dpo_cfg(tmp_path, *over, out="dpo"):
    base = {
        **DPO_BASE,
        "device": "cpu",
        "model": {"policy": "preset:tiny", "value_model": "none"},
        "dpo": {"pairs": 200, "steps": 4, "batch_size": 16, "lr": 1e-3},
        "log": {"output_dir": str(tmp_path / out), "progress": False, "checkpoint_every": 2},
    }
    return load_config(base=base, overrides=list(over), stage="dpo")


def test_dpo_starts_at_log2_and_learns_the_preferences(tmp_path):
    t = DPOTrainer(dpo_cfg(tmp_path, "dpo.steps=30"))
    first = t.step()  # policy == reference: zero implicit rewards, loss log 2
    assert first["loss"] == pytest.approx(0.6931, abs=1e-4)
    assert first["rewards/margin"] == pytest.approx(0.0, abs=1e-6)
    assert first["rewards/accuracy"] == 0.5  # every pair a tie, each counted half (not 0)
    t.fit()
    rows = read_jsonl(tmp_path / "dpo" / "metrics.jsonl")
    acc = [r["rewards/accuracy"] for r in rows]
    assert sum(acc[-5:]) / 5 > 0.6 and rows[-1]["rewards/margin"] > 0


@pytest.mark.parametrize("runtime", ["transformers", "native"])
def test_dpo_resume_is_bit_identical_and_ipo_runs(tmp_path, runtime):
    rt = f"model.runtime={runtime}"
    straight = DPOTrainer(dpo_cfg(tmp_path, rt, out="a"))
    straight.fit()
    half = DPOTrainer(dpo_cfg(tmp_path, rt, out="b"))
    half.cfg.dpo.steps = 2
    half.fit()
    resumed = DPOTrainer(dpo_cfg(tmp_path, rt, out="b"))
    resumed.fit(resume=True)
    for a, b in zip(straight.policy.state_dict().values(), resumed.policy.state_dict().values()):
        assert torch.equal(a, b)
    ipo = DPOTrainer(dpo_cfg(tmp_path, rt, "dpo.loss_type=ipo", "dpo.steps=1", out="ipo")).fit()
    assert ipo["last"]["loss"] == pytest.approx((1 / (2 * 0.1)) ** 2, rel=1e-4)


def test_each_command_s_own_defaults_live_in_the_config_tree():
    """rlhflab grpo/rloo/dpo defaults come from config.stages.STAGE_DEFAULTS (they wrote to
    runs/ppo before); a base, file or override wins field by field."""
    from rlhflab.config import load_config

    reward = {"functions": {"rlhflab.builtin.toy_rewards:vowel_reward": 1.0}}
    for stage in ("grpo", "rloo"):
        cfg = load_config(base={"reward": reward}, stage=stage)
        assert cfg.log.output_dir == f"runs/{stage}"
        assert cfg.ppo.advantage_estimator == stage and cfg.model.value_model == "none"
        assert (cfg.ppo.kl_placement, cfg.ppo.kl_estimator, cfg.ppo.kl_coef) == ("loss", "k3", 0.04)
        # one field of a section set by the caller keeps the stage's other fields of it
        cfg = load_config(base={"reward": reward, "ppo": {"kl_coef": 0.1}}, stage=stage)
        assert (cfg.ppo.kl_coef, cfg.ppo.kl_estimator) == (0.1, "k3")
        cfg = load_config(
            base={"reward": reward}, overrides=["log.output_dir=elsewhere"], stage=stage
        )
        assert cfg.log.output_dir == "elsewhere"
    assert load_config(stage="dpo").log.output_dir == "runs/dpo"
    assert load_config(base={"reward": reward}).log.output_dir == "runs/ppo"
