"""model.cpu_attention_fp32 on the transformers runtime: SDPA in fp32 on the CPU when the
values come out in 16 bits, through transformers' attention registry (models/hf_attention.py)."""

import copy

import pytest
import torch

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


class _Attention(torch.nn.Module):
    num_key_value_groups = 2  # grouped-query: 4 query heads on 2 key/value heads


@pytest.mark.parametrize("mask_kind", ["none", "bool", "float", "position_bias"])
def test_the_function_is_transformers_sdpa_in_fp32(mask_kind):
    """Against transformers' own function on the same inputs in fp32: equal up to the bf16
    rounding of the output (the inputs are bf16 numbers, exact in fp32); with fp32 inputs
    it is that function, bit for bit."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from rlhflab.models.hf_attention import _sdpa_fp32_on_cpu

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, h, 5, 8, generator=g) for h in (4, 2, 2))
    kw = {}
    mask = None
    if mask_kind == "bool":
        mask = torch.ones(2, 1, 5, 5, dtype=torch.bool).tril()
        mask[0, :, :, :2] = False  # a left-padded row
        mask[0, :, :2, 0] = True  # (its padded rows attend somewhere)
    elif mask_kind == "float":
        mask = torch.zeros(2, 1, 5, 5).masked_fill(torch.ones(5, 5).triu(1).bool(), -1e30)
    elif mask_kind == "position_bias":
        kw["position_bias"] = torch.randn(1, 4, 5, 5, generator=g)
    low = [t.bfloat16() for t in (q, k, v)]
    low_mask = mask.bfloat16() if mask is not None and mask.is_floating_point() else mask
    low_kw = {key: t.bfloat16() for key, t in kw.items()}
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, _ = _sdpa_fp32_on_cpu(_Attention(), *low, low_mask, **low_kw)
    ref_kw = {key: t.float() for key, t in low_kw.items()}
    ref_mask = low_mask.float() if low_mask is not None and low_mask.is_floating_point() else mask
    want, _ = sdpa_attention_forward(_Attention(), *(t.float() for t in low), ref_mask, **ref_kw)
    assert out.dtype == torch.bfloat16 and out.shape == want.shape == (2, 5, 4, 8)
    assert torch.equal(out, want.bfloat16())
    same, _ = _sdpa_fp32_on_cpu(_Attention(), q, k, v, mask, **kw)
    assert torch.equal(same, sdpa_attention_forward(_Attention(), q, k, v, mask, **kw)[0])


def test_models_whose_code_tests_the_name_or_mixes_attentions_keep_sdpa(monkeypatch):
    from transformers import LlamaForCausalLM

    from rlhflab.models import hf_attention

    assert hf_attention._reads_the_name(__import__("transformers").Gemma4ForCausalLM)
    monkeypatch.setitem(hf_attention._READS_NAME, LlamaForCausalLM, True)
    assert hf_model().config._attn_implementation == "sdpa"
    monkeypatch.setitem(hf_attention._READS_NAME, LlamaForCausalLM, False)
    model = hf_model()
    set_transformers_cpu_attention_fp32(False, [model])
    inner = copy.deepcopy(model.config)  # a composite: its tower on another attention
    inner._attn_implementation = "eager"
    model.model.config = inner
    assert set_transformers_cpu_attention_fp32(True, [model]) == 0
    assert model.config._attn_implementation == "sdpa"
