"""Peak resident memory of `rlhflab sft` with and without `sft.micro_batch_size`.

Each run is its own process (the `rlhflab` command, as a user starts it); its peak RSS is
the kernel's count for that child (``ru_maxrss``). The SFT rows are the SmolLM2 example's
prompts (``examples/smollm2/task.py``) with one fixed assistant answer each, rendered with
the model's chat template; the same seed and steps in every run, so the logged losses must
agree to float rounding — the script prints them beside the peaks.

    python benchmarks/micro_batch_peak.py                       # SmolLM2-135M, batch 16
    python benchmarks/micro_batch_peak.py --micro 2 4 8 --batch 16 --steps 2

Needs the converted SmolLM2 folder (``make real-model``). Nothing here runs in ``make test``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ANSWER = (
    "Let me work it out step by step: the sum of the two numbers is what is asked, and I "
    "will give just the number as the answer now."
)


def sft_rows(folder: Path, n: int) -> Path:
    """``n`` SFT conversations: the example task's prompts, each with ANSWER."""
    subprocess.run(
        [sys.executable, str(HERE.parent / "examples/smollm2/task.py"), "data"],
        cwd=folder, check=True, capture_output=True,
    )  # fmt: skip
    rows = [json.loads(line) for line in (folder / "data/train.jsonl").open()][:n]
    out = folder / "sft.jsonl"
    with out.open("w") as f:
        for r in rows:
            answer = {"role": "assistant", "content": ANSWER}
            f.write(json.dumps({"messages": r["messages"] + [answer]}) + "\n")
    return out


def run(model: str, data: Path, out: Path, batch: int, steps: int, micro: int | None) -> dict:
    """One `rlhflab sft` process: its peak RSS (MiB; Linux counts ru_maxrss in KiB) and
    logged losses."""
    cmd = [str(Path(sys.executable).parent / "rlhflab"), "sft", f"model.policy={model}"]
    cmd += [f"sft.data={data}", f"sft.batch_size={batch}", f"sft.steps={steps}"]
    cmd += ["sft.warmup_steps=0", "sft.lr=1e-5", "log.progress=false", f"sft.output_dir={out}"]
    cmd += [f"sft.micro_batch_size={micro}"] if micro else []
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    _, status, usage = os.wait4(proc.pid, 0)
    if status != 0:
        raise SystemExit(f"failed: {' '.join(cmd)}\n{proc.stderr.read()[-2000:]}")
    losses = [json.loads(x)["loss"] for x in (out / "run/metrics.jsonl").open()]
    return {"peak_mib": usage.ru_maxrss / 1024, "losses": losses}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="model folder (default: converted SmolLM2)")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--micro", type=int, nargs="+", default=[2])
    args = ap.parse_args()
    sys.path.insert(0, str(HERE.parent / "examples/smollm2"))
    from prepare import default_folder  # the example's converted SmolLM2

    model = args.model or str(default_folder())
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        data = sft_rows(folder, max(64, args.batch))
        for micro in [None, *args.micro]:
            name = f"micro {micro}" if micro else "whole batch"
            got = run(model, data, folder / f"sft-{micro}", args.batch, args.steps, micro)
            losses = " ".join(f"{x:.4f}" for x in got["losses"])
            print(f"{name:>12}: peak {got['peak_mib']:7.0f} MiB, losses {losses}", flush=True)


if __name__ == "__main__":
    main()
