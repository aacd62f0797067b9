"""``rlhflab report RUN_DIR``: one self-contained HTML file with the run's story.

Curves are inline SVG drawn here (no plotting library, no server, no network): reward per
head, gold reward, KL and β, length, entropy, clip fractions, value loss and explained
variance, every monitor signal with its alerts marked, time per phase and memory; then the
config, the alerts, and sample answers with their scores.
"""

from __future__ import annotations

import html
import math
from pathlib import Path

from rlhflab.app.tables import COMPARE_COLUMNS, DEMO_COLUMNS
from rlhflab.infra.runlog import read_json, read_jsonl

PALETTE = ("#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#17becf")
W, H, PAD = 460, 220, 42


def _fmt(v: float) -> str:
    return f"{v:.3g}" if abs(v) < 1e4 else f"{v:.2e}"


def line_chart(
    title: str,
    series: dict[str, list[tuple[float, float]]],
    alerts: list[float] = (),
    threshold: float | None = None,
) -> str:
    """An SVG line chart; ``alerts`` are x positions marked in red, ``threshold`` a dashed line."""
    pts = [p for s in series.values() for p in s if p[1] is not None and math.isfinite(p[1])]
    if not pts:
        return ""
    xs, ys = [p[0] for p in pts], [p[1] for p in pts]
    if threshold is not None:
        ys.append(threshold)
    x0, x1 = min(xs), max(xs) if max(xs) > min(xs) else min(xs) + 1
    y0, y1 = min(ys), max(ys)
    if y1 - y0 < 1e-12:
        y0, y1 = y0 - 1, y1 + 1

    def sx(x):
        return PAD + (x - x0) / (x1 - x0) * (W - PAD - 10)

    def sy(y):
        return H - 28 - (y - y0) / (y1 - y0) * (H - 56)

    parts = [
        f'<svg width="{W}" height="{H}" viewBox="0 0 {W} {H}" role="img">',
        f'<text x="{W / 2}" y="16" text-anchor="middle" class="t">{html.escape(title)}</text>',
        f'<line x1="{PAD}" y1="{H - 28}" x2="{W - 10}" y2="{H - 28}" class="ax"/>',
        f'<line x1="{PAD}" y1="28" x2="{PAD}" y2="{H - 28}" class="ax"/>',
        f'<text x="{PAD - 4}" y="{sy(y1) + 4}" text-anchor="end" class="l">{_fmt(y1)}</text>',
        f'<text x="{PAD - 4}" y="{sy(y0) + 4}" text-anchor="end" class="l">{_fmt(y0)}</text>',
        f'<text x="{PAD}" y="{H - 12}" class="l">{_fmt(x0)}</text>',
        f'<text x="{W - 10}" y="{H - 12}" text-anchor="end" class="l">iteration {_fmt(x1)}</text>',
    ]
    for x in alerts:
        parts.append(
            f'<line x1="{sx(x):.1f}" y1="28" x2="{sx(x):.1f}" y2="{H - 28}" '
            'stroke="#d62728" stroke-opacity="0.35" stroke-width="3"/>'
        )
    if threshold is not None:
        parts.append(
            f'<line x1="{PAD}" y1="{sy(threshold):.1f}" x2="{W - 10}" '
            f'y2="{sy(threshold):.1f}" stroke="#d62728" stroke-dasharray="4 3"/>'
        )
    for i, (name, s) in enumerate(series.items()):
        good = [(x, y) for x, y in s if y is not None and math.isfinite(y)]
        if not good:
            continue
        color = PALETTE[i % len(PALETTE)]
        path = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in good)
        parts.append(f'<polyline fill="none" stroke="{color}" stroke-width="1.8" points="{path}"/>')
        parts.append(
            f'<text x="{PAD + 6 + 150 * (i % 3)}" y="{34 + 12 * (i // 3)}" '
            f'fill="{color}" class="l">{html.escape(name)}</text>'
        )
    parts.append("</svg>")
    return "".join(parts)


