"""The floor's memory-bound terms (``time_floor.py``; issue 27): a decoding step's products
as one pass over a whole model's worth of distinct weights, and AdamW's update per
parameter. Both are bound by how fast the weights (and the optimiser's state) stream from
memory, so they are timed on tensors too large for the cache, as the iteration meets them.

Nothing here runs inside ``make test``.
"""

from __future__ import annotations

import numpy as np
import torch
from cpu_matmul import rate  # this folder's benchmark: one timing loop for all

from rlhflab.backends.cpu_blas import set_numpy_blas_threads


def set_threads(n: int) -> None:
    """torch's and numpy's BLAS thread counts, both."""
    torch.set_num_threads(n)
    set_numpy_blas_threads(n)


def streamed_step_seconds(shapes: list, threads: int = 1, seconds: float = 0.5) -> tuple:
    """(seconds, GB/s) of one sampling step's products ``shapes`` ((m, k, n) for each
    product of one forward, repeats included) run as a decode step must run them: its few
    rows multiplied by every weight in turn, each weight its own tensor, so that a model
    larger than the cache streams its weights from memory as a real decode step does. Best
    over both libraries, both weight layouts and one thread or ``threads``; leaves
    ``threads`` set. The GB/s is the weights' bytes over the time."""
    weight_bytes = 4 * sum(k * n for _, k, n in shapes)
    best = float("inf")
    for transposed in (False, True):
        # constant weights: the timing of a product does not depend on its values, and
        # filling is far quicker than drawing random numbers for a whole model
        weights = [
            torch.full((n, k), 0.01).t() if transposed else torch.full((k, n), 0.01)
            for _, k, n in shapes
        ]
        inputs = {(m, k): torch.randn(m, k) for m, k, _ in shapes}
        pairs = [(inputs[(m, k)], w) for (m, k, _), w in zip(shapes, weights, strict=True)]
        numpy_pairs = [(x.numpy(), w.numpy()) for x, w in pairs]
        for t in sorted({1, threads}):
            set_threads(t)

            def with_torch(pairs=pairs):
                for x, w in pairs:
                    torch.mm(x, w)

            def with_numpy(pairs=numpy_pairs):
                for x, w in pairs:
                    np.matmul(x, w)

            for call in (with_torch, with_numpy):
                # rate() returns calls × flops / s / 1e9: with flops = 1e9, calls per second
                best = min(best, 1 / rate(call, 1e9, seconds=seconds))
        del weights, pairs, numpy_pairs
    set_threads(threads)
    return best, weight_bytes / best / 1e9


def adamw_seconds_per_parameter(parameters: int, threads: int = 1) -> float:
    """Seconds per parameter of one AdamW update (fp32 parameters, gradients and both
    moments, no clipping), the faster of torch's fused and foreach implementations, one
    thread or ``threads``, timed over up to 2**25 parameters in tensors of up to 2**22
    (large enough to stream from memory as a real model's update does); leaves ``threads``
    set."""
    n = min(parameters, 1 << 25)
    chunk = 1 << 22
    sizes = [chunk] * (n // chunk) + ([n % chunk] if n % chunk else [])
    best = float("inf")
    for t in sorted({1, threads}):
        set_threads(t)
        for variant in ("fused", "foreach"):
            params = [torch.nn.Parameter(torch.zeros(size)) for size in sizes]
            for p in params:
                p.grad = torch.full_like(p, 1e-3)
            opt = torch.optim.AdamW(params, lr=1e-6, **{variant: True})
            best = min(best, 1 / rate(opt.step, 1e9, seconds=0.5))
            del opt, params
    set_threads(threads)
    return best / n
