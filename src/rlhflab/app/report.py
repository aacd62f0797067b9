"""``rlhflab report RUN_DIR``: one self-contained HTML file that says at a glance how a run
went, then shows why.

In reading order: a verdict (gold and proxy change, the best iteration by gold, alerts and
the first of them, the final KL, a plain sentence when reward hacking is suspected), the
alerts, the run's facts (dates, wall time, versions, machine, model sizes; ``run.json``),
the demo's or ``rlhflab compare``'s table where the run has one, the over-optimisation
curve of Gao et al. (2022) where there is a gold reward, every logged curve (inline SVG,
:mod:`~.charts`), sample answers beside the reference's, the reward model's checks, and the
config, the user's own settings first. No script, no external request: the file can be
mailed or archived as it is, and reads on a phone.
"""

from __future__ import annotations

import html
import logging
import math
from pathlib import Path

import yaml

from rlhflab.app import report_parts as P
from rlhflab.app import report_sections as S
from rlhflab.app.charts import Chart, Series
from rlhflab.diagnostics.gold_curve import story_from_rows
from rlhflab.infra.files import write_text_atomic
from rlhflab.infra.runinfo import read_run_info
from rlhflab.infra.runlog import RunLogError, read_json, read_jsonl

log = logging.getLogger(__name__)

# alerts fire above these thresholds, except where named here
_BELOW = {"entropy_ratio"}
_STAGES = {"PPO": "ppo", "GRPO": "grpo", "RLOO": "rloo", "DPO": "dpo", "SFT": "sft", "RM": "rm"}


_series = S.series_of


def _has(rows: list[dict], key: str) -> bool:
    return any(isinstance(r.get(key), (int, float)) for r in rows)


def _thresholds(config: dict) -> dict[str, tuple[float, str]]:
    from rlhflab.diagnostics.monitor import ADVICE

    mon = config.get("monitor") or {}
    out = {
        k: (float(mon[k]), "below" if k in _BELOW else "above")
        for k in ADVICE
        if isinstance(mon.get(k), (int, float)) and not isinstance(mon.get(k), bool)
    }
    out["kl_excess"] = (1.0, "above")
    return out


