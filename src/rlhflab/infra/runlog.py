"""The run directory's logs: metrics.jsonl every iteration, samples.jsonl, and optional
TensorBoard / Weights & Biases mirrors. Only this module knows where metrics go.

A run killed (or a machine losing power) while a line is being appended leaves that last
line cut short. Every reader of these files — and of the JSON files a run writes beside
them — goes through :func:`read_jsonl_lines` / :func:`read_json`, which skip such a torn
tail with a warning and keep every complete line.
"""

from __future__ import annotations

import json
import logging
import math
import os
from pathlib import Path

from rlhflab.errors import RlhflabError

log = logging.getLogger(__name__)


def _finite_or_none(v):
    return v if not isinstance(v, float) or math.isfinite(v) else None


class RunLog:
    def __init__(
        self,
        run_dir: Path,
        tensorboard: bool = False,
        wandb: bool = False,
        config: dict | None = None,
        resume_step: int | None = None,
    ):
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.metrics_path = self.run_dir / "metrics.jsonl"
        self.samples_path = self.run_dir / "samples.jsonl"
        self.alerts_path = self.run_dir / "alerts.jsonl"
        paths = (self.metrics_path, self.samples_path, self.alerts_path)
        if resume_step is not None:
            # Lines written after the checkpoint belong to iterations that will run again.
            for p in paths:
                self._truncate_after(p, resume_step)
        else:
            for p in paths:
                p.unlink(missing_ok=True)
        # every run has one, empty while no alert fired: a script reading it needs no
        # existence check (metrics and samples appear with the first iteration)
        self.alerts_path.touch()
        self.tb = self.wandb = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.tb = SummaryWriter(str(self.run_dir / "tensorboard"))
            except ImportError as exc:  # installed (checked before) but broken
                raise _broken("tensorboard", exc) from None
        if wandb:
            try:
                import wandb as wb

                self.wandb = wb.init(
                    project="rlhflab", dir=str(self.run_dir), config=config, resume="allow"
                )
            except ImportError as exc:
                raise _broken("wandb", exc) from None

    @staticmethod
    def _truncate_after(path: Path, step: int) -> None:
        """Keep the complete lines up to iteration ``step`` (a torn tail goes too, so new
        lines start on a line of their own); replaced in one rename, never half-written."""
        if not path.exists():
            return
        keep = [ln for ln, row in read_jsonl_lines(path) if row.get("iteration", 0) <= step]
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text("".join(ln + "\n" for ln in keep), encoding="utf-8")
        os.replace(tmp, path)

    def metrics(self, iteration: int, values: dict) -> None:
        row = {"iteration": iteration, **{k: _finite_or_none(v) for k, v in values.items()}}
        with self.metrics_path.open("a", encoding="utf-8") as f:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
        if self.tb is not None:
            for k, v in values.items():
                if isinstance(v, (int, float)):
                    self.tb.add_scalar(k, v, iteration)
        if self.wandb is not None:
            self.wandb.log(values, step=iteration)

    def samples(self, iteration: int, rows: list[dict]) -> None:
        with self.samples_path.open("a", encoding="utf-8") as f:
            for r in rows:
                f.write(json.dumps({"iteration": iteration, **r}, ensure_ascii=False) + "\n")

    def alerts(self, rows: list[dict]) -> None:
        if not rows:
            return
        with self.alerts_path.open("a", encoding="utf-8") as f:
            for r in rows:
                f.write(json.dumps(r, ensure_ascii=False) + "\n")

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()


def _broken(field: str, exc: ImportError):
    from rlhflab.config import ConfigError

    return ConfigError(
        f"log.{field}: the package does not import ({exc}); mend it, or set log.{field}=false"
    )


def refuse_missing_loggers(tensorboard: bool, wandb: bool) -> None:
    """``log.tensorboard``/``log.wandb`` asked for without the package: refused, naming the
    field — a warning at the start of a run that goes on for hours, then has no curves
    where the user will look, was too easy to miss. The trainers call it before any model
    loads (every rank alike)."""
    import importlib.util

    from rlhflab.config import ConfigError

    for field, on, package in (
        ("tensorboard", tensorboard, "tensorboard"),
        ("wandb", wandb, "wandb"),
    ):
        if on and importlib.util.find_spec(package) is None:
            raise ConfigError(
                f"log.{field}: the {package} package is not installed; pip install {package}, "
                f"or set log.{field}=false (metrics.jsonl is written either way)"
            )


class RunLogError(RlhflabError, ValueError):
    """A run-directory file damaged other than by a crash; the message names file and line."""


def read_jsonl_lines(path: Path) -> list[tuple[str, dict]]:
    """(line text, row) of every complete line of a JSONL log, in order.

    The last line, if not a whole JSON object (cut mid-write: possibly mid-character), is
    skipped with a warning. A bad line anywhere else is no crash's doing: RunLogError.
    """
    path = Path(path)
    lines = path.read_bytes().split(b"\n")
    last = max((i for i, raw in enumerate(lines) if raw.strip()), default=-1)
    out = []
    for i, raw in enumerate(lines):
        if not raw.strip():
            continue
        try:
            text = raw.decode("utf-8")
            row = json.loads(text)
            if not isinstance(row, dict):
                raise ValueError("not an object")
        except ValueError:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
            if i != last:
                raise RunLogError(
                    f"{path}:{i + 1}: not a complete JSON object, and not the last line "
                    "(a crash cuts only the last); the file is damaged"
                ) from None
            log.warning(
                "%s:%d: the last line is cut short (the run was stopped while writing it?); "
                "skipped",
                path,
                i + 1,
            )
            continue
        out.append((text, row))
    return out


def read_jsonl(path: Path) -> list[dict]:
    """Every complete row of a JSONL log (a torn last line skipped with a warning)."""
    return [row for _, row in read_jsonl_lines(path)]


def last_logged_metrics(run_dir: Path, step: int) -> dict:
    """The metrics.jsonl row of a run's latest step up to ``step``, without its
    ``iteration`` key, nulls as NaN; {} where there is none."""
    path = Path(run_dir) / "metrics.jsonl"
    rows = [r for r in read_jsonl(path) if r.get("iteration", 0) <= step] if path.is_file() else []
    # null in the file is a value that was not finite: NaN, as a live run's metrics hold it
    last = rows[-1] if rows else {}
    return {k: math.nan if v is None else v for k, v in last.items() if k != "iteration"}


def read_json(path: Path):
    """A JSON file a run wrote (summary.json, compare.json, rm_checks.json), or None with a
    warning when it is missing its end or otherwise unreadable: the reader goes on without."""
    try:
        return json.loads(Path(path).read_bytes().decode("utf-8"))
    except (OSError, ValueError) as exc:
        log.warning("%s: unreadable, cut short by a crash? (%s); left out", path, exc)
        return None


# what an earlier run leaves in its folder: moved aside by a --resume that finds nothing to
# continue (inputs/ stays: this run reads it)
EARLIER_RUN_FILES = (
    *("metrics.jsonl", "samples.jsonl", "alerts.jsonl", "run.json", "report.html"),
    *("checkpoints", "tensorboard"),
)


def earlier_run_files(run_dir: Path, names) -> list[Path]:
    """Those of ``names`` in ``run_dir`` that exist, and its config.until-step-N.yaml."""
    found = [run_dir / n for n in names if (run_dir / n).exists()]
    return found + sorted(run_dir.glob("config.until-step-*.yaml"))


def holds_something(path: Path) -> bool:
    """A file with content, or a folder with anything in it."""
    if path.is_dir():
        return any(path.iterdir())
    return path.stat().st_size > 0
