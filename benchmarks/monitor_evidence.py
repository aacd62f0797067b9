"""Do the reward-hacking monitors fire before the gold reward has fallen, and stay quiet otherwise?

Runs ``rlhflab demo`` for each preset and seed (or reuses a finished run folder), then reads
the PPO run's ``metrics.jsonl`` and ``alerts.jsonl`` and prints one row per run:

* gold start → end: the batch gold reward (``monitor/gold``, the 64 training answers of
  each iteration) averaged over the first 3 iterations (the policy has barely moved) and
  over the last 5;
* half-drop iteration: the first iteration (from the 2nd) at which the gold reward, as a
  centred 5-iteration moving average, is at or below the midpoint of start and end. One
  batch's mean moves ±0.08; the centred window does not lag, so it does not favour the
  monitors, it only keeps a single unlucky batch from counting as the collapse;
* first alert: the first iteration with any alert, and the signals that fired then;
* verdict: ``before`` when the first alert precedes the half-drop iteration.

Usage (2 cores: about 4 minutes a run, run nothing else alongside)::

    python benchmarks/monitor_evidence.py --presets hacking default --seeds 0 1 2 \
        --out runs/evidence
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path


def read_jsonl(path: Path) -> list[dict]:
    """rlhflab's log reader; a run without alerts has no alerts.jsonl at all."""
    from rlhflab.infra.runlog import read_jsonl as read

    return read(path) if path.exists() else []


def analyse(run: Path) -> dict:
    """One evidence row from a finished demo run folder (``<out>/<preset>-s<seed>``)."""
    metrics = read_jsonl(run / "ppo" / "metrics.jsonl")
    alerts = read_jsonl(run / "ppo" / "alerts.jsonl")
    gold = [row["monitor/gold"] for row in metrics]
    start, end = sum(gold[:3]) / 3, sum(gold[-5:]) / 5
    smooth = [statistics.mean(gold[max(0, i - 2) : i + 3]) for i in range(len(gold))]
    half_drop = None
    if end < start:
        midpoint = (start + end) / 2
        half_drop = next(
            (metrics[i]["iteration"] for i in range(1, len(gold)) if smooth[i] <= midpoint), None
        )
    summary = json.loads((run / "summary.json").read_text())
    first = min((a["iteration"] for a in alerts), default=None)
    fired = sorted({a["signal"] for a in alerts if a["iteration"] == first})
    return {
        "run": run.name,
        "gold_start": start,
        "gold_end": end,
        "heldout_gold": (summary["sft"]["gold"], summary["ppo"]["gold"]),
        "half_drop_iteration": half_drop,
        "first_alert": first,
        "first_signals": fired,
        "alerts": len(alerts),
        "iterations": len(metrics),
        "before": first is not None and half_drop is not None and first < half_drop,
    }


def format_rows(rows: list[dict]) -> str:
    lines = [
        "| run | batch gold start → end | held-out gold SFT → PPO | half-drop iteration "
        "| first alert (signals) | alerts |",
        "| --- | --- | --- | ---: | --- | ---: |",
    ]
    for r in rows:
        first = (
            f"{r['first_alert']} ({', '.join(r['first_signals'])})"
            if r["first_alert"] is not None
            else "none"
        )
        half = r["half_drop_iteration"] if r["half_drop_iteration"] is not None else "—"
        lines.append(
            f"| {r['run']} | {r['gold_start']:.3f} → {r['gold_end']:.3f} | "
            f"{r['heldout_gold'][0]:.3f} → {r['heldout_gold'][1]:.3f} | {half} | {first} "
            f"| {r['alerts']} |"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--presets", nargs="+", default=["hacking", "default"])
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    ap.add_argument("--out", default="runs/evidence")
    ap.add_argument("--reuse", action="store_true", help="analyse finished runs, train none")
    args = ap.parse_args()
    from rlhflab.app.demo import run_demo

    rows = []
    for preset in args.presets:
        for seed in args.seeds:
            run = Path(args.out) / f"{preset}-s{seed}"
            if not (args.reuse and (run / "summary.json").exists()):
                run_demo(preset, seed, args.out, progress=False)
            rows.append(analyse(run))
            print(format_rows(rows[-1:]).splitlines()[-1], flush=True)
    print(format_rows(rows))
    Path(args.out, "evidence.json").write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