def _series(rows: list[dict], *keys: str, prefix: str | None = None) -> dict:
    names = list(keys)
    if prefix:
        names += sorted({k for r in rows for k in r if k.startswith(prefix)})
    return {
        k: [(r["iteration"], r.get(k)) for r in rows]
        for k in names
        if any(r.get(k) is not None for r in rows)
    }


# Long (about 100 lines) because it lays out the page section by section in reading order;
# each section's HTML is built by the helpers below it.
def build_report(run_dir: str | Path) -> Path:
    run = Path(run_dir)
    metrics_path = run / "metrics.jsonl"
    if not metrics_path.exists():
        raise FileNotFoundError(f"{run}: no metrics.jsonl — is this a run directory?")
    rows = read_jsonl(metrics_path)
    if not rows:
        raise FileNotFoundError(f"{run}: metrics.jsonl is empty")
    alerts = read_jsonl(run / "alerts.jsonl") if (run / "alerts.jsonl").exists() else []
    samples = read_jsonl(run / "samples.jsonl") if (run / "samples.jsonl").exists() else []
    config = (run / "config.yaml").read_text() if (run / "config.yaml").exists() else ""
    summary_path = run.parent / "summary.json"
    summary = read_json(summary_path) if summary_path.exists() else None
    compare_path = run.parent / "compare.json"
    compare = read_json(compare_path) if compare_path.exists() else None

    charts = [
        line_chart(
            "reward per head", _series(rows, "objective/scores", prefix="objective/scores/")
        ),
        line_chart("gold reward (monitor)", _series(rows, "monitor/gold")),
        line_chart(
            "KL to reference (nats/answer)", _series(rows, "objective/kl", "objective/kl_k3")
        ),
        line_chart("β (KL coefficient)", _series(rows, "objective/kl_coef")),
        line_chart(
            "answer length (tokens)", _series(rows, "response/length_mean", "response/length_max")
        ),
        line_chart("policy entropy", _series(rows, "policy/entropy")),
        line_chart("clip fractions", _series(rows, "policy/clipfrac", "val/clipfrac")),
        line_chart("value loss", _series(rows, "val/loss")),
        line_chart("explained variance", _series(rows, "val/explained_variance")),
        line_chart(
            "time per phase (s)",
            _series(rows, "time/generate", "time/score", "time/train", "time/monitor_probe"),
        ),
        line_chart("peak memory (MiB)", _series(rows, "memory/peak_mib")),
    ]
    monitor_keys = sorted(
        {k for r in rows for k in r if k.startswith("monitor/")}
        - {"monitor/alerts", "monitor/gold"}
    )
    thresholds = _thresholds(config)
    for key in monitor_keys:
        name = key.split("/", 1)[1]
        marks = [a["iteration"] for a in alerts if a["signal"] == name]
        charts.append(
            line_chart(f"monitor: {name}", _series(rows, key), marks, thresholds.get(name))
        )
    body = [
        "<h1>rlhflab run report</h1>",
        f"<p class='m'>{html.escape(str(run))} — {len(rows)} iterations, {len(alerts)} alerts</p>",
    ]
    if summary:
        body.append(_summary_table(summary))
    if compare:
        body.append(
            "<h2>Methods compared</h2>"
            + _table(
                ["method", *COMPARE_COLUMNS],
                [
                    [
                        r["method"],
                        *(
                            f"{r[c]:.3f}" if isinstance(r[c], float) else r[c]
                            for c in COMPARE_COLUMNS
                        ),
                    ]
                    for r in compare["rows"]
                ],
            )
        )
    body.append(_reward_model_checks(config))
    body.append("<h2>Curves</h2><div class='g'>" + "".join(c for c in charts if c) + "</div>")
    body.append(
        "<h2>Alerts</h2>"
        + (
            _table(
                ["iteration", "signal", "value", "message"],
                [[a["iteration"], a["signal"], f"{a['value']:.3f}", a["message"]] for a in alerts],
            )
            if alerts
            else "<p>No monitor fired.</p>"
        )
    )
    body.append(
        "<h2>Samples</h2>"
        + _table(
            ["iteration", "prompt", "answer", "score", "KL"],
            [
                [s["iteration"], s["prompt"], s["response"], f"{s['score']:.3f}", f"{s['kl']:.2f}"]
                for s in samples
            ],
        )
    )
    body.append(f"<h2>Config</h2><pre>{html.escape(config)}</pre>")
    out = run / "report.html"
    out.write_text(_PAGE.replace("{{BODY}}", "\n".join(body)), encoding="utf-8")
    return out


