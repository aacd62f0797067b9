"""Memory accounting for the four-model cast (``rlhflab memory --config FILE``)."""

from __future__ import annotations

import resource
import sys
from dataclasses import dataclass

from rlhflab.models import module_bytes


def peak_rss_bytes() -> int:
    """Peak resident set size of this process so far.

    On Linux this reads ``VmHWM`` from ``/proc/self/status``: ``ru_maxrss`` carries the
    parent's peak across fork+exec (the kernel folds the old address space's high-water
    mark into it), so a worker started by a big parent would report the parent's peak.
    Elsewhere ``ru_maxrss`` (macOS reports bytes, other systems KiB).
    """
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


@dataclass
class ModelMemory:
    name: str
    weights: int  # bytes of all weights (shared tensors once; int8 at 1 byte)
    trainable: int  # bytes of the weights that get gradients
    gradients: int  # = trainable bytes
    optimizer: int  # AdamW keeps two moments per trainable weight

    @property
    def total(self) -> int:
        return self.weights + self.gradients + self.optimizer


def _trainable_bytes(model) -> int:
    params = getattr(model, "parameters", None)
    if params is None:
        return 0
    return sum(p.numel() * p.element_size() for p in params() if p.requires_grad)


def cast_memory(cast) -> list[ModelMemory]:
    """Per-model bytes. The LoRA reference shares the policy's weights and counts as 0."""
    rows = []
    for name, model in cast.models().items():
        weights = module_bytes(model) if hasattr(model, "state_dict") else 0
        trainable = _trainable_bytes(model)
        rows.append(ModelMemory(name, weights, trainable, trainable, 2 * trainable))
    return rows


def format_table(rows: list[ModelMemory], peak: int | None = None) -> str:
    mib = 1024 * 1024
    lines = [f"{'model':<10} {'weights':>10} {'grads':>10} {'optimizer':>10} {'total':>10}  (MiB)"]
    for r in rows:
        lines.append(
            f"{r.name:<10} {r.weights / mib:>10.2f} {r.gradients / mib:>10.2f} "
            f"{r.optimizer / mib:>10.2f} {r.total / mib:>10.2f}"
        )
    total = sum(r.total for r in rows)
    lines.append(
        f"{'total':<10} {sum(r.weights for r in rows) / mib:>10.2f} "
        f"{sum(r.gradients for r in rows) / mib:>10.2f} "
        f"{sum(r.optimizer for r in rows) / mib:>10.2f} {total / mib:>10.2f}"
    )
    if peak is not None:
        lines.append(f"measured peak resident memory while building: {peak / mib:.1f} MiB")
    return "\n".join(lines)
