"""Charts for the run report: inline SVG, drawn here (no plotting library, no script).

A chart is a ``<figure>``: its title, an SVG that scales to the width of its column
(``viewBox`` and ``width: 100%``), and an HTML legend under it whose swatches carry each
line's own colour and dash, so that nothing is written over the data and a phone wraps the
legend instead of cutting it. Axes have "nice" ticks (1, 2, 2.5 or 5 × 10^k), gridlines and
titles with units; a flat series gets a padded range instead of filling the height, and
quantities that start at zero (memory, time, counts) can keep zero on the axis.
"""

from __future__ import annotations

import html
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from rlhflab.diagnostics.gold_curve import ema

# Okabe & Ito's colour-blind-safe palette (black left out: it is the axes' colour)
PALETTE = ("#0072b2", "#d55e00", "#009e73", "#cc79a7", "#e69f00", "#56b4e9", "#8c6d1f")
ALERT = "#c0392b"
W, H = 480, 270  # the SVG's own units; the page scales it to its column
LEFT, RIGHT, TOP, BOTTOM = 62, 14, 10, 42  # plot margins: tick labels and axis titles


def nice_step(raw: float) -> float:
    """The smallest of 1, 2, 2.5, 5 × 10^k that is ≥ ``raw`` > 0."""
    k = math.floor(math.log10(raw))
    for m in (1, 2, 2.5, 5, 10):
        if m * 10**k >= raw * (1 - 1e-9):
            return m * 10**k
    return 10 ** (k + 1)


def nice_ticks(lo: float, hi: float, target: int = 5, min_step: float = 0.0) -> list[float]:
    """About ``target`` evenly spaced round values covering [lo, hi] (lo < hi): the first
    at or below lo, the last at or above it; steps of at least ``min_step`` (1 on an axis
    of whole iterations: no tick at iteration 1.25)."""
    step = max(nice_step((hi - lo) / max(target - 1, 1)), min_step)
    if min_step >= 1 and not float(step).is_integer():  # 2.5 on an axis of iterations
        step = float(math.ceil(step / min_step / 5) * 5 * min_step)
    first = math.floor(lo / step + 1e-9) * step
    n = math.ceil((hi - first) / step - 1e-9)
    return [round(first + i * step, 12) for i in range(n + 1)]


def axis_range(values: Sequence[float], include_zero: bool = False) -> tuple[float, float]:
    """(lo, hi) for the finite ``values``: a flat series (range under 1e-9 of its size)
    padded by 10 % of its value (±1 around 0; 0 to 1 with ``include_zero``), so that it sits inside the plot rather than
    on its edge or across its whole height; then widened to zero where ``include_zero``,
    and by 4 % of the range at each end that is not that zero."""
    lo, hi = min(values), max(values)
    if hi - lo <= 1e-9 * max(abs(lo), abs(hi), 1e-300):
        pad = 0.1 * abs(hi) if hi != 0 else 1.0
        lo, hi = (0.0, 1.0) if hi == 0 and include_zero else (lo - pad, hi + pad)
    if include_zero:
        lo, hi = min(lo, 0.0), max(hi, 0.0)
    # a little room, so that no line (a threshold, say) lies on the frame; zero stays put
    room = 0.04 * (hi - lo)
    return (lo if include_zero and lo == 0 else lo - room), (
        hi if include_zero and hi == 0 else hi + room
    )


def _decimals(step: float) -> int:
    """Decimals that a tick step of 1, 2, 2.5 or 5 × 10^k needs."""
    decimals = max(0, -math.floor(math.log10(step) + 1e-9))
    return decimals + (1 if round(step * 10**decimals, 6) % 1 else 0)  # 2.5 needs one more


def tick_label(v: float, step: float, largest: float | None = None) -> str:
    """``v`` short (about 6 characters) and no more precise than the tick step: 0.3 not
    0.30000000000000004, 5e-4 not 0.0005, 12k not 12000. ``largest``: the largest |tick|
    of the axis (default |v|): exponents only on an axis whose ticks are all under 0.01,
    so ticks near 1 read 0.998, 1.000, 1.002 rather than 9.98e-1, 1e0, 1.002e0."""
    if v == 0:
        return "0"
    if abs(v) >= 1e4:
        scale, suffix = (1e6, "M") if abs(v) >= 1e6 else (1e3, "k")
        return f"{v / scale:.{_decimals(step / scale) if step < scale else 0}f}{suffix}"
    if step < 0.01 and (abs(v) if largest is None else largest) < 0.01:
        digits = max(0, math.floor(math.log10(abs(v)) + 1e-9) - math.floor(math.log10(step)))
        mantissa, exponent = f"{v:.{digits + 1}e}".split("e")
        return f"{mantissa.rstrip('0').rstrip('.')}e{int(exponent)}"
    return f"{v:.{_decimals(step)}f}"


