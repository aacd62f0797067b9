"""bf16 against fp32 compute, rlhflab and TRL side by side, at 25M and on SmolLM2 (issue #27).

What ``model.compute_dtype=bf16`` buys a PPO iteration where the CPU multiplies bf16 in
hardware (AMX), and what it costs in arithmetic, on the two works the TRL comparisons use:

* ``25M``: ``vs_trl.py``'s (its locally built 25M Llama policy, reward model and critic
  from the reward model; 16 rollouts × 64 answer tokens forced, 4 PPO epochs of one
  minibatch, one torch thread);
* ``SmolLM2-135M``: ``vs_trl_real.py``'s equal settings (SmolLM2-135M-Instruct as
  ``examples/smollm2/prepare.py`` converts it, full fine-tuning of policy and critic from a
  reward model on its backbone; 8 rollouts × 24 answer tokens forced, 2 epochs, 2 threads).

Rows per work: rlhflab fp32 and bf16 (``model.runtime=native``, torch's MKL for the
products: numpy's OpenBLAS multiplies fp32 only), TRL 1.12.0 fp32 and with its own
``bf16=True`` (passed as ``accelerate launch --mixed_precision bf16`` does: see
``trl_ppo.run_trl``), each in a fresh worker process on the allocator each side starts on,
rows alternating within a round; the first ``--warmup`` iterations are not timed. Each
rlhflab row is the same config as in ``vs_trl.py`` / ``vs_trl_real.py`` but for
``model.compute_dtype`` (and ``cpu_matmul=torch``), so the speed-up is the dtype's alone.

What bf16 changes, beside the speed (``compute_dtype.py``'s accuracy worker on the same
policy): KL(p_fp32 ‖ p_bf16) of the untrained policy's next-token distributions per answer
token on one rollout (mean and max), and max |ratio − 1| at a first update whose old
log-probs are scored one answer per forward (other matrix shapes than training's);
and, from each rlhflab run itself, its first minibatch's ratio_max − 1: old log-probs taken
from the sampling pass (KV-cached, 1-row steps) against the training forward, as these
runs compute them (``rollout.logprobs_from_sampling``).

The last lines are ``bf16 speed-up <work> rlhflab: X`` (fp32 seconds per iteration over
bf16's), the same for TRL, and ``time ratio <work> bf16: Y`` (rlhflab bf16 over TRL bf16).

    python benchmarks/vs_trl.py --setup                      # once: TRL's venv (shared)
    python benchmarks/bf16_speedup.py                        # both works (~25 min)
    python benchmarks/bf16_speedup.py --works 25M --rounds 1

Nothing here runs inside ``make test``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import trl_ppo
from trl_ppo import TRL_VERSION, setup_trl_env
from vs_trl_work import ROLLOUTS, SIZES, build_models, rlhflab_config
from worker_process import launch, summarise, timed_fit

HERE = Path(__file__).resolve().parent
WORKS = ("25M", "SmolLM2-135M")
ROWS = ("rlhflab-fp32", "rlhflab-bf16", "trl-fp32", "trl-bf16")


def _real():
    import vs_trl_real_work

    return vs_trl_real_work


def threads(work: str) -> int:
    return 1 if work == "25M" else _real().THREADS


# ------------------------------------------------------------- workers (one process each)
def run_rlhflab(work: str, folder: Path, iterations: int, dtype: str) -> dict:
    import torch

    torch.set_num_threads(threads(work))
    from rlhflab.config import load_config
    from rlhflab.trainers.ppo import PPOTrainer

    if work == "25M":
        cfg = rlhflab_config(folder, SIZES["25M"][4], iterations, "native", "torch")
    else:
        cfg = _real().rlhflab_real_config(folder, iterations, "rlhflab", {"cpu_matmul": "torch"})
    cfg["model"]["compute_dtype"] = dtype
    cfg["log"]["output_dir"] = str(folder / f"run-bf16-bench-{dtype}")
    cfg["log"]["earlier_run"] = "replace"
    trainer = PPOTrainer(load_config(base=cfg))
    trainer.save = lambda *a, **k: None  # no end-of-run checkpoint (TRL writes none)
    out = timed_fit(trainer)
    first = trainer.first_minibatch or {}
    out["first_ratio_max_minus_1"] = first.get("policy/ratio_max", float("nan")) - 1
    return out


def run_trl(work: str, folder: Path, iterations: int, dtype: str) -> dict:
    bf16 = dtype == "bf16"
    if work == "25M":
        return trl_ppo.run_trl(folder, SIZES["25M"][4], iterations, bf16=bf16)
    real = _real()
    return trl_ppo.run_trl(
        folder, real.ANSWER, iterations, real.ROLLOUTS, real.EPOCHS, real.THREADS, real.PAD,
        bf16=bf16,
    )  # fmt: skip


def worker_main(argv: list[str]) -> None:
    row, work, folder, iterations = argv[0], argv[1], Path(argv[2]), int(argv[3])
    side, dtype = row.split("-")
    run = run_trl if side == "trl" else run_rlhflab
    print("RESULT " + json.dumps(run(work, folder, iterations, dtype)), flush=True)


# ------------------------------------------------------------------------------ the driver
def models_for(work: str, root: Path) -> tuple[Path, Path]:
    """The work's model folder and the policy folder inside it."""
    if work == "25M":
        folder = build_models("25M", root / "models-25M")
        return folder, folder / "policy"
    real = _real()
    policy = real.load_example("prepare").default_folder()
    folder = real.build_real_models(Path(policy), root / "models-smollm2")
    return folder, folder / "policy"


