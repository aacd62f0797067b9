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
