"""Reward-model refresh (reward.refresh_every, issue #29): the settings it refuses, a refresh
that trains the reward model and logs it at the right iterations, a user's labeller, and a
resume that stays bit-identical across refreshes."""

import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForSequenceClassification

from rlhflab.config import ConfigError, load_config
from rlhflab.experience.rewards import RewardError
from rlhflab.infra import checkpoint as C
from rlhflab.infra.runlog import read_jsonl
from rlhflab.trainers.ppo import PPOTrainer
from rlhflab.trainers.ppo_refresh import head_targets
from rlhflab.trainers.rm import pair_loss
from tests import reward_fns

VOLATILE = ("time/", "throughput/", "memory/")
REFRESH_KEYS = {
    "refresh/pairs",
    "refresh/pool",
    "refresh/rm_loss",
    "refresh/rm_accuracy_before",
    "refresh/rm_accuracy_after",
    "time/refresh",
}


def _cfg(tmp_path, rm_folder, *over, out="run"):
    base = {
        "device": "cpu",
        "threads": 1,
        "model": {"policy": "preset:nano", "value_model": "separate"},
        "reward": {"model": str(rm_folder), "refresh_every": 2, "refresh_steps": 3},
        "rollout": {"prompts_per_iteration": 8, "max_new_tokens": 6},
        "ppo": {"iterations": 4, "epochs": 1, "lr": 1e-3, "critic_lr": 1e-3},
        "rm": {"pairs": 40, "batch_size": 4},
        "log": {"output_dir": str(tmp_path / out), "progress": False, "checkpoint_every": 1},
    }
    base["reward"].update({"refresh_batch_size": 4, "refresh_lr": 1e-3})
    return load_config(base=base, overrides=list(over))


def _pool_loss(trainer, model, heads=("correctness", "brevity", "politeness")) -> float:
    """Bradley-Terry loss of ``model`` on every fresh pair the refreshes labelled."""
    pairs, heads = trainer.refresh.fresh, list(heads)
    tokenizer = trainer.refresh.models["reward"].tokenizer
    with torch.no_grad():
        loss, _ = pair_loss(
            model, tokenizer, pairs, head_targets(pairs, heads), [1.0] * len(heads), None, "cpu"
        )
    return loss.item()


def _rows(folder):
    return [
        {k: v for k, v in r.items() if not k.startswith(VOLATILE)}
        for r in read_jsonl(folder / "metrics.jsonl")
    ]


# ------------------------------------------------------------------ settings it refuses


@pytest.mark.parametrize(
    "over, match",
    [
        (["reward.model=rm", "reward.refresh_every=-1"], "reward.refresh_every"),
        (
            ["reward.functions={'m:f': 1}", "reward.refresh_every=5"],
            "reward.refresh_every.*Python functions only",
        ),
        (["reward.model=rm", "reward.refresh_labeller=m:f"], "reward.refresh_labeller: only"),
        (
            ["reward.model=rm", "reward.refresh_every=5", "data.prompts=p.jsonl"],
            "reward.refresh_every: no labeller",
        ),
        (
            ["reward.model=rm", "reward.refresh_every=5", "model.reward_precision=int8"],
            "reward.refresh_every.*quantised",
        ),
        (
            ["reward.model=rm", "reward.refresh_every=5", "model.reward_precision=bf16"],
            "reward.refresh_every.*16 bits",
        ),
        (
            ["reward.model=rm", "reward.refresh_every=5", "reward.refresh_labeller=nocolon"],
            "reward.refresh_labeller: expected 'module:function'",
        ),
        (
            ["reward.model=rm", "reward.refresh_every=5", "reward.refresh_replay=1.5"],
            "reward.refresh_replay",
        ),
        (
            ["reward.model=rm", "reward.refresh_every=5", "reward.refresh_replay=0.97"],
            "reward.refresh_replay: .*no fresh pair",
        ),
        (
            [
                "reward.model=rm",
                "reward.refresh_every=5",
                "reward.refresh_batch_size=1",
                "reward.refresh_replay=0.4",
            ],
            "reward.refresh_replay: .*no replayed pair",
        ),
        (["reward.model=rm", "reward.refresh_every=5", "reward.refresh_lr=0"], "reward.refresh_lr"),
        (
            ["reward.model=rm", "reward.refresh_every=5", "reward.refresh_steps=0"],
            "reward.refresh_steps",
        ),
        (
            [
                "reward.model=rm",
                "reward.refresh_every=5",
                "data.prompts=p.jsonl",
                "reward.refresh_labeller=m:f",
            ],
            "reward.refresh_replay: .*rm.data",
        ),
    ],
)
def test_invalid_refresh_settings_are_refused_naming_the_field(over, match):
    with pytest.raises(ConfigError, match=match):
        load_config(overrides=over)


