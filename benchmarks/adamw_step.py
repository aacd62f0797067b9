"""Seconds per AdamW step on a 25M-parameter Llama policy, per-tensor loop vs fused (1 thread).

rlhflab builds AdamW with ``fused=True`` where torch supports it (``trainers/common.py``);
this is the measurement behind that choice. A PPO iteration of ``benchmarks/vs_trl.py`` at
25M takes 8 optimiser steps (4 epochs × policy and critic).

    python benchmarks/adamw_step.py
"""

from __future__ import annotations

import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM
from vs_trl import SIZES


def main(reps: int = 5) -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    hidden, inter, layers, heads, _ = SIZES["25M"]  # the policy of vs_trl.py's 25M size
    cfg = LlamaConfig(
        vocab_size=440,
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        tie_word_embeddings=True,
    )
    model = LlamaForCausalLM(cfg)
    n = sum(p.numel() for p in model.parameters())
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    for fused in (False, True):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=fused)
        opt.step()  # allocate the moments outside the timing
        t0 = time.perf_counter()
        for _ in range(reps):
            opt.step()
        dt = (time.perf_counter() - t0) / reps
        print(f"{n / 1e6:.1f}M parameters, fused={fused}: {dt * 1000:.1f} ms per step")


if __name__ == "__main__":
    main()
