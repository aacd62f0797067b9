"""model.reference_low_weights: under a 16-bit compute_dtype an fp32 reference keeps its
Linear weights in that dtype — the products autocast would run anyway, so the same numbers
bit for bit, in half the bytes (rlhflab/models/frozen.py: store_linear_weights)."""

import copy

import pytest
import torch
from torch import nn

from rlhflab import models as M
from rlhflab.config import load_config
from rlhflab.experience.cast import reference_low_dtype
from rlhflab.models.frozen import freeze, low_linear_dtype, store_linear_weights
from rlhflab.trainers.ppo import PPOTrainer
from tests.test_lean import tiny_llama

REWARD = {"functions": {"rlhflab.builtin.toy_rewards:vowel_reward": 1.0}}


def _cfg(tmp_path, *overrides, out="run"):
    base = {
        "device": "cpu",
        "model": {"policy": "preset:nano", "value_model": "separate", "compute_dtype": "bf16"},
        "reward": REWARD,
        "rollout": {"prompts_per_iteration": 8, "max_new_tokens": 8},
        "ppo": {"iterations": 2, "epochs": 2, "minibatches": 2, "lr": 1e-3, "critic_lr": 1e-3},
        "log": {"output_dir": str(tmp_path / out), "progress": False, "checkpoint_every": 2},
    }
    return load_config(base=base, overrides=list(overrides))


def _lm(tied: bool) -> nn.Module:
    # a bias stays fp32: autocast casts it as before
    return tiny_llama(vocab_size=97, tie_word_embeddings=tied, attention_bias=True).eval()


@pytest.mark.parametrize("tied", [True, False], ids=["tied-head", "own-head"])
def test_stored_weights_give_autocast_s_logits_bit_for_bit_in_fewer_bytes(tied):
    plain = freeze(_lm(tied))
    low = copy.deepcopy(plain)
    before = M.module_bytes(low)
    freed = store_linear_weights(low, torch.bfloat16)
    linears = [m for m in low.modules() if type(m) is nn.Linear]
    head = low.get_output_embeddings()
    # every Linear weight but a head tied to the input embedding is bf16; the rest fp32
    for m in linears:
        want = torch.float32 if (tied and m is head) else torch.bfloat16
        assert m.weight.dtype == want, m
        assert m.bias is None or m.bias.dtype == torch.float32
    assert low.get_input_embeddings().weight.dtype == torch.float32
    assert all(p.dtype == torch.float32 for n, p in low.named_parameters() if "norm" in n)
    if tied:
        assert head.weight is low.get_input_embeddings().weight
    halved = sum(m.weight.numel() * 2 for m in linears if m.weight.dtype == torch.bfloat16)
    assert freed == halved and M.module_bytes(low) == before - halved
    assert low_linear_dtype(low) == torch.bfloat16 and low_linear_dtype(plain) is None

    ids = torch.randint(0, 97, (3, 11))
    mask = torch.ones_like(ids)
    mask[0, :4] = 0  # a left-padded row
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        want = plain(input_ids=ids, attention_mask=mask).logits
        got = low(input_ids=ids, attention_mask=mask).logits
    assert torch.equal(got, want)
    with pytest.raises(RuntimeError):  # outside autocast it refuses, never computes otherwise
        with torch.no_grad():
            low(input_ids=ids, attention_mask=mask)


@pytest.mark.parametrize("runtime", ["transformers", "native"])
def test_a_bf16_ppo_run_is_bit_identical_with_and_without_the_stored_weights(tmp_path, runtime):
    """Scoring, the KL, the monitors' reference answers (reference_every=1) and the opener
    probe all read the reference: the same metrics to the last bit either way, with an
    unchanged policy's KL 0."""
    rows = {}
    for on in (True, False):
        flag = f"model.reference_low_weights={str(on).lower()}"
        t = PPOTrainer(_cfg(tmp_path, flag, f"model.runtime={runtime}", out=f"r{on}"))
        ref_linears = [m for m in t.cast.reference.modules() if type(m) is nn.Linear]
        dtypes = {m.weight.dtype for m in ref_linears if m is not t.cast.reference.lm_head}
        assert dtypes == ({torch.bfloat16} if on else {torch.float32})
        assert all(q.dtype == torch.float32 for q in t.cast.policy.parameters())
        rows[on] = [t.step() for _ in range(2)]
    assert rows[True][0]["objective/kl"] == pytest.approx(0.0, abs=1e-6)
    for a, b in zip(rows[True], rows[False]):
        timed = ("time/", "memory/", "throughput/")
        same = {k: a[k] for k in a if not k.startswith(timed)}
        assert {"monitor/length_ratio", "monitor/flattery_opener_ratio", "val/loss"} <= set(same)
        assert same == {k: b[k] for k in same}


def test_the_weights_stay_fp32_where_they_must(tmp_path):
    cases = {
        ("model.compute_dtype=fp32",): None,
        ("model.reference_low_weights=false",): None,
        ("model.reference_precision=int8",): None,
        ("model.lora_r=4",): None,  # the reference is the policy's own base
        ("model.compute_dtype=fp16",): torch.float16,
        (): torch.bfloat16,
    }
    for overrides, want in cases.items():
        assert reference_low_dtype(_cfg(tmp_path, *overrides)) == want, overrides
