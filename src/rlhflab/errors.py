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
    """`` (at FILE:LINE, in FUNCTION)`` for the innermost frame of ``exc``'s traceback — the
    line of a user's function that raised, which the one-line error a command prints would
    otherwise lose — or "" when it has none."""
    tb = exc.__traceback__
    if tb is None:
        return ""
    while tb.tb_next is not None:
        tb = tb.tb_next
    code = tb.tb_frame.f_code
    return f" (at {code.co_filename}:{tb.tb_lineno}, in {code.co_name})"
