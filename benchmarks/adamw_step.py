"""Seconds per AdamW step on a 25M-parameter Llama policy, per-tensor loop vs fused (1 thread).

rlhflab builds AdamW with ``fused=True`` where torch supports it (``trainers/common.py``);
this is the measurement behind that choice. A PPO iteration of ``benchmarks/vs_trl.py`` at
25M takes 8 optimiser steps (4 epochs × policy and critic).

    python benchmarks/adamw_step.py
"""

from __future__ import annotations

import time

import torch
from vs_trl_work import bare_llama


def main(reps: int = 5) -> None:
    torch.set_num_threads(1)
    model = bare_llama("25M")  # the policy of vs_trl.py's 25M size
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
