"""Guards of the reward (issue #29): ensembles, PAR shaping, ODIN's length head."""

import json
import math

import pytest
import torch

from rlhflab.config import ConfigError, load_config
from rlhflab.core import guards as G
from rlhflab.diagnostics.monitor import HackingMonitor
from rlhflab.experience.ensemble import SCORE, SPREAD, EnsembleReward
from rlhflab.experience.rewards import RewardBatch, default_head_weights
from rlhflab.trainers.ppo import PPOTrainer
from rlhflab.trainers.rm_ensemble import train_rm
from tests.maths_helpers import rand

# ------------------------------------------------------------------ the maths, vs float64 loops


def _loop_combine(scores, mode, lam):
    k, b = scores.shape
    out = []
    for j in range(b):
        col = [scores[i][j].item() for i in range(k)]
        mean = sum(col) / k
        var = sum((c - mean) ** 2 for c in col) / k
        out.append({"mean": mean, "wco": min(col), "uwo": mean - lam * var}[mode])
    return torch.tensor(out, dtype=torch.float64)


@pytest.mark.parametrize("mode", ["mean", "wco", "uwo"])
def test_ensemble_combine_matches_a_loop(mode):
    scores = rand(4, 7, seed=3)
    got = G.ensemble_combine(scores, mode, 0.7)
    torch.testing.assert_close(got, _loop_combine(scores, mode, 0.7))


def test_ensemble_spread_matches_a_loop_and_is_zero_when_members_agree():
    scores = rand(3, 5, seed=1)
    want = [
        math.sqrt(
            sum((scores[i][j].item() - scores[:, j].mean().item()) ** 2 for i in range(3)) / 3
        )
        for j in range(5)
    ]
    torch.testing.assert_close(G.ensemble_spread(scores), torch.tensor(want, dtype=torch.float64))
    same = torch.ones(3, 1, dtype=torch.float64) * rand(1, 5, seed=2)
    assert G.ensemble_spread(same).abs().max() < 1e-12
    # worst case ≤ uwo ≤ mean whenever members disagree (λ small)
    assert (G.ensemble_combine(scores, "wco", 0) <= G.ensemble_combine(scores, "mean", 0)).all()
    with pytest.raises(ValueError, match="unknown mode"):
        G.ensemble_combine(scores, "max", 0.0)


def test_par_shape_is_a_sigmoid_of_the_gap_to_the_reference():
    r, r_ref = rand(9, seed=4) * 3, rand(9, seed=5)
    want = torch.tensor([1 / (1 + math.exp(-(a - b))) for a, b in zip(r.tolist(), r_ref.tolist())])
    torch.testing.assert_close(G.par_shape(r, r_ref), want.double())
    # bounded and saturating: far past the reference, pushing further earns ~nothing
    zero = torch.zeros(1, dtype=torch.float64)
    far = G.par_shape(torch.tensor([11.0], dtype=torch.float64), zero)
    assert far < 1.0 and far - G.par_shape(torch.tensor([10.0], dtype=torch.float64), zero) < 1e-4
    assert G.par_shape(zero, zero).item() == 0.5  # as good as the reference: the midpoint
    with pytest.raises(ValueError, match="differ in shape"):
        G.par_shape(r, r_ref[:3])


# ------------------------------------------------------------------ head weights and the ensemble


def test_a_length_head_gets_weight_zero_unless_named():
    assert default_head_weights(["preference", "length"], {}) == {"preference": 1.0, "length": 0.0}
    named = default_head_weights(["preference", "length"], {"length": 0.5})
    assert named == {"preference": 0.0, "length": 0.5}
    # and the report draws it as PPO weighs it: outside the optimised score, unless named
    from rlhflab.app.report_sections import head_weights

    names = ["rm/preference", "rm/length", "missing_eos_penalty"]
    assert head_weights({"reward": {}}, names) == dict(zip(names, [1.0, None, 1.0]))
    named = head_weights({"reward": {"heads": {"length": 0.5}}}, names)
    assert named == dict(zip(names, [None, 0.5, 1.0]))


class _FakeMember:
    def __init__(self, name, table):
        self.name, self.head_names, self.table = name, list(table), table

    def __call__(self, batch):
        return {f"{self.name}/{h}": torch.tensor(v) for h, v in self.table.items()}


