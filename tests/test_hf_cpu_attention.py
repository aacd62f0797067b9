"""model.cpu_attention_fp32 on the transformers runtime: SDPA in fp32 on the CPU when the
values come out in 16 bits, through transformers' attention registry (models/hf_attention.py)."""

import pytest
import torch
import torch.nn.functional as F

from rlhflab import models as M
from rlhflab.models.hf_attention import NAME, set_transformers_cpu_attention_fp32
from rlhflab.trainers.ppo import PPOTrainer
from tests.model_helpers import batch, loaded
from tests.test_any_lm import build
from tests.test_ppo import make_cfg


def hf_model(policy="preset:nano", *overrides, trained=True, precision="fp32"):
    return loaded(policy, "transformers", *overrides, trained=trained, precision=precision)


def test_an_sdpa_model_gets_the_fp32_function_and_gives_it_back():
    model = hf_model()
    assert model.config._attn_implementation == NAME
    assert set_transformers_cpu_attention_fp32(True, [model]) == 0  # already on
    assert set_transformers_cpu_attention_fp32(False, [model]) == 1
    assert model.config._attn_implementation == "sdpa"


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
