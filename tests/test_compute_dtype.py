"""model.compute_dtype: trained models' forwards under torch.autocast (bf16, fp16 with its loss
scale) over fp32 master weights, in every trainer, on the nano preset (seconds per test)."""

import dataclasses
import math

import pytest
import torch
from torch import nn

from rlhflab import models as M
from rlhflab.backends.loss_scale import LossScaler
from rlhflab.config import ConfigError, load_config
from rlhflab.experience.rollout import generate_rollout, score_rollout
from rlhflab.models.build import finish_models, load_model, load_tokenizer_for, to_trained
from rlhflab.trainers.dpo import DPOTrainer
from rlhflab.trainers.ppo import PPOTrainer
from rlhflab.trainers.rm_ensemble import train_rm
from rlhflab.trainers.sft import sft_trainer

REWARD = {"functions": {"rlhflab.builtin.toy_rewards:vowel_reward": 1.0}}


def ppo_cfg(tmp_path, *overrides, out="run"):
    base = {
        "device": "cpu",
        "model": {"policy": "preset:nano", "value_model": "separate"},
        "reward": REWARD,
        "rollout": {"prompts_per_iteration": 8, "max_new_tokens": 8},
        "ppo": {"iterations": 2, "epochs": 2, "minibatches": 2, "lr": 1e-3, "critic_lr": 1e-3},
        "log": {"output_dir": str(tmp_path / out), "progress": False, "checkpoint_every": 2},
    }
    return load_config(base=base, overrides=list(overrides))


# ---------------------------------------------------------------------------- the helper


def test_the_autocast_helper_is_a_no_op_for_fp32():
    layer = nn.Linear(8, 4)
    x = torch.randn(3, 8)
    with M.compute_autocast("cpu", "fp32"):
        assert not torch.is_autocast_enabled("cpu")
        inside = layer(x)
        head = M.fp32_head(layer, x)
    assert torch.equal(inside, layer(x)) and torch.equal(head, layer(x))
    assert inside.dtype == torch.float32


def test_bf16_lowers_the_products_and_keeps_the_heads_in_fp32():
    layer = nn.Linear(8, 4)
    x = torch.randn(3, 8)
    with M.compute_autocast("cpu", "bf16"):
        assert torch.get_autocast_dtype("cpu") == torch.bfloat16
        assert layer(x).dtype == torch.bfloat16
        head = M.fp32_head(layer, x)
    assert head.dtype == torch.float32
    assert torch.allclose(head, layer(x), rtol=0, atol=1e-6)  # the fp32 product itself
    assert not torch.is_autocast_enabled("cpu")  # left as it was


def test_config_refuses_what_bf16_or_fp16_cannot_go_with(tmp_path, monkeypatch):
    step_in_backward = ("ppo.step_in_backward=true", "ppo.max_grad_norm=null")
    with pytest.raises(ConfigError, match=r"ppo\.step_in_backward: with model\.compute_dtype=fp16"):
        ppo_cfg(tmp_path, "model.compute_dtype=fp16", *step_in_backward)
    assert ppo_cfg(tmp_path, "model.compute_dtype=bf16", *step_in_backward).ppo.step_in_backward
    with pytest.raises(ConfigError, match=r"model\.loss_scale"):
        ppo_cfg(tmp_path, "model.compute_dtype=fp16", "model.loss_scale=0.5")
    with pytest.raises(ConfigError, match=r"model\.compute_dtype"):
        ppo_cfg(tmp_path, "model.compute_dtype=fp8")
    for stage in ("sft", "rm", "dpo"):  # the supervised stages check it too
        with pytest.raises(ConfigError, match=r"model\.compute_dtype"):
            load_config(overrides=["model.compute_dtype=fp8"], stage=stage)
    with pytest.raises(ConfigError, match=r"model\.cpu_matmul: 'numpy' multiplies fp32"):
        ppo_cfg(tmp_path, "model.compute_dtype=bf16", "model.cpu_matmul=numpy")
    with pytest.raises(ConfigError, match=r"dist\.mixed_precision"):
        ppo_cfg(tmp_path, "model.compute_dtype=bf16", "dist.mixed_precision=bf16")
    assert ppo_cfg(tmp_path).model.compute_dtype == "fp32"  # the default
    # a GPU without bf16 arithmetic is refused once the device is known
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: False)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda _d=None: "Tesla V100")
    with pytest.raises(ConfigError, match=r"model\.compute_dtype: this GPU \(Tesla V100\)"):
        M.compute_autocast("cuda", "bf16")