def test_ensemble_reward_combines_weighted_head_sums_per_answer():
    m0 = _FakeMember("rm0", {"a": [1.0, 2.0], "b": [0.0, 1.0]})
    m1 = _FakeMember("rm1", {"a": [3.0, 2.0], "b": [1.0, 1.0]})
    ens = EnsembleReward([m0, m1], {"a": 1.0, "b": 2.0}, "wco", 0.0)
    out = ens(RewardBatch(["p", "q"], ["x", "y"]))
    # member sums: rm0 [1, 4], rm1 [5, 4]
    torch.testing.assert_close(out["ensemble/member0"], torch.tensor([1.0, 4.0]))
    torch.testing.assert_close(out[SCORE], torch.tensor([1.0, 4.0]))
    torch.testing.assert_close(out[SPREAD], torch.tensor([2.0, 0.0]))
    torch.testing.assert_close(out["rm/a"], torch.tensor([2.0, 2.0]))
    bad = _FakeMember("rm2", {"a": [0.0, 0.0], "b": [0.0, 0.0]})
    bad.head_names = ["a"]
    with pytest.raises(Exception, match=r"reward.ensemble\[1\]"):
        EnsembleReward([m0, bad], {}, "mean", 0.0)


def test_centred_members_lose_their_offsets_but_keep_their_disagreement():
    # rm1 is rm0 plus 10 on every answer (a Bradley-Terry offset) and disagrees on answer 1
    m0 = _FakeMember("rm0", {"a": [1.0, 2.0, 3.0]})
    m1 = _FakeMember("rm1", {"a": [11.0, 12.0, 15.0]})
    ens = EnsembleReward([m0, m1], {"a": 1.0}, "wco", 0.0)
    batch = RewardBatch(["p", "q", "r"], ["x", "y", "z"])
    torch.testing.assert_close(ens(batch)[SCORE], torch.tensor([1.0, 2.0, 3.0]))  # rm0 always
    # centred on answers where rm1 reads 10 more: offsets ∓5 about the members' average
    offsets = ens.set_offsets(torch.tensor([2.0, 12.0]))
    torch.testing.assert_close(offsets, torch.tensor([-5.0, 5.0]))
    out = ens(batch)
    torch.testing.assert_close(out["ensemble/member1"], torch.tensor([6.0, 7.0, 10.0]))
    torch.testing.assert_close(out[SCORE], torch.tensor([6.0, 7.0, 8.0]))  # min, level kept
    torch.testing.assert_close(out[SPREAD], torch.tensor([0.0, 0.0, 1.0]))  # only answer 2
    torch.testing.assert_close(out["rm/a"], torch.tensor([6.0, 7.0, 9.0]))  # heads uncentred
    with pytest.raises(Exception, match="reward.ensemble_center"):
        ens.set_offsets(torch.tensor([1.0, 2.0, 3.0]))


@pytest.mark.parametrize(
    "over, match",
    [
        (["reward.model=x", "reward.ensemble=['a', 'b']"], "not both"),
        (["reward.ensemble=['a']"], "one member"),
        (["reward.ensemble=['a', 'b']", "reward.ensemble_combine=max"], "ensemble_combine"),
        (["reward.ensemble=['a', 'b']", "reward.uwo_lambda=-1"], "uwo_lambda"),
        (["reward.functions={'m:f': 1}", "reward.shaping=clip"], "reward.shaping"),
        (["reward.functions={'m:f': 1}", "monitor.ensemble_spread=0"], "monitor.ensemble_spread"),
        # 0 turned the KL signal off silently, a negative limit could never alert
        (["reward.functions={'m:f': 1}", "monitor.kl_limit=0"], "monitor.kl_limit"),
        (["reward.functions={'m:f': 1}", "monitor.entropy_ratio=-1"], "monitor.entropy_ratio"),
    ],
)
def test_invalid_guard_settings_are_refused_naming_the_field(over, match):
    with pytest.raises(ConfigError, match=match):
        load_config(overrides=over)


def test_rm_refuses_a_head_named_length_with_the_length_head():
    with pytest.raises(ConfigError, match="rm.heads"):
        load_config(overrides=["rm.length_head=true", "rm.heads={'length': 1}"], stage="rm")


