"""The errors a command says in one line (``error: ...``, status 2) instead of a traceback:
a user's mistake in config, data, model folder or reward function, or a run halted on a loss
that is not finite. Imported lazily: each names a module of its own."""

from __future__ import annotations


def user_errors() -> tuple[type[BaseException], ...]:
    from rlhflab.config.base import ConfigError
    from rlhflab.experience.rewards import RewardError
    from rlhflab.models import ModelLoadError
    from rlhflab.trainers.common import TrainingHalted

    errors: list[type[BaseException]] = [ConfigError, ModelLoadError, RewardError]
    errors.append(TrainingHalted)  # a non-finite loss: the message says what to lower
    from rlhflab.infra.checkpoint import CheckpointError
    from rlhflab.infra.runlog import RunLogError

    errors += [CheckpointError, RunLogError]  # a run directory damaged past resuming
    from rlhflab.experience.sampling import UndrawableLogits

    errors.append(UndrawableLogits)  # NaN logits: said in one line, with what to try
    try:
        from rlhflab.experience.data import DataError

        errors.append(DataError)
    except ImportError:
        pass
    return tuple(errors)


def every_rank_errors() -> tuple[type[BaseException], ...]:
    """User errors every rank meets together: the same config, and halts decided on
    metrics averaged over the ranks. Any other (a reward function raising on one rank's
    answers, a file missing on one node) a rank may meet alone."""
    from rlhflab.config.base import ConfigError
    from rlhflab.trainers.common import TrainingHalted

    return (ConfigError, TrainingHalted)


def storage_error(exc: BaseException) -> str | None:
    """The one line for a file the command could not write (a read-only or full disk, no
    permission), or None for any other error: the OS's own words name the file."""
    import errno

    from rlhflab.infra.files import WRITER_WORDS, WriteFailed

    if isinstance(exc, WriteFailed):  # names the folder itself
        return str(exc)
    if isinstance(exc, OSError) and exc.errno in (
        errno.EROFS, errno.ENOSPC, errno.EDQUOT, errno.EACCES, errno.EPERM,
    ):  # fmt: skip
        where = exc.filename or "writing a file failed"
        hint = "; free some space and run it again" if exc.errno == errno.ENOSPC else ""
        return f"{where}: {exc.strerror}{hint}"
    # torch's and safetensors' writers say a full disk their own way, without the file
    # (writers that rlhflab.infra.files.writing wraps name it)
    if any(w in str(exc) for w in WRITER_WORDS):
        return f"writing a file failed (is the disk full?): {str(exc).splitlines()[0]}"
    return None


def say_repeated_overrides(overrides: list[str] | None) -> None:
    """Overrides (a command line, a Python list) that set one key twice with different
    values (``ppo.lr=1e-5 ... ppo.lr=3e-5``): the last wins, as scripts that append to a
    base list expect, and it is said (it won without a word). The same value twice is
    harmless. A bad override is left to the config's loader, which names it."""
    import logging

    from rlhflab.config.base import ConfigError, parse_override

    seen: dict[str, tuple[str, object]] = {}
    for text in overrides or []:
        try:
            path, value = parse_override(text)
        except ConfigError:
            continue
        key = ".".join(path)
        if key in seen and seen[key][1] != value:
            logging.getLogger("rlhflab").warning(
                "%s: given twice in the overrides (%r, then %r); the last is used",
                key, seen[key][0], text,
            )  # fmt: skip
        seen[key] = (text, value)
