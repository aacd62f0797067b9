"""model.reference_low_weights: peak memory and scoring time of a bf16 PPO iteration with the
fp32 reference's Linear weights stored in bf16, against autocast casting them every forward.

The work is bf16_speedup.py's (its models, its PPO settings; ``--work 25M`` or
``SmolLM2-135M``) with ``model.compute_dtype=bf16``. Two measurements:

* peak: each setting in its own process, ``--iterations`` iterations, the run's own
  ``memory/peak_mib`` of the last one (the stored weights are resident all run long);
* time: one process, the reference's Linear weights swapped between fp32 and bf16 after every
  iteration (the same arithmetic either way), medians of ``time/score`` and of the whole
  iteration per setting, the first iteration left out.

    .venv/bin/python benchmarks/reference_low_weights.py --work SmolLM2-135M --iterations 13
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def _trainer(work: str, iterations: int, stored: bool, out: Path):
    sys.path.insert(0, str(HERE))
    import bf16_speedup as B
    import torch
    import vs_trl_work as base

    from rlhflab.config import load_config
    from rlhflab.trainers.ppo import PPOTrainer

    folder, _ = B.models_for(work, HERE / ".vs_trl")
    torch.set_num_threads(B.threads(work))
    if work == "25M":
        cfg = base.rlhflab_config(folder, base.SIZES["25M"][4], iterations, "native", "torch")
    else:
        cfg = B._real().rlhflab_real_config(folder, iterations, "rlhflab", {"cpu_matmul": "torch"})
    cfg["model"].update(compute_dtype="bf16", reference_low_weights=stored)
    cfg["log"].update(output_dir=str(out), earlier_run="replace")
    trainer = PPOTrainer(load_config(base=cfg))
    trainer.save = lambda *a, **k: None  # no checkpoint writes in the timings
    return trainer


def peak(work: str, iterations: int, stored: bool, out: Path) -> None:
    """Worker: print the last iteration's memory/peak_mib as JSON."""
    trainer = _trainer(work, iterations, stored, out)
    peaks: list[float] = []
    trainer.callbacks.append(lambda t, ro, m: peaks.append(m["memory/peak_mib"]))
    trainer.fit()
    print(json.dumps({"stored": stored, "peak_mib": peaks[-1]}))


def alternate(work: str, iterations: int, out: Path) -> dict:
    """In one process, the reference's Linear weights fp32 and bf16 in turn."""
    import torch
    from torch import nn

    trainer = _trainer(work, iterations, False, out)
    ref = trainer.cast.reference
    tied = {id(m.weight) for m in ref.modules() if isinstance(m, nn.Embedding)}
    layers = [m for m in ref.modules() if type(m) is nn.Linear and id(m.weight) not in tied]
    fp32 = [m.weight for m in layers]
    low = [nn.Parameter(w.detach().to(torch.bfloat16), requires_grad=False) for w in fp32]
    state = {"stored": False, "t": time.perf_counter()}
    rows: dict[bool, list] = {True: [], False: []}

    def flip(t, ro, m):
        now = time.perf_counter()
        rows[state["stored"]].append((now - state["t"], m["time/score"]))
        state["t"], state["stored"] = now, not state["stored"]
        for layer, w in zip(layers, low if state["stored"] else fp32):
            layer.weight = w

    trainer.callbacks.append(flip)
    trainer.fit()
    rows[False] = rows[False][1:]  # the first iteration warms up
    return {
        ("stored bf16" if k else "cast per forward"): {
            "iterations": len(v),
            "iteration_s": statistics.median(r[0] for r in v),
            "score_s": statistics.median(r[1] for r in v),
        }
        for k, v in rows.items()
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", default="SmolLM2-135M", choices=("25M", "SmolLM2-135M"))
    ap.add_argument("--iterations", type=int, default=13)
    ap.add_argument("--out", type=Path, default=Path("/tmp/reference_low_weights"))
    ap.add_argument("--peak-worker", choices=("on", "off"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.peak_worker:
        peak(args.work, 2, args.peak_worker == "on", args.out / f"peak-{args.peak_worker}")
        return
    for setting in ("off", "on"):
        cmd = [sys.executable, __file__, "--work", args.work, "--out", str(args.out)]
        done = subprocess.run([*cmd, "--peak-worker", setting], capture_output=True, text=True)
        line = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else done.stderr
        print(f"peak, reference_low_weights={setting}: {line}")
    print(json.dumps(alternate(args.work, args.iterations, args.out / "alternate"), indent=1))


if __name__ == "__main__":
    main()
