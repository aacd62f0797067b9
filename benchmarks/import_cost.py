"""Resident memory of what a run imports before its first weight: transformers vs native.

Each step runs in a fresh interpreter (imports cannot be undone) and prints the process's
RSS after: importing torch; constructing a ``torch.optim.AdamW`` (its methods import
``torch._dynamo`` on first call) or rlhflab's ``FusedAdamW``; loading the tokenizer; loading
a small Llama policy through transformers or through ``model.runtime=native``. The model is
vs_trl.py's 0.2M policy (built there, or here with ``--build``) so weights add ~1 MiB.

    .venv/bin/python benchmarks/import_cost.py          # ~20 s

Nothing here runs inside ``make test``.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent

STEPS = {
    "transformers": [
        ("import torch", "import torch"),
        (
            "torch.optim.AdamW(fused=True)",
            "torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], fused=True)",
        ),
        ("AutoTokenizer.from_pretrained", "tok = M.load_tokenizer(F)"),
        ("AutoModelForCausalLM.from_pretrained", "M.load_causal_lm(F, tok)"),
    ],
    "native": [
        ("import torch", "import torch"),
        (
            "rlhflab FusedAdamW",
            "from rlhflab.backends.optim import FusedAdamW; "
            "FusedAdamW([torch.nn.Parameter(torch.zeros(1))])",
        ),
        ("PreTrainedTokenizerFast (runtime=native)", "tok = M.load_tokenizer(F, runtime='native')"),
        ("native Llama (runtime=native)", "M.load_causal_lm(F, tok, runtime='native')"),
    ],
}

PROBE = """
import sys
def rss():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS"):
            return int(line.split()[1]) / 1024
F = {folder!r}
from rlhflab import models as M
{code}
heavy = [m for m in ("torch._dynamo", "sympy", "transformers.modeling_utils") if m in sys.modules]
print("RSS", rss(), ",".join(heavy) or "-")
"""


def measure(folder: Path, steps: list[tuple[str, str]]) -> list[tuple[str, float, str]]:
    rows, code = [], []
    for name, line in steps:
        code.append(line)
        script = PROBE.format(folder=str(folder), code="\n".join(code))
        done = subprocess.run(
            [sys.executable, "-c", script],
            capture_output=True,
            text=True,
            env={"PYTHONPATH": str(HERE.parent / "src"), "PATH": "/usr/bin:/bin"},
        )
        out = [x for x in done.stdout.splitlines() if x.startswith("RSS ")]
        if done.returncode != 0 or not out:
            raise RuntimeError(f"{name}: {done.stderr[-2000:]}")
        _, rss, heavy = out[-1].split(" ")
        rows.append((name, float(rss), heavy))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", default=str(HERE / ".vs_trl"), help="vs_trl.py's work folder")
    ap.add_argument("--build", action="store_true", help="build the 0.2M models if missing")
    args = ap.parse_args()
    folder = Path(args.work) / "models-0.2M"
    if not (folder / "policy" / "config.json").exists():
        if not args.build:
            sys.exit(f"{folder} is missing: run benchmarks/vs_trl.py once, or pass --build")
        sys.path.insert(0, str(HERE))
        from vs_trl_work import build_models

        build_models("0.2M", folder)
    for runtime, steps in STEPS.items():
        print(f"## runtime={runtime}")
        print("| after | RSS MiB | compiler stack / transformers modelling imported |")
        print("| --- | ---: | --- |")
        for name, rss, heavy in measure(folder / "policy", steps):
            print(f"| {name} | {rss:.0f} | {heavy} |")
        print()


if __name__ == "__main__":
    main()
