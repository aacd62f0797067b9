"""The run report's verdict, run facts and tables (:mod:`rlhflab.app.report` lays the page
out; :mod:`~.report_sections` has the samples, reward-model checks and config). Each
returns an HTML fragment; :func:`table` and :func:`num` are shared by both."""

from __future__ import annotations

import html
import math
import re
from pathlib import Path

from rlhflab.app.tables import COMPARE_COLUMNS, DEMO_COLUMNS, cell
from rlhflab.diagnostics.gold_curve import ema
from rlhflab.diagnostics.gold_curve import is_finite_number as _finite

# monitor signals that point at the reward being gamed (entropy collapse and KL drift are
# training trouble, named in the verdict as alerts but not as hacking)
HACKING_SIGNALS = {
    "length_ratio",
    "flattery_rate",
    "flattery_excess",
    "flattery_opener_ratio",
    "repeated_ngram_rate",
    "reward_length_corr",
    "gold_drop",
}
# below this many logged iterations the verdict gives no all-clear: the monitor's EMA
# (smoothing 0.8) weighs a batch ~3 batches back at half, so no fall can stand out of the
# noise yet (a one-iteration run read "looks healthy")
TOO_FEW_TO_JUDGE = 5
FIT_MIN_KL = 0.01  # nats an answer the run must reach for the verdict to state the fit


# bidirectional overrides and isolates: in a prompt or answer they reverse the text after
# them on the page (U+202E made "abc" read "cba"), so the report shows them as themselves
BIDI = re.compile("[\u202a-\u202e\u2066-\u2069]")


def esc(v) -> str:
    """``v`` as HTML text, its bidirectional control characters shown as ``[U+202E]``."""
    return BIDI.sub(lambda m: f"[U+{ord(m.group()):04X}]", html.escape(str(v)))


def num(v, digits: int = 3) -> str:
    """A number for a table cell: '-' for None or non-finite, ints as they are."""
    if isinstance(v, bool) or v is None:
        return "-" if v is None else str(v)
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float) and not math.isfinite(v):
        return "-"
    return f"{v:.{digits}f}" if isinstance(v, float) else str(v)


def table(header: list[str], rows: list[list], raw: bool = False) -> str:
    """An HTML table in a wrapper that scrolls sideways on its own on a narrow screen
    (the page never does); cells are escaped unless ``raw``."""
    cell = (lambda c: str(c)) if raw else esc
    head = "".join(f"<th>{esc(h).replace('_', '_<wbr>')}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{cell(c)}</td>" for c in r) + "</tr>" for r in rows)
    return f'<div class="tw"><table><tr>{head}</tr>{body}</table></div>'


def _signed(v: float) -> str:
    return f"{v:+.3f}"


