"""Dropping freshly written shared libraries from the page cache (``make install`` runs it).

Why: a process's resident memory counts every page of a shared library it has mapped, and
how many pages one page fault maps depends on how the file sits in the page cache. Files
that pip has just written sit there in the large folios the write made (ext4 keeps written
data in folios of up to 1 MiB on Linux 6.16 and later); a fault in one of them maps the
whole folio. Read in by a process's own page faults they come in 4 KiB pages instead.
Measured 2026-12-06 (Intel Xeon VM, Linux 6.18, ext4): right after ``make install`` all
398 MiB of ``libtorch_cpu.so`` that were cached sat in 1 MiB folios, and
``benchmarks/vs_trl.py``'s 0.2M rlhflab worker peaked at 388 MiB, 135 MiB of it that one
library; after dropping it from the cache, 317 MiB with 67 MiB of the library — the same
anonymous memory (212 MiB) in both. Those are clean file pages the kernel may reclaim, not
memory the run allocates, but they count in its peak RSS until something evicts them, so
the install does that once for the environment it has just written.

Pages that some process has mapped stay cached (the kernel drops only unmapped ones), and
pages not yet written back cannot be dropped, so each file is synced first. Nothing here
imports torch: importing it would map the very pages to be dropped.

    python -m rlhflab.infra.pagecache .venv     # what `make install` runs after pip
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable
from pathlib import Path


def shared_libraries(root: Path) -> list[Path]:
    """The shared libraries (``*.so``, ``*.so.N…``) under ``root``, links left out."""
    return sorted(
        p
        for p in Path(root).rglob("*.so*")
        if (p.name.endswith(".so") or ".so." in p.name) and p.is_file() and not p.is_symlink()
    )


def drop(paths: Iterable[Path]) -> int:
    """Write back and drop each file's cached pages; returns how many files were dropped
    (0 where the platform has no ``posix_fadvise``, e.g. macOS)."""
    if not hasattr(os, "posix_fadvise"):
        return 0
    count = 0
    for path in paths:
        # an optimisation only: a file it cannot open, sync or advise on (permissions, a
        # filesystem without fdatasync, a file gone meanwhile) is skipped, never an error
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue
        try:
            if hasattr(os, "fdatasync"):
                os.fdatasync(fd)  # dirty pages are not dropped
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            count += 1
        except OSError:
            pass
        finally:
            os.close(fd)
    return count


def main(argv: list[str] | None = None) -> None:
    folders = sys.argv[1:] if argv is None else argv
    if not folders:
        sys.exit("usage: python -m rlhflab.infra.pagecache FOLDER...")
    for folder in folders:
        libs = shared_libraries(Path(folder))
        n = drop(libs)
        print(f"page cache: dropped {n} of {len(libs)} shared libraries under {folder}")


if __name__ == "__main__":
    main()
