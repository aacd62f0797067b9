"""model.cpu_attention_fp32: attention in fp32 on the CPU when the projections come out in 16
bits — the native runtime's rotary embedding, KV cache and SDPA (backends/native.py), and a
transformers model's SDPA (models/hf_attention.py; its own tests: test_hf_cpu_attention.py)."""

import pytest
import torch

from rlhflab import models as M
from rlhflab.backends.native import NativeAttention
from rlhflab.config import load_config
from rlhflab.models.build import set_attention_fp32_on_cpu
from rlhflab.trainers.ppo import PPOTrainer
from tests.model_helpers import batch, loaded

REWARD = {"functions": {"rlhflab.builtin.toy_rewards:vowel_reward": 1.0}}


RUNTIMES = ["native", "transformers"]


def native_nano(*overrides, trained=True, precision="fp32", runtime="native"):
    return loaded("preset:nano", runtime, *overrides, trained=trained, precision=precision)


def switch_off(model) -> None:
    set_attention_fp32_on_cpu(False, [model])


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_bf16_compute_attends_in_fp32_on_the_cpu_unless_switched_off(sdpa_dtypes, runtime):
    model = native_nano(runtime=runtime)
    ids, mask = batch()
    with torch.no_grad():
        ref = M.causal_forward(model, ids, mask).logits
        with M.compute_autocast("cpu", "bf16"):
            wide = M.causal_forward(model, ids, mask).logits
        assert sdpa_dtypes and set(sdpa_dtypes) == {(torch.float32,) * 3}
        sdpa_dtypes.clear()
        switch_off(model)
        with M.compute_autocast("cpu", "bf16"):
            narrow = M.causal_forward(model, ids, mask).logits
        assert sdpa_dtypes and set(sdpa_dtypes) == {(torch.bfloat16,) * 3}
    real = mask.bool()
    for out in (wide, narrow):  # both are fp32's logits up to bf16 rounding
        err = (out.float() - ref)[real].abs().max() / ref[real].abs().max()
        assert 0 < err < 5e-2
    assert not torch.equal(wide, narrow)  # the switch changes the arithmetic


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_fp32_compute_is_untouched_by_the_switch(sdpa_dtypes, runtime):
    model = native_nano(runtime=runtime)
    ids, mask = batch()
    with torch.no_grad():
        on = M.causal_forward(model, ids, mask).logits
        switch_off(model)
        off = M.causal_forward(model, ids, mask).logits
    assert torch.equal(on, off)
    assert set(sdpa_dtypes) == {(torch.float32,) * 3}


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_a_frozen_bf16_model_attends_in_fp32_without_autocast(sdpa_dtypes, runtime):
    """... and hands its output projection bf16, the dtype of its weight."""
    model = native_nano(trained=False, precision="bf16", runtime=runtime)
    assert next(model.parameters()).dtype == torch.bfloat16
    ids, mask = batch()
    with torch.no_grad():
        logits = M.causal_forward(model, ids, mask).logits
    assert logits.dtype == torch.bfloat16 and torch.isfinite(logits.float()).all()
    assert set(sdpa_dtypes) == {(torch.float32,) * 3}


def test_kv_cached_decoding_matches_the_full_forward_in_fp32_attention():
    """Sampling's cache holds fp32 keys and values: the last position's logits from a
    prompt forward plus one cached step equal a full forward's up to bf16 rounding."""
    model = native_nano()
    ids, mask = batch()
    with torch.no_grad(), M.compute_autocast("cpu", "bf16"):
        full = M.causal_forward(model, ids, mask).logits[:, -1]
        first = model(ids[:, :-1], attention_mask=mask[:, :-1], use_cache=True)
        cache = first.past_key_values
        assert all(k.dtype == torch.float32 for k in cache.keys)
        step = model(ids[:, -1:], attention_mask=mask, past_key_values=cache, use_cache=True)
    last = step.logits[:, -1].float()
    assert (last - full.float()).abs().max() / full.float().abs().max() < 2e-2


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_gradients_flow_to_fp32_weights_through_the_fp32_attention(sdpa_dtypes, runtime):
    model = native_nano(runtime=runtime).train()
    ids, mask = batch()
    with M.compute_autocast("cpu", "bf16"):
        logits = M.causal_forward(model, ids, mask).logits
    logits.float().logsumexp(-1).mean().backward()
    q = model.model.layers[0].self_attn.q_proj.weight
    assert q.grad is not None and q.grad.dtype == torch.float32 and q.grad.abs().sum() > 0
    assert sdpa_dtypes and set(sdpa_dtypes) == {(torch.float32,) * 3}


@pytest.mark.parametrize("on", [True, False])
def test_the_ppo_config_sets_every_model_s_attention(tmp_path, on):
    cfg = load_config(
        base={
            "device": "cpu",
            "model": {"policy": "preset:nano", "runtime": "native", "value_model": "separate"},
            "reward": REWARD,
            "rollout": {"prompts_per_iteration": 4, "max_new_tokens": 4},
            "ppo": {"iterations": 1, "epochs": 1, "minibatches": 1},
            "log": {"output_dir": str(tmp_path / "run"), "progress": False},
        },
        overrides=["model.compute_dtype=bf16", f"model.cpu_attention_fp32={on}"],
    )
    trainer = PPOTrainer(cfg)
    cast = trainer.cast
    flags = {
        m.fp32_on_cpu
        for model in (cast.policy, cast.critic, cast.reference)
        for m in model.modules()
        if isinstance(m, NativeAttention)
    }
    assert flags == {on}
    row = trainer.step()
    first = trainer.first_minibatch
    assert abs(first["policy/ratio_mean"] - 1) < 1e-5, row


@pytest.mark.parametrize("trained", [True, False])
def test_every_loaded_model_takes_the_switch(trained):
    """Frozen models loaded outside a training command (eval, compare) too."""
    model = native_nano("model.cpu_attention_fp32=false", trained=trained, precision="bf16")
    flags = {m.fp32_on_cpu for m in model.modules() if isinstance(m, NativeAttention)}
    assert flags == {False}
