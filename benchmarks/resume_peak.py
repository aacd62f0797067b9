"""Peak resident memory of resuming a PPO run from its checkpoint, against running it fresh.

The run is ``vs_trl.py``'s rlhflab side at one size (separate critic, fp32, one thread,
the allocator the ``rlhflab`` command starts on). One child writes a checkpoint after the
first iteration; then, each in a fresh interpreter, the same run goes to ``--iterations``
from scratch (``fresh``) and from that checkpoint (``resume``), printing its RSS before and
after loading the checkpoint and its peak (VmHWM) at the end. ``--baseline REV`` resumes
once more with the rlhflab of a git revision (checked out into a temporary worktree), for
before/after; the default, a7bd26a, is the last one that read the weights as a whole
state dict and copied the optimiser's moments out of the loaded one.

    .venv/bin/python benchmarks/resume_peak.py [--size 25M] [--baseline REV]   # ~2 min

Build the models first (``vs_trl.py --sizes 25M``). Nothing here runs inside ``make test``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent

CHILD = """
import sys
from pathlib import Path
import torch
torch.set_num_threads(1)
import vs_trl
from vs_trl_work import SIZES
from rlhflab import config

def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) / 1024

size, mode, label, out, iterations = sys.argv[1:6]


def load_config(base, _load=config.load_config, **kw):  # this run's folder, a checkpoint a step
    base["log"].update(output_dir=out, checkpoint_every=1)
    return _load(base=base, **kw)


config.load_config = load_config
made = {}
# run_rlhflab calls timed_fit through vs_trl's own name for it (from worker_process)
vs_trl.timed_fit = lambda trainer: made.setdefault("trainer", trainer)
folder = Path(vs_trl.__file__).parent / ".vs_trl" / f"models-{size}"
vs_trl.run_rlhflab(folder, SIZES[size][4], int(iterations), False, "native", "torch")
trainer = made["trainer"]
loading = {}
inner = trainer.load_checkpoint

def timed_load(path):
    loading["before"] = status("VmRSS")
    inner(path)
    loading["after"] = status("VmRSS")

trainer.load_checkpoint = timed_load
trainer.fit(resume=mode == "resume")
if loading:
    print(f"{mode} ({label}): RSS {loading['before']:.0f} -> {loading['after']:.0f} MiB "
          f"loading the checkpoint; peak {status('VmHWM'):.0f} MiB")
else:
    print(f"{mode}: peak {status('VmHWM'):.0f} MiB")
"""


def child(size: str, mode: str, src: Path, label: str, out: Path, iterations: int) -> None:
    """One run in a fresh interpreter, importing rlhflab from ``src``."""
    from rlhflab.backends.allocator import environment

    env = environment("auto", {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"})
    env["PYTHONPATH"] = os.pathsep.join([str(HERE), str(src)])
    cmd = [sys.executable, "-c", CHILD, size, mode, label, str(out), str(iterations)]
    subprocess.run(cmd, check=True, env=env)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", default="25M", choices=("0.2M", "4M", "25M"))
    ap.add_argument("--iterations", type=int, default=2, help="the run's length")
    ap.add_argument("--baseline", default="a7bd26a", help="git revision to compare ('': none)")
    args = ap.parse_args()
    if not (HERE / ".vs_trl" / f"models-{args.size}" / "policy").exists():
        sys.exit(f"no {args.size} models: run benchmarks/vs_trl.py --sizes {args.size} first")
    ours = HERE.parent / "src"
    with tempfile.TemporaryDirectory() as tmp:
        saved = Path(tmp) / "saved"
        child(args.size, "fresh", ours, "this tree", saved, 1)  # the checkpoint after 1
        child(args.size, "fresh", ours, "this tree", Path(tmp) / "fresh", args.iterations)
        sources = [("this tree", ours)]
        if args.baseline:
            base = Path(tmp) / "baseline"
            git = ["git", "-C", str(HERE.parent), "worktree"]
            subprocess.run([*git, "add", "-q", "--detach", str(base), args.baseline], check=True)
            sources.insert(0, (args.baseline, base / "src"))
        try:
            for i, (label, src) in enumerate(sources):
                run = Path(tmp) / f"resume-{i}"
                shutil.copytree(saved, run)
                child(args.size, "resume", src, label, run, args.iterations)
        finally:
            if args.baseline:
                subprocess.run([*git, "remove", "--force", str(base)], check=True)


if __name__ == "__main__":
    main()