# Long (about 90 lines) because it is the list of charts in the order the page shows them,
# grouped under headings; each chart is one Chart(...) call.
def curve_groups(
    rows: list[dict],
    alerts: list[dict],
    config: dict,
    best: int | None = None,
    python: dict[str, float] | None = None,
) -> list[tuple[str, list]]:
    """[(heading, [Chart])]: every logged curve, grouped, in reading order; ``best``: the
    iteration of the best smoothed gold, marked on the gold chart; ``python``: the weights
    of Python API rewards (:func:`report_sections.python_reward_weights`)."""
    smooth = float((config.get("monitor") or {}).get("smoothing", 0.8))
    heads = sorted({k for r in rows for k in r if k.startswith("objective/scores/")})
    names = [h.removeprefix("objective/scores/") for h in heads]
    weights = S.head_weights(config, names, python)
    inside = [h for h in heads if weights[h.removeprefix("objective/scores/")] is not None]
    outside = [h for h in heads if h not in inside]

    def part(key: str) -> Series:
        name = key.removeprefix("objective/scores/")
        w = weights[name]
        note = "" if w is None or math.isnan(w) else f"× {w:g}"
        return _series(rows, key, name, note=note)

    reward = [
        Chart(
            "Proxy reward: the optimised score and its weighted parts",
            [_series(rows, "objective/scores", "score (weighted sum)"), *map(part, inside)],
            "reward (score units)",
            smooth=smooth,
        ),
        Chart(
            "Reward-model heads outside the objective (watched, not optimised)",
            [_series(rows, h, h.removeprefix("objective/scores/")) for h in outside],
            "reward (score units)",
            smooth=smooth,
        ),
        Chart(
            "Gold reward (monitor.gold)",
            [_series(rows, "monitor/gold", "gold")],
            "gold reward",
            alerts=[a["iteration"] for a in alerts if a["signal"] == "gold_drop"],
            smooth=smooth,
            marks=[(best, f"best (smoothed): iteration {best}")] if best else [],
        ),
    ]
    kl = [
        Chart(
            "KL to the reference",
            [_series(rows, "objective/kl", "k1"), _series(rows, "objective/kl_k3", "k3")],
            "nats per answer",
            include_zero=True,
        ),
        Chart(
            "β (KL coefficient)",
            [_series(rows, "objective/kl_coef", "β")],
            "β",
            include_zero=True,
        ),
    ]
    update = [
        Chart("Policy loss", [_series(rows, "policy/loss", "loss")], "loss"),
        Chart(
            "approx KL of each update (π_old → π)",
            [_series(rows, "policy/approx_kl", "approx_kl (k3)")],
            "nats per token",
            include_zero=True,
        ),
        Chart(
            "Clip fractions",
            [
                _series(rows, "policy/clipfrac", "policy"),
                _series(rows, "val/clipfrac", "value", dashed=True),
            ],
            "fraction of tokens",
            include_zero=True,
        ),
        Chart(
            "Policy entropy",
            [_series(rows, "policy/entropy", "entropy")],
            "nats per token",
            include_zero=True,
        ),
        Chart(
            "Learning rate",
            [_series(rows, "lr/policy", "policy lr")],
            "learning rate",
            include_zero=True,
        ),
        Chart("Value loss", [_series(rows, "val/loss", "value loss")], "loss", include_zero=True),
        Chart(
            "Explained variance of the value",
            [_series(rows, "val/explained_variance", "explained variance")],
            "1 − Var(R − V)/Var(R)",
        ),
    ]
    answers = [
        Chart(
            "Answer length",
            [
                _series(rows, "response/length_mean", "mean"),
                _series(rows, "response/length_max", "longest", dashed=True),
            ],
            "tokens",
            include_zero=True,
        ),
        Chart(
            "Answers that ended with EOS",
            [_series(rows, "response/eos_rate", "EOS rate")],
            "fraction of answers",
            include_zero=True,
        ),
    ]
    thresholds = _thresholds(config)
    monitors = []
    for key in sorted({k for r in rows for k in r if k.startswith("monitor/")}):
        name = key.split("/", 1)[1]
        if name in ("alerts", "gold"):
            continue
        monitors.append(
            Chart(
                f"Monitor: {name}",
                [_series(rows, key, name)],
                name.replace("_", " "),
                alerts=[a["iteration"] for a in alerts if a["signal"] == name],
                threshold=thresholds.get(name),
            )
        )
    phases = ("time/generate", "time/score", "time/train", "time/monitor_probe")
    system = [
        Chart(
            "Time per phase",
            [_series(rows, k, k.split("/")[1]) for k in phases],
            "seconds per iteration",
            include_zero=True,
        ),
        Chart(
            "Sampling throughput",
            [_series(rows, "throughput/tokens_per_sec", "generated tokens per second")],
            "tokens per second",
            include_zero=True,
        ),
        Chart(
            "Peak memory",
            [_series(rows, "memory/peak_mib", "peak")],
            "MiB",
            include_zero=True,
        ),
        Chart(
            "Skipped updates (non-finite reward, loss or gradient)",
            [_series(rows, "faults/skipped_updates", "skipped so far")],
            "updates",
            include_zero=True,
        ),
    ]
    return [
        ("Reward", reward),
        ("KL", kl),
        ("The policy and value updates", update),
        ("Answers", answers),
        ("Reward-hacking monitors", monitors),
        ("Time and memory", system),
    ]


def _ending(info: dict | None) -> tuple:
    """(stop reason, error message) from run.json."""
    return (info or {}).get("stop_reason"), (info or {}).get("error_message")


def _read(path: Path):
    return read_json(path) if path.is_file() else None


