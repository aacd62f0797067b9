"""Child processes that end with the process that started them.

``rlhflab compare`` trains each method in a child process and ``rlhflab sweep --jobs J``
runs J − 1 worker processes. Killed by a signal it cannot catch — SIGTERM from ``timeout``,
a scheduler or ``docker stop``, or ``kill -9`` — the parent ended and its children carried
on as orphans, training into the folder whose lock had just been released (outside testing,
stop 46: a second ``compare`` there was not refused). On Linux each child asks the kernel
for SIGTERM when its parent dies (``prctl(PR_SET_PDEATHSIG)``); elsewhere nothing changes.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1  # linux/prctl.h


def ends_with_parent():
    """A ``preexec_fn`` for :mod:`subprocess` (None where the kernel cannot do it): the
    child gets SIGTERM when this process dies, and exits at once if it already has. The
    C function is looked up here, in the parent: between fork and exec, in a process whose
    torch threads are running, the child only makes the system call (no library search,
    no ``dlopen``: those can deadlock there)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl  # the C library already loaded
    except (OSError, AttributeError):  # no prctl to be had: the children run as before
        return None
    parent = os.getpid()

    def arm() -> None:  # runs in the child, between fork and exec
        prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
        if os.getppid() != parent:  # the parent died before the request was made
            os._exit(1)

    return arm