# ---------------------------------------------------------------------------- fp16 loss scale


def test_the_loss_scale_follows_torch_grad_scaler_through_overflows_and_growth():
    """Same scale after every update as torch.amp.GradScaler, for one pattern of clean and
    overflowing updates (growth every 3 clean updates, halving on each overflow)."""
    pattern = [False, False, True, False, False, False, True, True, False, False, False, False]
    ours = LossScaler(True, init_scale=8.0, growth_interval=3)
    w = nn.Parameter(torch.ones(4))
    sgd = torch.optim.SGD([w], lr=0.1)
    theirs = torch.amp.GradScaler("cpu", init_scale=8.0, growth_interval=3)
    for overflow in pattern:
        theirs.scale(w.sum()).backward()  # GradScaler needs a scaled loss first
        w.grad = torch.full((4,), math.inf if overflow else 1.0)
        theirs.step(sgd)  # unscales, finds the inf, skips
        theirs.update()
        skipped = ours.update(overflow)
        assert skipped == overflow
        assert ours.scale == theirs.get_scale()
    assert ours.overflows == 3 and ours.scale != 8.0
    # at the floor an overflow is a real non-finite gradient, for the trainer's guard
    floor = LossScaler(True, init_scale=2.0)
    assert floor.update(True) and floor.scale == 1.0
    assert not floor.update(True) and floor.scale == 1.0
    off = LossScaler(False, init_scale=1024.0)  # fp32 / bf16: nothing scaled
    loss = torch.tensor(3.0)
    assert off.scaled(loss) is loss and off.scale == 1.0 and not off.update(True)
    # an fp32/bf16 checkpoint resumed under fp16 starts at the configured scale, not at 1
    resumed = LossScaler(True, init_scale=1024.0)
    resumed.load_state_dict(off.state_dict())
    assert off.state_dict() == {} and resumed.scale == 1024.0


def test_without_the_loss_scale_fp16_gradients_underflow_to_zero():
    """The reason for the scale: a gradient of ~1e-8 flows through fp16 products as 0, and
    scaled by 2^16 survives and unscales to the fp32 gradient's value."""
    torch.manual_seed(0)
    layer, x = nn.Linear(16, 16), torch.randn(8, 16)
    (layer(x).sum() * 1e-8).backward()
    exact, layer.weight.grad = layer.weight.grad.clone(), None
    grads = {}
    for enabled in (False, True):
        scaler = LossScaler(enabled)
        with M.compute_autocast("cpu", "fp16"):
            out = layer(x)
        assert out.dtype == torch.float16
        scaler.scaled(out.float().sum() * 1e-8).backward()
        scaler.unscale_(layer.parameters())
        grads[enabled], layer.weight.grad = layer.weight.grad.clone(), None
    assert torch.count_nonzero(grads[False]) == 0
    assert torch.allclose(grads[True], exact, rtol=1e-2, atol=0)


def test_fp16_ppo_starts_at_ratio_one_with_fp32_master_weights_and_logs_the_scale(tmp_path):
    t = PPOTrainer(ppo_cfg(tmp_path, "model.compute_dtype=fp16"))
    rows = [t.step() for _ in range(2)]
    first = t.first_minibatch
    assert abs(first["policy/ratio_mean"] - 1) < 1e-5 and first["policy/approx_kl"] < 1e-8
    assert rows[0]["objective/kl"] == pytest.approx(0.0, abs=1e-6)
    assert all(math.isfinite(v) for row in rows for v in row.values())
    assert rows[-1]["faults/loss_scale"] == 2.0**16 and rows[-1]["faults/overflow_skips"] == 0
    assert t.skipped_total == 0
    for model in (t.cast.policy, t.cast.critic):
        assert all(q.dtype == torch.float32 for q in model.parameters())
    assert "faults/loss_scale" not in PPOTrainer(ppo_cfg(tmp_path, out="fp32")).step()