def accuracy(work: str, policy: Path) -> dict:
    """compute_dtype.py's accuracy worker on ``policy`` at this work's sizes."""
    import compute_dtype

    if work == "25M":
        prompts, tokens = ROLLOUTS, SIZES["25M"][4]
    else:
        prompts, tokens = _real().ROLLOUTS, _real().ANSWER
    args = argparse.Namespace(
        iterations=1, prompts=prompts, tokens=tokens, threads=threads(work),
        dtypes=["fp32", "bf16"],
    )  # fmt: skip
    return compute_dtype.run_worker("accuracy", str(policy), "fp32", args)


def cpu_line() -> str:
    import compute_dtype

    model, flags = compute_dtype.cpu_facts()
    return f"CPU: {model}, {os.cpu_count()} cores; bf16 in hardware: {', '.join(flags) or 'none'}"


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        return worker_main(sys.argv[2:])
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--works", nargs="+", default=list(WORKS), choices=WORKS)
    ap.add_argument("--rows", nargs="+", default=list(ROWS), choices=ROWS)
    ap.add_argument("--iterations", type=int, default=3, help="timed iterations per run")
    ap.add_argument("--warmup", type=int, default=1, help="untimed first iterations per run")
    ap.add_argument("--rounds", type=int, default=2, help="rounds over the rows")
    ap.add_argument("--work", default=str(HERE / ".vs_trl"), help="models, runs, TRL's venv")
    args = ap.parse_args()
    root = Path(args.work)
    trl_py = str(setup_trl_env(root / f"trl-{TRL_VERSION}"))
    print(cpu_line(), flush=True)
    print(f"load average before: {os.getloadavg()[0]:.1f}", flush=True)
    results = {}
    for work in args.works:
        folder, policy = models_for(work, root)
        runs: dict[str, list] = {row: [] for row in args.rows}
        for r in range(args.rounds):
            for row in args.rows:
                trl = row.startswith("trl")
                runs[row].append(
                    launch(
                        trl_py if trl else sys.executable,
                        [row, work, str(folder), str(args.warmup + args.iterations)],
                        "system" if trl else "auto",
                        threads(work),
                        ours=not trl,
                        script=Path(__file__),
                        what=f"{row} {work}",
                    )
                )
                s = summarise(runs[row][-1:], args.warmup)["s_per_it"]
                print(f"  round {r + 1} {work} {row}: {s:.2f} s/it", flush=True)
        table = {row: summarise(rs, args.warmup) for row, rs in runs.items()}
        for row in args.rows:
            if row.startswith("rlhflab"):
                table[row]["first_ratio_max_minus_1"] = max(
                    x["first_ratio_max_minus_1"] for x in runs[row]
                )
        table["accuracy"] = accuracy(work, policy)
        results[work] = table
        report(work, table)
    (root / "results-bf16.json").write_text(json.dumps(results, indent=1))
    print(f"load average after: {os.getloadavg()[0]:.1f}")
    for work, table in results.items():
        for side in ("rlhflab", "trl"):
            if f"{side}-fp32" in table and f"{side}-bf16" in table:
                x = table[f"{side}-fp32"]["s_per_it"] / table[f"{side}-bf16"]["s_per_it"]
                print(f"bf16 speed-up {work} {'TRL' if side == 'trl' else side}: {x:.2f}")
        if "rlhflab-bf16" in table and "trl-bf16" in table:
            y = table["rlhflab-bf16"]["s_per_it"] / table["trl-bf16"]["s_per_it"]
            print(f"time ratio {work} bf16: {y:.3f}")


def report(work: str, table: dict) -> None:
    print(f"\n{work}")
    print("| row | s/it (median) | spread | speed-up over its fp32 | peak MiB |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for row, t in table.items():
        if row == "accuracy":
            continue
        fp32 = table.get(row.split("-")[0] + "-fp32", t)["s_per_it"]
        lo, hi = t["spread"]
        print(
            f"| {row} | {t['s_per_it']:.2f} | {lo:.2f}–{hi:.2f} | {fp32 / t['s_per_it']:.2f} "
            f"| {t['peak_mib']:.0f} |"
        )
    a = table["accuracy"]
    print(
        f"KL(fp32 || bf16) per answer token, untrained policy: mean {a['kl_mean_bf16']:.2e}, "
        f"max {a['kl_max_bf16']:.2e}; max |ratio - 1| at a first update scored one answer "
        f"per forward: fp32 {a['ratio_gap_fp32']:.2e}, bf16 {a['ratio_gap_bf16']:.2e}"
    )
    for row in ("rlhflab-fp32", "rlhflab-bf16"):
        if row in table:
            print(
                f"{row}: first minibatch ratio_max - 1 (old log-probs from sampling): "
                f"{table[row]['first_ratio_max_minus_1']:.2e}"
            )


if __name__ == "__main__":
    main()
