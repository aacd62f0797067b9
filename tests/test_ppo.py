"""The PPO trainer end to end on the nano preset (seconds per test)."""

import json

import pytest
import torch

from rlhflab.config import ConfigError, load_config
from rlhflab.experience.data import DataError, load_prompts
from rlhflab.infra.runlog import read_jsonl
from rlhflab.trainers.common import TrainingHalted
from rlhflab.trainers.ppo import PPOTrainer

VOLATILE = ("time/", "throughput/", "memory/")


def make_cfg(tmp_path, *overrides):
    base = {
        "device": "cpu",
        "model": {"policy": "preset:nano", "value_model": "separate"},
        "reward": {"functions": {"rlhflab.builtin.toy_rewards:vowel_reward": 1.0}},
        "rollout": {"prompts_per_iteration": 8, "max_new_tokens": 8},
        "ppo": {"iterations": 4, "epochs": 2, "minibatches": 2, "lr": 1e-3, "critic_lr": 1e-3},
        "log": {"output_dir": str(tmp_path / "run"), "progress": False, "checkpoint_every": 2},
    }
    return load_config(base=base, overrides=list(overrides))


def test_first_minibatch_ratio_is_one_and_kl_zero(tmp_path):
    for layout in ("separate", "shared"):
        t = PPOTrainer(make_cfg(tmp_path, "ppo.iterations=1", f"model.value_model={layout}"))
        t.fit()
        first = t.first_minibatch
        assert first["policy/ratio_mean"] == pytest.approx(1.0, abs=1e-6)
        assert first["policy/approx_kl"] == pytest.approx(0.0, abs=1e-7)
        assert first["policy/clipfrac"] == 0.0


def test_seeded_run_raises_a_programmatic_reward(tmp_path):
    cfg = make_cfg(
        tmp_path,
        "ppo.iterations=20",
        "rollout.prompts_per_iteration=16",
        "model.policy=preset:tiny",
        "ppo.epochs=4",
        "ppo.kl_coef=0.01",
    )
    PPOTrainer(cfg).fit()
    rows = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    scores = [r["objective/scores"] for r in rows]
    assert len(rows) == 20
    assert sum(scores[-5:]) / 5 > sum(scores[:5]) / 5 + 0.1, scores


def test_large_beta_keeps_kl_small(tmp_path):
    kls = {}
    for beta in (0.0, 5.0):
        cfg = make_cfg(
            tmp_path,
            "ppo.iterations=10",
            f"ppo.kl_coef={beta}",
            "ppo.epochs=4",
            "model.policy=preset:tiny",
            "rollout.prompts_per_iteration=16",
            f"log.output_dir={tmp_path / str(beta)}",
        )
        PPOTrainer(cfg).fit()
        kls[beta] = [r["objective/kl"] for r in read_jsonl(tmp_path / str(beta) / "metrics.jsonl")]
    assert sum(kls[5.0][-5:]) < 0.6 * sum(kls[0.0][-5:]), kls


def test_missing_eos_penalty_applies(tmp_path):
    cfg = make_cfg(
        tmp_path, "ppo.iterations=1", "reward.missing_eos_penalty=0.7", "rollout.max_new_tokens=3"
    )
    t = PPOTrainer(cfg)
    m = t.step()
    ro = t.last_rollout
    assert not ro.ended.all()  # the random model rarely ends within 3 tokens
    expect = ro.scores - 0.7 * (~ro.ended).float()
    assert m["objective/scores"] == pytest.approx(expect.mean().item(), abs=1e-6)
    # the parts the report draws add up to the score: the components and the penalty
    parts = [v for k, v in m.items() if k.startswith("objective/scores/")]
    assert m["objective/scores/missing_eos_penalty"] < 0
    assert sum(parts) == pytest.approx(m["objective/scores"], abs=1e-6)


def test_ignore_eos_gives_every_answer_full_length(tmp_path):
    t = PPOTrainer(make_cfg(tmp_path, "ppo.iterations=1", "rollout.ignore_eos=true"))
    m = t.step()
    assert m["response/count"] == 8 and m["response/tokens"] == 8 * 8
    assert m["response/eos_rate"] == 0.0


