"""Bytes that tensors hold, measured as torch's dispatcher sees them: what a function's
tensors keep alive (:func:`held_by`), what a forward keeps for backward and the most its
backward holds (:func:`forward_backward_bytes`), and what optimisers hold
(:func:`optimizer_held_bytes`). :mod:`~.memory` builds ``rlhflab memory``'s tables on them.
"""

from __future__ import annotations

import contextlib

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class NewStorages(TorchDispatchMode):
    """Sees every tensor operation's outputs and follows, by weak reference, each storage
    that is not one of the operation's inputs' (views and in-place results are not new
    memory): the bytes alive now, and the most that were alive after any operation."""

    def __init__(self):
        super().__init__()
        self.alive: dict[int, tuple[StorageWeakRef, int]] = {}
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {
            t.untyped_storage().data_ptr()
            for t in tree_flatten((args, kwargs))[0]
            if isinstance(t, torch.Tensor)
        }
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                if storage.data_ptr() not in inputs:
                    # keyed by address: one freed and reused replaces its dead entry
                    self.alive[storage.data_ptr()] = (StorageWeakRef(storage), storage.nbytes())
        self.peak = max(self.peak, self.held())
        return out

    def held(self) -> int:
        dead = [k for k, (ref, _) in self.alive.items() if ref.expired()]
        for k in dead:
            del self.alive[k]
        return sum(n for _, n in self.alive.values())


def held_by(fn) -> tuple[object, int, int]:
    """Run ``fn()``; return its result, the bytes of the tensors it created that are still
    alive when it returns — its outputs and, with grad on, everything its graph keeps for
    backward (activation checkpointing's kept inputs included, whatever holds them) — and
    the most bytes its tensors held at once after any operation.

    Every tensor operation is seen on its way through torch's dispatcher (a
    ``TorchDispatchMode``), on any device; memory made outside torch's operations —
    ``torch.from_numpy`` of numpy's own products under ``model.cpu_matmul=numpy`` — is not.
    """
    mode = NewStorages()
    with mode:
        out = fn()
    return out, mode.held(), mode.peak


def forward_backward_bytes(
    forward, model, gradients_exist: bool, autocast=contextlib.nullcontext
) -> tuple[int, int]:
    """Bytes that ``forward()`` keeps for backward, and the most that its forward and the
    backward of the sum of its outputs hold at once: activations, their gradients,
    recomputed checkpoint segments and the model's own gradients as backward makes them —
    or, with ``gradients_exist`` (micro-batches accumulating), only each fresh gradient
    before it is added into one made beforehand, which :func:`~.memory.estimated_peak` counts. The
    forward runs in ``autocast()``'s context. The model is left with no gradients."""
    params = [q for q in model.parameters() if q.requires_grad]
    for q in params:
        q.grad = torch.zeros_like(q) if gradients_exist else None
    tracker = NewStorages()
    try:
        with torch.enable_grad(), tracker:
            with autocast():
                outs = [o for o in forward() if o is not None and o.requires_grad]
            kept = tracker.held()
            sum(o.float().sum() for o in outs).backward()
            del outs
    finally:
        for q in params:
            q.grad = None
    return kept, tracker.peak


def optimizer_held_bytes(*optimizers) -> int:
    """Bytes of the optimisers' moments and of their parameters' gradients that exist now
    (each storage once; ``None`` optimisers skipped): what an iteration starts on top of
    the weights."""
    seen, total = set(), 0
    for opt in optimizers:
        if opt is None:
            continue
        tensors = [v for st in opt.state.values() for v in st.values() if torch.is_tensor(v)]
        tensors += [q.grad for g in opt.param_groups for q in g["params"] if q.grad is not None]
        for t in tensors:
            if t.untyped_storage().data_ptr() not in seen:
                seen.add(t.untyped_storage().data_ptr())
                total += t.untyped_storage().nbytes()
    return total
