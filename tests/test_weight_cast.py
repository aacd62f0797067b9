"""model.cast_cache: trained models keep their fp32 weights' 16-bit copies between forwards
(backends/weight_cast.py) — autocast's arithmetic bit for bit, remade when a weight changes."""

import pytest
import torch
from torch import nn

from rlhflab import models as M
from rlhflab.backends import weight_cast
from rlhflab.backends.optim import FusedAdamW
from rlhflab.config import load_config
from rlhflab.trainers.ppo import PPOTrainer
from tests.model_helpers import REWARD, batch, loaded


def nano(runtime, *overrides):
    torch.manual_seed(0)
    return loaded("preset:nano", runtime, "model.compute_dtype=bf16", *overrides, eval_mode=False)


def kept(model):
    return [m for m in model.modules() if getattr(m, weight_cast.FLAG, False)]


def logits_and_grads(model):
    ids, mask = batch()
    model.zero_grad()
    with M.compute_autocast("cpu", "bf16"):
        logits = M.causal_forward(model, ids, mask).logits
    logits.float().logsumexp(-1).mean().backward()
    return logits.detach(), [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("runtime", ["transformers", "native"])
def test_kept_copies_give_autocast_s_logits_and_gradients_bit_for_bit(runtime):
    on, off = nano(runtime), nano(runtime, "model.cast_cache=false")
    assert kept(on) and not kept(off)
    assert all(type(m) is nn.Linear for m in kept(on))  # the class is untouched
    for _ in range(2):  # the second pass reads the kept copies
        (lo, go), (lf, gf) = logits_and_grads(on), logits_and_grads(off)
        assert lo.dtype == torch.bfloat16 and torch.equal(lo, lf)
        assert all(a.dtype == torch.float32 and torch.equal(a, b) for a, b in zip(go, gf))


def test_a_copy_is_reused_until_its_weight_changes():
    layer = nn.Linear(8, 4)
    weight_cast.keep_weight_casts(layer)
    x = torch.randn(2, 8)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        layer(x)
        first = weight_cast.kept_copy(layer.weight, torch.bfloat16)
        again = weight_cast.kept_copy(layer.weight, torch.bfloat16)
        assert again.data_ptr() == first.data_ptr()
        layer.weight.add_(1.0)  # an optimiser step is an in-place update like this
        fresh = weight_cast.kept_copy(layer.weight, torch.bfloat16)
        assert fresh.data_ptr() != first.data_ptr()
        assert torch.equal(fresh, layer.weight.to(torch.bfloat16))
        assert torch.equal(layer(x), nn.functional.linear(x, layer.weight, layer.bias))
    assert torch.equal(layer(x), nn.functional.linear(x, layer.weight, layer.bias))  # fp32


@pytest.mark.parametrize("optimizer", [FusedAdamW, torch.optim.AdamW])
def test_training_steps_match_autocast_s_after_every_update(optimizer):
    """AdamW updates the weights in place between forwards: each forward after a step must
    use the new weights (a stale copy would make the runs part at the second step). The
    fused kernel rlhflab's AdamW runs does not bump the weights' versions: it drops the
    copies itself."""
    runs = []
    for flag in ("true", "false"):
        model = nano("native", f"model.cast_cache={flag}")
        opt = optimizer(model.parameters(), lr=1e-2)
        losses = []
        for _ in range(3):
            logits, _ = logits_and_grads(model)
            opt.step()
            losses.append(logits.float().logsumexp(-1).mean().item())
        runs.append(losses)
    assert runs[0] == runs[1] and runs[0][0] != runs[0][2]


def test_fp32_compute_and_the_switch_off_keep_nothing():
    for runtime in ("native", "transformers"):
        assert not kept(loaded("preset:nano", runtime))
        off = ("model.compute_dtype=bf16", "model.cast_cache=false")
        assert not kept(loaded("preset:nano", runtime, *off))


def test_nothing_is_kept_under_torch_distributed(tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        assert weight_cast.keep_weight_casts(nn.Linear(4, 4)) == 0
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("layout", ["separate", "lora", "step_in_backward"])
def test_a_bf16_ppo_run_keeps_the_trained_models_copies_and_trains_as_without(tmp_path, layout):
    """Two iterations of 2 epochs × 2 minibatches (AdamW steps between forwards, sampling
    after them): the same weights to the last bit with and without the kept copies; with
    LoRA the frozen base's copies serve policy and reference (the adapter-disabled base)."""
    extra = {
        "separate": ["model.value_model=separate"],
        "lora": ["model.lora_r=4"],
        # AdamW inside the backward: a weight changes while others' copies are still in use
        "step_in_backward": [
            "model.value_model=separate",
            "ppo.step_in_backward=true",
            "ppo.max_grad_norm=null",
        ],
    }[layout]
    trainers = []
    for flag in ("true", "false"):
        cfg = load_config(
            base={
                "device": "cpu",
                "model": {"policy": "preset:nano"},
                "reward": REWARD,
                "rollout": {"prompts_per_iteration": 4, "max_new_tokens": 4},
                "ppo": {"iterations": 2, "epochs": 2, "minibatches": 2},
                "log": {"output_dir": str(tmp_path / flag), "progress": False},
            },
            overrides=["model.compute_dtype=bf16", f"model.cast_cache={flag}", *extra],
        )
        trainer = PPOTrainer(cfg)
        trainer.step()
        trainer.step()
        trainers.append(trainer)
    on, off = (t.cast for t in trainers)
    assert kept(on.policy) and not kept(off.policy)
    pairs = [(on.policy, off.policy)]
    if layout == "lora":  # the frozen base keeps its copies too: the reference reads them
        base = [p for n, p in on.policy.named_parameters() if "base_layer.weight" in n]
        assert base and all(weight_cast.COPY in p.__dict__ for p in base)
        assert not any(p.requires_grad for p in base)
        assert any(p.requires_grad for p in weight_cast.kept_weights(on.policy))  # adapters
    else:
        assert kept(on.critic) and not kept(on.reference)
        pairs.append((on.critic, off.critic))
    for a, b in pairs:
        assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))


