"""A sweep's best settings against the defaults on new seeds, without selection bias.

The sweep picked its best trial on the seed it searched with; that trial's objective is
therefore optimistic. This reruns the whole demo pipeline (SFT → RM → PPO → held-out
evaluation) on seeds the sweep never saw, once with the preset's defaults and once with the
sweep's best settings as overrides (the same seed gives both arms the same SFT and reward
model), and prints the held-out gold reward of each arm.

    python benchmarks/sweep_rerun.py runs/sweeps/quick-s0/sweep.json --preset quick \\
        --seeds 11 12 13 --out runs/sweep-rerun
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sweep_json", help="the sweep's sweep.json")
    parser.add_argument("--preset", default="quick")
    parser.add_argument("--seeds", type=int, nargs="+", default=[11, 12, 13])
    parser.add_argument("--out", default="runs/sweep-rerun")
    args = parser.parse_args()
    from rlhflab.app.demo import run_demo

    best = json.loads(Path(args.sweep_json).read_text())["best"]
    if best is None:
        raise SystemExit(f"{args.sweep_json}: the sweep has no complete trial")
    tuned = [f"{k}={json.dumps(v)}" for k, v in best["params"].items()]
    rows = []
    for seed in args.seeds:
        for arm, overrides in (("defaults", []), ("best", tuned)):
            start = time.perf_counter()
            summary = run_demo(args.preset, seed, str(Path(args.out) / arm), overrides)
            ppo = summary["ppo"]
            rows.append(
                {
                    "seed": seed,
                    "arm": arm,
                    "gold": ppo["gold"],
                    "accuracy": ppo["accuracy"],
                    "kl": ppo["kl_to_reference"],
                    "seconds": time.perf_counter() - start,
                }
            )
            print(json.dumps(rows[-1]), flush=True)
    print("best settings:", ", ".join(tuned))
    print("| seed | arm | held-out gold | accuracy | KL |")
    print("| --- | --- | ---: | ---: | ---: |")
    for r in rows:
        print(
            f"| {r['seed']} | {r['arm']} | {r['gold']:.3f} | {r['accuracy']:.3f} | {r['kl']:.2f} |"
        )
    for arm in ("defaults", "best"):
        golds = [r["gold"] for r in rows if r["arm"] == arm]
        spread = statistics.stdev(golds) if len(golds) > 1 else 0.0
        print(f"held-out gold {arm}: {statistics.mean(golds):.3f} ± {spread:.3f}")


if __name__ == "__main__":
    main()