# Long (about 70 lines) because it is one paragraph of findings in reading order, each
# line from one source (gold story, proxy, held-out evaluation, alerts, KL, fit).
def verdict(
    rows: list[dict],
    alerts: list[dict],
    story: dict,
    summary: dict | None,
    stop_reason: str | None = None,
    error: str | None = None,
) -> str:
    """The report's first block: what the run did to gold and proxy reward, its best
    iteration, its alerts, its final KL, the over-optimisation fit, and a plain sentence
    when reward hacking is suspected. ``error``: the message the run ended with (run.json),
    said first — a halt's iteration and count are not in the log, whose last line is the
    step before."""
    if not story and not any("objective/scores" in r for r in rows):
        return _verdict_without_reward(rows, error)
    facts, worries = [], []
    if story:
        a = story["smoothing"]
        line = (
            f"<b>Gold reward</b> (monitor, smoothed EMA {a:g}): {story['first']:.3f} → "
            f"{story['final']:.3f} ({_signed(story['final'] - story['first'])}); best "
            f"{story['best']:.3f} at iteration {story['best_iteration']}"
        )
        if story.get("best_checkpoint"):
            line += " — kept in <code>checkpoints/best</code>"
        facts.append(line)
    proxy = [r["objective/scores"] for r in rows if _finite(r.get("objective/scores"))]
    if proxy:
        a = story.get("smoothing", 0.8) if story else 0.8
        p = ema(proxy, a)
        shaped = [
            r["objective/shaped_scores"] for r in rows if _finite(r.get("objective/shaped_scores"))
        ]
        what = "the reward's score before PAR shaping" if shaped else "the optimised score"
        facts.append(
            f"<b>Proxy reward</b> ({what}, smoothed): {p[0]:.3f} → {p[-1]:.3f} "
            f"({_signed(p[-1] - p[0])})"
        )
        if shaped:  # reward.shaping=par: what PPO optimises is σ(score − reference's)
            q = ema(shaped, a)
            facts.append(
                f"<b>Shaped reward</b> (PAR's σ(score − reference score), what PPO optimises, "
                f"smoothed): {q[0]:.3f} → {q[-1]:.3f} ({_signed(q[-1] - q[0])})"
            )
    held = _held_out(summary)
    if held:
        facts.append(held[0])
        worries += held[1:]
    if alerts:
        first = min(alerts, key=lambda x: x["iteration"])
        names = sorted({x["signal"] for x in alerts})
        facts.append(
            f"<b>{len(alerts)} monitor alert{'s' * (len(alerts) > 1)}</b>, the first at "
            f"iteration {first['iteration']} ({esc(first['signal'])}); signals: "
            + esc(", ".join(names))
        )
        hacking = [n for n in names if n in HACKING_SIGNALS]
        # a run too short to judge gets no hacking verdict from signals of a few batches
        # (a reward–length correlation over 4 answers; its alerts stay in the facts) —
        # unless the monitor stopped it for them (monitor.response=stop), which is one
        stopped = "(monitor.response=stop)" in (stop_reason or "")
        if hacking and (len(rows) >= TOO_FEW_TO_JUDGE or stopped):
            worries.append(
                "The monitor flagged signs of a gamed reward: " + esc(", ".join(hacking)) + "."
            )
    else:
        facts.append("<b>No monitor alert.</b>")
    last = rows[-1]
    skipped = last.get("faults/skipped_updates")
    if _finite(skipped) and skipped > 0:
        worries.append(
            f"{int(skipped)} update{'s were' if skipped > 1 else ' was'} skipped for a "
            "non-finite reward, loss or gradient: the policy did not learn from those "
            "batches (see the faults chart)."
        )
    if _finite(last.get("objective/kl")):
        beta = last.get("objective/kl_coef")
        facts.append(
            f"<b>Final KL</b> to the reference: {last['objective/kl']:.3f} nats per answer"
            + (f" (β {beta:.3g})" if _finite(beta) else "")
            # a sampled estimate (k1): noise takes it a little below 0; far below 0 is the
            # run's KL-sign warning (answers not sampled from π: top_k/top_p truncation)
            + (
                " — below 0: k1 is a sampled estimate, slightly negative by noise; far below, "
                "see the log's KL-sign warning and objective/kl_k3"
                if last["objective/kl"] < 0
                else ""
            )
        )
    fit = story.get("fit") if story else None
    # a fit through a few batches at KL ≈ 0 ("peaks near KL 0.00, ended at 0.00, past
    # it") says nothing: stated only from enough batches that moved away from the reference
    judged = fit and fit["points"] >= TOO_FEW_TO_JUDGE and fit["final_kl"] >= FIT_MIN_KL
    if judged and fit.get("peak"):
        pk = fit["peak"]
        where = "past" if fit["past_peak"] else "before"
        facts.append(
            f"<b>Over-optimisation fit</b> (Gao et al. 2022, to {fit['points']} noisy "
            f"batches): gold peaks near KL {pk['kl']:.2f} nats; the run ended at KL "
            f"{fit['final_kl']:.2f}, {where} it"
        )
    if story and story["fell"]:
        keep = (
            "it is kept in checkpoints/best (<code>rlhflab export --checkpoint best</code>)"
            if story.get("best_checkpoint")
            else "set log.keep_best to keep it"
        )
        times = story["drop"] / story["noise"] if story["noise"] > 0 else math.inf
        if story["proxy_rose"]:
            worries.insert(
                0,
                f"Reward hacking suspected: after iteration {story['best_iteration']} the proxy "
                f"reward kept rising ({story['proxy_at_best']:.3f} → "
                f"{story['proxy_final']:.3f}, smoothed) while the gold reward fell "
                f"{story['drop']:.3f} ({times:.1f}× its smoothed noise). The policy of "
                f"iteration {story['best_iteration']} was better on gold; {keep}.",
            )
        elif story.get("proxy_at_best") is None or story.get("proxy_final") is None:
            worries.insert(
                0,
                f"The gold reward fell {story['drop']:.3f} from its best at iteration "
                f"{story['best_iteration']} ({times:.1f}× its smoothed noise); the proxy has "
                f"no finite score there to say whether it was gamed. {keep.capitalize()}.",
            )
        else:
            worries.insert(
                0,
                f"The gold reward fell {story['drop']:.3f} from its best at iteration "
                f"{story['best_iteration']} ({times:.1f}× its smoothed noise), and the proxy "
                f"fell with it: over-training rather than a gamed reward. {keep.capitalize()}.",
            )
    if error:  # first: what ended the run
        worries.insert(0, f"The run ended with an error: {esc(error)}")
    if worries:
        tone, sentence = "bad", "".join(f"<p class='say'>{w}</p>" for w in worries)
    elif len(rows) < TOO_FEW_TO_JUDGE:
        tone = "warn" if alerts else "short"
        sentence = (
            f"<p class='say'>Too few iterations ({len(rows)}) to judge the run: a trend in "
            "the gold or proxy reward needs more batches than this"
            + (", and alerts on so few batches are hints to look at, not a verdict" * bool(alerts))
            + ".</p>"
        )
    elif story:
        tone = "warn" if alerts else "good"
        sentence = (
            "<p class='say'>No sign of reward hacking: the gold reward did not fall "
            "significantly below its best and no hacking signal fired.</p>"
        )
    else:
        tone = "warn" if alerts else "none"
        sentence = (
            "<p class='say'>No gold reward (monitor.gold) to check the proxy against: the "
            "monitor's signals are the only check.</p>"
        )
    badge = {
        "bad": "needs a look",
        "warn": "alerts",
        "good": "looks healthy",
        "none": "no gold",
        "short": "too short",
    }
    items = "".join(f"<li>{f}</li>" for f in facts)
    return (
        f"<section class='verdict {tone}' id='verdict'><h2>Verdict <span class='badge'>"
        f"{badge[tone]}</span></h2>{sentence}<ul>{items}</ul></section>"
    )


