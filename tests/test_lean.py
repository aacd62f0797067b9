"""Lean RMSNorm / SwiGLU: same outputs as transformers, right gradients, fewer saved bytes."""

import copy
import warnings

import pytest
import torch
from torch import nn
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

from rlhflab.backends import lean


def tiny_llama(**kw) -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = dict(
        vocab_size=50,
        hidden_size=16,
        intermediate_size=40,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
    )
    model = LlamaForCausalLM(LlamaConfig(**{**cfg, **kw}))
    with torch.no_grad():  # norms away from their all-ones start, so weight gradients matter
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.3 * torch.randn_like(p))
    return model


def saved_bytes(model, ids) -> tuple[torch.Tensor, int]:
    """Logits and the bytes autograd keeps for backward (parameters not counted)."""
    params = {p.data_ptr() for p in model.parameters()}
    seen = {}

    def pack(t):
        if t.data_ptr() not in params:
            seen[(t.data_ptr(), tuple(t.shape), t.stride())] = t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(input_ids=ids).logits
    return out, sum(seen.values())


def plain_rms_norm(x, w, eps):
    """Per-token loop in float64: y_i = w · x_i / sqrt(mean(x_i²) + eps)."""
    rows = []
    for row in x.reshape(-1, x.shape[-1]):
        rows.append(w * row / torch.sqrt((row * row).sum() / row.numel() + eps))
    return torch.stack(rows).reshape(x.shape)


def plain_swiglu(gate, up):
    return gate / (1 + torch.exp(-gate)) * up


def test_rms_norm_gradients_match_a_plain_loop_in_float64():
    torch.manual_seed(1)
    x = torch.randn(2, 3, 8, dtype=torch.float64, requires_grad=True)
    w = torch.randn(8, dtype=torch.float64, requires_grad=True)
    g = torch.randn(2, 3, 8, dtype=torch.float64)
    got = torch.autograd.grad((lean.rms_norm(x, w, 1e-6) * g).sum(), (x, w))
    want = torch.autograd.grad((plain_rms_norm(x, w, 1e-6) * g).sum(), (x, w))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    assert torch.autograd.gradcheck(lambda a, b: lean.rms_norm(a, b, 1e-6), (x, w))


@pytest.mark.parametrize("fused_down", [True, False])
def test_swiglu_gradients_match_a_plain_loop_in_float64(fused_down):
    torch.manual_seed(2)
    x = torch.randn(2, 3, 6, dtype=torch.float64, requires_grad=True)
    gate, up = nn.Linear(6, 10).double(), nn.Linear(6, 10).double()
    down = nn.Linear(10, 6).double()
    # a Linear subclass is not fused: the path taken for LoRA or quantised layers
    down_layer = down if fused_down else type("Wrapped", (nn.Linear,), {})(10, 6).double()
    if not fused_down:
        down_layer.load_state_dict(down.state_dict())
    inputs = (x, *gate.parameters(), *up.parameters(), *down_layer.parameters())
    out = lean.swiglu_mlp(x, gate, up, down_layer)
    want_out = down(plain_swiglu(gate(x), up(x)))
    torch.testing.assert_close(out, want_out, rtol=1e-12, atol=1e-12)
    g = torch.randn_like(out)
    got = torch.autograd.grad((out * g).sum(), inputs)
    want = torch.autograd.grad(
        (down_layer(plain_swiglu(gate(x), up(x))) * g).sum(), inputs, allow_unused=True
    )
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_lean_model_matches_transformers_and_keeps_fewer_bytes():
    model = tiny_llama()
    leaner = copy.deepcopy(model)
    assert lean.make_activations_lean(leaner) == 2 * 2 + 1 + 2  # 2 norms/layer, final, MLPs
    assert list(leaner.state_dict()) == list(model.state_dict())  # same keys: same checkpoints
    ids = torch.randint(0, 50, (3, 12))
    ref, ref_bytes = saved_bytes(model, ids)
    out, lean_bytes = saved_bytes(leaner, ids)
    assert torch.equal(out, ref)  # fp32: bit-identical forward, so the first PPO ratio is 1
    assert lean_bytes < 0.8 * ref_bytes
    (ref.sin().sum()).backward()
    (out.sin().sum()).backward()
    for (name, a), b in zip(model.named_parameters(), leaner.parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-4, atol=1e-6, msg=name)
    with torch.no_grad():  # sampling and scoring: the same numbers as with grad
        assert torch.equal(leaner(input_ids=ids).logits, ref.detach())


def test_lean_swap_works_under_lora():
    pytest.importorskip("peft")
    from rlhflab.models import apply_lora

    model = tiny_llama()
    lean.make_activations_lean(model)
    with warnings.catch_warnings():  # peft's transformers deprecation notice is not shown
        warnings.simplefilter("error", FutureWarning)
        wrapped = apply_lora(model, 2, 4.0, ["q_proj", "down_proj"])
    ids = torch.randint(0, 50, (2, 7))
    wrapped(input_ids=ids).logits.sum().backward()
    lora_grads = [p.grad for n, p in wrapped.named_parameters() if "lora_" in n]
    assert lora_grads and all(g is not None for g in lora_grads)


def test_other_architectures_are_left_alone():
    torch.manual_seed(0)
    gpt2 = GPT2LMHeadModel(GPT2Config(n_embd=16, n_layer=1, n_head=2, vocab_size=50))
    before = [type(m) for m in gpt2.modules()]
    assert lean.make_activations_lean(gpt2) == 0
    assert [type(m) for m in gpt2.modules()] == before
    # a Llama model with a non-SiLU activation keeps its MLP
    gelu = tiny_llama(hidden_act="gelu")
    assert lean.make_activations_lean(gelu) == 2 * 2 + 1
