"""Result files written whole or not at all.

A summary, table or report that a user (or the next command) reloads must never be left
half-written by a crash, a full disk or ``kill -9`` in the middle of the write: the text
goes to a temporary file beside the target, which is then renamed over it
(``os.replace`` is atomic on POSIX and Windows within one file system), so a reader sees
either the old file or the new one. Checkpoints have their own manifest-based scheme
(:mod:`rlhflab.infra.checkpoint`).
"""

from __future__ import annotations

import os
from pathlib import Path


def write_text_atomic(path: str | Path, text: str) -> Path:
    """Replace ``path`` with ``text`` (UTF-8) in one rename; its folder must exist. On any
    failure (an unencodable character, a full disk) the old file is left as it was and the
    temporary file is removed."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


_UMASK: int | None = None


def _umask() -> int:
    global _UMASK
    if _UMASK is None:  # os.umask can only be read by setting it: once, and set back
        _UMASK = os.umask(0o022)
        os.umask(_UMASK)
    return _UMASK


def share_like_umask(folder: str | Path) -> None:
    """Give every file under ``folder`` the mode the process's umask gives new files
    (usually 0644). safetensors creates its files owner-only (0600), so a model saved on a
    shared machine would be unreadable by the teammates every other file is readable by.
    Called on a finished folder before it is put in place."""
    mode = 0o666 & ~_umask()
    for f in Path(folder).rglob("*"):
        if f.is_file() and not f.is_symlink():
            os.chmod(f, mode)
