"""The run directory's logs: metrics.jsonl every iteration, samples.jsonl, and optional
TensorBoard / Weights & Biases mirrors. Only this module knows where metrics go."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

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
        self.tb = self.wandb = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.tb = SummaryWriter(str(self.run_dir / "tensorboard"))
            except ImportError:
                log.warning("log.tensorboard: the tensorboard package is not installed; skipped")
        if wandb:
            try:
                import wandb as wb

                self.wandb = wb.init(
                    project="rlhflab", dir=str(self.run_dir), config=config, resume="allow"
                )
            except ImportError:
                log.warning("log.wandb: wandb is not installed; skipped")

    @staticmethod
    def _truncate_after(path: Path, step: int) -> None:
        if not path.exists():
            return
        keep = [
            ln
            for ln in path.read_text(encoding="utf-8").splitlines()
            if ln.strip() and json.loads(ln).get("iteration", 0) <= step
        ]
        path.write_text("".join(ln + "\n" for ln in keep), encoding="utf-8")

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


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(ln) for ln in Path(path).read_text(encoding="utf-8").splitlines() if ln]
