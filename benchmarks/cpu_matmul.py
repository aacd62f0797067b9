"""Which library multiplies faster on this CPU: torch.mm (MKL) or numpy.matmul (OpenBLAS)?

The evidence behind ``model.cpu_matmul`` (rlhflab/backends/cpu_blas.py). For the Linear shapes of
``vs_trl.py``'s Llama models, one thread, float32, it times the three products a Linear
layer runs in training — forward x·Wᵀ, input gradient g·W, weight gradient gᵀ·x — through
both libraries, with the operands laid out as autograd hands them over (W as stored, Wᵀ and
gᵀ as transposed views), at the row counts of scoring and training (16 answers × 72 tokens)
and of sampling (16 rows, one token each). Best of 3 interleaved timings per cell.

    python benchmarks/cpu_matmul.py               # the 25M shapes, ~1 min
    python benchmarks/cpu_matmul.py --size 4M

Nothing here runs inside ``make test``.
"""

from __future__ import annotations

import argparse
import platform
import time

import numpy as np
import torch

from rlhflab.backends.cpu_blas import set_numpy_blas_threads

# hidden, intermediate (vs_trl.py's SIZES); vocabulary 440 as there
SHAPES = {"0.2M": (64, 176), "4M": (256, 704), "25M": (512, 1408)}
VOCAB = 440


def rate(product, flops: float, seconds: float = 0.3) -> float:
    """GFLOP/s of ``product()`` over about ``seconds`` after one untimed call."""
    product()
    reps, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        product()
        reps += 1
    return flops * reps / (time.perf_counter() - t0) / 1e9


def products(rows: int, k: int, n: int):
    """(name, torch call, numpy call) for a Linear with W (n, k) on ``rows`` inputs."""
    x, w, g = torch.randn(rows, k), torch.randn(n, k), torch.randn(rows, n)
    xn, wn, gn = x.numpy(), w.numpy(), g.numpy()
    return [
        ("x·Wᵀ", lambda: torch.mm(x, w.t()), lambda: np.matmul(xn, wn.T)),
        ("g·W", lambda: torch.mm(g, w), lambda: np.matmul(gn, wn)),
        ("gᵀ·x", lambda: torch.mm(g.t(), x), lambda: np.matmul(gn.T, xn)),
    ]


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(x.split(":", 1)[1].strip() for x in f if x.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or "unknown CPU"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="25M", choices=list(SHAPES))
    ap.add_argument("--rows", type=int, nargs="+", default=[16 * 72, 16])
    args = ap.parse_args()
    torch.set_num_threads(1)
    if not set_numpy_blas_threads(1):
        print("warning: numpy's BLAS thread count unknown; set OPENBLAS_NUM_THREADS=1")
    hidden, inter = SHAPES[args.size]
    layers = {
        "q/k/v/o": (hidden, hidden),
        "gate/up": (hidden, inter),
        "down": (inter, hidden),
        "head": (hidden, VOCAB),
    }
    print(f"{cpu_name()}, torch {torch.__version__}, numpy {np.__version__}, one thread")
    print("| rows | layer (k→n) | product | torch GFLOP/s | numpy GFLOP/s | numpy/torch |")
    print("| ---: | --- | --- | ---: | ---: | ---: |")
    for rows in args.rows:
        for layer, (k, n) in layers.items():
            flops = 2 * rows * k * n
            for name, via_torch, via_numpy in products(rows, k, n):
                best = {"torch": 0.0, "numpy": 0.0}
                for _ in range(3):
                    best["torch"] = max(best["torch"], rate(via_torch, flops))
                    best["numpy"] = max(best["numpy"], rate(via_numpy, flops))
                print(
                    f"| {rows} | {layer} ({k}→{n}) | {name} | {best['torch']:.1f} | "
                    f"{best['numpy']:.1f} | {best['numpy'] / best['torch']:.2f} |"
                )


if __name__ == "__main__":
    main()
