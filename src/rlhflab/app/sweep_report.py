"""What a sweep leaves: ``sweep.json`` (every trial), ``best.yaml`` (the best trial's whole
config, to rerun) and ``report.html`` (self-contained: best settings, objective over
trials, parameter importance, the trial table)."""

from __future__ import annotations

import html
import json
import math
import warnings
from pathlib import Path

import yaml

from rlhflab.config import Config
from rlhflab.config.base import dump_yaml_text
from rlhflab.infra.files import write_text_atomic


def trial_rows(study) -> list[dict]:
    rows = []
    for t in study.get_trials(deepcopy=False):
        seconds = (
            (t.datetime_complete - t.datetime_start).total_seconds()
            if t.datetime_complete and t.datetime_start
            else None
        )
        rows.append(
            {
                "number": t.number,
                "state": t.state.name.lower(),
                "value": t.value,
                "params": dict(t.params),
                "iterations": t.user_attrs.get("iterations"),
                "run_dir": t.user_attrs.get("run_dir"),
                "seconds": seconds,
            }
        )
    return rows


def importance(study, optuna) -> dict[str, float]:
    """Optuna's parameter importance (fANOVA) over the complete trials; {} when fewer than
    two differ."""
    complete = study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))
    if len(complete) < 2:
        return {}
    try:
        with warnings.catch_warnings():  # "importances will be equal" on a few trials: shown
            warnings.simplefilter("ignore")
            found = optuna.importance.get_param_importances(study)
    except (RuntimeError, ValueError, ZeroDivisionError):  # e.g. one distinct value only
        return {}
    return {k: float(v) for k, v in found.items()}


def write_results(
    study, optuna, cfg: Config, space: dict, sweep_dir: Path, name: str, objective: str
) -> dict:
    rows = trial_rows(study)
    complete = [r for r in rows if r["state"] == "complete" and r["value"] is not None]
    best = max(complete, key=lambda r: r["value"]) if complete else None
    result = {
        "name": name,
        "objective": objective,
        "space": space,
        "trials": rows,
        "counts": {
            s: sum(r["state"] == s for r in rows) for s in ("complete", "pruned", "fail", "running")
        },
        "best": best,
        "importance": importance(study, optuna),
        "sweep_dir": str(sweep_dir),
    }
    if best is not None and best["run_dir"] and (Path(best["run_dir"]) / "config.yaml").is_file():
        config = yaml.safe_load((Path(best["run_dir"]) / "config.yaml").read_text())
        config["log"]["output_dir"] = str(Path("runs") / f"best-{name}")
        header = (
            f"# The best trial of sweep {name!r} (trial {best['number']}, objective "
            f"{best['value']:.4f}): rerun it on new seeds, e.g.\n"
            f"#   rlhflab {cfg.sweep.method} --config best.yaml seed=11\n"
        )
        write_text_atomic(
            sweep_dir / "best.yaml",
            header + dump_yaml_text(config),
        )
        result["best_yaml"] = str(sweep_dir / "best.yaml")
    write_text_atomic(sweep_dir / "sweep.json", json.dumps(result, indent=2, default=str))
    write_text_atomic(sweep_dir / "report.html", render(result))
    result["report"] = str(sweep_dir / "report.html")
    return result


def _seconds(s: float | None) -> str:
    """A trial's wall time: tenths below 10 s (a sub-second trial read 0), whole above."""
    if not s:
        return "–"
    return f"{s:.1f}" if s < 10 else f"{s:.0f}"


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return html.escape(str(v))