@dataclass
class Series:
    name: str
    points: list[tuple[float, float]]  # (x, y); None or non-finite y are gaps
    color: str | None = None  # None: the next palette colour
    dashed: bool = False
    dots: bool = False  # points, not a line
    note: str = ""  # said after the name in the legend
    source: str = ""  # the logged metric it plots, if one (the report's bookkeeping)


@dataclass
class Chart:
    title: str
    series: list[Series]
    y_title: str  # what and in which unit
    x_title: str = "iteration"
    alerts: list[float] = field(default_factory=list)  # x of alerts: red bands
    threshold: tuple[float, str] | None = None  # (value, 'above' | 'below') alerts fire
    include_zero: bool = False
    smooth: float | None = None  # draw the EMA (this factor) over the faint raw line
    x_from_zero: bool = False
    marks: list[tuple[float, str]] = field(default_factory=list)  # labelled verticals
    anchor: str = ""

    def html(self) -> str:
        return render(self)


def _finite(points) -> list[tuple[float, float]]:
    return [
        (float(x), float(y))
        for x, y in points
        if isinstance(y, (int, float)) and math.isfinite(y) and math.isfinite(x)
    ]


def _segments(points) -> list[list[tuple[float, float]]]:
    """The finite runs of ``points``: a None or non-finite y (a skipped update's loss, say)
    ends one, so that the line has a gap there instead of joining its neighbours."""
    runs: list[list[tuple[float, float]]] = [[]]
    for x, y in points:
        if isinstance(y, (int, float)) and math.isfinite(y) and math.isfinite(x):
            runs[-1].append((float(x), float(y)))
        elif runs[-1]:
            runs.append([])
    return [r for r in runs if r]


def _swatch(color: str, dashed: bool = False, dots: bool = False, band: bool = False) -> str:
    if band:
        shape = f'<rect x="8" y="0" width="6" height="10" fill="{color}" fill-opacity="0.3"/>'
    elif dots:
        shape = f'<circle cx="11" cy="5" r="3" fill="{color}"/>'
    else:
        dash = ' stroke-dasharray="5 3"' if dashed else ""
        shape = f'<line x1="0" y1="5" x2="22" y2="5" stroke="{color}" stroke-width="2.5"{dash}/>'
    return f'<svg class="sw" width="22" height="10" viewBox="0 0 22 10">{shape}</svg>'


