"""The one base class of the errors rlhflab raises on purpose.

Every error rlhflab raises for something a user can act on — a config field, a data row, a
model folder, a checkpoint, a reward function, a run it halted, a write that failed — is a
:class:`RlhflabError`, besides the built-in type it always was (``ValueError``,
``RuntimeError`` or ``OSError``), so ``except rlhflab.RlhflabError`` catches all of them
and nothing else: a bug inside rlhflab or torch stays an ordinary traceback. Kept free of
imports so that every module can take it.
"""


class RlhflabError(Exception):
    """Base of :class:`~rlhflab.ConfigError`, :class:`~rlhflab.DataError`,
    :class:`~rlhflab.ModelLoadError`, :class:`~rlhflab.CheckpointError`,
    :class:`~rlhflab.RewardError`, :class:`~rlhflab.TrainingHalted` and the rest of
    rlhflab's own errors; the message says what to change."""


def where_raised(exc: BaseException) -> str:
    """`` (at FILE:LINE, in FUNCTION)`` for the line of the user's code that raised ``exc``:
    the innermost frame outside Python's own library, installed packages and rlhflab (a
    reward function's ``json.loads`` raises inside the json module; its caller is the line
    to fix), or the innermost frame where every one is such; "" without a traceback."""
    import os
    import sysconfig

    libraries = tuple(
        os.path.realpath(sysconfig.get_paths()[k]) + os.sep
        for k in ("stdlib", "purelib", "platlib")
    ) + (os.path.dirname(os.path.realpath(__file__)) + os.sep,)
    tb, user, last = exc.__traceback__, None, None
    while tb is not None:
        last = tb
        if not os.path.realpath(tb.tb_frame.f_code.co_filename).startswith(libraries):
            user = tb
        tb = tb.tb_next
    found = user or last
    if found is None:
        return ""
    code = found.tb_frame.f_code
    return f" (at {code.co_filename}:{found.tb_lineno}, in {code.co_name})"
