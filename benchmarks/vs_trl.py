"""rlhflab's PPO against Hugging Face TRL's on the same work, side by side (issue 7).

TRL is never a dependency of rlhflab: ``--setup`` makes its own virtual environment with
TRL 1.12.0 (the last release with ``trl.experimental.ppo.PPOTrainer``) and the *same* torch
and transformers versions as ours. Both sides get the same locally built Llama-style
policy/reference, reward and value models (value initialised from the reward model, as in
TRL's examples), the same tokenizer and prompts, and the same work per iteration: 16
rollouts, answers forced to full length (EOS is an ordinary token on both sides), 4 PPO
epochs of one minibatch, k1 KL in the reward with β = 0.05, clip 0.2 / value clip 0.2,
γ = 1, λ = 0.95, one learning rate, fp32, one torch thread. Where the two differ only in
how they compute the same thing, each side does it its own way: TRL takes the old
log-probs from the generation logits and rlhflab does too (``rollout.logprobs_from_sampling``);
TRL draws tokens with ``torch.multinomial``, rlhflab from the same softmax by the Gumbel-max
trick (``rollout.sampler=gumbel``, since 2026-12-07). Each run is its own process;
runs alternate A B A B. The first ``--warmup`` iterations are not timed.

Reported per size: median and spread of seconds per iteration, generation tokens per
second, peak resident memory (VmHWM of the worker; torch's libraries are evicted from the
page cache before each worker starts, so both sides map them cold), achieved GFLOP/s of useful work
(counted below) against a one-thread fp32 matmul ceiling measured here, and the ratios.
A second table runs rlhflab with the recommended levers (shared policy/value backbone,
reference and reward model in bf16 or int8, whichever multiplies faster here, measured
first; ``--lever-precision`` forces one). rlhflab runs with ``model.runtime=native`` (its own Llama
forward and AdamW over the same files: same arithmetic, fewer imports); ``--runtime
transformers`` runs it on transformers' classes instead. rlhflab's worker starts on the
allocator the ``rlhflab`` command starts on (``--allocator auto``: mimalloc where installed,
rlhflab/backends/allocator.py), TRL's on the system's; ``--trl-allocator mimalloc`` runs TRL on the
same library, to tell the allocator's share from the rest. rlhflab multiplies its Linear
layers through whichever of torch's MKL and numpy's OpenBLAS (``model.cpu_matmul``) reached
the higher one-thread fp32 rate on this size's shapes, measured first (``--cpu-matmul
auto``; OpenBLAS won on the AMD EPYC VMs, MKL on the Intel Xeon ones; ``torch`` or
``numpy`` forces one; TRL always runs on MKL). The last lines are ``time ratio <size>: X``,
``memory ratio <size>: Y`` and ``time ratio 25M with levers: Z``; above them ``floor / TRL
<size>``: the iteration's products and attention alone at their best rates measured here
(``time_floor.py``), as a fraction of TRL's time — no time ratio below it can be reached
with these libraries on this machine.

    python benchmarks/vs_trl.py --setup                 # once: TRL's own environment
    python benchmarks/vs_trl.py                         # all sizes (~25 min on 2 cores)
    python benchmarks/vs_trl.py --sizes 0.2M 4M --rounds 1

Nothing here runs inside ``make test``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ppo_flops import frozen_precision_rates, matmul_ceiling, useful_flops
from trl_ppo import TRL_VERSION, run_trl, setup_trl_env
from vs_trl_work import ROLLOUTS, SIZES, build_models, prompt_length, rlhflab_config
from worker_process import evict_torch_libraries, launch, summarise, timed_fit

HERE = Path(__file__).resolve().parent


# ------------------------------------------------------------- workers (one process each)
def run_rlhflab(
    folder: Path,
    answer: int,
    iterations: int,
    levers: bool,
    runtime: str = "native",
    cpu_matmul: str = "numpy",
    lever_precision: str = "int8",
) -> dict:
    import torch

    torch.set_num_threads(1)
    from rlhflab.config import load_config
    from rlhflab.trainers.ppo import PPOTrainer

    base = rlhflab_config(folder, answer, iterations, runtime, cpu_matmul)
    if levers:
        base["model"].update(
            value_model="shared",
            reference_precision=lever_precision,
            reward_precision=lever_precision,
        )
    return timed_fit(PPOTrainer(load_config(base=base)))


def worker_main(argv: list[str]) -> None:
    side, folder, answer, iterations = argv[0], Path(argv[1]), int(argv[2]), int(argv[3])
    if side == "trl":
        out = run_trl(folder, answer, iterations)
    else:
        levers = side == "rlhflab-levers"
        out = run_rlhflab(folder, answer, iterations, levers, *argv[4:7])
    print("RESULT " + json.dumps(out), flush=True)


# ------------------------------------------------------------------------------ the driver
def run_side(
    python: str,
    side: str,
    folder: Path,
    size: str,
    iterations: int,
    runtime: str = "native",
    allocator: str = "system",
    cpu_matmul: str = "numpy",
    lever_precision: str = "int8",
) -> dict:
    worker_args = [side, str(folder), str(SIZES[size][4]), str(iterations)]
    worker_args += [runtime, cpu_matmul, lever_precision]
    return launch(python, worker_args, allocator, ours=side != "trl", what=f"{side} {size}")


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        return worker_main(sys.argv[2:])
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    ap.add_argument("--iterations", type=int, default=10, help="timed iterations per run")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=2, help="A B rounds per size")
    ap.add_argument("--no-levers", action="store_true", help="skip the levers table")
    ap.add_argument(
        "--no-floor",
        action="store_true",
        help="skip the floor of each size (benchmarks/time_floor.py, ~30 s a size)",
    )
    ap.add_argument("--work", default=str(HERE / ".vs_trl"), help="models, runs, TRL's venv")
    ap.add_argument("--setup", action="store_true", help="only build TRL's environment")
    ap.add_argument(
        "--runtime",
        default="native",
        choices=("native", "transformers"),
        help="rlhflab's model.runtime (native: its own Llama forward; transformers: HF's)",
    )
    ap.add_argument(
        "--cpu-matmul",
        default="auto",
        choices=("auto", "numpy", "torch"),
        help="rlhflab's model.cpu_matmul (numpy: OpenBLAS; torch: MKL, as TRL; auto: the "
        "faster of the two on this size's shapes, measured before the runs)",
    )
    ap.add_argument(
        "--lever-precision",
        default="auto",
        choices=("auto", "int8", "bf16"),
        help="the levers' reference and reward precision (auto: the faster of bf16 and int8 "
        "on this size's shapes, measured before the runs)",
    )
    ap.add_argument(
        "--allocator",
        default="auto",
        choices=("auto", "mimalloc", "system"),
        help="malloc of rlhflab's worker; auto = what the rlhflab command uses (mimalloc "
        "where installed)",
    )
    ap.add_argument(
        "--trl-allocator",
        default="system",
        choices=("auto", "mimalloc", "system"),
        help="malloc of TRL's worker (mimalloc: the same library, to separate the "
        "allocator's share from rlhflab's)",
    )
    args = ap.parse_args()
    # before anything here imports torch: the pages this process maps are not evicted again
    # before each worker, so they must be read in cold now (evict_torch_libraries)
    evict_torch_libraries(sys.executable)
    work = Path(args.work)
    trl_py = str(setup_trl_env(work / f"trl-{TRL_VERSION}"))
    if args.setup:
        print(f"TRL {TRL_VERSION} environment ready: {trl_py}")
        return
    ours, total = sys.executable, args.warmup + args.iterations
    results: dict[str, dict] = {}
    for size in args.sizes:
        folder = build_models(size, work / f"models-{size}")
        prompt_tokens = prompt_length(folder)
        ceiling = matmul_ceiling(size, prompt_tokens)
        cpu_matmul = args.cpu_matmul
        if cpu_matmul == "auto":
            cpu_matmul = "numpy" if ceiling["numpy"] > ceiling["torch"] else "torch"
        print(f"{size}: rlhflab multiplies through {cpu_matmul} ({ceiling})", flush=True)
        lever_precision = args.lever_precision
        if lever_precision == "auto":
            hidden, inter, _, _, answer = SIZES[size]
            low = frozen_precision_rates(hidden, inter, ROLLOUTS * (prompt_tokens + answer))
            lever_precision = max(low, key=low.get)
            print(f"{size}: levers' reference and reward in {lever_precision} ({low})", flush=True)
        floor = None
        if not args.no_floor:
            from time_floor import Work, floor_seconds  # this folder's benchmark

            floor = floor_seconds(Work.of_size(size), prompt_tokens)
            print(f"{size}: floor {floor['total']:.3f} s per iteration", flush=True)
        runs: dict[str, list] = {"rlhflab": [], "trl": [], "rlhflab-levers": []}
        for _ in range(args.rounds):  # A B A B
            ours_args = (args.runtime, args.allocator, cpu_matmul, lever_precision)
            runs["rlhflab"].append(run_side(ours, "rlhflab", folder, size, total, *ours_args))
            runs["trl"].append(
                run_side(trl_py, "trl", folder, size, total, allocator=args.trl_allocator)
            )
            if not args.no_levers:
                lever_run = run_side(ours, "rlhflab-levers", folder, size, total, *ours_args)
                runs["rlhflab-levers"].append(lever_run)
        flops = useful_flops(size, prompt_tokens)
        row = {k: summarise(v, args.warmup) for k, v in runs.items() if v}
        for side, r in row.items():
            side_flops = useful_flops(size, prompt_tokens, levers=side == "rlhflab-levers")
            r["gflops"] = side_flops / r["s_per_it"] / 1e9
        row["ceiling_gflops"] = ceiling
        row["cpu_matmul"] = cpu_matmul
        row["lever_precision"] = lever_precision
        row["flops_per_it"] = flops
        if floor is not None:
            row["floor_s"] = floor
        results[size] = row
        print(format_size(size, row), flush=True)
    (work / "results.json").write_text(
        json.dumps(
            {
                "runtime": args.runtime,
                "cpu_matmul": args.cpu_matmul,  # per size under each size's key
                "allocator": args.allocator,
                "trl_allocator": args.trl_allocator,
                **results,
            },
            indent=2,
        )
    )
    print()
    for size, row in results.items():  # before the lines, which come last
        if "floor_s" in row:
            print(f"floor / TRL {size}: {row['floor_s']['total'] / row['trl']['s_per_it']:.3f}")
    for size, row in results.items():
        print(f"time ratio {size}: {row['rlhflab']['s_per_it'] / row['trl']['s_per_it']:.3f}")
        print(f"memory ratio {size}: {row['rlhflab']['peak_mib'] / row['trl']['peak_mib']:.3f}")
    if "25M" in results and "rlhflab-levers" in results["25M"]:
        r = results["25M"]
        print(
            f"time ratio 25M with levers: {r['rlhflab-levers']['s_per_it'] / r['trl']['s_per_it']:.3f}"
        )


def format_size(size: str, row: dict) -> str:
    lines = [
        f"## {size}: {row['flops_per_it'] / 1e9:.1f} GFLOP of useful work per iteration, "
        f"one-thread fp32 matmul ceiling {row['ceiling_gflops']['torch']:.0f} GFLOP/s "
        f"through torch, {row['ceiling_gflops']['numpy']:.0f} through numpy; rlhflab "
        f"multiplies through {row['cpu_matmul']}; levers' reference and reward in "
        f"{row['lever_precision']}",
        "| side | s/iteration (median) | min–max | gen tokens/s | peak MiB | GFLOP/s |",
        "| --- | ---: | --- | ---: | ---: | ---: |",
    ]
    for side in ("rlhflab", "trl", "rlhflab-levers"):
        if side in row:
            r = row[side]
            lines.append(
                f"| {side} | {r['s_per_it']:.3f} | {r['spread'][0]:.3f}–{r['spread'][1]:.3f} | "
                f"{r['gen_tps']:.0f} | {r['peak_mib']:.0f} | {r['gflops']:.1f} |"
            )
    if "floor_s" in row:
        from time_floor import describe  # this folder's benchmark

        f = row["floor_s"]
        lines.append(
            f"{describe(f)}; TRL at {row['trl']['s_per_it'] / f['total']:.2f}× it, "
            f"rlhflab at {row['rlhflab']['s_per_it'] / f['total']:.2f}×"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