def render(c: Chart) -> str:
    """The chart's ``<figure>``, or '' when no series has a finite point."""
    lines = [(s, _finite(s.points)) for s in c.series]
    lines = [(s, p) for s, p in lines if p]
    if not lines:
        return ""
    xs = [x for _, p in lines for x, _ in p] + [x for x, _ in c.marks]
    ys = [y for _, p in lines for _, y in p]
    if c.threshold is not None:
        ys.append(c.threshold[0])
    x0, x1 = (0.0 if c.x_from_zero else min(xs)), max(xs)
    if x1 <= x0:
        x0, x1 = x0 - 1, x1 + 1
    whole = 1.0 if all(float(x).is_integer() for x in xs) else 0.0  # iterations, trials
    xticks = [t for t in nice_ticks(x0, x1, min_step=whole) if x0 - 1e-9 <= t <= x1 + 1e-9]
    lo, hi = axis_range(ys, c.include_zero)
    yticks = nice_ticks(lo, hi)
    y0, y1 = yticks[0], yticks[-1]
    ystep, largest = yticks[1] - yticks[0], max(abs(t) for t in yticks)
    ylabels = [tick_label(t, ystep, largest) for t in yticks]
    # room for the longest tick label (11 px digits, ~6.3 px each) right of the rotated
    # axis title, which ends ~18 px from the edge: long labels ran under the title
    left = max(LEFT, math.ceil(23 + 6.3 * max(len(t) for t in ylabels)))
    pw, ph = W - left - RIGHT, H - TOP - BOTTOM

    def sx(x: float) -> float:
        return left + (x - x0) / (x1 - x0) * pw

    def sy(y: float) -> float:
        return TOP + ph - (y - y0) / (y1 - y0) * ph

    xstep = xticks[1] - xticks[0] if len(xticks) > 1 else 1.0
    out = [
        f'<svg class="pl" viewBox="0 0 {W} {H}" role="img" aria-label="{html.escape(c.title)}">',
        f'<rect x="{left}" y="{TOP}" width="{pw}" height="{ph}" class="pa"/>',
    ]
    for t, label in zip(yticks, ylabels):
        y = sy(t)
        out.append(f'<line x1="{left}" y1="{y:.1f}" x2="{W - RIGHT}" y2="{y:.1f}" class="gr"/>')
        out.append(
            f'<text x="{left - 5}" y="{y + 3.5:.1f}" text-anchor="end" class="tk">{label}</text>'
        )
    for t in xticks:
        x = sx(t)
        out.append(f'<line x1="{x:.1f}" y1="{TOP}" x2="{x:.1f}" y2="{TOP + ph}" class="gr"/>')
        out.append(
            f'<text x="{x:.1f}" y="{TOP + ph + 14}" text-anchor="middle" class="tk">'
            f"{tick_label(t, xstep)}</text>"
        )
    out.append(
        f'<text x="{left + pw / 2}" y="{H - 6}" text-anchor="middle" class="at">'
        f"{html.escape(c.x_title)}</text>"
        f'<text transform="translate(12 {TOP + ph / 2}) rotate(-90)" text-anchor="middle" '
        f'class="at">{html.escape(c.y_title)}</text>'
    )
    legend, marks = [], []
    for x in c.alerts:
        out.append(
            f'<rect x="{sx(x) - 2:.1f}" y="{TOP}" width="4" height="{ph}" fill="{ALERT}" '
            'fill-opacity="0.3" class="al"/>'
        )
    if c.alerts:
        first = min(c.alerts)
        marks.append(
            (_swatch(ALERT, band=True), f"alert ({len(c.alerts)}; first at {first:g})", "")
        )
    if c.threshold is not None:
        value, side = c.threshold
        out.append(
            f'<line x1="{left}" y1="{sy(value):.1f}" x2="{W - RIGHT}" y2="{sy(value):.1f}" '
            f'stroke="{ALERT}" stroke-width="1.2" stroke-dasharray="6 4"/>'
        )
        marks.append((_swatch(ALERT, dashed=True), f"threshold {value:g} (alert {side})", ""))
    for x, label in c.marks:
        out.append(
            f'<line x1="{sx(x):.1f}" y1="{TOP}" x2="{sx(x):.1f}" y2="{TOP + ph}" '
            'stroke="#444" stroke-width="1.2" stroke-dasharray="2 3"/>'
        )
        marks.append((_swatch("#444", dashed=True), html.escape(label), ""))
    for i, (s, pts) in enumerate(lines):
        color = s.color or PALETTE[i % len(PALETTE)]
        out.extend(_draw(s, pts, _segments(s.points), color, i, sx, sy, c.smooth))
        note = f" <small>{html.escape(s.note)}</small>" if s.note else ""
        legend.append(
            (_swatch(color, s.dashed, s.dots), html.escape(s.name) + note, f' data-s="{i}"')
        )
    out.append("</svg>")
    smooth = (
        f'<p class="cn">bold: smoothed (EMA {c.smooth:g}); faint: each iteration</p>'
        if c.smooth
        else ""
    )
    items = "".join(f"<li{key}>{sw}{label}</li>" for sw, label, key in legend + marks)
    anchor = f' id="{c.anchor}"' if c.anchor else ""
    return (
        f'<figure class="c"{anchor}><figcaption>{html.escape(c.title)}</figcaption>'
        f'{"".join(out)}<ul class="lg">{items}</ul>{smooth}</figure>'
    )


def _draw(s: Series, pts, runs, color: str, i: int, sx, sy, smooth: float | None) -> list[str]:
    """One series' marks: dots at its finite points ``pts``, or a line through each of its
    finite ``runs`` (:func:`_segments`), faint under its EMA when ``smooth``."""
    if s.dots:
        return [
            f'<circle cx="{sx(x):.1f}" cy="{sy(y):.1f}" r="2.6" fill="{color}" '
            f'fill-opacity="0.75" data-s="{i}"/>'
            for x, y in pts
        ]
    dash = ' stroke-dasharray="5 3"' if s.dashed else ""
    out = []
    if smooth:
        for run in runs:
            raw = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in run)
            out.append(
                f'<polyline fill="none" stroke="{color}" stroke-width="1" '
                f'stroke-opacity="0.3" points="{raw}"/>'
            )
        # the average runs on over a gap (it is of the values there are), drawn in pieces
        smoothed = iter(ema([y for _, y in pts], smooth))
        runs = [[(x, next(smoothed)) for x, _ in run] for run in runs]
    for run in runs:
        path = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in run)
        out.append(
            f'<polyline fill="none" stroke="{color}" stroke-width="2"{dash} points="{path}" '
            f'data-s="{i}"/>'
        )
        if len(run) == 1:  # a line through one point draws nothing (a one-iteration run)
            ((x, y),) = run
            out.append(
                f'<circle cx="{sx(x):.1f}" cy="{sy(y):.1f}" r="3.5" fill="{color}" data-s="{i}"/>'
            )
    return out
