"""``run.json``: the facts of a run that its metrics do not carry, for the report and for
anyone comparing runs later: when it started and finished, its wall time, the versions of
rlhflab, torch and Python, the machine and its CPU (and GPU), and what the trainer adds
(model sizes; a PPO run's gold-reward story, :mod:`rlhflab.diagnostics.gold_curve`).

Written when the run starts (so a crashed run still says what it ran on), at each checkpoint
(the wall time so far) and when it ends, each time whole and atomically (a temporary file renamed over the old one).
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
from datetime import datetime
from pathlib import Path

import torch

import rlhflab
from rlhflab.infra.files import write_text_atomic
from rlhflab.infra.runlog import read_json

RUN_INFO = "run.json"


def cpu_name() -> str:
    """The CPU's model name (Linux's /proc/cpuinfo), else what ``platform`` knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text(errors="replace").splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def machine_facts() -> dict:
    """Versions and hardware of this process: what a timing or a result depends on."""
    facts = {
        "rlhflab": rlhflab.__version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(terse=True),
        "cpu": cpu_name(),
        "cpu_cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
    }
    if torch.cuda.is_available():
        facts["gpu"] = torch.cuda.get_device_name(0)
    return facts


def now() -> str:
    """The local time with its UTC offset, to the second (ISO 8601)."""
    return datetime.now().astimezone().isoformat(timespec="seconds")


def read_run_info(run_dir: str | Path) -> dict | None:
    """The run's run.json, or None where there is none (a run from before 2026-12-06) or it
    cannot be read (a warning says so)."""
    path = Path(run_dir) / RUN_INFO
    if not path.is_file():
        return None
    info = read_json(path)
    return info if isinstance(info, dict) else None


def write_run_info(run_dir: str | Path, info: dict) -> Path:
    """Replace the run's run.json with ``info`` in one rename."""
    path = Path(run_dir) / RUN_INFO
    return write_text_atomic(path, json.dumps(info, indent=2, ensure_ascii=False, default=str))


# the data file each trainer reads: a --resume after it changed trains on other data
DATA_FIELDS = {"SFT": ("sft", "data"), "RM": ("rm", "data"), "DPO": ("dpo", "data")}
PROMPTS = ("data", "prompts")  # PPO, GRPO, RLOO
_EDGE = 1 << 20  # bytes hashed at each end of a file: fast for a many-GB file


def data_fingerprints(config: dict, trainer: str) -> dict[str, dict]:
    """``section.field`` → size and a hash of the first and last MiB of the local data
    file ``trainer`` reads (for a dataset folder: of its files' names and sizes). Not a
    proof of sameness, but an edit or a replaced file shows."""
    out = {}
    for sec, name in [DATA_FIELDS.get(trainer, PROMPTS)]:
        value = (config.get(sec) or {}).get(name)
        path = Path(value).expanduser() if isinstance(value, str) and value else None
        if path is None or not path.exists():
            continue
        digest = hashlib.sha256()
        if path.is_dir():
            for f in sorted(p for p in path.rglob("*") if p.is_file()):
                digest.update(f"{f.relative_to(path)}:{f.stat().st_size}\n".encode())
            out[f"{sec}.{name}"] = {"path": str(path), "sha256": digest.hexdigest()}
            continue
        size = path.stat().st_size
        with path.open("rb") as f:
            digest.update(f.read(_EDGE))
            if size > _EDGE:  # the last MiB, or all the rest of a file under 2 MiB
                f.seek(max(_EDGE, size - _EDGE))
                digest.update(f.read())
        out[f"{sec}.{name}"] = {"path": str(path), "size": size, "sha256": digest.hexdigest()}
    return out


def data_changes(before: dict | None, now: dict) -> list[str]:
    """The data files whose fingerprint differs from ``before`` (run.json's)."""
    before = before or {}
    return [
        f"{key} ({now[key]['path']})"
        for key in now
        if key in before
        and {k: v for k, v in before[key].items() if k != "path"}
        != {k: v for k, v in now[key].items() if k != "path"}
    ]
