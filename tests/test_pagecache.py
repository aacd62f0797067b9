"""make install drops the new environment's shared libraries from the page cache
(rlhflab/infra/pagecache.py: pip leaves them in large folios that the first runs map whole)."""

import ctypes
import mmap
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rlhflab.infra import pagecache

ROOT = Path(__file__).resolve().parent.parent


def test_the_install_drops_the_environment_from_the_page_cache_after_pip():
    recipe = ROOT.joinpath("Makefile").read_text().split("$(STAMP): pyproject.toml\n")[1]
    steps = [line.strip() for line in recipe.split("\n\n")[0].splitlines()]
    drop = steps.index("$(BIN)/python -m rlhflab.infra.pagecache $(VENV)")
    last_pip = max(i for i, step in enumerate(steps) if "-m pip install" in step)
    assert last_pip < drop < steps.index("touch $(STAMP)")


def test_the_module_does_not_import_torch():
    # importing torch would map the very pages it is asked to drop
    code = "import sys, rlhflab.infra.pagecache; print('torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.stdout.strip() == "False", done.stderr


def test_shared_libraries_are_so_files_not_links(tmp_path):
    for name in ("a.so", "b.so.1", "c.so.1.2", "d.py", "e.sources", "f.sox"):
        (tmp_path / name).write_bytes(b"x")
    (tmp_path / "g.so").symlink_to(tmp_path / "a.so")
    assert [p.name for p in pagecache.shared_libraries(tmp_path)] == ["a.so", "b.so.1", "c.so.1.2"]


def _filesystem(path: Path) -> str:
    dev = os.stat(path).st_dev
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        fields, fstype = line.split(" - ")[0].split(), line.split(" - ")[1].split()[0]
        major, minor = map(int, fields[2].split(":"))
        if os.makedev(major, minor) == dev:
            return fstype
    return "?"


def _cached_pages(path: Path) -> int:
    """Pages of ``path`` in the page cache (mincore over a mapping that touches none)."""
    size, page = path.stat().st_size, mmap.PAGESIZE
    with open(path, "rb") as f, mmap.mmap(f.fileno(), size, prot=mmap.PROT_READ):
        vec = (ctypes.c_ubyte * ((size + page - 1) // page))()
        libc = ctypes.CDLL(None, use_errno=True)
        start = ctypes.c_void_p(_mapping_address(path))
        assert libc.mincore(start, ctypes.c_size_t(size), vec) == 0, os.strerror(ctypes.get_errno())
        return sum(v & 1 for v in vec)


def _mapping_address(path: Path) -> int:
    real = str(path.resolve())
    for line in Path("/proc/self/maps").read_text().splitlines():
        parts = line.split()
        if len(parts) >= 6 and parts[5] == real:
            return int(parts[0].split("-")[0], 16)
    raise AssertionError(f"{real} is not mapped")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="posix_fadvise and mincore")
def test_a_freshly_written_file_leaves_the_page_cache(tmp_path):
    if _filesystem(tmp_path) not in ("ext4", "ext3", "xfs", "btrfs"):
        pytest.skip(f"{_filesystem(tmp_path)}: not a disk filesystem whose cache can be dropped")
    lib = tmp_path / "libfresh.so"
    lib.write_bytes(os.urandom(1 << 20))
    assert _cached_pages(lib) > 0  # as written
    assert pagecache.drop([lib]) == 1
    assert _cached_pages(lib) == 0


def test_a_file_that_cannot_be_opened_is_skipped_not_an_error(tmp_path):
    """The install step is an optimisation: it must never fail `make install`."""
    assert pagecache.drop([tmp_path / "gone.so"]) == 0
    pagecache.main([str(tmp_path)])  # an empty folder: nothing to drop, no error
