"""rlhflab's PPO against TRL's on a real model, SmolLM2-135M-Instruct, side by side (issue #27).

``vs_trl.py`` on locally built toy models says how the two libraries compare in overhead;
this says how they compare on the kind of model a user brings. Its machinery is
``vs_trl.py``'s, imported: TRL 1.12.0 in its own venv (``--setup``, the same folder as
``vs_trl.py``'s), each side in a fresh worker process with torch's libraries evicted from
the page cache first, rounds alternating the sides, the first ``--warmup`` iterations not
timed, peak resident memory as the worker's VmHWM; the floor is ``time_floor.py``'s,
measured on SmolLM2's shapes (read from its config.json) in the same run.

**The models.** The policy is SmolLM2-135M-Instruct as ``examples/smollm2/prepare.py``
converts it (LlamaForCausalLM, fp32, 134.5M parameters; 30 layers, hidden 576,
intermediate 1536, 9 query and 3 key/value heads, vocabulary 49,152, tied embeddings). The
reference is a second copy of it. The reward model is built here, nothing downloaded: a
LlamaForSequenceClassification with one label whose backbone is SmolLM2's and whose score
head is fresh (seed 0). The critic is initialised from the reward model, as in TRL's
examples (``model.value_model=from_reward`` on rlhflab's side).

**The prompts.** ``examples/smollm2/task.py``'s single-digit sums ("What is 4 + 9? Answer
with just the number.", the 70 training problems) rendered with SmolLM2's chat template and
its default system prompt: 44 tokens each, so no prompt is padded. Both sides tokenize the
same text without special tokens.

**Equal settings** (the issue's measured reference setting): full fine-tuning, 8 rollouts
× 24 answer tokens forced (EOS an ordinary token on both sides), 2 PPO epochs of one
minibatch, fp32, 2 threads, rlhflab's monitors off; k1 KL in the reward with β = 0.05,
clip 0.2 / value clip 0.2, γ = 1, λ = 0.95, lr 3e-6, no gradient clip (TRL 1.12 clips
none) — ``vs_trl_work.rlhflab_config`` and ``trl_ppo.run_trl`` with these sizes (so rlhflab
draws every row's tokens with ``rollout.sampler=gumbel``, the same softmax as TRL's
``torch.multinomial`` through the Gumbel-max trick, since 2026-12-07). SmolLM2's
tokenizer pads with its EOS, ``<|im_end|>``, which occurs twice in every chat prompt; TRL
builds its masks as ``ids != pad_token_id``, so on TRL's side a ``[PAD]`` token is added
first, as TRL's PPO example script does (otherwise TRL would mask the prompts' own
``<|im_end|>`` tokens and cut every answer's loss at its first sampled EOS). rlhflab pads by
lengths and needs nothing. Neither side writes a checkpoint (TRL: ``save_strategy="no"``;
rlhflab's worker skips its end-of-run save: 135M weights and moments are ~3 GB per run).

Rows (``--rows``):

* ``trl``: TRL 1.12.0, fp32. ``trl-bf16``: the same with TRL's own ``bf16=True``, for
  fairness: TRL's one precision switch. TRL 1.12's PPOTrainer builds its own Accelerator
  without the config's precision, and transformers 5.25 no longer passes it on, so
  ``bf16=True`` alone runs fp32 (checked: the same first-iteration metrics to the last
  digit); ``trl_ppo.run_trl`` passes it as ``accelerate launch --mixed_precision bf16``
  does, through ``ACCELERATE_MIXED_PRECISION``, and the table shows the precision TRL's
  accelerator ran in. What it then lowers: accelerate's bf16 autocast around the training
  forward of policy and value model; sampling, reference, reward and the rollout's value
  forward stay fp32, as TRL runs them.
* ``rlhflab``: ``model.runtime=native`` (rlhflab's own Llama forward and AdamW over the same
  files); ``rlhflab-tf``: ``model.runtime=transformers`` (transformers' classes).
* ``levers``: what a user would switch on for this model on a CPU, not equal settings:
  LoRA r=8 on every linear layer (α 16, lr 1e-4 as ``examples/smollm2/ppo.yaml``), the
  reference being the adapter-disabled base and the value head on the policy's backbone
  (rlhflab's default with LoRA; transformers runtime, which LoRA needs), the reward model
  in int8 or bf16 (``--lever-reward``; ``auto``: whichever multiplies faster here at the
  reward model's shape, measured first), ``model.compute_dtype`` bf16 only where it pays
  (``--lever-compute``; ``auto``: bf16 where a bf16 product at the training shape runs
  faster than an fp32 one here — on a CPU without AMX bf16 is emulated and a PPO iteration
  2–3× slower, docs/real-models.md, "Precision"); like every rlhflab row, it draws
  with ``rollout.sampler=gumbel`` (the same distribution as ``torch.multinomial``, 9.9 →
  2.1 ms per decoding step's draw at this vocabulary).

**KL to full precision** (printed beside the levers' ratios). Lower precision changes the
run, not only its speed; what it changed is measured against the same levers run with the
precision levers off (reward model fp32, compute fp32: the ``levers, full precision`` row,
run once before the rounds, same seed, same number of iterations). After training, that
full-precision policy samples 8 answers of 24 tokens (T = 1, seed 1234, EOS ignored) to
the first 8 held-out problems; on those tokens both trained policies give their full
next-token distributions, computed in fp32, and the figure is the mean over the 192
answer positions of KL(p_full ‖ p_levers), in nats, with its maximum. Both runs start
from the same weights and sample the same first rollout; they part as the int8/bf16 reward
scores it differently (and, with bf16 compute, as sampling rounds differently), and the
KL is what that leaves after the run. Beside it, for scale, KL(p_full ‖ p_base) on the
same tokens: how far the full-precision run moved the policy from where it started. LoRA
and the shared value head are not part of this comparison: they change what is trained,
not its arithmetic, and both runs use them. The runs are deterministic: the levers run
with its precision set to fp32 gives a KL of exactly 0 (checked on 2 threads), so what
the figure shows is the precision's doing.

    python benchmarks/vs_trl_real.py --setup    # once: TRL's venv (vs_trl.py's, shared)
    python benchmarks/vs_trl_real.py            # every row, 2 rounds (~25 min on 2 quiet cores)
    python benchmarks/vs_trl_real.py --quick    # validation: 1 round, 1 iteration, no warm-up
    python benchmarks/vs_trl_real.py --rows trl rlhflab --rounds 1

The converted model must exist first (``python examples/smollm2/prepare.py``). The last
lines are ``floor / TRL SmolLM2-135M: F``, each side's iteration over the floor (and over
the products and attention alone, the floor before 2026-12-06: ``time_floor.py``),
``time ratio SmolLM2-135M equal: X`` and ``memory ratio SmolLM2-135M equal: Y`` (rlhflab
native against TRL fp32), the transformers
runtime's ratios, TRL bf16's against TRL fp32, ``time ratio SmolLM2-135M levers: Z`` and
``memory ratio SmolLM2-135M levers: W`` against TRL fp32, the same against TRL bf16, and
the KL line; ``results-real.json`` in ``--work`` keeps every number. A row that fails is
reported with its error, and the ratios that need it say so.

Nothing here runs inside ``make test``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ppo_flops import frozen_precision_rates
from trl_ppo import TRL_VERSION, run_trl, setup_trl_env
from vs_trl_real_kl import kl_to_full_precision, write_eval_answers
from vs_trl_real_report import format_table, ratio_lines, summarise
from vs_trl_real_work import (
    ANSWER,
    EPOCHS,
    FULL,
    NAME,
    PAD,
    ROLLOUTS,
    ROWS,
    THREADS,
    build_real_models,
    load_example,
    rlhflab_real_config,
)
from vs_trl_work import prompt_length
from worker_process import launch, timed_fit

HERE = Path(__file__).resolve().parent


# ------------------------------------------------------------- workers (one process each)
def run_rlhflab_real(folder: Path, iterations: int, side: str, opts: dict) -> dict:
    import torch

    torch.set_num_threads(THREADS)
    from rlhflab.config import load_config
    from rlhflab.trainers.ppo import PPOTrainer

    trainer = PPOTrainer(load_config(base=rlhflab_real_config(folder, iterations, side, opts)))
    trainer.save = lambda *a, **k: None  # no end-of-run checkpoint: TRL writes none either
    out = timed_fit(trainer)  # its peak is read here, before the evaluation below
    answers = folder / "eval-answers.pt"
    if side == FULL:
        out.update(write_eval_answers(trainer, folder, answers))
    elif side == "levers" and opts.get("kl"):
        out.update(kl_to_full_precision(trainer, answers))
    return out


def worker_main(argv: list[str]) -> None:
    side, folder, iterations, opts = argv[0], Path(argv[1]), int(argv[2]), json.loads(argv[3])
    if side in ("trl", "trl-bf16"):
        out = run_trl(
            folder, ANSWER, iterations, ROLLOUTS, EPOCHS, THREADS, PAD, bf16=side == "trl-bf16"
        )
    else:
        out = run_rlhflab_real(folder, iterations, side, opts)
    print("RESULT " + json.dumps(out), flush=True)


# ------------------------------------------------------------------------------ the driver
def run_row(python: str, side: str, folder: Path, iterations: int, opts: dict, args) -> dict:
    trl = side.startswith("trl")
    return launch(
        python,
        [side, str(folder), str(iterations), json.dumps(opts)],
        args.trl_allocator if trl else args.allocator,
        THREADS,
        ours=not trl,
        script=Path(__file__),
        what=side,
    )


def choose_precisions(args, hidden: int, inter: int, rows: int) -> dict:
    """The levers' reward precision and compute dtype: as asked, or (auto) as measured."""
    out = {"reward": args.lever_reward, "compute": args.lever_compute}
    if args.lever_reward == "auto":
        low = frozen_precision_rates(hidden, inter, rows, THREADS)
        out["reward"] = max(low, key=low.get)
        print(f"levers' reward model in {out['reward']} (GFLOP/s {fmt_rates(low)})", flush=True)
    if args.lever_compute == "auto":
        rates = compute_rates(hidden, inter, rows, THREADS)
        out["compute"] = "bf16" if rates["bf16"] > rates["fp32"] else "fp32"
        print(f"levers' compute in {out['compute']} (GFLOP/s {fmt_rates(rates)})", flush=True)
    return out


