"""The run report's samples, reward-model checks, config and alerts sections (the verdict
and the tables are in :mod:`~.report_parts`); each returns an HTML fragment."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

from rlhflab.app.charts import Chart, Series
from rlhflab.app.report_parts import esc, num, table
from rlhflab.config.base import dump_yaml_text
from rlhflab.diagnostics.gold_curve import is_finite_number
from rlhflab.infra.runlog import read_json

LENGTH_HEAD = "length"  # rlhflab.experience.rewards.LENGTH_HEAD (not imported: no torch here)


def rm_checks(config: dict, run: Path) -> str:
    """The held-out checks ``rlhflab rm`` wrote beside the run's reward model, found where
    the run's config names it: as written (from the current directory), from the folder the
    run was started in, and beside the run directory. Where none has it, the section says
    where it looked. '' when the run has no reward model."""
    folder = (config.get("reward") or {}).get("model")
    if not folder:
        return ""
    tried = _rm_candidates(Path(folder), config, run)
    path = next((p for p in tried if p.is_file()), None)
    head = "<h2 id='rm'>Reward model checks</h2>"
    if path is None:
        where = "".join(f"<li><code>{esc(p)}</code></li>" for p in tried)
        return (
            head + f"<p>No rm_checks.json for the reward model <code>{esc(folder)}</code> "
            f"(a model trained before the checks, or one not trained by "
            f"<code>rlhflab rm</code>). Looked in:</p><ul>{where}</ul>"
        )
    from rlhflab.diagnostics.rm_checks import gold_warning, length_warning

    checks = read_json(path)
    if not isinstance(checks, dict):
        return head + f"<p>{esc(path)} cannot be read.</p>"
    keys = ("accuracy", "calibration_error", "longer_preferred")
    keys += ("longer_preferred_by_labels", "score_length_corr")
    body = table(
        ["reward", *keys],
        [[name, *(num(row.get(k)) for k in keys)] for name, row in checks.items()],
    )

    def numbers(row: str) -> dict:
        return {k: (float("nan") if v is None else v) for k, v in checks.get(row, {}).items()}

    reward = numbers("reward")
    warnings = [
        length_warning(reward) if "longer_preferred" in reward else None,
        gold_warning(numbers("reward_vs_gold")),
    ]
    note = "".join(f"<p><b>{esc(w)}</b></p>" for w in warnings if w)
    return (
        head + f"<p class='m'>{esc(path)}, held-out pairs (docs/ppo.md, 'Is the reward "
        "model any good?')</p>" + body + note
    )


def _rm_candidates(folder: Path, config: dict, run: Path) -> list[Path]:
    out = [(folder / "rm_checks.json").resolve()]
    if not folder.is_absolute():
        # the run was started in the folder that its log.output_dir is relative to
        written = Path(str((config.get("log") or {}).get("output_dir") or ""))
        parts = run.resolve().parts
        k = len(written.parts)
        if written.parts and not written.is_absolute() and parts[-k:] == written.parts:
            out.append(Path(*parts[:-k]) / folder / "rm_checks.json")
        out.append(run.resolve().parent / folder.name / "rm_checks.json")
    return list(dict.fromkeys(out))  # each once, in order


def config_section(config: dict, defaults: dict, started_in: str | None = None) -> str:
    """The settings that differ from the defaults first, then the whole config folded
    (non-ASCII shown as text). ``started_in``: the folder the run started in (run.json)."""
    mine = [(k, v, defaults.get(k, "(no default)")) for k, v in _flat(config).items()]
    mine = [
        (k, v, d) for k, v, d in mine if v != d and not _default_made_absolute(v, d, started_in)
    ]
    rows = [[k, _show(v), _show(d)] for k, v, d in mine]
    text = dump_yaml_text(config)
    lines = text.count("\n")
    own = (
        table(["setting", "this run", "default"], rows)
        if rows
        else "<p>Every setting is at its default.</p>"
    )
    return (
        f"<h2 id='config'>Config</h2><h3>Your settings ({len(rows)} differ from the "
        f"defaults)</h3>{own}<details><summary>The whole config ({lines} lines, as "
        f"config.yaml holds it)</summary><pre>{esc(text)}</pre></details>"
    )


def _default_made_absolute(value, default, started_in: str | None = None) -> bool:
    """A run records its folder settings absolute (config.PATH_FIELDS): a relative default
    such as ``runs/sft`` comes back as ``/where/it/ran/runs/sft``, which the user never set.
    Exact against the folder the run started in where run.json says it; for older runs,
    any absolute path that ends with the default."""
    if not (isinstance(value, str) and isinstance(default, str)) or not default:
        return False
    v, d = Path(value), Path(default)
    if not v.is_absolute() or d.is_absolute():
        return False
    if started_in:
        return os.path.normpath(v) == os.path.normpath(Path(started_in) / d)
    return v.parts[-len(d.parts) :] == d.parts


def _flat(config: dict) -> dict:
    """section.field → value (a field's own mapping, such as reward.heads, kept whole)."""
    out = {}
    for k, v in config.items():
        if isinstance(v, dict):
            out.update({f"{k}.{f}": x for f, x in v.items()})
        else:
            out[k] = v
    return out


def flat_defaults(stage: str) -> dict:
    """The flattened defaults of a stage's config (ppo, grpo, rloo, dpo, sft, rm)."""
    from rlhflab.config import Config
    from rlhflab.config.base import to_dict
    from rlhflab.config.stages import STAGE_DEFAULTS

    out = _flat(to_dict(Config()))
    out.update(_flat(STAGE_DEFAULTS.get(stage, {})))
    return out


def _show(v) -> str:
    if isinstance(v, (dict, list)):
        return json.dumps(v, ensure_ascii=False)
    return "null" if v is None else str(v)


def python_reward_weights(run: Path) -> dict[str, float]:
    """The weights of the rewards a Python caller passed as callables no config can name
    (RUN/inputs/python_rewards.json, by component name); {} where there are none."""
    path = run / "inputs" / "python_rewards.json"
    try:
        weights = json.loads(path.read_text(encoding="utf-8")).get("weights") or {}
    except (OSError, ValueError, AttributeError):
        return {}
    return {k: float(v) for k, v in weights.items() if isinstance(v, (int, float))}


def head_weights(
    config: dict, names: list[str], python: dict[str, float] | None = None
) -> dict[str, float | None]:
    """Each reward component's weight in the optimised score, None for one outside it: a
    reward-model head ``rm/<h>`` is in it when reward.heads names it (or is empty: every
    head but ODIN's ``length``, weight 1); the missing-EOS penalty is in it, weight 1; a
    reward function's parts carry its reward.functions weight (or, for a Python API
    callable, its weight in ``python``); a part neither can place counts as in it, weight
    unknown (nan)."""
    reward = config.get("reward") or {}
    heads = reward.get("heads") or {}
    functions = {**(python or {}), **(reward.get("functions") or {})}
    out: dict[str, float | None] = {}
    for name in names:
        if name.startswith("rm/"):
            h = name[3:]
            # with reward.heads empty, every head but ODIN's length head (weight 0)
            default = None if heads or h == LENGTH_HEAD else 1.0
            out[name] = float(heads[h]) if h in heads else default
        elif name == "missing_eos_penalty":  # reward.missing_eos_penalty, added as it is
            out[name] = 1.0
        else:
            out[name] = float(functions[name]) if name in functions else float("nan")
    return out


def _parts(components: dict, weights: dict) -> str:
    def one(k: str, v: float) -> str:
        w = weights.get(k)
        times = "" if w is None or w != w else f" ×{w:g}"
        return f"{esc(k.removeprefix('rm/'))} {v:.2f}{times}"

    inside = [one(k, v) for k, v in components.items() if weights.get(k, 1.0) is not None]
    outside = [one(k, v) for k, v in components.items() if weights.get(k, 1.0) is None]
    text = ", ".join(inside)
    if outside:
        text += "; not optimised: " + ", ".join(outside)
    return text


def _answer(who: str, row: dict, weights: dict, kl: float | None = None) -> str:
    facts = [f"proxy <b>{row['score']:.3f}</b>"] if isinstance(row.get("score"), float) else []
    if isinstance(row.get("gold"), float):
        facts.append(f"gold <b>{row['gold']:.3f}</b>")
    if kl is not None:
        facts.append(f"KL {kl:.2f}")
    parts = _parts(row.get("components") or {}, weights)
    return (
        f"<div class='sa'><h4>{who}</h4><pre>{esc(row.get('response', ''))}</pre>"
        f"<p>{' · '.join(facts)}</p><p class='m'>{parts}</p></div>"
    )


def _span(its: list[int]) -> str:
    if len(its) == 1:
        return f"Iteration {its[0]}"
    return f"Iterations {its[0]}–{its[-1]} ({len(its)} logged)"


def samples_section(
    samples: list[dict], config: dict, trainer: str = "", python: dict | None = None
) -> str:
    """Sample answers with their proxy score and its parts, gold reward and KL, beside the
    reference's answer to the same prompt where the run sampled it: the first and last
    logged iterations open, the ones between folded."""
    head = "<h2 id='samples'>Samples</h2>"
    if not samples:
        n = (config.get("log") or {}).get("samples_per_log")
        if n == 0:
            return head + "<p>No samples logged: log.samples_per_log is 0.</p>"
        if trainer in ("DPO", "SFT", "RM"):
            return head + f"<p>No samples: a {trainer} run samples no answers.</p>"
        return (
            head + "<p>No samples logged (every log.sample_every iterations, and at the last).</p>"
        )
    names = sorted({k for s in samples for k in (s.get("components") or {})})
    weights = head_weights(config, names, python)
    by_it: dict[int, list[dict]] = {}
    for s in samples:
        by_it.setdefault(s["iteration"], []).append(s)

    def block(it: int) -> str:
        cards = []
        for s in by_it[it]:
            ref = s.get("reference")
            pair = _answer("policy", s, weights, s.get("kl"))
            pair += _answer("reference, same prompt", ref, weights) if ref else ""
            cards.append(
                f"<div class='smp'><p class='q'>prompt: <code>{esc(s['prompt'])}</code></p>"
                f"<div class='pair'>{pair}</div></div>"
            )
        return f"<h3>Iteration {it}</h3>" + "".join(cards)

    its = sorted(by_it)
    shown = [its[0]] + ([its[-1]] if len(its) > 1 else [])
    between = [it for it in its if it not in shown]
    out = head + block(its[0])
    if between:
        out += (
            f"<details><summary>{_span(between)}</summary>"
            + "".join(block(it) for it in between)
            + "</details>"
        )
    if len(its) > 1:
        out += block(its[-1])
    no_ref = not any(s.get("reference") for s in samples)
    if no_ref:
        out += (
            "<p class='m'>No reference answers: runs from before 2026-12-06 did not log them, "
            "and monitor.reference_every = 0 does not sample them.</p>"
        )
    return out


def other_charts(rows: list[dict], groups: list[tuple[str, list[Chart]]]) -> list[Chart]:
    """One chart per logged metric that no chart of ``groups`` draws (a DPO run's loss and
    preference accuracy, a metric a newer trainer adds): every number a run logs can be
    seen in its report."""
    drawn = {s.source for _, charts in groups for c in charts for s in c.series}
    keys = sorted(
        {
            k
            for r in rows
            for k, v in r.items()
            if k != "iteration" and isinstance(v, (int, float)) and not isinstance(v, bool)
        }
        - drawn
    )
    return [Chart(k, [series_of(rows, k)], k) for k in keys]


def series_of(rows: list[dict], key: str, name: str | None = None, **kw) -> Series:
    """The logged metric ``key`` over the rows' iterations: a value logged as null (not
    finite) and an iteration whose update was skipped (``faults/skipped_updates``: its
    update metrics are not logged) are gaps in the line; any other iteration that does not
    log the key (a signal computed every N-th) is passed over, the line joining across."""
    points, skips = [], 0
    for r in rows:  # faults/skipped_updates counts the run's skips so far: a rise is one
        skipped = (r.get("faults/skipped_updates") or 0) > skips
        skips = max(skips, r.get("faults/skipped_updates") or 0)
        if key in r or skipped:
            points.append((r["iteration"], r.get(key)))
    return Series(name or key, points, source=key, **kw)


def overoptimisation(rows: list[dict], story: dict) -> str:
    """Gold against √KL with Gao et al.'s fitted curve and its predicted peak."""
    fit = story.get("fit") if story else None
    if not fit:
        return ""
    pts = [
        (math.sqrt(max(r["objective/kl"], 0.0)), r["monitor/gold"])
        for r in rows
        if isinstance(r.get("objective/kl"), (int, float))
        and is_finite_number(r.get("monitor/gold"))
    ]
    peak = fit.get("peak")
    d_max = max(d for d, _ in pts)
    top = d_max * 1.05 if peak is None else max(d_max, min(peak["d"] * 1.15, 2 * d_max))
    curve = []
    for i in range(61):
        d = top * i / 60
        gain = 0.0 if d <= 0 else d * (fit["alpha"] - fit["beta"] * math.log(d))
        curve.append((d, fit["baseline"] + gain))
    marks = []
    if peak is not None and peak["d"] <= top:
        marks.append((peak["d"], f"predicted peak: √KL {peak['d']:.2f} (KL {peak['kl']:.2f})"))
    chart = Chart(
        "Gold reward against the distance from the reference",
        [
            Series("each iteration", pts, dots=True),
            Series("fit: g0 + d(α − β ln d)", curve),
        ],
        "gold reward",
        x_title="d = √KL (√nats per answer)",
        x_from_zero=True,
        marks=marks,
    ).html()
    where = (
        "no peak: the fitted gain never turns down (β ≤ 0)"
        if peak is None
        else f"predicted peak gold {peak['gold']:.3f} at KL {peak['kl']:.2f} nats "
        f"(d* = exp(α/β − 1) = {peak['d']:.2f}); the run ended at KL {fit['final_kl']:.2f}"
    )
    text = (
        f"<p>Gao, Schulman &amp; Hilton (2022) found that under RL against a proxy reward the "
        f"gold reward follows g0 + d(α − β ln d) in d = √KL. Least squares over "
        f"{fit['points']} iterations: α = {fit['alpha']:.3f}, β = {fit['beta']:.3f}, "
        f"g0 = {fit['baseline']:.3f}, residual {fit['rmse']:.3f} (one batch's noise); "
        f"{where}.</p>"
    )
    return f"<h2 id='overopt'>Over-optimisation</h2>{text}<div class='one'>{chart}</div>"


def alerts_table(alerts: list[dict]) -> str:
    """One row per signal (how often, over which iterations, its value farthest past the
    threshold), every alert folded below: one row per alert made a long run's page a table
    of repeats (387 for a 400-iteration GRPO run), its curves out of sight."""
    if not alerts:
        return "<p>No monitor fired.</p>"
    _step = lambda i: i if isinstance(i, (int, float)) else math.inf  # noqa: E731
    by_signal: dict[str, list[dict]] = {}
    for a in alerts:
        by_signal.setdefault(str(a.get("signal")), []).append(a)
    rows = []
    for signal, fired in by_signal.items():
        steps = [a.get("iteration") for a in fired]
        first, last = min(steps, key=_step), max(steps, key=_step)
        rows.append(
            [
                signal,
                len(fired),
                f"{first}" if first == last else f"{first}–{last}",
                num(_worst(fired)),
                num(fired[-1].get("threshold")),
                _advice(fired[-1]),
            ]
        )
    grouped = table(["signal", "alerts", "iterations", "worst", "threshold", "what to try"], rows)
    every = table(
        ["iteration", "signal", "value", "threshold"],
        [[a.get("iteration"), a.get("signal"), num(a.get("value")), num(a.get("threshold"))]
         for a in alerts],
    )  # fmt: skip
    return f"{grouped}<details><summary>every alert ({len(alerts)})</summary>{every}</details>"


def _worst(fired: list[dict]):
    """The value farthest past the signal's threshold (above or below it), or None."""
    pairs = [
        (a["value"], a.get("threshold"))
        for a in fired
        if isinstance(a.get("value"), (int, float)) and math.isfinite(a["value"])
    ]
    if not pairs:
        return None
    limit = pairs[-1][1]
    if not isinstance(limit, (int, float)) or not math.isfinite(limit):
        return pairs[-1][0]
    below = sum(v < t for v, t in pairs if isinstance(t, (int, float))) > len(pairs) / 2
    values = [v for v, _ in pairs]
    return min(values) if below else max(values)


def _advice(alert: dict) -> str:
    message = alert.get("message", "")
    return message.split(" — ", 1)[1] if " — " in message else message