# Long (about 60 lines) because it reads every input and lays the page out section by
# section in reading order; each section's HTML comes from report_parts/report_sections.
def build_report(run_dir: str | Path) -> Path:
    run = Path(run_dir)
    metrics_path = run / "metrics.jsonl"
    rows = read_jsonl(metrics_path) if metrics_path.exists() else []
    if not rows and ((run / "run.json").is_file() or (run / "config.yaml").is_file()):
        raise FileNotFoundError(
            f"{run}: a run with no iteration logged yet (still before the end of its first, "
            "or stopped before it): nothing to report"
        )
    if not run.is_dir():
        raise FileNotFoundError(
            f"{run}: no such folder" if not run.exists() else f"{run}: not a folder"
        )
    if not metrics_path.exists():
        raise FileNotFoundError(f"{run}: no metrics.jsonl — is this a run directory?")
    if not rows:
        raise FileNotFoundError(f"{run}: metrics.jsonl is empty")
    for n, row in enumerate(rows, start=1):
        if not isinstance(row.get("iteration"), int) or isinstance(row["iteration"], bool):
            raise RunLogError(f"{metrics_path}: row {n} has no iteration: not a run's log")
    alerts = read_jsonl(run / "alerts.jsonl") if (run / "alerts.jsonl").exists() else []
    samples = read_jsonl(run / "samples.jsonl") if (run / "samples.jsonl").exists() else []
    config = _config(run)
    info = read_run_info(run)
    summary, compare = _read(run.parent / "summary.json"), _read(run.parent / "compare.json")
    smoothing = float((config.get("monitor") or {}).get("smoothing", 0.8))
    story = story_from_rows(rows, smoothing)
    if story:
        # run.json's word where it has one; a run killed before its end wrote none
        recorded = (info or {}).get("gold") or {}
        best = run / "checkpoints" / "best"
        story["best_checkpoint"] = (
            recorded["best_checkpoint"] if "best_checkpoint" in recorded else best.is_dir()
        )
    trainer = (info or {}).get("trainer", "")
    name = "/".join(run.resolve().parts[-2:])
    sections = [("verdict", "Verdict"), ("alerts", "Alerts"), ("run", "The run")]
    body = [
        P.verdict(rows, alerts, story, summary, *_ending(info)),
        "<h2 id='alerts'>Alerts</h2>" + S.alerts_table(alerts),
        "<h2 id='run'>The run</h2>" + P.run_facts(info, rows, run),
    ]
    if summary:
        sections.append(("demo", "Demo: held-out evaluation"))
        body.append("<h2 id='demo'>Demo: held-out evaluation</h2>" + P.demo_table(summary))
    if compare:
        sections.append(("compare", "Methods compared"))
        body.append("<h2 id='compare'>Methods compared</h2>" + P.compare_table(compare))
    over = S.overoptimisation(rows, story)
    if over:
        sections.append(("overopt", "Over-optimisation"))
        body.append(over)
    curves = []
    best = story.get("best_iteration") if story else None
    python = S.python_reward_weights(run)
    groups = curve_groups(rows, alerts, config, best, python)
    groups.append(("Other logged metrics", S.other_charts(rows, groups)))
    for i, (heading, charts) in enumerate(groups):
        drawn = [c.html() for c in charts]
        if any(drawn):
            curves.append(f"<h3 id='c{i}'>{html.escape(heading)}</h3><div class='g'>")
            curves.append("".join(drawn) + "</div>")
    sections.append(("curves", "Curves"))
    body.append("<h2 id='curves'>Curves</h2>" + "".join(curves))
    sections.append(("samples", "Samples"))
    body.append(S.samples_section(samples, config, trainer, python))
    checks = S.rm_checks(config, run)
    if checks:
        sections.append(("rm", "Reward model checks"))
        body.append(checks)
    sections.append(("config", "Config"))
    started_in = (info or {}).get("started_in")
    if "__unread__" in config:
        unread = html.escape(config["__unread__"])
        body.append(f"<h2 id='config'>Config</h2><p>{unread}: the run's settings are unknown.</p>")
    else:
        section = S.config_section(config, S.flat_defaults(_STAGES.get(trainer, "ppo")), started_in)
        body.append(section.replace("</h2>", "</h2>" + P.settings_history(run), 1))
    toc = "".join(f"<li><a href='#{a}'>{html.escape(t)}</a></li>" for a, t in sections)
    when = (info or {}).get("started", "")[:16].replace("T", " ")
    head = (
        f"<h1>{html.escape(name)}</h1><p class='m'>{html.escape(trainer or 'run')} · "
        f"{len(rows)} iteration{'s' * (len(rows) != 1)}{' · started ' + html.escape(when) if when else ''} · "
        f"<code>{html.escape(str(run))}</code></p><nav><ul class='toc'>{toc}</ul></nav>"
    )
    its = f"{len(rows)} iteration{'s' * (len(rows) != 1)}"
    title = (
        f"{name}: {trainer or 'run'} report, {its}, {len(alerts)} alert{'s' * (len(alerts) != 1)}"
    )
    page = _PAGE.replace("{{TITLE}}", html.escape(title))
    out = run / "report.html"
    if out.is_dir():  # found when writing, after the whole report was built
        raise RunLogError(f"{out}: a folder; the report is written under that name")
    write_text_atomic(out, page.replace("{{BODY}}", head + "\n".join(body)))
    return out