def compute_rates(hidden: int, inter: int, rows: int, threads: int) -> dict[str, float]:
    """GFLOP/s of one training-shaped product (``rows`` × hidden · hidden × intermediate)
    in fp32 and in bf16 on ``threads`` threads: whether ``model.compute_dtype=bf16`` can pay
    here at all (its products are what autocast lowers)."""
    import torch
    from cpu_matmul import rate

    torch.set_num_threads(threads)
    x, w = torch.randn(rows, hidden), torch.randn(hidden, inter)
    xb, wb = x.bfloat16(), w.bfloat16()
    flops = 2 * rows * hidden * inter
    return {
        "fp32": rate(lambda: torch.mm(x, w), flops, seconds=0.5),
        "bf16": rate(lambda: torch.mm(xb, wb), flops, seconds=0.5),
    }


def fmt_rates(rates: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:.0f}" for k, v in rates.items())


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        return worker_main(sys.argv[2:])
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", nargs="+", default=list(ROWS), choices=list(ROWS))
    ap.add_argument("--iterations", type=int, default=4, help="timed iterations per run")
    ap.add_argument("--warmup", type=int, default=1, help="untimed first iterations per run")
    ap.add_argument("--rounds", type=int, default=2, help="rounds over the rows")
    ap.add_argument(
        "--quick", action="store_true", help="validation: --rounds 1 --iterations 1 --warmup 0"
    )
    ap.add_argument("--no-floor", action="store_true", help="skip the floor (~1 min)")
    ap.add_argument("--setup", action="store_true", help="only build TRL's environment")
    ap.add_argument("--work", default=str(HERE / ".vs_trl"), help="models, runs, TRL's venv")
    ap.add_argument("--policy", help="the converted SmolLM2 (default: prepare.py's folder)")
    ap.add_argument(
        "--cpu-matmul",
        default="torch",
        choices=("torch", "numpy"),
        help="rlhflab's model.cpu_matmul (torch: MKL, as TRL; numpy: OpenBLAS)",
    )
    ap.add_argument(
        "--lever-reward",
        default="auto",
        choices=("auto", "int8", "bf16", "fp32"),
        help="the levers' reward precision (auto: the faster of int8 and bf16 here)",
    )
    ap.add_argument(
        "--lever-compute",
        default="auto",
        choices=("auto", "fp32", "bf16"),
        help="the levers' model.compute_dtype (auto: bf16 only where its products are faster)",
    )
    ap.add_argument("--allocator", default="auto", choices=("auto", "mimalloc", "system"))
    ap.add_argument("--trl-allocator", default="system", choices=("auto", "mimalloc", "system"))
    args = ap.parse_args()
    if args.quick:
        args.rounds, args.iterations, args.warmup = 1, 1, 0
    work = Path(args.work)
    trl_py = str(setup_trl_env(work / f"trl-{TRL_VERSION}"))
    if args.setup:
        print(f"TRL {TRL_VERSION} environment ready: {trl_py}")
        return
    policy = Path(args.policy) if args.policy else load_example("prepare").default_folder()
    folder = build_real_models(policy, work / "models-smollm2")
    config = json.loads((folder / "policy" / "config.json").read_text())
    prompt_tokens = prompt_length(folder)
    rows = ROLLOUTS * (prompt_tokens + ANSWER)
    print(
        f"{NAME}-Instruct: {ROLLOUTS} rollouts × ({prompt_tokens} prompt + {ANSWER} answer) "
        f"tokens, {EPOCHS} epochs of one minibatch, {THREADS} threads",
        flush=True,
    )
    floor = None
    if not args.no_floor:
        from time_floor import Work, floor_seconds  # this folder's benchmark

        work_shape = Work.of_config(config, ROLLOUTS, EPOCHS, ANSWER)
        floor = floor_seconds(work_shape, prompt_tokens, threads=THREADS)
        print(f"floor {floor['total']:.2f} s per iteration", flush=True)
    opts = {"cpu_matmul": args.cpu_matmul, "kl": False}
    if "levers" in args.rows:
        opts.update(
            choose_precisions(args, config["hidden_size"], config["intermediate_size"], rows)
        )
        opts["kl"] = (opts["reward"], opts["compute"]) != ("fp32", "fp32")
    total = args.warmup + args.iterations
    ours = sys.executable
    runs: dict[str, list] = {side: [] for side in ROWS if side in args.rows}
    errors: dict[str, str] = {}
    if opts["kl"]:  # the KL's reference first: the levers' runs read its answers
        runs[FULL] = []
        try:
            runs[FULL].append(run_row(ours, FULL, folder, total, opts, args))
        except RuntimeError as e:
            errors[FULL] = str(e)
            opts["kl"] = False
    for _ in range(args.rounds):  # A B A B: every row once per round
        for side in ROWS:
            if side not in args.rows or side in errors:
                continue  # a row that failed once fails again: not retried
            python = trl_py if side.startswith("trl") else ours
            try:
                runs[side].append(run_row(python, side, folder, total, opts, args))
            except RuntimeError as e:
                errors[side] = str(e)
                print(f"{side} failed:\n{e}", flush=True)
    results = {side: summarise(v, args.warmup) for side, v in runs.items() if v}
    record = {
        "model": NAME,
        "rollouts": ROLLOUTS,
        "answer": ANSWER,
        "epochs": EPOCHS,
        "threads": THREADS,
        "prompt_tokens": prompt_tokens,
        "iterations": args.iterations,
        "warmup": args.warmup,
        "rounds": args.rounds,
        "levers": {k: opts.get(k) for k in ("reward", "compute")},
        "cpu_matmul": args.cpu_matmul,
        "allocator": args.allocator,
        "trl_allocator": args.trl_allocator,
        "floor_s": floor,
        "asked": args.rows,
        "rows": results,
        "errors": errors,
    }
    (work / "results-real.json").write_text(json.dumps(record, indent=2))
    print(format_table(record))
    print()
    print("\n".join(ratio_lines(record)))


if __name__ == "__main__":
    main()
