"""Peak resident memory of loading one checkpoint through ``model.runtime=native``.

Each reader runs in a fresh interpreter, which prints its VmHWM before and after
``load_native`` and the loaded weights' size: the rise of the peak over the weights is what
reading cost on top of them. ``stream`` is rlhflab's reader (each tensor read from the file
into its own memory, ``native_models.read_safetensors``); ``bytes`` is the one it replaced
(the whole file as bytes, then ``safetensors.torch.load``). The default model is
vs_trl.py's 25M policy (build it with ``vs_trl.py --sizes 25M`` or pass any folder).

    .venv/bin/python benchmarks/load_peak.py [--folder DIR] [--dtype bfloat16]   # ~10 s

Nothing here runs inside ``make test``.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent

CHILD = """
import sys, torch
from pathlib import Path
from rlhflab.backends import native_models as N

def hwm_mib():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM"):
            return int(line.split()[1]) / 1024

folder, reader, dtype = Path(sys.argv[1]), sys.argv[2], getattr(torch, sys.argv[3])
if reader == "bytes":  # the reader before 2026-12-05
    from safetensors.torch import load as load_bytes

    def read_safetensors(path, dtype=None):
        return {k: v.to(dtype) for k, v in load_bytes(path.read_bytes()).items()}

    N.read_safetensors = read_safetensors
before = hwm_mib()
model = N.load_native(folder, "causal", dtype=dtype)
weights = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
print(f"{reader}: weights {weights:.0f} MiB, peak {before:.0f} -> {hwm_mib():.0f} MiB, "
      f"rise {hwm_mib() - before:.0f} MiB")
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--folder", default=str(HERE / ".vs_trl" / "models-25M" / "policy"))
    ap.add_argument("--dtype", default="float32", help="the dtype the model is loaded in")
    args = ap.parse_args()
    if not (Path(args.folder) / "config.json").exists():
        sys.exit(f"{args.folder}: no checkpoint there (vs_trl.py --sizes 25M builds one)")
    for reader in ("bytes", "stream"):
        cmd = [sys.executable, "-c", CHILD, args.folder, reader, args.dtype]
        subprocess.run(cmd, check=True)


if __name__ == "__main__":
    main()
