"""Which ``malloc`` an rlhflab process runs on, and starting it on mimalloc (Linux).

Why: on the CPU every tensor is a ``malloc`` block, and PPO's pattern — a forward that keeps
hundreds of activation-sized blocks, a backward that frees them while allocating gradients
of other sizes, then sampling with yet other sizes — fragments glibc's heap. Measured in
the 25M PPO worker of ``benchmarks/vs_trl.py`` (docs/benchmarks.md): at its peak the heap
held 1563 MiB of which 523 MiB were free holes too small or too split up to reuse, so peak
RSS sat ~500 MiB above the live tensors. glibc can be told to hand large blocks back
(``MALLOC_MMAP_THRESHOLD_``), but then every such block starts with fresh page faults
(+25–30 % time). mimalloc keeps blocks of one size class together, so freed blocks are
reused by the next ones of that size: 25M worker peak 1839 → 1574 MiB at the same seconds
per iteration. With its default purging (freed memory handed back after 10 ms) the peak was
lower still (1518 MiB) but each iteration 25 % slower, for the same page-fault reason; so
rlhflab starts it with ``MIMALLOC_PURGE_DELAY=-1`` (keep freed memory for reuse), and with
``MIMALLOC_ALLOW_THP=0``: mimalloc otherwise asks the kernel for transparent huge pages on
its arenas, which on a ``madvise``-mode kernel rounds resident memory up to 2 MiB pages —
peak RSS 1577 → 1489 MiB at 25M and 351 → 318 MiB at 0.2M without it, at the same seconds
per iteration (back to back, 2026-12-04, docs/benchmarks.md). A variable the caller set
wins over either default.

The allocator of a process is fixed when it starts, so the ``rlhflab`` command re-executes
itself once, with ``LD_PRELOAD`` naming the ``libmimalloc.so`` of the ``cmeel-mimalloc``
wheel (a dependency on Linux). Code that starts its own worker processes calls
:func:`environment` for theirs. Nothing here changes any arithmetic: the same run gives the
same numbers on either allocator.
"""

from __future__ import annotations

import importlib.metadata
import os
import sys
from pathlib import Path

from rlhflab.errors import RlhflabError

CHOICES = ("auto", "mimalloc", "system")
ENV_CHOICE = "RLHFLAB_ALLOCATOR"  # the default of ``rlhflab --allocator``
_STARTED = "RLHFLAB_ALLOCATOR_STARTED"  # set in the re-executed process: never loop


class AllocatorError(RlhflabError, RuntimeError):
    """An allocator was asked for that this machine cannot provide (message says why)."""


def mimalloc_library() -> Path | None:
    """``libmimalloc.so`` of the installed ``cmeel-mimalloc`` wheel, or None."""
    try:
        dist = importlib.metadata.distribution("cmeel-mimalloc")
    except importlib.metadata.PackageNotFoundError:
        return None
    path = Path(str(dist.locate_file("cmeel.prefix/lib/libmimalloc.so")))
    return path if path.is_file() else None


def in_use() -> str:
    """'mimalloc' when this process has libmimalloc mapped, else 'system'."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return "system"
    return "mimalloc" if "libmimalloc" in maps else "system"


def environment(choice: str, env: dict[str, str] | None = None) -> dict[str, str]:
    """A copy of ``env`` (default: this process's) that starts a new process on ``choice``.

    'auto' means mimalloc where it is installed and the platform is Linux, else the system
    allocator; 'mimalloc' insists (:class:`AllocatorError` if it cannot be had); 'system'
    leaves the environment as it is.
    """
    if choice not in CHOICES:
        raise AllocatorError(f"allocator: {choice!r} is not one of {', '.join(CHOICES)}")
    out = dict(os.environ if env is None else env)
    if choice == "system":
        return out
    lib = mimalloc_library() if sys.platform.startswith("linux") else None
    if lib is None:
        if choice == "mimalloc":
            raise AllocatorError(
                "allocator: mimalloc needs Linux and the cmeel-mimalloc package "
                "(pip install cmeel-mimalloc); use --allocator system"
            )
        return out
    out["LD_PRELOAD"] = ":".join(x for x in (str(lib), out.get("LD_PRELOAD", "")) if x)
    out.setdefault("MIMALLOC_PURGE_DELAY", "-1")
    out.setdefault("MIMALLOC_ALLOW_THP", "0")  # no 2 MiB rounding of resident memory
    out[_STARTED] = "1"
    return out


def restart_under(choice: str, argv: list[str]) -> None:
    """Re-execute ``python -m rlhflab ARGV`` on ``choice`` unless this process already is
    the restarted one or nothing would change. Returns only when no restart happens."""
    if os.environ.get(_STARTED) or choice == "system":
        return
    env = environment(choice)
    if _STARTED not in env:  # auto, and mimalloc is not available here
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, "-m", "rlhflab", *argv], env)
