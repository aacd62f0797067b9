"""What the monitor's flattery-opener probe costs on SmolLM2-135M-Instruct, as a share of
the PPO iteration it runs in (issue #27: at most 5 %).

`examples/smollm2/ppo.yaml` (LoRA r=8 on every linear layer, a value head on the policy's
backbone, the adapter-disabled base as reference, the task's reward), run from that folder
as its README runs it, with the probe on (``monitor.flattery_opener_ratio`` at its default;
the example's file switches it off), in these cases:

* ``issue``: 8 prompts × 24 new tokens, the report that opened the issue;
* ``full``: the same with full fine-tuning (``model.lora_r=0``): a separate critic and a
  separate frozen reference, what a user gets without the LoRA lines;
* ``yaml``: the example's own batch, 16 prompts × 8 new tokens (answers 3× shorter than the
  probe's spellings: the hardest case for the share);
* ``every``: ``issue`` with ``monitor.opener_every=1``, a probe at every iteration (the
  default probes every 2nd): what one probe costs (this tree only).

Each case runs in its own process, ``--iterations`` PPO iterations (``PPOTrainer.step``,
the command's iteration without its logging); the first is a warm-up (and always probed).
The share is Σ time/monitor_probe / Σ iteration seconds over the others, both measured in
the same iterations of the same process, so a machine shared with other jobs slows
numerator and denominator alike (not exactly: the probe's share moved from 0.06 to 0.02
between a quiet and a heavily loaded run). ``--baseline REV`` also runs each case with the
rlhflab of a git revision (``git archive``, nothing checked out), alternating with this tree.

    .venv/bin/python benchmarks/monitor_probe.py [--cases issue full yaml every] [--iterations 5]
        [--baseline REV] [--model FOLDER] [--threads 2]

Prints a table, then ``monitor probe share SmolLM2: X`` (the ``issue`` case, this tree).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
EXAMPLE = HERE.parent / "examples" / "smollm2"
CASES = {
    "issue": ["rollout.prompts_per_iteration=8", "rollout.max_new_tokens=24"],
    "full": ["rollout.prompts_per_iteration=8", "rollout.max_new_tokens=24", "model.lora_r=0"],
    "yaml": [],
    "every": [
        "rollout.prompts_per_iteration=8",
        "rollout.max_new_tokens=24",
        "monitor.opener_every=1",
    ],
}
NEW_ONLY = {"every"}  # settings a baseline may not know
PHASES = ("time/generate", "time/score", "time/monitor_probe", "time/train")


def worker(case: str, args) -> list[dict]:
    """Wall seconds of each iteration and its time/* metrics, in this process."""
    from rlhflab.config import load_config
    from rlhflab.trainers.ppo import PPOTrainer

    os.chdir(EXAMPLE)  # ppo.yaml names data/ and the task's reward relative to it
    sys.path.insert(0, str(EXAMPLE))
    if not (EXAMPLE / "data" / "train.jsonl").exists():
        import task

        task.write(EXAMPLE / "data")
    ratio = load_config(reward_given=True).monitor.flattery_opener_ratio  # the default: on
    with tempfile.TemporaryDirectory() as out:
        overrides = [
            f"model.policy={args.model}",
            f"monitor.flattery_opener_ratio={ratio}",
            f"threads={args.threads}",
            f"ppo.iterations={args.iterations}",
            f"log.output_dir={out}",
            "log.progress=false",
            *CASES[case],
        ]
        trainer = PPOTrainer(load_config("ppo.yaml", overrides))
        rows = []
        for _ in range(args.iterations):
            t0 = time.perf_counter()
            metrics = trainer.step()
            trainer.iteration += 1
            rows.append({"wall": time.perf_counter() - t0, **{k: metrics[k] for k in PHASES}})
    return rows


def run_worker(case: str, src: Path, args) -> list[dict]:
    cmd = [sys.executable, __file__, "--worker", case, "--model", args.model]
    cmd += ["--iterations", str(args.iterations), "--threads", str(args.threads)]
    env = {**os.environ, "PYTHONPATH": str(src), "OMP_NUM_THREADS": str(args.threads)}
    res = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if res.returncode:
        sys.exit(f"worker {case} ({src}) failed:\n{res.stderr[-3000:]}")
    return json.loads(res.stdout.split("RESULT ")[-1])


def cpu_model() -> str:
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return next(
        (ln.split(":", 1)[1].strip() for ln in text.splitlines() if "Model name" in ln), "?"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    ap.add_argument("--iterations", type=int, default=5, help="per case; the first is warm-up")
    ap.add_argument("--threads", type=int, default=2, help="torch CPU threads (the example's)")
    ap.add_argument("--baseline", default="", help="git revision to compare ('': none)")
    ap.add_argument(
        "--model", default=str(Path("~/.cache/rlhflab/smollm2-135m-instruct").expanduser())
    )
    ap.add_argument("--worker", choices=list(CASES), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print("RESULT " + json.dumps(worker(args.worker, args)))
        return
    print(f"CPU: {cpu_model()}, {os.cpu_count()} cores; load average {os.getloadavg()[0]:.1f}")
    print(f"SmolLM2 at {args.model}, {args.threads} threads, iterations 2..{args.iterations} timed")
    with tempfile.TemporaryDirectory() as tmp:
        sources = [("this tree", HERE.parent / "src")]
        if args.baseline:
            archive = subprocess.run(
                ["git", "-C", str(HERE.parent), "archive", args.baseline, "src"],
                capture_output=True,
                check=True,
            ).stdout
            subprocess.run(["tar", "-x", "-C", tmp], input=archive, check=True)
            sources.insert(0, (args.baseline, Path(tmp) / "src"))
        print("| case | rlhflab | iteration s | generate s | score s | probe s | train s | share |")
        print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
        shares = {}
        for case in args.cases:
            for name, src in sources:
                if case in NEW_ONLY and name != "this tree":
                    continue
                rows = run_worker(case, src, args)
                timed = rows[1:] or rows
                mean = {k: sum(r[k] for r in timed) / len(timed) for k in ("wall", *PHASES)}
                shares[case, name] = mean["time/monitor_probe"] / mean["wall"]
                cells = " | ".join(f"{mean[k]:.1f}" for k in ("wall", *PHASES))
                print(f"| {case} | {name} | {cells} | {shares[case, name]:.3f} |", flush=True)
    print(f"load average after: {os.getloadavg()[0]:.1f}")
    for (case, name), share in shares.items():
        if name != "this tree" or case != "issue":
            print(f"monitor probe share SmolLM2 {case} ({name}): {share:.3f}")
    if ("issue", "this tree") in shares:
        print(f"monitor probe share SmolLM2: {shares['issue', 'this tree']:.3f}")


if __name__ == "__main__":
    main()
