"""What would a kernel compiler buy rlhflab's training pass? (issue 27)

One SmolLM2-135M decoder layer, forward and backward at the PPO benchmark's training shape
(``vs_trl_real.py``: 8 sequences of 68 positions, hidden 576), on the run's threads:

- ``rlhflab eager``: the native runtime's layer as PPO runs it (lean RMSNorm and SwiGLU
  autograd nodes, the two-pass rotary embedding);
- ``plain eager``: the same arithmetic written as transformers' Llama writes it;
- ``rlhflab compiled`` and ``plain compiled``: each through ``torch.compile`` (inductor's
  C++ kernels, which fuse the element-wise work between the products: norms, rotary,
  SwiGLU, residual adds, forward and backward). Under the compiler rlhflab's rotary takes
  the plain expression (inductor 2.13 fails on its ``out=`` products).

The products and attention are the same in all four, so the differences are what fusing
the element-wise work saves; the script checks the two functions agree.

    python benchmarks/compile_layer.py               # ~1-2 min, most of it compiling
    python benchmarks/compile_layer.py --threads 1

Needs a C++ compiler for inductor (``g++``). Nothing here runs inside ``make test``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from rlhflab.backends.lean import make_activations_lean
from rlhflab.backends.native import NativeDecoderLayer
from rlhflab.backends.native_config import NativeConfig, read_config

HERE = Path(__file__).resolve().parent
SMOLLM2 = HERE / ".vs_trl" / "models-smollm2" / "policy"
# SmolLM2-135M's shape, for a machine without the converted model
SMOLLM2_SHAPE = {
    "model_type": "llama",
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 1,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "rms_norm_eps": 1e-5,
    "rope_parameters": {"rope_type": "default", "rope_theta": 100000.0},
    "vocab_size": 49152,
    "hidden_act": "silu",
}


def plain_layer(layer: NativeDecoderLayer, cfg: NativeConfig):
    """``layer``'s arithmetic as transformers' Llama writes it (rotate_half, RMSNorm as
    three element-wise passes, SiLU times up), on ``layer``'s own weights."""
    attn, mlp = layer.self_attn, layer.mlp
    hd, eps = cfg.head_dim, cfg.rms_norm_eps

    def rms(x, w):
        return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))

    def rotary(x, c, s):
        x1, x2 = x[..., : hd // 2], x[..., hd // 2 :]
        return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), -1)

    def forward(h, cos, sin):
        B, L, _ = h.shape
        x = rms(h, layer.input_layernorm.weight)
        q = attn.q_proj(x).view(B, L, attn.heads, hd).transpose(1, 2)
        k = attn.k_proj(x).view(B, L, attn.kv_heads, hd).transpose(1, 2)
        v = attn.v_proj(x).view(B, L, attn.kv_heads, hd).transpose(1, 2)
        c, s = cos.unsqueeze(1), sin.unsqueeze(1)
        out = F.scaled_dot_product_attention(
            rotary(q, c, s), rotary(k, c, s), v, is_causal=True, enable_gqa=True
        )
        h = h + attn.o_proj(out.transpose(1, 2).reshape(B, L, -1))
        x = rms(h, layer.post_attention_layernorm.weight)
        return h + mlp.down_proj(F.silu(mlp.gate_proj(x)) * mlp.up_proj(x))

    return forward


def median_ms(step, repeats: int) -> float:
    for _ in range(3):
        step()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2, help="vs_trl_real.py's 2 by default")
    ap.add_argument("--rows", type=int, default=8, help="sequences (vs_trl_real.py: 8)")
    ap.add_argument("--length", type=int, default=68, help="positions (prompt 44 + answer 24)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=20, help="timed calls a round")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cfg = read_config(SMOLLM2) if SMOLLM2.exists() else NativeConfig(SMOLLM2_SHAPE)
    torch.manual_seed(0)
    layer = NativeDecoderLayer(cfg, 0)
    make_activations_lean(layer)
    B, L, hd = args.rows, args.length, cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta() ** (torch.arange(0, hd, 2).float() / hd))
    freqs = torch.arange(L).float()[None, :, None] * inv_freq
    cos, sin = freqs.cos().expand(B, L, -1), freqs.sin().expand(B, L, -1)
    h = torch.randn(B, L, cfg.hidden_size, requires_grad=True)
    grad = torch.randn(B, L, cfg.hidden_size)
    plain = plain_layer(layer, cfg)
    gap = (plain(h, cos, sin) - layer(h, cos, sin, None, None)).abs().max().item()
    print(f"plain vs rlhflab layer: max |difference| {gap:.2e}")
    t0 = time.perf_counter()
    compiled, ours = torch.compile(plain), torch.compile(layer)
    compiled(h, cos, sin).backward(grad)
    ours(h, cos, sin, None, None).backward(grad)
    print(f"compiling both, forward and backward: {time.perf_counter() - t0:.1f} s", flush=True)
    variants = {
        "rlhflab eager": lambda: layer(h, cos, sin, None, None).backward(grad),
        "rlhflab compiled": lambda: ours(h, cos, sin, None, None).backward(grad),
        "plain eager": lambda: plain(h, cos, sin).backward(grad),
        "plain compiled": lambda: compiled(h, cos, sin).backward(grad),
    }
    results: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(args.rounds):  # A B C A B C: drift hits every variant alike
        for name, step in variants.items():
            results[name].append(median_ms(step, args.repeats))
    print(
        f"one layer, forward + backward, ({B}, {L}, {cfg.hidden_size}), {args.threads} threads, "
        f"median of {args.rounds} rounds' medians:"
    )
    base = statistics.median(results["rlhflab eager"])
    for name, ms in results.items():
        m = statistics.median(ms)
        print(f"  {name:16s} {m:7.2f} ms  ({m - base:+.2f} ms against rlhflab eager)")


if __name__ == "__main__":
    main()