def _svg_over_trials(rows: list[dict]) -> str:
    """Each trial's value (pruned ones at their last report are absent) and the best so
    far, as an inline SVG that fills the width."""
    points = [(r["number"], r["value"]) for r in rows if r["value"] is not None]
    if not points:
        return "<p>No finished trial yet.</p>"
    # left: room for a label such as -0.00833 right-aligned before the axis (at 40 px
    # the minus sign and first digits fell off the picture)
    w, h, pad, left = 600, 220, 40, 72
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    x0, x1 = min(xs), max(max(xs), min(xs) + 1)
    y0, y1 = min(ys), max(ys)
    if math.isclose(y0, y1):
        y0, y1 = y0 - 0.5, y1 + 0.5
    sx = lambda x: left + (x - x0) / (x1 - x0) * (w - left - pad)  # noqa: E731
    sy = lambda y: h - pad - (y - y0) / (y1 - y0) * (h - 2 * pad)  # noqa: E731
    dots = "".join(
        f'<circle cx="{sx(x):.1f}" cy="{sy(y):.1f}" r="4" fill="#1f77b4"><title>trial {x}: {y:.4g}</title></circle>'
        for x, y in points
    )
    best, line = -math.inf, []
    for x, y in sorted(points):
        best = max(best, y)
        line.append(f"{sx(x):.1f},{sy(best):.1f}")
    step = max(1, len(xs) // 10)
    ticks = "".join(
        f'<text x="{sx(x):.1f}" y="{h - pad + 14}" text-anchor="middle" font-size="11">{x}</text>'
        for x in sorted(xs)[::step]
    )
    axes = (
        f'<line x1="{left}" y1="{h - pad}" x2="{w - pad}" y2="{h - pad}" stroke="#888"/>'
        f'<line x1="{left}" y1="{pad}" x2="{left}" y2="{h - pad}" stroke="#888"/>'
        f'<text x="{w / 2}" y="{h - 6}" text-anchor="middle" font-size="12">trial</text>'
        f'<text x="12" y="{h / 2}" text-anchor="middle" font-size="12" '
        f'transform="rotate(-90 12 {h / 2})">objective</text>'
        f'<text x="{left - 4}" y="{sy(y1):.1f}" text-anchor="end" font-size="11">{y1:.3g}</text>'
        f'<text x="{left - 4}" y="{sy(y0):.1f}" text-anchor="end" font-size="11">{y0:.3g}</text>'
        + ticks
    )
    return (
        f'<svg viewBox="0 0 {w} {h}" width="100%" style="max-width:800px" role="img" '
        f'aria-label="objective over trials">'
        f'{axes}<polyline points="{" ".join(line)}" fill="none" stroke="#d62728" stroke-width="2"/>'
        f"{dots}</svg><p>Blue: each trial's objective; red: the best so far.</p>"
    )


def render(result: dict) -> str:
    best, rows = result["best"], result["trials"]
    keys = sorted(result["space"])
    best_rows = (
        "".join(
            f"<tr><td>{html.escape(k)}</td><td>{_fmt(best['params'].get(k))}</td></tr>"
            for k in keys
        )
        if best
        else ""
    )
    imp = (
        "".join(
            f'<tr><td>{html.escape(k)}</td><td class="barcell"><div class="bar" style="width:{100 * v:.0f}%"></div></td>'
            f"<td>{v:.2f}</td></tr>"
            for k, v in sorted(result["importance"].items(), key=lambda kv: -kv[1])
        )
        or "<tr><td colspan=3>needs two or more complete trials</td></tr>"
    )
    head = "".join(
        f"<th>{html.escape(k)}</th>"
        for k in ["trial", "state", "objective", "iterations", "seconds", *keys]
    )
    body = "".join(
        "<tr>"
        + "".join(
            f"<td>{_fmt(v)}</td>"
            for v in [
                r["number"],
                r["state"],
                r["value"] if r["value"] is not None else "–",
                r["iterations"] or "–",
                _seconds(r["seconds"]),
                *(r["params"].get(k, "–") for k in keys),
            ]
        )
        + "</tr>"
        for r in rows
    )
    c = result["counts"]
    verdict = (
        f"Best: trial {best['number']}, objective {best['value']:.4f}; rerun it with "
        f"<code>best.yaml</code> on new seeds before trusting it."
        if best
        else "No trial has finished yet."
    )
    return f"""<!doctype html><html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>rlhflab sweep {html.escape(result["name"])}</title>
<style>body{{font-family:system-ui,sans-serif;max-width:1100px;margin:1em auto;padding:0 1em}}
table{{border-collapse:collapse;margin:.5em 0}}td,th{{border:1px solid #ccc;padding:2px 6px;text-align:left}}
.scroll{{overflow-x:auto}}.bar{{background:#1f77b4;height:10px;min-width:2px}}
.barcell{{width:160px}}
.verdict{{font-size:1.2em;background:#eef5ff;padding:.6em;border-radius:6px}}</style></head><body>
<h1>Sweep {html.escape(result["name"])}</h1>
<p class="verdict">{verdict}</p>
<p>{c["complete"]} complete, {c["pruned"]} pruned, {c["fail"]} failed, {c["running"]} running or lost.
Objective: {html.escape(result["objective"])}.</p>
<h2>Best settings</h2><table>{best_rows}</table>
<h2>Objective over trials</h2>{_svg_over_trials(rows)}
<h2>Parameter importance</h2><table>{imp}</table>
<h2>Trials</h2><div class="scroll"><table><tr>{head}</tr>{body}</table></div>
</body></html>
"""
