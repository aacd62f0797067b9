"""Lean RMSNorm/SwiGLU (model.lean_activations) against transformers' modules.

One Llama-style model of vs_trl.py's 25M shape (or --size), a batch of 16 sequences, one
torch thread. Each mode runs in its own process: bytes autograd saves for backward (counted
with saved_tensors_hooks, parameters excluded), median seconds of forward+backward over
--steps steps after one warm-up, and the worker's peak RSS (VmHWM).

    .venv/bin/python benchmarks/lean_activations.py [--size 25M] [--tokens 96] [--steps 6]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from vs_trl_work import SIZES, bare_llama  # noqa: E402
from worker_process import _peak_rss_mib  # noqa: E402


def worker(mode: str, size: str, tokens: int, steps: int) -> dict:
    import torch

    from rlhflab.backends.lean import make_activations_lean

    torch.set_num_threads(1)
    model = bare_llama(size).train()
    if mode == "lean":
        make_activations_lean(model)
    ids = torch.randint(0, 440, (16, tokens))
    params = {p.data_ptr() for p in model.parameters()}
    saved: dict = {}

    def pack(t):
        if t.data_ptr() not in params:
            saved[(t.data_ptr(), tuple(t.shape), t.stride())] = t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(input_ids=ids).logits.float().logsumexp(-1).mean().backward()
    times = []
    for _ in range(steps):
        model.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        model(input_ids=ids).logits.float().logsumexp(-1).mean().backward()
        times.append(time.perf_counter() - t0)
    return {
        "saved_mib": sum(saved.values()) / 2**20,
        "s_per_step": statistics.median(times),
        "spread": [min(times), max(times)],
        "peak_mib": _peak_rss_mib(),
    }


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        mode, size, tokens, steps = sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
        print("RESULT " + json.dumps(worker(mode, size, tokens, steps)))
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="25M", choices=list(SIZES))
    ap.add_argument("--tokens", type=int, default=96, help="sequence length")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=2, help="A B rounds")
    args = ap.parse_args()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(HERE.parent / "src")}
    rows: dict[str, list[dict]] = {"transformers": [], "lean": []}
    for _ in range(args.rounds):
        for mode in rows:
            cmd = [sys.executable, __file__, "--worker", mode, args.size]
            cmd += [str(args.tokens), str(args.steps)]
            out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True)
            rows[mode].append(json.loads(out.stdout.split("RESULT ")[-1]))
    print(f"size {args.size}, 16 x {args.tokens} tokens, forward + backward, one thread")
    print("| modules | saved for backward MiB | s per step (min-max) | peak RSS MiB |")
    print("| --- | ---: | ---: | ---: |")
    for mode, runs in rows.items():
        s = statistics.median(r["s_per_step"] for r in runs)
        lo = min(r["spread"][0] for r in runs)
        hi = max(r["spread"][1] for r in runs)
        peak = statistics.median(r["peak_mib"] for r in runs)
        print(f"| {mode} | {runs[0]['saved_mib']:.0f} | {s:.3f} ({lo:.3f}-{hi:.3f}) | {peak:.0f} |")


if __name__ == "__main__":
    main()