def test_ensemble_spread_signal_alerts_when_disagreement_grows():
    cfg = load_config(overrides=["reward.functions={'m:f': 1}", "monitor.warmup_iterations=0"])
    mon = HackingMonitor(cfg.monitor)
    from tests.test_monitor import fake_rollout

    ro = fake_rollout(["a", "b"], [2.0, 1.0], [2, 3])  # score falls with length
    base = {"objective/scores": 1.0, "objective/kl": 0.0, "policy/entropy": 1.0}
    first = mon.signals(ro, {**base, "objective/ensemble_std": 0.2})
    assert first["ensemble_spread"] == 1.0 and mon.check(1, first) == []
    later = mon.signals(ro, {**base, "objective/ensemble_std": 0.5})
    assert later["ensemble_spread"] == pytest.approx(2.5)
    assert [a.signal for a in mon.check(2, later)] == ["ensemble_spread"]
    assert "ensemble_spread" not in mon.signals(ro, base)  # no ensemble, no signal
    # identical members at first (spread 0), a NaN entropy: the ratios wait for a first
    # finite, positive value instead of reading 1.0 for the whole run
    mon = HackingMonitor(cfg.monitor)
    nan = {**base, "policy/entropy": math.nan}
    assert mon.signals(ro, {**nan, "objective/ensemble_std": 0.0})["ensemble_spread"] == 1.0
    assert mon.signals(ro, {**base, "objective/ensemble_std": 0.4})["ensemble_spread"] == 1.0
    grown = mon.signals(ro, {**base, "policy/entropy": 0.1, "objective/ensemble_std": 1.2})
    assert grown["ensemble_spread"] == pytest.approx(3.0)
    assert grown["entropy_ratio"] == pytest.approx(0.1)
    assert sorted(a.signal for a in mon.check(3, grown)) == ["ensemble_spread", "entropy_ratio"]


# ------------------------------------------------------------------ end to end, tiny


def _ppo_cfg(tmp_path, *over, reward=None):
    base = {
        "device": "cpu",
        "threads": 1,
        "model": {"policy": "preset:nano", "value_model": "separate"},
        "reward": reward or {"functions": {"rlhflab.builtin.toy_rewards:vowel_reward": 1.0}},
        "rollout": {"prompts_per_iteration": 8, "max_new_tokens": 6},
        "ppo": {"iterations": 1, "epochs": 1, "lr": 1e-4},
        "log": {"output_dir": str(tmp_path / "run"), "progress": False},
        "monitor": {"warmup_iterations": 0},
    }
    return load_config(base=base, overrides=list(over))


def test_par_shapes_the_reward_against_the_reference_answers_sampled_once(tmp_path, monkeypatch):
    from rlhflab.builtin.toy_rewards import vowel_reward
    from rlhflab.trainers import ppo_watch

    calls = []
    real = ppo_watch.generate_rollout
    monkeypatch.setattr(
        ppo_watch, "generate_rollout", lambda *a, **k: calls.append(1) or real(*a, **k)
    )
    trainer = PPOTrainer(_ppo_cfg(tmp_path, "reward.shaping=par", "monitor.reference_every=1"))
    metrics = trainer.step()
    assert len(calls) == 1  # PAR and the monitor's length signal share one sample
    ro, ref = trainer.last_rollout, trainer.watch._reference[1]
    assert ref.prompts == ro.prompts
    ref_scores = torch.tensor(vowel_reward(ref.prompts, ref.responses))
    assert metrics["objective/reference_scores"] == pytest.approx(ref_scores.mean().item())
    shaped = torch.sigmoid(ro.scores - ref_scores).mean().item()
    assert metrics["objective/shaped_scores"] == pytest.approx(shaped, abs=1e-6)
    assert "monitor/length_ratio" in metrics