def test_fp16_gradient_norms_are_the_unscaled_ones_of_policy_and_critic(tmp_path):
    """Every trained model's gradients are unscaled before their norm, clip and update:
    fp16's first-minibatch norms are fp32's up to rounding, not 2^16 times them."""
    first = {}
    for dtype in ("fp32", "fp16"):
        t = PPOTrainer(ppo_cfg(tmp_path, f"model.compute_dtype={dtype}", out=dtype))
        t.step()
        first[dtype] = t.first_minibatch
    for key in ("policy/grad_norm", "val/grad_norm"):
        assert first["fp16"][key] == pytest.approx(first["fp32"][key], rel=5e-2)
    assert first["fp16"]["val/loss"] == pytest.approx(first["fp32"]["val/loss"], rel=5e-2)


def test_an_fp16_overflow_skips_the_update_and_halves_the_scale_without_a_halt(tmp_path):
    t = PPOTrainer(ppo_cfg(tmp_path, "model.compute_dtype=fp16", "model.loss_scale=1e30"))
    before = [q.detach().clone() for q in t.cast.policy.parameters()]
    row = t.step()  # 4 updates, each overflowing at this scale: none is applied
    assert row["faults/overflow_skips"] == 4 and row["faults/loss_scale"] == 1e30 / 16
    assert row["faults/skipped_updates"] == 0 and t.update.guard.consecutive_bad == 0
    assert all(torch.equal(a, b) for a, b in zip(before, t.cast.policy.parameters()))


def test_fp16_resume_is_bit_identical_with_the_loss_scale_in_the_checkpoint(tmp_path):
    """The scale grows after every clean update here and halves on overflows, so a resume
    that restarted it would train differently."""
    extra = (
        "model.compute_dtype=fp16",
        "model.loss_scale_growth_interval=1",
        "model.loss_scale=2e4",
    )
    straight = PPOTrainer(ppo_cfg(tmp_path, *extra, "ppo.iterations=4", out="a"))
    straight.fit()
    half = PPOTrainer(ppo_cfg(tmp_path, *extra, "ppo.iterations=4", out="b"))
    half.cfg.ppo.iterations = 2  # stop after 2 (a checkpoint at step 2), as if killed
    half.fit()
    assert half.update.guard.scaler.scale != 2e4
    resumed = PPOTrainer(ppo_cfg(tmp_path, *extra, "ppo.iterations=4", out="b"))
    resumed.fit(resume=True)
    assert resumed.update.guard.scaler.state_dict() == straight.update.guard.scaler.state_dict()
    for a, b in zip(straight.cast.policy.parameters(), resumed.cast.policy.parameters()):
        assert torch.equal(a, b)


# ---------------------------------------------------------------------------- PPO


def test_bf16_ppo_scores_in_bf16_with_its_first_ratio_one_and_fp32_master_weights(tmp_path):
    t = PPOTrainer(ppo_cfg(tmp_path, "model.compute_dtype=bf16"))
    rows = [t.step() for _ in range(2)]
    first = t.first_minibatch
    # old log-probs were scored in the arithmetic of the training forward (measured: exactly
    # 1; scored in fp32 instead, ratio_mean − 1 is 1.4e-4 here)
    assert abs(first["policy/ratio_mean"] - 1) < 1e-5
    assert first["policy/ratio_max"] - 1 < 1e-5
    assert first["policy/approx_kl"] < 1e-8
    # the reference computes as the policy does: the unchanged policy's KL is 0
    assert rows[0]["objective/kl"] == pytest.approx(0.0, abs=1e-6)
    assert all(math.isfinite(v) for row in rows for v in row.values())
    assert t.skipped_total == 0
    for model in (t.cast.policy, t.cast.critic):
        assert all(q.dtype == torch.float32 for q in model.parameters())
    for opt in (t.opt, t.critic_opt):
        moments = [v for s in opt.state.values() for v in s.values() if v.is_floating_point()]
        assert moments and all(v.dtype == torch.float32 for v in moments)