def test_resume_is_bit_identical(tmp_path):
    straight = PPOTrainer(make_cfg(tmp_path, f"log.output_dir={tmp_path / 'a'}"))
    straight.fit()
    half = PPOTrainer(make_cfg(tmp_path, f"log.output_dir={tmp_path / 'b'}", "ppo.iterations=4"))
    half.cfg.ppo.iterations = 2  # stop after 2 (a checkpoint at step 2), as if killed
    half.fit()
    resumed = PPOTrainer(make_cfg(tmp_path, f"log.output_dir={tmp_path / 'b'}"))
    resumed.fit(resume=True)
    for a, b in zip(
        straight.cast.policy.state_dict().values(), resumed.cast.policy.state_dict().values()
    ):
        assert torch.equal(a, b)
    for a, b in zip(
        straight.cast.critic.state_dict().values(), resumed.cast.critic.state_dict().values()
    ):
        assert torch.equal(a, b)
    ma = read_jsonl(tmp_path / "a" / "metrics.jsonl")
    mb = read_jsonl(tmp_path / "b" / "metrics.jsonl")
    strip = lambda rows: [{k: v for k, v in r.items() if not k.startswith(VOLATILE)} for r in rows]  # noqa: E731
    assert strip(ma) == strip(mb)


def test_checkpoint_is_a_loadable_hf_folder_and_keeps_last_k(tmp_path):
    from transformers import AutoModelForCausalLM

    PPOTrainer(make_cfg(tmp_path, "log.checkpoint_every=1", "log.keep_last=2")).fit()
    ckpts = sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir())
    assert ckpts == ["step-3", "step-4"]
    AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "checkpoints" / "step-4" / "policy")
    step4 = tmp_path / "run" / "checkpoints" / "step-4"
    state = torch.load(step4 / "state.pt", weights_only=True)
    assert state["iteration"] == 4
    # the optimisers' moments in their own file (a sharded resume reads it on rank 0 only)
    moments = torch.load(step4 / "optimizer.pt", weights_only=True)
    assert set(moments) == {"optim", "critic_optim"} and not set(moments) & set(state)
    assert moments["optim"]["state"]


def test_a_checkpoint_with_its_optimisers_inside_state_pt_still_loads(tmp_path):
    # checkpoints written before 2026-12-05 had no optimizer.pt
    from rlhflab.infra.checkpoint import read_state

    old = {"iteration": 2, "optim": {"state": {}}, "critic_optim": {"state": {}}}
    torch.save(old, tmp_path / "state.pt")
    assert read_state(tmp_path) == old
    assert read_state(tmp_path, optimizers=False) == {"iteration": 2}


def test_nan_reward_is_skipped_then_the_run_halts_with_a_checkpoint(tmp_path):
    cfg = make_cfg(
        tmp_path, "reward.functions={'tests.reward_fns:nan_reward': 1.0}", "ppo.max_bad_updates=2"
    )
    t = PPOTrainer(cfg)
    before = [p.clone() for p in t.cast.policy.parameters()]
    with pytest.raises(TrainingHalted, match="non-finite reward"):
        t.fit()
    for a, b in zip(before, t.cast.policy.parameters()):
        assert torch.equal(a, b)
    assert (tmp_path / "run" / "checkpoints").exists()
    assert t.skipped_total == 2


