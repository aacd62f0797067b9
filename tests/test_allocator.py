"""rlhflab --allocator: the command restarts itself on mimalloc, and only when asked."""

import os
import subprocess
import sys

import pytest

from rlhflab.backends import allocator


def _run(*args, **env):
    full = {k: v for k, v in os.environ.items() if not k.startswith(("RLHFLAB_ALLOC", "LD_PRE"))}
    return subprocess.run(
        [sys.executable, "-m", "rlhflab", *args, "config"],
        capture_output=True,
        text=True,
        env={**full, **env},
        timeout=120,
    )


@pytest.mark.skipif(allocator.mimalloc_library() is None, reason="cmeel-mimalloc not installed")
def test_the_command_restarts_on_mimalloc_unless_told_not_to():
    for args, env, expect in [
        ((), {}, "mimalloc"),  # auto
        (("--allocator", "mimalloc"), {}, "mimalloc"),
        (("--allocator", "system"), {}, "system"),
        ((), {"RLHFLAB_ALLOCATOR": "system"}, "system"),
    ]:
        done = _run(*args, **env)
        assert done.returncode == 0, done.stderr
        # read from /proc/self/maps by the process that ran the command
        assert f"allocator: {expect}" in done.stderr.splitlines()
        assert "seed = 0" in done.stdout


def test_environment_names_the_library_and_keeps_freed_memory():
    assert allocator.environment("system", {"A": "1"}) == {"A": "1"}
    lib = allocator.mimalloc_library()
    env = allocator.environment("auto", {"LD_PRELOAD": "/x.so"})
    if lib is None:
        assert "MIMALLOC_PURGE_DELAY" not in env and "MIMALLOC_ALLOW_THP" not in env
        return
    assert env["LD_PRELOAD"] == f"{lib}:/x.so" and lib.is_file()
    assert env["MIMALLOC_PURGE_DELAY"] == "-1"  # purging costs page faults (allocator.py)
    assert env["MIMALLOC_ALLOW_THP"] == "0"  # huge pages round RSS up (allocator.py)
    mine = {"MIMALLOC_PURGE_DELAY": "5", "MIMALLOC_ALLOW_THP": "1"}
    assert allocator.environment("auto", mine).items() >= mine.items()


def test_asking_for_mimalloc_where_it_is_missing_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(allocator, "mimalloc_library", lambda: None)
    with pytest.raises(allocator.AllocatorError, match="cmeel-mimalloc"):
        allocator.environment("mimalloc", {})
    assert "LD_PRELOAD" not in allocator.environment("auto", {})  # auto: quietly the system's
    with pytest.raises(allocator.AllocatorError, match="not one of"):
        allocator.environment("tcmalloc", {})


def test_python_dash_m_rlhflab_exits_with_the_commands_status():
    # `torchrun -m rlhflab` and `python -m rlhflab` go through __main__.py: a refused
    # config must fail the process, as the installed `rlhflab` script does (it exited 0)
    done = subprocess.run(
        [sys.executable, "-m", "rlhflab", "--allocator", "system", "ppo", "ppo.lr=-1"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2 and "ppo.lr" in done.stderr, done.stderr
