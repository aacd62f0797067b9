"""rlhflab's GRPO and RLOO against current TRL's on the same work, side by side (issue 7).

The critic-free half of ``vs_trl.py``: TRL's ``GRPOTrainer`` and ``RLOOTrainer`` live in
current TRL (1.16.0 here), which ``--setup`` installs into its own virtual environment with
our torch and transformers versions. Models, tokenizer, prompts, sizes, the A B A B
alternation, the warm-up and the reported numbers are ``vs_trl.py``'s (its helpers are
imported from the modules it is built on). The work per iteration, equal on both sides:

* 4 prompts × G = 4 answers = 16 rollouts, answers exactly as long as the size says: TRL is
  given ``min_new_tokens`` = ``max_completion_length``, rlhflab ``rollout.ignore_eos``;
* one optimisation step on all 16 (μ = 1 epoch, one minibatch), lr 3e-6, fp32, one thread;
* activation checkpointing on both sides (TRL's default for these trainers; rlhflab's
  ``model.gradient_checkpointing``);
* GRPO: advantages (s − mean)/std within the group, k3 KL in the loss with β = 0.04, clip
  0.2, per-answer token mean then batch mean (TRL ``loss_type="grpo"``);
* RLOO: leave-one-out baseline, k1 KL in the reward with β = 0.05 (TRL's default), clip 0.2;
* the reward is the same one-label sequence classifier on both sides (TRL decodes and
  re-tokenizes the answers for it, as it does for any reward model; rlhflab passes the
  token ids through when the tokenizers match — part of what is measured).

    python benchmarks/vs_trl_group.py --setup            # once: TRL's own environment
    python benchmarks/vs_trl_group.py                    # both algorithms, all sizes
    python benchmarks/vs_trl_group.py --algos grpo --sizes 0.2M --rounds 1

As in ``vs_trl.py`` (whose options these are): rlhflab runs on ``model.runtime=native``
(``--runtime transformers`` for transformers' classes), its worker on the allocator the
``rlhflab`` command starts on (``--allocator``; TRL's on the system's, ``--trl-allocator``),
its Linear products through whichever of MKL and OpenBLAS this size's shapes run faster
here (``--cpu-matmul``), and torch's libraries are evicted from the page cache before each
worker starts.

The last lines are ``time ratio <algo> <size>: X`` and ``memory ratio <algo> <size>: Y``.
Nothing here runs inside ``make test``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import trl_ppo
import vs_trl_work
from ppo_flops import matmul_ceiling
from trl_ppo import TRL_COMMON, setup_trl_env
from vs_trl_work import ROLLOUTS, SIZES, build_models, prompt_length
from worker_process import _peak_rss_mib, evict_torch_libraries, launch, summarise, timed_fit

HERE = Path(__file__).resolve().parent
TRL_VERSION = "1.16.0"
GROUP, LR = 4, vs_trl_work.LR
BETA = {"grpo": 0.04, "rloo": 0.05}


def run_rlhflab(
    folder: Path,
    answer: int,
    iterations: int,
    algo: str,
    runtime: str = "native",
    cpu_matmul: str = "torch",
) -> dict:
    import torch

    torch.set_num_threads(1)
    from rlhflab.config import load_config
    from rlhflab.trainers.grpo import GRPOTrainer

    kl = (
        {"kl_placement": "loss", "kl_estimator": "k3"}
        if algo == "grpo"
        else {"kl_placement": "reward", "kl_estimator": "k1"}
    )
    cfg = {
        "device": "cpu",
        "seed": 0,
        # TRL's GRPO/RLOO checkpoint activations by default (gradient_checkpointing=True):
        # the same recomputation on our side keeps the work equal
        "model": {
            "policy": str(folder / "policy"),
            "value_model": "none",
            "gradient_checkpointing": True,
            "runtime": runtime,
            "cpu_matmul": cpu_matmul,
        },
        "reward": {"model": str(folder / "reward"), "normalize": "none", "clip": None},
        "rollout": {
            "prompts_per_iteration": ROLLOUTS,
            "max_new_tokens": answer,
            "ignore_eos": True,
            "temperature": 1.0,
        },
        "grpo": {"group_size": GROUP},
        "ppo": {
            **kl,
            "iterations": iterations,
            "epochs": 1,
            "minibatches": 1,
            "lr": LR,
            "kl_coef": BETA[algo],
            "clip_low": 0.2,
            "loss_agg": "seq-mean-token-mean",
        },
        "data": {"prompts": str(folder / "prompts.jsonl")},
        "log": {
            "output_dir": str(folder / f"run-rlhflab-{algo}"),
            "progress": False,
            "sample_every": 10_000,
            "checkpoint_every": 10_000,
        },
        "monitor": {"enabled": False},
    }
    return timed_fit(GRPOTrainer(load_config(base=cfg, stage=algo), None, algo))


def run_trl(folder: Path, answer: int, iterations: int, algo: str) -> dict:
    import torch

    torch.set_num_threads(1)
    import transformers
    from datasets import Dataset
    from transformers import AutoModelForSequenceClassification, AutoTokenizer, TrainerCallback

    if algo == "grpo":
        from trl import GRPOConfig as Config
        from trl import GRPOTrainer as Trainer

        extra = {"loss_type": "grpo", "scale_rewards": "group"}
    else:
        from trl import RLOOConfig as Config
        from trl import RLOOTrainer as Trainer

        extra = {}
    tok = AutoTokenizer.from_pretrained(folder / "policy", padding_side="left")
    prompts = [
        json.loads(x)["prompt"] for x in (folder / "prompts.jsonl").read_text().split("\n") if x
    ]
    args = Config(
        output_dir=str(folder / f"run-trl-{algo}"),
        per_device_train_batch_size=ROLLOUTS,
        gradient_accumulation_steps=1,
        steps_per_generation=1,
        num_generations=GROUP,
        num_iterations=1,
        gradient_checkpointing=True,  # TRL's default, stated
        max_completion_length=answer,
        generation_kwargs={"min_new_tokens": answer},  # full length, as rlhflab's ignore_eos
        temperature=1.0,
        top_k=0,
        beta=BETA[algo],
        epsilon=0.2,
        learning_rate=LR,
        max_steps=iterations,
        lr_scheduler_type="constant",
        **TRL_COMMON,
        **extra,
    )
    reward = AutoModelForSequenceClassification.from_pretrained(folder / "reward", num_labels=1)
    gen, original = [], transformers.GenerationMixin.generate

    def timed_generate(model, *a, **kw):
        t0 = time.perf_counter()
        out = original(model, *a, **kw)
        new_tokens = out.shape[1] - kw["input_ids"].shape[1]
        gen.append(out.shape[0] * new_tokens / (time.perf_counter() - t0))
        return out

    transformers.GenerationMixin.generate = timed_generate
    ticks = []

    class Tick(TrainerCallback):
        def on_step_end(self, *a, **kw):
            ticks.append(time.perf_counter())

    trainer = Trainer(
        model=str(folder / "policy"),
        reward_funcs=reward,
        args=args,
        train_dataset=Dataset.from_dict({"prompt": prompts}),
        processing_class=tok,
        reward_processing_classes=tok,
        callbacks=[Tick()],
    )
    start = time.perf_counter()
    trainer.train()
    return {"start": start, "ticks": ticks, "gen_tps": gen, "peak_mib": _peak_rss_mib()}


def worker_main(argv: list[str]) -> None:
    side, algo, folder, answer, iterations = argv[0], argv[1], Path(argv[2]), *map(int, argv[3:5])
    if side == "trl":
        out = run_trl(folder, answer, iterations, algo)
    else:
        out = run_rlhflab(folder, answer, iterations, algo, *argv[5:7])
    print("RESULT " + json.dumps(out), flush=True)


def run_side(
    python: str,
    side: str,
    algo: str,
    folder: Path,
    size: str,
    iterations: int,
    allocator: str = "system",
    runtime: str = "native",
    cpu_matmul: str = "torch",
) -> dict:
    args = [side, algo, str(folder), str(SIZES[size][4]), str(iterations)]
    if side != "trl":
        args += [runtime, cpu_matmul]
    what = f"{side} {algo} {size}"
    return launch(python, args, allocator, 1, side != "trl", Path(__file__), what)


def format_row(algo: str, size: str, row: dict) -> str:
    lines = [
        f"## {algo} {size}",
        "| side | s/iteration (median) | min–max | gen tokens/s | peak MiB |",
        "| --- | ---: | --- | ---: | ---: |",
    ]
    for side in ("rlhflab", "trl"):
        r = row[side]
        lines.append(
            f"| {side} | {r['s_per_it']:.3f} | {r['spread'][0]:.3f}–{r['spread'][1]:.3f} | "
            f"{r['gen_tps']:.0f} | {r['peak_mib']:.0f} |"
        )
    return "\n".join(lines)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        return worker_main(sys.argv[2:])
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--algos", nargs="+", default=["grpo", "rloo"], choices=["grpo", "rloo"])
    ap.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    ap.add_argument("--iterations", type=int, default=10, help="timed iterations per run")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=2, help="A B rounds per size")
    ap.add_argument("--work", default=str(HERE / ".vs_trl"), help="models, runs, TRL's venv")
    ap.add_argument("--setup", action="store_true", help="only build TRL's environment")
    ap.add_argument("--runtime", default="native", choices=("native", "transformers"))
    ap.add_argument("--cpu-matmul", default="auto", choices=("auto", "numpy", "torch"))
    ap.add_argument("--allocator", default="auto", choices=("auto", "mimalloc", "system"))
    ap.add_argument("--trl-allocator", default="system", choices=("auto", "mimalloc", "system"))
    args = ap.parse_args()
    evict_torch_libraries(sys.executable)  # before this process imports torch (vs_trl.py)
    work = Path(args.work)
    trl_ppo.TRL_VERSION = TRL_VERSION  # setup_trl_env installs the module's version
    trl_py = str(setup_trl_env(work / f"trl-{TRL_VERSION}"))
    if args.setup:
        print(f"TRL {TRL_VERSION} environment ready: {trl_py}")
        return
    total, results = args.warmup + args.iterations, {}
    for size in args.sizes:
        folder = build_models(size, work / f"models-{size}")
        cpu_matmul = args.cpu_matmul
        if cpu_matmul == "auto":
            ceiling = matmul_ceiling(size, prompt_length(folder))
            cpu_matmul = "numpy" if ceiling["numpy"] > ceiling["torch"] else "torch"
        ours = (args.allocator, args.runtime, cpu_matmul)
        for algo in args.algos:
            runs: dict[str, list] = {"rlhflab": [], "trl": []}
            for _ in range(args.rounds):  # A B A B
                runs["rlhflab"].append(
                    run_side(sys.executable, "rlhflab", algo, folder, size, total, *ours)
                )
                runs["trl"].append(
                    run_side(trl_py, "trl", algo, folder, size, total, args.trl_allocator)
                )
            row = {k: summarise(v, args.warmup) for k, v in runs.items()}
            row["cpu_matmul"] = cpu_matmul
            results[f"{algo} {size}"] = row
            print(format_row(algo, size, row), flush=True)
    (work / "results_group.json").write_text(json.dumps(results, indent=2))
    print()
    for key, row in results.items():
        print(f"time ratio {key}: {row['rlhflab']['s_per_it'] / row['trl']['s_per_it']:.3f}")
        print(f"memory ratio {key}: {row['rlhflab']['peak_mib'] / row['trl']['peak_mib']:.3f}")


if __name__ == "__main__":
    main()