def test_bf16_scoring_differs_from_fp32_by_rounding_only(tmp_path):
    """The autocast is really on: the same rollout's log-probs and values under bf16 are
    not fp32's, and are close to them."""
    t = PPOTrainer(
        ppo_cfg(
            tmp_path,
            "model.compute_dtype=bf16",
            "model.value_model=shared",
            # the same reference scores in fp32 below, which needs its fp32 weights
            "model.reference_low_weights=false",
        )
    )
    cast, r = t.cast, t.cfg.rollout
    prompts = t.next_prompts()
    ro = generate_rollout(
        cast.policy_lm, cast.tokenizer, prompts, 8, 1.0, 0, 1.0, None, "cpu", autocast=cast.autocast
    )
    fp32_cast = dataclasses.replace(cast, compute_dtype="fp32")
    bf16 = score_rollout(cast, ro, r.temperature, 4)
    lp16, ref16, v16 = bf16.old_logprobs.clone(), bf16.ref_logprobs.clone(), bf16.values.clone()
    fp32 = score_rollout(fp32_cast, ro, r.temperature, 4)
    assert lp16.dtype == ref16.dtype == v16.dtype == torch.float32
    assert not torch.equal(lp16, fp32.old_logprobs)
    assert (lp16 - fp32.old_logprobs).abs().max() < 0.05
    assert torch.equal(lp16, ref16)  # fp32 reference weights: computed as the policy is
    m = ro.response_mask.bool()
    assert (v16 - fp32.values)[m].abs().max() < 0.05


@pytest.mark.parametrize(
    "extra",
    [
        ("model.runtime=native", "model.gradient_checkpointing=true"),
        ("model.value_model=shared", "rollout.logprobs_from_sampling=true"),
    ],
    ids=["native-checkpointed", "shared-sampling-logprobs"],
)
def test_bf16_ppo_runs_on_the_native_runtime_and_the_sampling_pass(tmp_path, extra):
    t = PPOTrainer(ppo_cfg(tmp_path, "model.compute_dtype=bf16", "ppo.iterations=1", *extra))
    row = t.step()
    assert all(math.isfinite(v) for v in row.values())
    first = t.first_minibatch
    # the sampling pass's KV-cached log-probs sum in another order: bf16 widens that gap
    # (measured: ratio_max − 1 = 5e-4; 5e-7 in fp32)
    tol = 1e-2 if "rollout.logprobs_from_sampling=true" in extra else 1e-5
    assert abs(first["policy/ratio_mean"] - 1) < tol and first["policy/ratio_max"] - 1 < tol


