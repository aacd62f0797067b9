"""Where a start of a run writes what a Python caller passed as objects
(:mod:`rlhflab.app.inputs` writes them): ``inputs/``, or a fresh ``inputs-<UTC time>/`` beside
an earlier start's; the folder a resume reads; the data a resume given none goes on with."""

from __future__ import annotations

import logging
import time
from pathlib import Path

from rlhflab.config import Config
from rlhflab.trainers.resume_checks import read_recorded_config

log = logging.getLogger(__name__)


def inputs_folder(parent: Path, resume: bool, recorded: Path | None = None) -> Path:
    """Where this start writes what a Python caller passed as objects, in the run folder
    ``parent``: a resumed run, the folder its config.yaml names (the data it began with;
    else the newest); a fresh start, ``inputs/`` — or, where that holds an earlier start's
    files, ``inputs-<UTC time>/``: writing over them would change the data the earlier
    run's config.yaml names (its logs and checkpoints are set aside, not its inputs) and,
    if this start never trains, that run's own, which a resume would then read.
    ``recorded``: the folder of that config.yaml where it is not ``parent`` (an ensemble's
    member 0)."""
    starts = sorted(
        p for p in parent.glob("inputs*") if p.is_dir() and p.name.split("-")[0] == "inputs"
    )
    if resume:  # the one the run's config.yaml names (a later refused start made another)
        named = _named_inputs(recorded or parent, starts)
        return named or (starts[-1] if starts else parent / "inputs")
    first = parent / "inputs"
    if not first.is_dir() or not any(first.iterdir()):
        return first
    stamp = time.strftime("inputs-%Y%m%d-%H%M%S", time.gmtime())
    folder, n = parent / stamp, 1
    while folder.exists():  # two starts within a second
        n += 1
        folder = parent / f"{stamp}-{n}"
    return folder


def _named_inputs(parent: Path, starts: list[Path]) -> Path | None:
    """The inputs folder among ``starts`` that a path in ``parent``'s config.yaml lies in
    (its data, its policy's copy), or None."""
    saved = _recorded(parent)
    found = {p.resolve(): p for p in starts}
    # the policy's copy first: a resume given other data put only that in a newer folder
    policy = (saved.get("model") or {}).get("policy")
    values = [saved, policy]
    while values:
        v = values.pop()
        if isinstance(v, dict):
            values += list(v.values())
        elif isinstance(v, list):
            values += v
        elif isinstance(v, str) and "/" in v:
            for folder in Path(v).resolve().parents:
                if folder in found:
                    return found[folder]
    return None


def set_data(cfg: Config, given: str | None, dotted: str, run_dir, resume: bool) -> None:
    """The data setting ``dotted`` (``data.prompts``, ``dpo.data`` …) set to ``given``; on a
    resume given none, with the config's unset, the run's own from its config.yaml: else
    the run would go on with the built-in data instead of what it trained on."""
    section, key = dotted.split(".")
    values = getattr(cfg, section)
    if given is not None or not resume or getattr(values, key) is not None:
        if given is not None:
            setattr(values, key, given)
        return
    recorded = ((_recorded(Path(run_dir)).get(section)) or {}).get(key)
    if recorded is not None:
        log.info("resuming with the run's own %s: %s", dotted, recorded)
        setattr(values, key, recorded)


def _recorded(run_dir: Path) -> dict:
    """The run's config.yaml as a dict; {} where there is none (a first start) or it cannot
    be read (warned: the resume's own checks say what is wrong)."""
    path = run_dir / "config.yaml"
    return read_recorded_config(path) if path.is_file() else {}