def _thresholds(config_text: str) -> dict[str, float]:
    import yaml

    try:
        mon = (yaml.safe_load(config_text) or {}).get("monitor", {})
    except yaml.YAMLError:
        return {}
    from rlhflab.diagnostics.monitor import ADVICE

    out = {k: mon[k] for k in ADVICE if isinstance(mon.get(k), (int, float))}
    out["kl_excess"] = 1.0
    return out


def _reward_model_checks(config_text: str) -> str:
    """The held-out checks ``rlhflab rm`` wrote beside the run's reward model
    (``reward.model``/rm_checks.json), as a table; '' where there are none."""
    import yaml

    try:
        folder = ((yaml.safe_load(config_text) or {}).get("reward") or {}).get("model")
    except yaml.YAMLError:
        return ""
    path = Path(folder) / "rm_checks.json" if folder else None
    if path is None or not path.is_file():
        return ""
    from rlhflab.diagnostics.rm_checks import gold_warning, length_warning

    checks = read_json(path)
    if not isinstance(checks, dict):
        return ""
    keys = ("accuracy", "calibration_error", "longer_preferred")
    keys += ("longer_preferred_by_labels", "score_length_corr")

    def cell(v) -> str:
        return "-" if v is None else f"{v:.3f}"

    table = _table(
        ["reward", *keys],
        [[name, *(cell(row.get(k)) for k in keys)] for name, row in checks.items()],
    )

    def numbers(row: str) -> dict:
        return {k: (float("nan") if v is None else v) for k, v in checks.get(row, {}).items()}

    reward = numbers("reward")
    warnings = [
        length_warning(reward) if "longer_preferred" in reward else None,
        gold_warning(numbers("reward_vs_gold")),
    ]
    note = "".join(f"<p><b>{html.escape(w)}</b></p>" for w in warnings if w)
    return (
        f"<h2>Reward model checks</h2><p class='m'>{html.escape(str(path))}, held-out pairs "
        "(docs/ppo.md, 'Is the reward model any good?')</p>" + table + note
    )


def _summary_table(summary: dict) -> str:
    cols = DEMO_COLUMNS
    rows = [
        [name] + [f"{summary[name].get(c, float('nan')):.3f}" for c in cols]
        for name in ("sft", "ppo")
        if name in summary
    ]
    return "<h2>Demo summary</h2>" + _table(["policy", *cols], rows)


def _table(header: list[str], rows: list[list]) -> str:
    head = "".join(f"<th>{html.escape(str(h))}</th>" for h in header)
    body = "".join(
        "<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in r) + "</tr>" for r in rows
    )
    return f"<table><tr>{head}</tr>{body}</table>"


_PAGE = """<!doctype html><html><head><meta charset="utf-8"><title>rlhflab report</title>
<style>body{font-family:system-ui,sans-serif;margin:24px;color:#222}
.g{display:flex;flex-wrap:wrap;gap:10px}svg{background:#fafafa;border:1px solid #ddd}
.t{font-size:13px;font-weight:600}.l{font-size:10px;fill:#555}.ax{stroke:#999}
table{border-collapse:collapse;font-size:12px;margin:8px 0}
td,th{border:1px solid #ddd;padding:3px 6px;text-align:left;vertical-align:top;
white-space:pre-wrap}.m{color:#666}pre{background:#f4f4f4;padding:8px;font-size:11px}
</style></head><body>
{{BODY}}
</body></html>
"""