def _grads(runtime: str, checkpointing: bool, dtype: str) -> torch.Tensor:
    cfg = load_config(
        base={"model": {"policy": "preset:nano", "runtime": runtime}, "reward": REWARD},
        overrides=[f"model.gradient_checkpointing={checkpointing}"],
    )
    tok = load_tokenizer_for(cfg.model.policy, cfg.model)
    model = load_model(cfg.model.policy, tok, cfg.model)
    finish_models(cfg.model, "cpu", trained=(model,))
    model = to_trained(model, "cpu", "policy")
    ids = torch.randint(3, 400, (3, 12), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[0, :4] = 0
    with M.compute_autocast("cpu", dtype):
        logits = M.causal_forward(model, ids, mask).logits
    logits.float().logsumexp(-1).mean().backward()
    return torch.cat([q.grad.flatten() for q in model.parameters()])


@pytest.mark.parametrize("runtime", ["transformers", "native"])
def test_bf16_gradients_match_with_checkpointing_and_lean_activations(runtime):
    """Lean activations' own backward and the native runtime's recomputation follow the
    forward's autocast: checkpointed gradients equal plain ones, and both are fp32's up to
    bf16 rounding."""
    plain, ckpt = _grads(runtime, False, "bf16"), _grads(runtime, True, "bf16")
    assert torch.equal(plain, ckpt)
    ref = _grads(runtime, False, "fp32")
    assert not torch.equal(plain, ref)
    assert (plain - ref).norm() / ref.norm() < 2e-2


# ---------------------------------------------------------------------------- SFT, RM, DPO


def test_bf16_sft_step_is_fp32_s_up_to_rounding(tmp_path):
    losses = {}
    for dtype in ("fp32", "bf16"):
        cfg = load_config(
            overrides=[
                "model.policy=preset:nano",
                "device=cpu",
                f"model.compute_dtype={dtype}",
                "sft.examples=16",
                "sft.batch_size=4",
                f"sft.output_dir={tmp_path / dtype}",
            ],
            stage="sft",
        )
        trainer = sft_trainer(cfg)
        losses[dtype] = trainer.step()["loss"]
        assert all(q.dtype == torch.float32 for q in trainer.model.parameters())
    assert losses["bf16"] != losses["fp32"]
    assert losses["bf16"] == pytest.approx(losses["fp32"], abs=2e-2)


def test_bf16_reward_model_step_is_fp32_s_up_to_rounding(tmp_path):
    out = {}
    for dtype in ("fp32", "bf16"):
        cfg = load_config(
            overrides=[
                "model.policy=preset:nano",
                "device=cpu",
                f"model.compute_dtype={dtype}",
                "rm.pairs=24",
                "rm.steps=1",
                "rm.batch_size=4",
                f"rm.output_dir={tmp_path / dtype}",
                "log.progress=false",
            ],
            stage="rm",
        )
        out[dtype] = train_rm(cfg)["loss_last"]
    assert out["bf16"] != out["fp32"]
    assert math.isfinite(out["bf16"]) and out["bf16"] == pytest.approx(out["fp32"], abs=2e-2)


def dpo_cfg(tmp_path, *overrides):
    base = {
        "device": "cpu",
        "model": {"policy": "preset:nano", "value_model": "none"},
        "dpo": {"pairs": 40, "steps": 2, "batch_size": 8, "lr": 1e-3},
        "log": {"output_dir": str(tmp_path / "dpo"), "progress": False},
    }
    return load_config(base=base, overrides=list(overrides), stage="dpo")


def test_bf16_dpo_starts_at_log2_with_fp32_master_weights(tmp_path):
    t = DPOTrainer(dpo_cfg(tmp_path, "model.compute_dtype=bf16"))
    first = t.step()
    # policy and fp32 reference computed alike: zero implicit rewards at the start
    # (measured: exactly 0; with the reference in fp32 arithmetic, rewards/chosen is 2.5e-5)
    assert first["loss"] == pytest.approx(math.log(2), abs=1e-6)
    for key in ("rewards/chosen", "rewards/rejected", "rewards/margin"):
        assert first[key] == pytest.approx(0.0, abs=1e-6)
    assert math.isfinite(t.step()["loss"])
    assert all(q.dtype == torch.float32 for q in t.policy.parameters())
    moments = [v for s in t.opt.state.values() for v in s.values() if v.is_floating_point()]
    assert moments and all(v.dtype == torch.float32 for v in moments)


@pytest.mark.parametrize("stage", ["sft", "dpo"])
def test_fp16_supervised_stages_scale_their_loss_and_checkpoint_the_scale(tmp_path, stage):
    if stage == "sft":
        overrides = ["sft.examples=16", "sft.batch_size=4", f"sft.output_dir={tmp_path / 'o'}"]
        cfg = load_config(
            overrides=[
                "model.policy=preset:nano",
                "device=cpu",
                "model.compute_dtype=fp16",
                "model.loss_scale=1e30",
                *overrides,
            ],
            stage="sft",
        )
        t = sft_trainer(cfg)
        weights = lambda: list(t.model.parameters())  # noqa: E731
    else:
        cfg = dpo_cfg(tmp_path, "model.compute_dtype=fp16", "model.loss_scale=1e30")
        t = DPOTrainer(cfg)
        weights = lambda: list(t.policy.parameters())  # noqa: E731
    before = [q.detach().clone() for q in weights()]
    assert math.isfinite(t.step()["loss"])  # overflowed at 1e30: skipped, no halt
    assert all(torch.equal(a, b) for a, b in zip(before, weights()))
    state = t.state_dict()
    assert state["loss_scale"] == {"scale": 5e29, "clean_steps": 0, "overflows": 1}
    assert all(q.dtype == torch.float32 for q in weights())
    fresh = sft_trainer(cfg) if stage == "sft" else DPOTrainer(cfg)
    assert fresh.scaler.scale == 1e30
    fresh.load_state_dict(state)  # what a resume does with the checkpoint's state
    assert fresh.scaler.state_dict() == state["loss_scale"]


def test_fp16_with_step_in_backward_is_refused_for_ppo_only(tmp_path):
    base = ["model.compute_dtype=fp16", "ppo.step_in_backward=true", "ppo.max_grad_norm=null"]
    for stage in ("sft", "rm", "dpo"):  # they never read ppo.*
        assert load_config(overrides=base, stage=stage).model.compute_dtype == "fp16"
    for stage in ("ppo", "grpo"):
        with pytest.raises(ConfigError, match=r"ppo\.step_in_backward"):
            load_config(overrides=base, stage=stage)
