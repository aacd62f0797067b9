"""Defects found from outside in stop 47, each pinned by a test that fails on the old code."""

import io

from rlhflab.trainers import common


class _Terminal(io.StringIO):
    def isatty(self):
        return True


def test_a_progress_bar_redraws_rarely_when_stderr_is_a_log_file(monkeypatch):
    # a batch job's log got ten carriage-return-joined copies of the bar a second
    monkeypatch.setattr("sys.stderr", io.StringIO())
    bar = common.progress(range(3), True, "train")
    assert bar.mininterval == common.NON_TTY_INTERVAL
    list(bar)
    monkeypatch.setattr("sys.stderr", _Terminal())
    bar = common.progress(range(3), True, "train")
    assert bar.mininterval < 1
    list(bar)
    assert common.progress(range(3), False, "train") == range(3)
