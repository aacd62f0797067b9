"""One run at a time in a run directory.

Two runs started in one output folder (a job submitted twice, a notebook cell run while
the command still trains) would append to the same ``metrics.jsonl``, truncate it under
each other on resume, and write checkpoints that interleave two trainings. The run loop
holds an advisory lock on ``<run_dir>/.rlhflab.lock`` for as long as it runs; a second
run there is refused with the process that holds it. The kernel drops the lock when its
process ends however it ends (``kill -9`` included), so a killed run never leaves a stale
lock behind and ``--resume`` works at once.

``flock`` is POSIX (Linux, macOS); where it does not exist (Windows), or the file system
refuses it (NFS without its lock daemon), runs are not locked (the latter said once).
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from pathlib import Path

from rlhflab.config import ConfigError

try:
    import fcntl
except ImportError:  # Windows
    fcntl = None

LOCK_NAME = ".rlhflab.lock"
log = logging.getLogger(__name__)


@contextlib.contextmanager
def run_lock(run_dir: Path, field: str = "log.output_dir") -> Iterator[None]:
    """Hold ``run_dir``'s lock for the body; ConfigError naming ``field`` (the setting that
    chose the folder) when another process holds it. The folders this call made, when they
    hold nothing but the lock as the body ends (a run refused, or failing, before it wrote
    anything), are removed again."""
    run_dir = Path(run_dir)
    made = [p for p in (run_dir, *run_dir.parents) if not p.exists()]  # innermost first
    path = run_dir / LOCK_NAME
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        try:  # 0o666 less the umask, as every file of the run: a teammate's resume opens it
            fd, writable = os.open(path, os.O_RDWR | os.O_CREAT, 0o666), True
        except PermissionError:  # another user's lock file: flock works on a read-only handle
            fd, writable = os.open(path, os.O_RDONLY), False
    except OSError as exc:  # a folder that cannot be made or written (read-only, immutable)
        for folder in made:
            with contextlib.suppress(OSError):
                folder.rmdir()
        raise ConfigError(
            f"{field}: {run_dir} cannot be written ({exc.strerror or exc}); give a folder you "
            "can write"
        ) from None
    held = False
    try:
        if fcntl is not None:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.read(fd, 32).decode("ascii", "replace").strip() or "unknown"
                raise ConfigError(
                    f"{field}: another rlhflab run (process {holder}) is training in "
                    f"{run_dir}; wait for it to end, or give this run another folder"
                ) from None
            except OSError as exc:  # a file system without locks (NFS without lockd, ...)
                log.warning("%s: not locked (%s); run one training at a time here", path, exc)
        held = True
        if writable:
            os.ftruncate(fd, 0)
            os.write(fd, f"{os.getpid()}\n".encode())
        yield
    finally:
        os.close(fd)  # releases the lock
        if made and held:
            with contextlib.suppress(OSError):  # a folder holding more stops the walk up
                if [p.name for p in run_dir.iterdir()] == [LOCK_NAME]:
                    path.unlink()
                    for folder in made:
                        folder.rmdir()


@contextlib.contextmanager
def rank_zero_lock(run_dir: Path, field: str, is_main: bool) -> Iterator[None]:
    """:func:`run_lock` held by the process that writes the run's files (rank 0 under
    torchrun); with a process group, its refusal is sent to every rank, which all raise it
    (ConfigError: rank 0 says it once) instead of the others dying in their next
    collective with a transport error."""
    import torch.distributed as dist

    grouped = dist.is_available() and dist.is_initialized()
    with contextlib.ExitStack() as stack:
        refused = None
        if is_main:
            try:
                stack.enter_context(run_lock(run_dir, field))
            except ConfigError as exc:
                if not grouped:
                    raise
                refused = str(exc)
        if grouped:
            said = [refused]
            dist.broadcast_object_list(said, src=0)
            if said[0] is not None:
                raise ConfigError(said[0])
        yield


def refuse_held(run_dir: Path, field: str, is_main: bool) -> None:
    """Refuse now, before any model loads, a folder another run holds (the run takes the
    lock itself when it starts: :func:`rank_zero_lock`); collective under torchrun."""
    with rank_zero_lock(run_dir, field, is_main):
        pass