def test_refresh_is_off_by_default_and_zero_is_off():
    assert load_config(overrides=["reward.model=rm"]).reward.refresh_every is None
    cfg = load_config(overrides=["reward.functions={'m:f': 1}", "reward.refresh_every=0"])
    assert cfg.reward.refresh_every == 0  # off: a functions-only reward is then fine


# ------------------------------------------------------------------ end to end, nano


def test_a_refresh_trains_the_reward_model_and_logs_at_its_iterations(tmp_path, nano_rm):
    cfg = _cfg(tmp_path, nano_rm, "reward.refresh_replay=0", "reward.refresh_steps=10")
    trainer = PPOTrainer(cfg)
    rm = trainer.refresh.models["reward"].model
    before = {k: v.clone() for k, v in rm.state_dict().items()}
    trainer.fit()
    rows = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert [REFRESH_KEYS <= set(r) for r in rows] == [False, True, False, True]
    assert not any(k.startswith("refresh/") for k in {**rows[0], **rows[2]})
    p2, p4 = rows[1]["refresh/pairs"], rows[3]["refresh/pairs"]
    assert 0 < p2 <= 8 and 0 < p4 <= 8  # one pair per prompt, identical answers dropped
    assert rows[3]["refresh/pool"] == p2 + p4 == len(trainer.refresh.fresh)
    # the fresh pairs are the built-in annotator's: attribute labels of a ≻ b in {0, ½, 1}
    assert all(
        set(p.labels) == {"preference", "correctness", "brevity", "politeness"}
        for p in trainer.refresh.fresh
    )
    # the reward model PPO scores with is the trained one: its weights moved, and it fits
    # the labels of the pairs it was refreshed on (replay 0: those alone) better than before
    changed = [k for k, v in rm.state_dict().items() if not torch.equal(v, before[k])]
    assert "score.weight" in changed and len(changed) > 5
    assert not any(p.requires_grad for p in rm.parameters())  # frozen again
    original = AutoModelForSequenceClassification.from_pretrained(nano_rm)
    assert _pool_loss(trainer, rm) < _pool_loss(trainer, original) - 0.02
    assert trainer.cast.reward.sources[0][0].model is rm
    # the last checkpoint holds the refreshed reward model as a whole reward.model folder
    saved = tmp_path / "run" / "checkpoints" / "step-4" / "reward"
    assert json.loads((saved / "config.json").read_text())["id2label"]["0"] == "correctness"
    weights = load_file(str(saved / "model.safetensors"))
    assert torch.equal(weights["score.weight"], rm.state_dict()["score.weight"])