def test_rm_trains_an_ensemble_and_ppo_scores_with_it(tmp_path):
    rm_cfg = load_config(
        overrides=[
            "model.policy=preset:nano",
            "threads=1",
            "rm.steps=3",
            "rm.pairs=24",
            "rm.batch_size=4",
            "rm.heldout_fraction=0.25",
            "rm.ensemble_size=2",
            "rm.length_head=true",
            f"rm.output_dir={tmp_path / 'rm'}",
            "log.progress=false",
        ],
        stage="rm",
    )
    out = train_rm(rm_cfg)
    folders = out["ensemble"]
    assert folders == [str(tmp_path / "rm" / f"member-{i}") for i in range(2)]
    cfgs = [
        json.loads((tmp_path / "rm" / f"member-{i}" / "config.json").read_text()) for i in (0, 1)
    ]
    assert all(c["id2label"]["4"] == "length" for c in cfgs)  # after the four default heads
    assert all(c["odin_exempt"] == ["brevity"] for c in cfgs)  # what a refresh reads back
    reward = {"ensemble": folders, "ensemble_combine": "uwo", "uwo_lambda": 1.0}
    trainer = PPOTrainer(_ppo_cfg(tmp_path, reward=reward))
    metrics = trainer.step()
    comps = trainer.last_rollout.components
    stack = torch.stack([comps["ensemble/member0"], comps["ensemble/member1"]])
    assert metrics["objective/ensemble_std"] > 0  # two seeds, two different models
    torch.testing.assert_close(comps[SCORE], stack.mean(0) - stack.var(0, unbiased=False))
    torch.testing.assert_close(trainer.last_rollout.scores, comps[SCORE])
    assert metrics["monitor/ensemble_spread"] == 1.0  # the first iteration is the baseline
    assert "reward-1" in trainer.cast.models()
    # the length head is left out of each member's sum: member 0's sum is its four heads',
    # less its offset (reward.ensemble_center=reference by default)
    heads = ["preference", "correctness", "brevity", "politeness"]
    (ens,) = [s for s, _ in trainer.cast.reward.sources if isinstance(s, EnsembleReward)]
    torch.testing.assert_close(
        comps["ensemble/member0"],
        sum(_member_head(trainer, 0, h) for h in heads) - ens.offsets[0],
    )
    # the offsets centre the members on the reference's answers to the same prompts
    ref = trainer.watch._reference[1]
    assert ref.prompts == trainer.last_rollout.prompts
    sums, _ = ens.member_sums(
        RewardBatch(ref.prompts, ref.responses, ref.sequences, ref.attention_mask, ref.ended)
    )
    means = sums.double().mean(1)
    torch.testing.assert_close(ens.offsets, (means - means.mean()).float())
    assert ens.offsets.abs().max() > 0  # two seeds, two offsets
    spread = (ens.offsets.max() - ens.offsets.min()).item()
    assert metrics["objective/ensemble_offset_range"] == pytest.approx(spread)
    # 'none' scores with the members as they are
    raw_run = f"log.output_dir={tmp_path / 'raw'}"
    raw = PPOTrainer(_ppo_cfg(tmp_path, raw_run, reward={**reward, "ensemble_center": "none"}))
    raw.step()
    (raw_ens,) = [s for s, _ in raw.cast.reward.sources if isinstance(s, EnsembleReward)]
    assert raw_ens.offsets is None
    torch.testing.assert_close(
        raw.last_rollout.components["ensemble/member0"],
        sum(_member_head(raw, 0, h) for h in heads),
    )


def _member_head(trainer, i, head):
    (ens,) = [s for s, _ in trainer.cast.reward.sources if isinstance(s, EnsembleReward)]
    ro = trainer.last_rollout
    batch = RewardBatch(ro.prompts, ro.responses, ro.sequences, ro.attention_mask, ro.ended)
    return ens.members[i](batch)[f"rm{i}/{head}"]


@pytest.mark.parametrize(
    "over, stage, match",
    [
        (["rm.length_exempt=['brevity']"], "rm", "rm.length_exempt: .* rm.length_head is off"),
        (
            [
                "reward.functions={'m:f': 1}",
                "monitor.response=raise_kl",
                "monitor.kl_coef_max=0.01",
            ],
            "ppo",
            r"monitor.kl_coef_max: 0.01 is not above ppo.kl_coef",
        ),
    ],
)
def test_settings_that_would_do_nothing_are_refused(over, stage, match):
    with pytest.raises(ConfigError, match=match):
        load_config(overrides=["model.policy=preset:nano", *over], stage=stage)


def test_centring_leaves_a_non_finite_score_out_of_its_members_mean(caplog):
    from types import SimpleNamespace

    from rlhflab.trainers.ppo_guards import center_ensemble

    m0 = _FakeMember("rm0", {"a": [1.0, float("nan"), 3.0]})  # mean of the finite: 2
    m1 = _FakeMember("rm1", {"a": [4.0, 6.0, 8.0]})  # mean 6
    ens = EnsembleReward([m0, m1], {"a": 1.0}, "wco", 0.0)
    ref = SimpleNamespace(prompts=["p"] * 3, responses=["x"] * 3, sequences=None)
    ref.attention_mask, ref.ended = None, None
    cast = SimpleNamespace(reward=SimpleNamespace(sources=[(ens, {SCORE: 1.0})]))
    watch = SimpleNamespace(reference_rollout=lambda rollout, it: ref)
    ctx = SimpleNamespace(enabled=False)
    metrics = center_ensemble(cast, watch, ctx, None, 0)
    torch.testing.assert_close(ens.offsets, torch.tensor([-2.0, 2.0]))
    assert metrics["objective/ensemble_offset_range"] == pytest.approx(4.0)
    # a member with no finite score at all: no centring this iteration, and a warning
    m0.table = {"a": [float("nan")] * 3}
    center_ensemble(cast, watch, ctx, None, 4)
    torch.testing.assert_close(ens.offsets, torch.zeros(2))
    assert "not centred this iteration" in caplog.text and "iteration 5" in caplog.text