def test_forwards_reuse_the_copies_and_the_memory_report_counts_them():
    from rlhflab.diagnostics.memory import cast_memory

    model = nano("native")
    weights = weight_cast.kept_weights(model)
    assert weights and all(w.requires_grad for w in weights)
    logits_and_grads(model)
    first = [w.__dict__[weight_cast.COPY][1] for w in weights]
    logits_and_grads(model)  # no update in between: the same tensors serve again
    assert all(w.__dict__[weight_cast.COPY][1] is c for w, c in zip(weights, first))

    class Cast:
        def models(self):
            return {"policy": model}

    (row,) = cast_memory(Cast())
    assert row.kept_casts == 2 * sum(w.numel() for w in weights) > 0


def test_with_activation_checkpointing_a_frozen_lora_base_keeps_no_copies(tmp_path):
    """Its training forward holds no casts for backward there: kept copies of the frozen
    base would add half its fp32 bytes to the training peak. The adapters keep theirs."""
    for checkpointing, base_kept in (("false", True), ("true", False)):
        cfg = load_config(
            base={
                "device": "cpu",
                "model": {"policy": "preset:nano", "lora_r": 4, "compute_dtype": "bf16"},
                "reward": REWARD,
                "rollout": {"prompts_per_iteration": 4, "max_new_tokens": 4},
                "ppo": {"iterations": 1, "epochs": 1},
                "log": {"output_dir": str(tmp_path / checkpointing), "progress": False},
            },
            overrides=[f"model.gradient_checkpointing={checkpointing}"],
        )
        trainer = PPOTrainer(cfg)
        trainer.step()
        policy = trainer.cast.policy
        base = [p for n, p in policy.named_parameters() if "base_layer.weight" in n]
        assert base and all((weight_cast.COPY in p.__dict__) == base_kept for p in base)
        assert any(p.requires_grad for p in weight_cast.kept_weights(policy))  # adapters
