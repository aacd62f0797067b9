"""The rewards only Python can pass — a lambda, a closure, a function of ``__main__`` — on
record in a run's ``inputs/``: their names, weights and a digest of their code, so that a
resume that cannot bring them (the command line) is refused, and a Python resume that
brings others, or the same name with other code, is told that its objective changes."""

from __future__ import annotations

import json
import logging
from pathlib import Path

from rlhflab.config import ConfigError
from rlhflab.infra.files import write_text_atomic

log = logging.getLogger(__name__)

PYTHON_REWARDS = "python_rewards.json"


def note_python_rewards(run_dir: Path, extra, gold) -> None:
    """Record in ``RUN/inputs/`` the rewards that only Python could pass (their names), so
    that a resume from the command line, which cannot bring them, is refused instead of
    continuing on another objective; removed when there are none."""
    path = run_dir / "inputs" / PYTHON_REWARDS
    names, code = _names_and_code(extra, gold)
    if not names:
        path.unlink(missing_ok=True)
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    # and their weights, which no config.yaml holds: the report shows a part's weight (a
    # number weights the source's one part, named after it; a dict weights parts by name;
    # the parts of a source that returns a dict under one number stay unknown here)
    weights: dict[str, float] = {}
    for source, w in extra:
        if isinstance(w, dict):
            weights.update({str(k): float(v) for k, v in w.items()})
        elif isinstance(w, (int, float)):
            weights[source.name] = float(w)
    record = {"rewards": names, "weights": weights, "code": code}
    write_text_atomic(path, json.dumps(record))


def _names_and_code(extra, gold) -> tuple[list[str], dict[str, str | None]]:
    """The Python rewards' names (the gold one as ``gold NAME``) and each one's code digest:
    what a start records and what a resume compares."""
    sources = [source for source, _ in extra] + ([gold] if gold else [])
    names = [source.name for source, _ in extra] + ([f"gold {gold.name}"] if gold else [])
    return names, {name: code_digest(source.fn) for name, source in zip(names, sources)}


def code_digest(fn) -> str | None:
    """A digest of a function's code — its bytecode, names and constants, nested code
    (comprehensions, inner functions) included, not the values a closure captured — to tell
    on a resume whether the function passed again is the one the run began with (a lambda is
    named ``<lambda>`` whatever it computes). The same in every process: a set literal's
    constant is hashed in sorted order, not in its iteration order, which PYTHONHASHSEED
    changes. None for a callable without code of its own (a builtin, a C function)."""
    import hashlib

    target = getattr(fn, "func", fn)  # functools.partial
    code = getattr(target, "__code__", None)
    if code is None:  # a callable object: its class's own __call__
        code = getattr(type(target).__dict__.get("__call__"), "__code__", None)
    if code is None:
        return None
    digest = hashlib.sha256()
    _digest_code(code, digest)
    return digest.hexdigest()[:16]


def _digest_code(code, digest) -> None:
    digest.update(code.co_code)
    digest.update(repr(code.co_names).encode())
    for const in code.co_consts:
        if hasattr(const, "co_code"):
            _digest_code(const, digest)
        elif isinstance(const, frozenset):
            digest.update(repr(sorted(map(repr, const))).encode())
        else:
            digest.update(repr(const).encode())
        digest.update(b"\0")


def check_resumed_python_rewards(run_dir: Path, extra, gold, configured: bool) -> None:
    """A resume from Python against what the run's first start recorded of its Python
    rewards (``note_python_rewards``): none passed again, where nothing else scores, is
    refused naming them (not the generic "set reward.model" of a config without rewards);
    other names, or the same name with other code, are warned about: the objective changes
    from this step on, as a changed config's would (and the warning says so, as that one's
    does). ``configured``: the config names a reward model, ensemble or function."""
    path = Path(run_dir) / "inputs" / PYTHON_REWARDS
    if not path.is_file():
        return
    try:
        recorded = json.loads(path.read_text(encoding="utf-8"))
        before = [str(n) for n in recorded.get("rewards", [])]
        before_code = dict(recorded.get("code") or {})
    except (OSError, ValueError, AttributeError, TypeError):
        log.warning("resume: %s cannot be read; the Python rewards are not compared", path)
        return
    now, now_code = _names_and_code(extra, gold)
    rewards_before = [n for n in before if not n.startswith("gold ")]
    if rewards_before and not extra and not configured:
        raise ConfigError(
            f"reward: {run_dir} was trained with Python rewards its config.yaml cannot name "
            f"({', '.join(rewards_before)}); pass them again: "
            "rlhflab.PPOTrainer(..., reward=..., resume=True)"
        )
    if sorted(before) != sorted(now):
        log.warning(
            "resume: the run trained with the Python rewards %s; this start passes %s: the "
            "objective (or the gold curve) changes from here on",
            ", ".join(before) or "none",
            ", ".join(now) or "none",
        )
        return
    changed = [
        n for n in now if before_code.get(n) and now_code.get(n) and before_code[n] != now_code[n]
    ]
    if changed:
        log.warning(
            "resume: %s passed again with other code than the run began with: the objective "
            "(or the gold curve) changes from here on",
            ", ".join(changed),
        )


def refuse_resume_without_python_rewards(run_dir: str | Path) -> None:
    """``--resume`` from the command line of a run that a Python caller gave rewards no
    config can name: refused, naming them."""
    path = Path(run_dir) / "inputs" / PYTHON_REWARDS
    if path.is_file():
        names = json.loads(path.read_text()).get("rewards", [])
        raise ConfigError(
            f"--resume: {run_dir} was trained with Python rewards its config.yaml cannot name "
            f"({', '.join(names)}); resume it from Python, passing them again "
            "(rlhflab.PPOTrainer(..., resume=True))"
        )
