"""Result files written whole or not at all.

A summary, table or report that a user (or the next command) reloads must never be left
half-written by a crash, a full disk or ``kill -9`` in the middle of the write: the text
goes to a temporary file beside the target, which is then renamed over it
(``os.replace`` is atomic on POSIX and Windows within one file system), so a reader sees
either the old file or the new one. Checkpoints have their own manifest-based scheme
(:mod:`rlhflab.infra.checkpoint`).
"""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Iterable
from pathlib import Path

from rlhflab.errors import RlhflabError


def write_text_atomic(path: str | Path, text: str) -> Path:
    """Replace ``path`` with ``text`` (UTF-8) in one rename; its folder must exist. On any
    failure (an unencodable character, a full disk) the old file is left as it was and the
    temporary file is removed."""
    return write_lines_atomic(path, (text,))


def write_lines_atomic(path: str | Path, lines: Iterable[str]) -> Path:
    """Replace ``path`` with the concatenated ``lines`` (UTF-8, each with its own line end
    if it wants one) in one rename, streamed: a JSONL file of many rows is never held
    whole. As :func:`write_text_atomic` on failure — including one raised by ``lines``
    itself (a row that cannot be serialised): the old file stays, the temporary goes."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with writing(path, "file"), tmp.open("w", encoding="utf-8") as f:
            for line in lines:
                f.write(line)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):  # a read-only folder: keep the first error
            tmp.unlink(missing_ok=True)
        raise
    return path


class WriteFailed(RlhflabError, OSError):
    """Files rlhflab writes could not be written (a full disk, most often); the message
    names where. Raised by :func:`writing` in place of the writer's own error, which for
    torch's and safetensors' writers names no file."""


# the OS errors of a write that failed (a file not found is not one)
WRITE_ERRNOS = frozenset(
    (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.EIO, errno.EFBIG)
)
# how torch.save (PytorchStreamWriter / inline_container) and safetensors ("Error while
# serializing: I/O error") report a failed write: RuntimeError and SafetensorError, no errno
WRITER_WORDS = ("PytorchStreamWriter", "inline_container", "Error while serializing")


@contextlib.contextmanager
def writing(where: str | Path, what: str = "files"):
    """Turn a failed write inside the body into :class:`WriteFailed` naming ``where`` (the
    folder or file being written); any other exception passes as it is."""
    try:
        yield
    except WriteFailed:
        raise
    except Exception as exc:
        if isinstance(exc, OSError):
            if exc.errno not in WRITE_ERRNOS:  # a file not found, say: not a write's failure
                raise
            reason = exc.strerror + (f" ({exc.filename})" if exc.filename else "")
        elif any(w in str(exc) for w in WRITER_WORDS):
            reason = str(exc).splitlines()[0]
        else:
            raise
        full = "No space left" in str(exc) or "unexpected pos" in str(exc)
        hint = " (is the disk full?)" if full or not isinstance(exc, OSError) else ""
        raise WriteFailed(f"{where}: the {what} could not be written{hint}: {reason}") from exc


def current_umask() -> int:
    """The process's umask, read from /proc (Linux) where it can be; elsewhere by setting
    it and setting it back, which is not safe against another thread creating a file in
    between, so read afresh on every call rather than cached."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def share_like_umask(folder: str | Path) -> None:
    """Give the safetensors files under ``folder`` the mode the umask gives new files
    (usually 0644): safetensors creates its files owner-only (0600), so a model saved on a
    shared machine would be unreadable by the teammates every other file of it is readable
    by. Only those files (nothing else a user keeps in the folder changes mode), and only
    the ones this process owns. Called on a finished folder before it is put in place."""
    mode = 0o666 & ~current_umask()
    owner = os.getuid() if hasattr(os, "getuid") else None  # POSIX; Windows has no modes
    for f in Path(folder).rglob("*.safetensors"):
        if f.is_file() and not f.is_symlink() and owner in (None, f.stat().st_uid):
            os.chmod(f, mode)