@pytest.mark.parametrize(
    "override,field",
    [
        ("ppo.clip_low=-1", "ppo.clip_low"),
        ("ppo.lr=fast", "ppo.lr"),
        ("ppo.nope=1", "ppo.nope"),
        ("rollout.top_p=2", "rollout.top_p"),
        ("rollout.sampler=greedy", "rollout.sampler"),
        ("ppo.minibatches=3", "ppo.minibatches"),
        ("ppo.kl_estimator=k2", "ppo.kl_estimator"),
    ],
)
def test_config_errors_name_the_field(tmp_path, override, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        make_cfg(tmp_path, override)


def test_a_kl_in_the_loss_refuses_estimators_without_a_kl_gradient(tmp_path):
    # E_π[∇ log π] = 0: k1 differentiated in the loss adds no KL pull (abs none either),
    # so the penalty would silently vanish
    for est in ("k1", "abs"):
        with pytest.raises(ConfigError, match=r"ppo\.kl_estimator.*'k2', 'k3', 'k3\+'"):
            make_cfg(tmp_path, "ppo.kl_placement=loss", f"ppo.kl_estimator={est}")
    for est in ("k2", "k3", "k3+"):
        assert make_cfg(tmp_path, "ppo.kl_placement=loss", f"ppo.kl_estimator={est}")
    from rlhflab.trainers.grpo import GRPO_BASE

    reward = {"functions": {"rlhflab.builtin.toy_rewards:vowel_reward": 1.0}}
    for stage in ("grpo", "rloo"):  # the group trainers' defaults put a working KL there
        cfg = load_config(base={**GRPO_BASE, "reward": reward}, stage=stage)
        assert (cfg.ppo.kl_placement, cfg.ppo.kl_estimator) == ("loss", "k3")


def test_running_normalisation_of_a_batch_of_equal_scores_trains(tmp_path):
    # the running std of a first batch of equal scores is 0: dividing by it gave NaN (0/0)
    # and a skipped update
    t = PPOTrainer(
        make_cfg(
            tmp_path,
            "ppo.iterations=1",
            "ppo.epochs=1",
            "monitor.enabled=false",
            "reward.normalize=running",
            "reward.functions={'tests.reward_fns:zero_reward': 1.0}",
        )
    )
    m = t.step()
    assert m["faults/skipped_updates"] == 0 and m["val/loss"] == 0.0


def test_a_huge_critic_gradient_leaves_the_policy_update_alone(tmp_path):
    # one clip over both models' joint norm let the critic's gradient shrink the policy's
    # step; each model is clipped by its own norm (veRL, OpenRLHF)
    policies, rows = [], []
    for scale in (1.0, 1e6):
        t = PPOTrainer(
            make_cfg(
                tmp_path,
                "ppo.iterations=1",
                "ppo.epochs=1",
                "ppo.minibatches=1",
                "monitor.enabled=false",
                f"log.output_dir={tmp_path / str(scale)}",
            )
        )
        for q in t.cast.critic.parameters():
            q.register_hook(lambda g, s=scale: g * s)
        rows.append(t.step())
        policies.append([q.detach().clone() for q in t.cast.policy.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*policies))
    assert rows[1]["val/grad_norm"] == pytest.approx(1e6 * rows[0]["val/grad_norm"], rel=1e-4)
    assert rows[1]["policy/grad_norm"] == rows[0]["policy/grad_norm"] > 0


def test_bad_prompt_rows_get_clear_errors(tmp_path):
    from rlhflab.models import load_tokenizer
    from rlhflab.models.presets import preset_path

    tok = load_tokenizer(preset_path("nano"))
    f = tmp_path / "p.jsonl"
    rows = [
        '{"prompt": "copy: cat\\nanswer:"}',
        "{broken",
        '{"text": "x"}',
        '{"prompt": ""}',
        json.dumps({"prompt": "cat " * 200}),
        json.dumps({"messages": [{"role": "user", "content": "sort: b a"}]}),
    ]
    f.write_text("\n".join(rows) + "\n")
    with pytest.raises(DataError, match=r"p\.jsonl:2: not valid JSON"):
        load_prompts(f, tok, 64)
    prompts, report = load_prompts(f, tok, 64, on_bad_row="skip")
    assert report.skipped == 4 and len(prompts) == 2
    assert prompts[1].startswith("user: sort: b a")
    reasons = "\n".join(report.reasons)
    assert "p.jsonl:3: missing field 'prompt'" in reasons
    assert "p.jsonl:4: field 'prompt' is empty" in reasons
    assert "p.jsonl:5: field 'prompt' is 201 tokens, over the limit of 64" in reasons
    csv = tmp_path / "p.csv"
    csv.write_text("prompt,other\ncopy: cat\nanswer:,1\n,2\n")
    with pytest.raises(DataError, match=r"p\.csv:\d+: field 'prompt' is empty"):
        load_prompts(csv, tok, 64)


def test_cli_reports_user_errors_without_traceback(tmp_path, capsys):
    from rlhflab.app.cli import main

    cfg = tmp_path / "c.yaml"
    cfg.write_text(
        "ppo: {lr: -1}\nreward: {functions: {'rlhflab.builtin.toy_rewards:cat_reward': 1}}\n"
    )
    assert main(["ppo", "--config", str(cfg)]) == 2
    assert f"error: {cfg}: ppo.lr: must be > 0.0" in capsys.readouterr().err  # the file named


def test_parquet_prompts_and_memory_command(tmp_path, capsys):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from rlhflab.app.cli import main
    from rlhflab.models import load_tokenizer
    from rlhflab.models.presets import preset_path

    tok = load_tokenizer(preset_path("nano"))
    f = tmp_path / "p.parquet"
    pq.write_table(pa.table({"prompt": ["copy: cat\nanswer:", ""]}), f)
    with pytest.raises(DataError, match=r"p\.parquet:2: field 'prompt' is empty"):
        load_prompts(f, tok, 64)
    assert load_prompts(f, tok, 64, on_bad_row="skip")[0] == ["copy: cat\nanswer:"]
    assert (
        main(
            [
                "memory",
                "model.policy=preset:nano",
                "model.value_model=shared",
                "reward.functions={'rlhflab.builtin.toy_rewards:vowel_reward': 1}",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "policy" in out and "reference" in out and "measured peak" in out
    assert "what one iteration adds" in out and "KV cache" in out
    assert "policy + value head forward+backward" in out and "estimated peak" in out


def test_a_significantly_negative_kl_is_explained_once_and_a_correct_run_never_warns(
    tmp_path, caplog
):
    t = PPOTrainer(make_cfg(tmp_path))
    with caplog.at_level("WARNING", logger="rlhflab.trainers.ppo_watch"):
        t.fit()  # a correct run: its answers are π's own samples
        rows = read_jsonl(tmp_path / "run" / "metrics.jsonl")
        assert all(r["objective/kl_k3"] >= 0 for r in rows)
        assert "standard errors below zero" not in caplog.text
        t.watch.check_kl_sign(torch.tensor([0.1, -0.2, 0.05, 0.0]))  # noise around zero
        # 4 answers at z ≈ −9.8: a fixed normal threshold of −4 warned here, though Student's
        # t with 3 degrees of freedom falls below −4 in 1.4 % of correct iterations
        t.watch.check_kl_sign(torch.tensor([-0.30, -0.31, -0.33, -0.20]))
        assert "standard errors below zero" not in caplog.text
        t.cfg.rollout.top_k = 5  # a cause the warning should name
        t.watch.check_kl_sign(torch.tensor([-0.50, -0.45, -0.55, -0.48, -0.52, -0.47]))
        assert "standard errors below zero" in caplog.text and "rollout.top_k" in caplog.text
        caplog.clear()
        t.watch.check_kl_sign(torch.full((6,), -1.0) + torch.arange(6) * 0.01)
        assert "standard errors below zero" not in caplog.text  # once a run


def test_a_forgotten_key_that_falls_back_to_a_built_in_is_said(tmp_path, caplog):
    """issue #31: your model on the toy prompts, or your prompts on a random preset, is
    rarely what was meant; the built-in pipeline on its own says nothing."""
    import logging

    from rlhflab.models.presets import preset_path
    from rlhflab.trainers.common import load_prompt_set

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "say hi"}\n' * 4)
    from rlhflab.models import load_tokenizer

    tok = load_tokenizer(preset_path("nano"))
    import shutil

    # a policy `rlhflab sft` trained on the built-in task (the demo's): its prompts fit
    builtin_sft, own_sft = tmp_path / "sft-builtin", tmp_path / "sft-own"
    for folder, data in ((builtin_sft, "null"), (own_sft, "chats.jsonl")):
        shutil.copytree(preset_path("nano"), folder)
        (folder / "run").mkdir()
        (folder / "run" / "config.yaml").write_text(f"sft:\n  data: {data}\n")
    cases = [
        ([f"model.policy={preset_path('nano')}"], "data.prompts is not set"),
        ([f"model.policy={own_sft}"], "data.prompts is not set"),
        ([f"model.policy={builtin_sft}"], None),
        ([f"data.prompts={prompts}"], "model.policy is not set to a folder"),
        ([], None),
    ]
    for overrides, said in cases:
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            load_prompt_set(make_cfg(tmp_path, *overrides), tok)
        if said:
            assert said in caplog.text, overrides
        else:
            assert "is not set" not in caplog.text


def test_every_short_source_name_the_settings_cite_is_spelled_out(capsys):
    """issue #31: OAI19, N+, DSM, MOSS, DAPO, k3+ … were cited and explained nowhere."""
    import re

    from rlhflab.app.cli import main
    from rlhflab.config import SOURCES, Config
    from rlhflab.config.base import describe

    cited = set(
        re.findall(r"\b(OAI19|N\+|DSM|MOSS|DAPO|IGPT|KLA|DrGRPO|k3\+)", "\n".join(describe(Config)))
    )
    assert cited  # the settings do cite them
    for short in cited:
        assert any(short in key for key in SOURCES), short
    assert main(["config"]) == 0
    printed = capsys.readouterr().out
    assert all(f"  {key}: " in printed for key in SOURCES)


def test_rollout_sampler_reaches_every_sampling_pass(tmp_path, monkeypatch):
    """rollout.sampler=gumbel: the policy's answers and the reference's (monitor, PAR) are
    drawn with it."""
    import rlhflab.experience.sampling as sampling

    seen = []
    real = sampling.draw_tokens
    monkeypatch.setattr(sampling, "draw_tokens", lambda lg, g, s: seen.append(s) or real(lg, g, s))
    cfg = make_cfg(tmp_path, "ppo.iterations=1", "rollout.sampler=gumbel", "reward.shaping=par")
    PPOTrainer(cfg).fit()
    # 8 steps of the policy's answers and 8 of the reference's
    assert len(seen) == 16 and set(seen) == {"gumbel"}
