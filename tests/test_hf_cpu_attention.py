"""model.cpu_attention_fp32 on the transformers runtime: SDPA in fp32 on the CPU when the
values come out in 16 bits, through transformers' attention registry (models/hf_attention.py)."""

import pytest
import torch
import torch.nn.functional as F

from rlhflab import models as M
from rlhflab.config import load_config
from rlhflab.models.build import finish_models, load_model, load_tokenizer_for, to_trained
from rlhflab.models.hf_attention import NAME, set_transformers_cpu_attention_fp32
from rlhflab.trainers.ppo import PPOTrainer
from tests.test_any_lm import build
from tests.test_cpu_attention import batch
from tests.test_ppo import make_cfg

REWARD = {"functions": {"rlhflab.builtin.toy_rewards:vowel_reward": 1.0}}


def hf_model(policy="preset:nano", *overrides, trained=True, precision="fp32"):
    cfg = load_config(
        base={"model": {"policy": policy, "runtime": "transformers"}, "reward": REWARD},
        overrides=list(overrides),
    )
    tok = load_tokenizer_for(cfg.model.policy, cfg.model)
    model = load_model(cfg.model.policy, tok, cfg.model, trained=trained, precision=precision)
    if trained:
        finish_models(cfg.model, "cpu", trained=(model,))
        return to_trained(model, "cpu", "policy").eval()
    finish_models(cfg.model, "cpu", frozen=(model,))
    return model.eval()


def test_bf16_compute_attends_in_fp32_on_the_cpu_unless_switched_off(sdpa_dtypes):
    model = hf_model()
    assert model.config._attn_implementation == NAME
    ids, mask = batch()
    with torch.no_grad():
        ref = M.causal_forward(model, ids, mask).logits
        with M.compute_autocast("cpu", "bf16"):
            wide = M.causal_forward(model, ids, mask).logits
        assert sdpa_dtypes and set(sdpa_dtypes) == {(torch.float32,) * 3}
        assert set_transformers_cpu_attention_fp32(False, [model]) == 1
        assert model.config._attn_implementation == "sdpa"
        with M.compute_autocast("cpu", "bf16"):
            narrow = M.causal_forward(model, ids, mask).logits
        assert sdpa_dtypes[-1] == (torch.bfloat16,) * 3
    real = mask.bool()
    for out in (wide, narrow):  # both are fp32's logits up to bf16 rounding
        err = (out.float() - ref)[real].abs().max() / ref[real].abs().max()
        assert 0 < err < 5e-2
    assert not torch.equal(wide, narrow)  # the switch changes the arithmetic


def test_fp32_compute_is_untouched_by_the_switch():
    model = hf_model()
    ids, mask = batch()
    with torch.no_grad():
        on = M.causal_forward(model, ids, mask).logits
        set_transformers_cpu_attention_fp32(False, [model])
        off = M.causal_forward(model, ids, mask).logits
    assert torch.equal(on, off)


def test_a_frozen_bf16_model_attends_in_fp32_and_hands_bf16_to_its_output_projection(
    sdpa_dtypes,
):
    model = hf_model(trained=False, precision="bf16")
    assert next(model.parameters()).dtype == torch.bfloat16
    ids, mask = batch()
    with torch.no_grad():
        logits = M.causal_forward(model, ids, mask).logits
    assert logits.dtype == torch.bfloat16 and torch.isfinite(logits.float()).all()
    assert set(sdpa_dtypes) == {(torch.float32,) * 3}


def test_the_switch_off_keeps_transformers_sdpa(sdpa_dtypes):
    model = hf_model("preset:nano", "model.cpu_attention_fp32=false")
    assert model.config._attn_implementation == "sdpa"
    ids, mask = batch()
    with torch.no_grad(), M.compute_autocast("cpu", "bf16"):
        M.causal_forward(model, ids, mask)
    assert set(sdpa_dtypes) == {(torch.bfloat16,) * 3}


def test_an_eager_model_is_left_alone():
    model = hf_model()
    set_transformers_cpu_attention_fp32(False, [model])
    model.set_attn_implementation("eager")
    assert set_transformers_cpu_attention_fp32(True, [model, None]) == 0
    assert model.config._attn_implementation == "eager"


def test_gradients_flow_through_the_fp32_attention(sdpa_dtypes):
    model = hf_model().train()
    ids, mask = batch()
    with M.compute_autocast("cpu", "bf16"):
        logits = M.causal_forward(model, ids, mask).logits
    logits.float().logsumexp(-1).mean().backward()
    q = model.model.layers[0].self_attn.q_proj.weight
    assert q.grad is not None and q.grad.dtype == torch.float32 and q.grad.abs().sum() > 0
    assert set(sdpa_dtypes) == {(torch.float32,) * 3}


def test_a_gpt2_checkpoint_is_switched_too(tmp_path, sdpa_dtypes):
    folder, _ = build("gpt2", tmp_path / "gpt2", tied=True, pad="eos", side="left")
    model = hf_model(str(folder))
    assert model.config._attn_implementation == NAME
    ids, mask = batch()
    ids = ids % 60 + 3
    with torch.no_grad():
        ref = M.causal_forward(model, ids, mask).logits
        with M.compute_autocast("cpu", "bf16"):
            low = M.causal_forward(model, ids, mask).logits
    assert set(sdpa_dtypes) == {(torch.float32,) * 3}
    real = mask.bool()
    assert (low.float() - ref)[real].abs().max() / ref[real].abs().max() < 5e-2


def test_bf16_lora_ppo_on_the_transformers_runtime_starts_at_ratio_one_and_exports_clean(
    tmp_path, sdpa_dtypes
):
    """The levers' setting: LoRA (adapter-disabled base as reference), bf16 compute. The
    saved config names no rlhflab attention, so plain transformers reloads the folder."""
    cfg = make_cfg(
        tmp_path,
        "model.runtime=transformers",
        "model.compute_dtype=bf16",
        "model.lora_r=4",
        "model.value_model=shared",
        "ppo.iterations=1",
        "ppo.minibatches=1",
    )
    trainer = PPOTrainer(cfg)
    trainer.fit()
    assert trainer.first_minibatch["policy/ratio_mean"] == pytest.approx(1.0, abs=1e-5)
    assert sdpa_dtypes and set(sdpa_dtypes) == {(torch.float32,) * 3}
    from transformers import AutoModelForCausalLM

    from rlhflab.models.export import save_policy

    folder = save_policy(trainer.cast.policy, trainer.cast.tokenizer, tmp_path / "export")
    assert NAME not in (folder / "config.json").read_text()
    reloaded = AutoModelForCausalLM.from_pretrained(folder)
    assert reloaded.config._attn_implementation == "sdpa"
    ids, mask = batch()
    with torch.no_grad():
        assert torch.isfinite(reloaded(input_ids=ids % 60 + 3, attention_mask=mask).logits).all()


def test_sdpa_fixture_sees_the_calls():
    """The recording fixture wraps the function transformers calls (F.scaled_dot_product_attention
    looked up at call time): otherwise the tests above could pass without a call."""
    from transformers.integrations import sdpa_attention

    assert sdpa_attention.torch.nn.functional is F