RECENT = 20  # the steps the commands' own "loss A → B" line averages (Supervised.recent_loss)


def _verdict_without_reward(rows: list[dict], error: str | None = None) -> str:
    """The verdict of a run that scores no sampled answers (DPO, SFT, a reward model): no
    gold or proxy story to tell; its first and last loss, and a DPO run's accuracy."""
    facts = []
    for key, what in (("loss", "Loss"), ("rewards/accuracy", "Preference accuracy")):
        seen = [r[key] for r in rows if _finite(r.get(key))]
        if seen and key == "loss" and len(seen) > 1:
            # as the command says it: the last 20 steps' mean (one step's loss is noisy)
            tail = seen[-RECENT:]
            facts.append(
                f"<b>{what}</b>: {seen[0]:.3f} → {sum(tail) / len(tail):.3f} (the mean of "
                f"the last {len(tail)} steps; {seen[-1]:.3f} at the last)"
            )
        elif seen:
            facts.append(f"<b>{what}</b>: {seen[0]:.3f} → {seen[-1]:.3f}")
    items = "".join(f"<li>{f}</li>" for f in facts)
    ended = f"<p class='say'>The run ended with an error: {esc(error)}</p>" if error else ""
    return (
        "<section class='verdict' id='verdict'><h2>Verdict <span class='badge'>no reward"
        f"</span></h2>{ended}<p class='say'>This run scores no sampled answers, so there is no gold "
        "or proxy reward to judge it by and no reward-hacking monitor; every logged metric "
        f"is under Curves.</p><ul>{items}</ul></section>"
    )


def _held_out(summary: dict | None) -> list[str]:
    """[the held-out line, worries...] from the demo's summary.json, or []."""
    if not summary or "sft" not in summary or "ppo" not in summary:
        return []
    s, p = summary["sft"], summary["ppo"]
    if not all(_finite(x.get(k)) for x in (s, p) for k in ("gold", "proxy")):
        return []
    dg, dp = p["gold"] - s["gold"], p["proxy"] - s["proxy"]
    out = [
        f"<b>Held-out evaluation</b> of the final policy against the SFT start: gold "
        f"{s['gold']:.3f} → {p['gold']:.3f} ({_signed(dg)}), proxy {s['proxy']:.3f} → "
        f"{p['proxy']:.3f} ({_signed(dp)})"
    ]
    best = summary.get("ppo_best")
    if best and _finite(best.get("gold")):
        out[0] += f"; the best checkpoint: gold {best['gold']:.3f}"
    if dp > 0 > dg:
        out.append("On held-out prompts the proxy rose while the gold reward fell: hacking.")
    return out