def test_resume_is_bit_identical_across_refreshes(tmp_path, nano_rm):
    """4 iterations, refreshes after 2 and 4. One run straight through; one stopped after 1
    (before the first refresh), resumed and stopped after 3 (after it, before the second),
    then resumed to the end: the same metrics, policy and reward model."""
    straight = PPOTrainer(_cfg(tmp_path, nano_rm, out="a"))
    straight.fit()
    for stop in (1, 3, 4):
        t = PPOTrainer(_cfg(tmp_path, nano_rm, out="b"))
        t.cfg.ppo.iterations = stop  # as if killed after its checkpoint
        t.fit(resume=stop > 1)
    assert _rows(tmp_path / "a") == _rows(tmp_path / "b")
    assert len(_rows(tmp_path / "b")) == 4
    for name in ("policy", "reward"):
        a = straight.cast.models()[name].state_dict()
        b = t.cast.models()[name].state_dict()
        assert all(torch.equal(a[k], b[k]) for k in a), name
    assert [p.prompt for p in straight.refresh.fresh] == [p.prompt for p in t.refresh.fresh]
    # resumed with the refresh switched off, the run keeps the refreshed reward model (it
    # must not silently score with the one from before the refreshes)
    off = PPOTrainer(_cfg(tmp_path, nano_rm, "reward.refresh_every=0", "log.keep_last=1", out="b"))
    off.cfg.ppo.iterations = 6
    off.fit(resume=True)
    a = straight.cast.models()["reward"].state_dict()
    b = off.cast.models()["reward"].state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    # and its own checkpoints keep it: the ones holding it were pruned (keep_last), and a
    # resume from step-6 read the reward model from before the refreshes
    newest = tmp_path / "b" / "checkpoints" / "step-6"
    assert [p.name for p in C.list_checkpoints(tmp_path / "b")] == ["step-6"]
    again = PPOTrainer(_cfg(tmp_path, nano_rm, "reward.refresh_every=0", out="b"))
    again.cast.models()["reward"].load_state_dict(
        {k: torch.zeros_like(v) for k, v in again.cast.models()["reward"].state_dict().items()}
    )
    again.checkpoints.load(newest)
    c = again.cast.models()["reward"].state_dict()
    assert all(torch.equal(a[k], c[k]) for k in a)


# ------------------------------------------------------------------ a user's labeller


def _prompt_file(tmp_path):
    path = tmp_path / "prompts.jsonl"
    rows = [{"prompt": f"copy: {w}\nanswer:"} for w in ("red", "blue", "cat", "dog", "sun")]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows * 4))
    return path


def test_a_module_function_labeller_labels_the_fresh_pairs(tmp_path, nano_rm):
    reward_fns.LABELLED.clear()
    cfg = _cfg(
        tmp_path,
        nano_rm,
        f"data.prompts={_prompt_file(tmp_path)}",
        "reward.refresh_labeller=tests.reward_fns:prefer_shorter",
        "reward.refresh_replay=0",
        "reward.refresh_every=1",
        "ppo.iterations=2",
    )
    trainer = PPOTrainer(cfg)
    trainer.fit()
    rows = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert all("refresh/rm_loss" in r for r in rows)  # reward.refresh_every=1
    assert len(reward_fns.LABELLED) == 2  # one call per refresh
    fresh = trainer.refresh.fresh
    assert sum(len(call[0]) for call in reward_fns.LABELLED) == len(fresh)
    for prompts, a, b in reward_fns.LABELLED:
        assert all(q.startswith("copy: ") for q in prompts) and len(prompts) == len(a) == len(b)
    # its dict named the 'brevity' head: that label is each pair's, oriented a vs b
    labelled = [(q, x, y) for call in reward_fns.LABELLED for q, x, y in zip(*call)]
    assert [(p.prompt, p.chosen, p.rejected) for p in fresh] == labelled
    want = reward_fns.prefer_shorter(*zip(*labelled))["brevity"]
    assert [p.labels for p in fresh] == [{"brevity": v} for v in want]


def test_a_labeller_that_returns_bad_labels_is_named(tmp_path, nano_rm):
    base = [
        f"data.prompts={_prompt_file(tmp_path)}",
        "reward.refresh_replay=0",
        "reward.refresh_every=1",
        "ppo.iterations=1",
    ]
    trainer = PPOTrainer(
        _cfg(tmp_path, nano_rm, *base, "reward.refresh_labeller=tests.reward_fns:too_few_labels")
    )
    with pytest.raises(RewardError, match="reward.refresh_labeller .*too_few_labels: 1 labels"):
        trainer.step()
    # a plain list labels the head 'preference', which this model does not have: refused,
    # even where replayed pairs (built-in task, refresh_replay 0.5) would give a loss
    always = ["reward.refresh_labeller=tests.reward_fns:a_always", "reward.refresh_every=1"]
    trainer = PPOTrainer(_cfg(tmp_path, nano_rm, *always, "ppo.iterations=1"))
    assert trainer.refresh.replay
    with pytest.raises(RewardError, match="none of the reward model's heads"):
        trainer.step()
    with pytest.raises(ConfigError, match="reward.refresh_labeller: .*no_such"):
        PPOTrainer(
            _cfg(tmp_path, nano_rm, *base, "reward.refresh_labeller=tests.reward_fns:no_such")
        )


