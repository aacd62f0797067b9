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


def streamed_step_seconds(shapes: list, threads: int = 1, seconds: float = 0.3) -> tuple:
    """(seconds, GB/s) of one sampling step's products ``shapes`` ((m, k, n) for each
    product of one forward, repeats included) run as a decode step must run them: its few
    rows multiplied by every weight in turn, each weight its own tensor, so that the
    weights come from wherever a whole model's worth of them can stay between steps (the
    last-level cache for a small model, memory for a large one), as in a real decode step.

    Each product shape takes its own library (torch or numpy) and weight layout (as stored
    or transposed), chosen by one pass of coordinate search from the best uniform choice,
    so that no mix of choices an implementation could make is left faster; the thread
    count (1 or ``threads``) is the whole pass's. Leaves ``threads`` set. The GB/s is the
    weights' bytes over the time."""
    weight_bytes = 4 * sum(k * n for _, k, n in shapes)
    # constant weights: the timing of a product does not depend on its values, and filling
    # is far quicker than drawing random numbers for a whole model; both layouts held
    stored = {
        False: [torch.full((k, n), 0.01) for _, k, n in shapes],
        True: [torch.full((n, k), 0.01).t() for _, k, n in shapes],
    }
    inputs = {(m, k): torch.randn(m, k) for m, k, _ in shapes}
    options = [(lib, transposed) for lib in ("torch", "numpy") for transposed in (False, True)]

    def pass_seconds(choice: dict) -> float:
        calls = []
        for i, (m, k, n) in enumerate(shapes):
            lib, transposed = choice[(m, k, n)]
            x, w = inputs[(m, k)], stored[transposed][i]
            calls.append((torch.mm, x, w) if lib == "torch" else (np.matmul, x.numpy(), w.numpy()))

        def one_pass():
            for mm, x, w in calls:
                mm(x, w)

        # rate() returns calls × flops / s / 1e9: with flops = 1e9, calls per second
        return 1 / rate(one_pass, 1e9, seconds=seconds)

    best = float("inf")
    groups = sorted(set(shapes))
    for t in sorted({1, threads}):
        set_threads(t)
        uniform = {o: pass_seconds(dict.fromkeys(groups, o)) for o in options}
        choice = dict.fromkeys(groups, min(uniform, key=uniform.get))
        current = uniform[choice[groups[0]]]
        for g in groups:  # one sweep: each shape's own best, the others held
            for o in options:
                if o != choice[g]:
                    trial = pass_seconds({**choice, g: o})
                    if trial < current:
                        choice, current = {**choice, g: o}, trial
        best = min(best, current)
    set_threads(threads)
    return best, weight_bytes / best / 1e9


def adamw_seconds_per_parameter(parameters: int, threads: int = 1) -> float:
    """Seconds per parameter of one AdamW update (fp32, no clipping), the faster of torch's
    fused and foreach implementations, one thread or ``threads``, over up to 2**25
    parameters in tensors of 2**20: the parameters and both moments streamed (3 × 128 MiB
    at most, from memory where that outgrows the last-level cache), the gradient in cache:
    one gradient tensor shared by every parameter, as when ``ppo.step_in_backward``
    updates a tensor right after its gradient is written, the cheapest an update can be.
    Leaves ``threads`` set."""
    n = min(parameters, 1 << 25)
    chunk = min(n, 1 << 20)
    sizes = [chunk] * (n // chunk) + ([n % chunk] if n % chunk else [])
    grad = torch.full((chunk,), 1e-3)
    best = float("inf")
    for t in sorted({1, threads}):
        set_threads(t)
        for variant in ("fused", "foreach"):
            params = [torch.nn.Parameter(torch.zeros(size)) for size in sizes]
            for p in params:
                p.grad = grad[: p.numel()]
            opt = torch.optim.AdamW(params, lr=1e-6, **{variant: True})
            best = min(best, 1 / rate(opt.step, 1e9, seconds=0.5))
            del opt, params
    set_threads(threads)
    return best / n