def run_facts(info: dict | None, rows: list[dict], run: Path) -> str:
    """The run's metadata (run.json) as a two-column table."""
    if not info:
        logged = sum(
            r.get(k) or 0
            for r in rows
            for k in ("time/generate", "time/score", "time/train", "time/monitor_probe")
        )
        return (
            f"<p class='m'>{esc(run)} has no run.json (written by runs from 2026-12-06 on): no "
            f"dates, versions or machine. The logged phases took {logged:.0f} s.</p>"
        )
    wall = info.get("wall_s")
    ended = bool(info.get("finished"))
    logged = max((r.get("iteration") or 0 for r in rows), default=0)
    if not ended:
        why = "-"  # run.json is written again only when the run ends
    else:
        error = ": ".join(str(x) for x in (info.get("error"), info.get("error_message")) if x)
        why = info.get("stop_reason") or error or "it was done"
    pairs = [
        ("trainer", info.get("trainer")),
        ("started", info.get("started")),
        ("finished", info.get("finished") or "not finished (still running, or killed)"),
        ("wall time", f"{wall:.0f} s ({wall / 60:.1f} min)" if _finite(wall) else "-"),
        ("iterations", f"{info.get('steps', logged)} of {info.get('total', '?')}"),
        ("stopped because", why),
        ("rlhflab", info.get("rlhflab")),
        ("torch", info.get("torch")),
        ("python", info.get("python")),
        ("machine", info.get("platform")),
        (
            "CPU",
            f"{info.get('cpu')} ({info.get('cpu_cores')} cores, "
            f"{info.get('torch_threads')} torch threads)",
        ),
    ]
    if info.get("gpu"):
        pairs.append(("GPU", info["gpu"]))
    for name, size in (info.get("models") or {}).items():
        n, t = size.get("parameters", 0), size.get("trained", 0)
        said = f"{n:,} parameters ({t:,} trained)"
        if size.get("shares_policy"):
            said = "the policy with its LoRA adapters off (its weights; none of its own)"
        pairs.append((f"{name} model", said))
    return table(["", "value"], [[k, "-" if v is None else v] for k, v in pairs])


def demo_table(summary: dict) -> str:
    """The demo's held-out table (summary.json): one row per evaluated policy."""
    label = {
        "sft": "sft (where PPO started)",
        "ppo": "ppo (final policy)",
        "ppo_best": "ppo best (checkpoints/best" + _best_at(summary) + ")",
    }
    rows = [
        [label[name], *(num(summary[name].get(c)) for c in DEMO_COLUMNS)]
        for name in ("sft", "ppo", "ppo_best")
        if isinstance(summary.get(name), dict)
    ]
    n = summary.get("eval_prompts")
    note = f"<p class='m'>{n} held-out prompts.</p>" if n else ""
    return table(["policy", *DEMO_COLUMNS], rows) + note


def _best_at(summary: dict) -> str:
    it = (summary.get("gold_curve") or {}).get("best_iteration")
    return f", iteration {it}" if it else ""


def compare_table(compare: dict) -> str:
    """``rlhflab compare``'s table: rewards to 3 decimals, time and memory as integers
    with their units (:func:`rlhflab.app.tables.cell`)."""
    return table(
        ["method", *COMPARE_COLUMNS],
        [[r["method"], *(cell(c, r.get(c)) for c in COMPARE_COLUMNS)] for r in compare["rows"]],
    )


def settings_history(run: Path) -> str:
    """What a resume changed, span by span (``config.until-step-N.yaml`` holds the settings
    steps up to N ran with; config.yaml the last span's, which the tables below show)."""
    from rlhflab.trainers.resume_checks import config_changes, read_recorded_config

    def step(p: Path) -> int:
        tail = p.name[len("config.until-step-") : -len(".yaml")]
        return int(tail) if tail.isdigit() else -1

    kept = sorted((p for p in run.glob("config.until-step-*.yaml") if step(p) >= 0), key=step)
    files = [*kept, run / "config.yaml"]
    spans = []
    for older, newer in zip(files, files[1:]):
        changes = config_changes(read_recorded_config(older), read_recorded_config(newer))
        if changes:
            said = "; ".join(esc(c) for c in changes)
            spans.append(f"after step {step(older)} ({esc(older.name)}): {said}")
    if not spans:
        return ""
    return (
        "<p class='m'><b>Settings changed at a resume</b> — "
        + " · ".join(spans)
        + ". The tables show the settings of the last steps.</p>"
    )