def _config(run: Path) -> dict:
    """The run's config.yaml; one that is missing or unreadable is said in the log and on
    the page ({"__unread__": why}), not shown as a run at every default."""
    path = run / "config.yaml"
    if not path.is_file():
        why = "missing"
    else:
        try:
            loaded = yaml.safe_load(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
            loaded, why = None, f"unreadable ({type(exc).__name__})"
        else:
            if isinstance(loaded, dict):
                return loaded
            why = "not a mapping of settings"
    log.warning("%s is %s; the report's Config section says so", path, why)
    return {"__unread__": f"{path} is {why}"}


_PAGE = """<!doctype html><html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>{{TITLE}}</title>
<style>
body{font:15px/1.45 system-ui,-apple-system,"Segoe UI",sans-serif;color:#1c1c1e;
margin:0 auto;padding:16px 20px;max-width:1800px}
h1{font-size:1.45em;margin:.2em 0;overflow-wrap:anywhere}
h2{font-size:1.2em;border-bottom:1px solid #ddd;padding-bottom:.15em;margin-top:1.5em}
h3{font-size:1.02em;margin:1.1em 0 .4em}h4{margin:0 0 .2em;font-size:.9em;color:#555}
code{font-size:.92em;overflow-wrap:anywhere}.m,.cn{color:#555}.cn{font-size:.8em;margin:2px 0 0}
nav .toc{list-style:none;padding:0;margin:.4em 0;display:flex;flex-wrap:wrap;gap:4px 16px}
.verdict{border-left:6px solid #888;background:#f6f6f6;padding:2px 16px 8px;margin-top:12px}
.verdict.good{border-color:#1a7f37;background:#eef8f0}.verdict.bad{border-color:#c0392b;
background:#fcefed}.verdict.warn{border-color:#b26b00;background:#fdf5e6}
.badge{font-size:.8em;padding:.15em .55em;border-radius:4px;color:#fff;background:#666;
vertical-align:middle}.good .badge{background:#1a7f37}.bad .badge{background:#c0392b}
.warn .badge{background:#b26b00}.say{font-size:1.08em;font-weight:600}
.verdict ul{margin:.3em 0;padding-left:1.2em}
.g{display:grid;grid-template-columns:repeat(auto-fill,minmax(min(100%,400px),1fr));gap:14px}
.one{max-width:640px}
figure.c{margin:0;border:1px solid #ddd;border-radius:6px;padding:8px 10px;background:#fff;
min-width:0}svg.pl{display:block;width:100%;height:auto}
figcaption{font-weight:600;font-size:.92em;margin-bottom:4px}
.pa{fill:#fcfcfc;stroke:#bbb}.gr{stroke:#e6e6e6}.tk{font-size:11px;fill:#444}
.at{font-size:12px;fill:#222}
ul.lg{list-style:none;margin:6px 0 0;padding:0;display:flex;flex-wrap:wrap;gap:2px 14px;
font-size:.83em}ul.lg li{display:flex;align-items:center;gap:5px}.sw{flex:none}
.tw{overflow-x:auto;max-width:100%}table{border-collapse:collapse;font-size:.86em;margin:6px 0}
td,th{border:1px solid #ddd;padding:3px 7px;text-align:left;vertical-align:top;
overflow-wrap:break-word}th{background:#f3f3f3}
pre{background:#f4f4f4;padding:6px 8px;font-size:.85em;white-space:pre-wrap;
overflow-wrap:anywhere;margin:0}details{margin:.6em 0}summary{cursor:pointer;color:#0b5cad}
.smp{border:1px solid #ddd;border-radius:6px;padding:6px 10px;margin:8px 0}.q{margin:2px 0 6px}.q code{white-space:pre-wrap}
.pair{display:grid;grid-template-columns:repeat(auto-fit,minmax(min(100%,300px),1fr));gap:10px}
.sa p{margin:3px 0;font-size:.9em}
@media (max-width:600px){body{padding:10px;font-size:14px}table{font-size:.78em}
td,th{padding:2px 4px}}
</style></head><body>
{{BODY}}
</body></html>
"""