def test_heads_the_built_in_annotator_does_not_label_are_named_without_blaming_a_labeller(
    tmp_path,
):
    from rlhflab.models.presets import build_preset

    rm = build_preset("nano", tmp_path / "rm", seed=3, heads=["tone", "style"])
    trainer = PPOTrainer(_cfg(tmp_path, rm, "reward.refresh_every=1", "ppo.iterations=1"))
    with pytest.raises(RewardError, match=r"reward\.refresh_every: the built-in annotator") as e:
        trainer.step()
    assert "['style', 'tone']" in str(e.value) or "['tone', 'style']" in str(e.value)
    assert "set reward.refresh_labeller" in str(e.value)


def test_a_one_head_reward_model_of_another_tokenizer_learns_a_list_labeller(tmp_path, foreign_rm):
    """A plain list labels a one-head model's only head; the answers are re-encoded with
    its own tokenizer; the built-in task's pairs are replayed beside them (refresh_replay)."""
    cfg = _cfg(
        tmp_path,
        foreign_rm,
        "reward.refresh_labeller=tests.reward_fns:a_always",
        "reward.refresh_every=1",
        "reward.refresh_steps=10",
        "ppo.iterations=1",
    )
    trainer = PPOTrainer(cfg)
    assert trainer.refresh.replay and trainer.refresh.models["reward"].reencode
    assert all(p.labels["preference"] == 1.0 for p in trainer.refresh.replay)
    trainer.fit()
    assert all(p.labels == {"preference": 1.0} for p in trainer.refresh.fresh)
    original = AutoModelForSequenceClassification.from_pretrained(foreign_rm)
    rm = trainer.refresh.models["reward"].model
    assert _pool_loss(trainer, rm, ["score"]) < _pool_loss(trainer, original, ["score"]) - 0.02


def test_each_member_of_an_ensemble_is_refreshed_and_checkpointed(tmp_path, nano_rm):
    """Both members are fine-tuned on the fresh pairs and saved in the checkpoint; offloaded
    frozen models (model.offload_frozen) train in place too."""
    from rlhflab.models import Offloaded
    from rlhflab.models.presets import build_preset

    heads = ["correctness", "brevity", "politeness"]
    other = build_preset("nano", tmp_path / "rm2", seed=2, heads=heads)
    cfg = _cfg(
        tmp_path,
        nano_rm,
        "reward.model=null",
        f"reward.ensemble=['{nano_rm}', '{other}']",
        "reward.refresh_every=1",
        "ppo.iterations=1",
        "model.offload_frozen=true",
    )
    trainer = PPOTrainer(cfg)
    members = trainer.refresh.models
    assert sorted(members) == ["reward-0", "reward-1"]
    assert all(isinstance(m.model, Offloaded) for m in members.values())
    trainer.fit()
    step = tmp_path / "run" / "checkpoints" / "step-1"
    for name, folder in (("reward-0", nano_rm), ("reward-1", other)):
        original = load_file(str(folder / "model.safetensors"))["score.weight"]
        saved = load_file(str(step / name / "model.safetensors"))["score.weight"]
        assert not torch.equal(saved, original), name
        assert torch.equal(saved, members[name].model.model.score.weight), name
    rows = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert REFRESH_KEYS <= set(rows[0])


def test_replayed_pairs_too_long_for_the_reward_model_are_named(tmp_path, nano_rm):
    """The refresh replays rm.data's pairs: each must fit the reward model's positions, as
    `rlhflab rm` checks them (a learned position table fails deep in its forward else)."""
    from rlhflab.experience.data import DataError

    pairs = tmp_path / "pairs.jsonl"
    long = {"prompt": "copy: a\nanswer:", "chosen": " a", "rejected": " a" * 600}
    pairs.write_text("".join(json.dumps(r) + "\n" for r in [long] * 10))
    cfg = _cfg(tmp_path, nano_rm, f"rm.data={pairs}", "reward.refresh_replay=0.5")
    with pytest.raises(
        DataError, match=f"{pairs}:1: prompt \\+ 'rejected' \\+ EOS is .* over the 512"
    ):
        PPOTrainer(cfg)
