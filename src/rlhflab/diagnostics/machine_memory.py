"""What this machine and process have: resident memory now and at its peak, and the memory
a device can still give (``rlhflab memory``'s fit checks; every trainer's memory/peak_mib)."""

from __future__ import annotations

import resource
import sys
from pathlib import Path

import torch


def _status_bytes(key: str) -> int | None:
    """A ``/proc/self/status`` figure (kB) in bytes; None off Linux."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def rss_bytes() -> int:
    """Resident set size of this process now (Linux ``VmRSS``; elsewhere the peak)."""
    now = _status_bytes("VmRSS")
    return now if now is not None else peak_rss_bytes()


def peak_rss_bytes() -> int:
    """Peak resident set size of this process so far.

    On Linux this reads ``VmHWM`` from ``/proc/self/status``: ``ru_maxrss`` carries the
    parent's peak across fork+exec (the kernel folds the old address space's high-water
    mark into it), so a worker started by a big parent would report the parent's peak.
    Elsewhere ``ru_maxrss`` (macOS reports bytes, other systems KiB).
    """
    peak = _status_bytes("VmHWM")
    if peak is not None:
        return peak
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def free_bytes(device) -> int | None:
    """Memory that ``device`` can still give: the GPU's free bytes, or Linux's
    ``MemAvailable`` (less, inside a container whose cgroup limit is nearer); None where
    neither can be read."""
    device = torch.device(device)
    if device.type == "cuda":  # and what torch's allocator keeps reserved but unused
        unused = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return torch.cuda.mem_get_info(device)[0] + unused
    free = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    free = int(line.split()[1]) * 1024
    except OSError:
        pass
    try:  # a container's own limit (cgroup v2), which MemAvailable does not see
        cgroup = Path("/sys/fs/cgroup")
        limit = (cgroup / "memory.max").read_text().strip()
        if limit != "max":
            # the page cache the kernel can reclaim counts in memory.current: added back,
            # as Docker and the kubelet count a working set
            stat = dict(ln.split() for ln in (cgroup / "memory.stat").read_text().splitlines())
            used = int((cgroup / "memory.current").read_text()) - int(stat.get("inactive_file", 0))
            left = max(int(limit) - used, 0)
            free = left if free is None else min(free, left)
    except (OSError, ValueError):
        pass
    return free
