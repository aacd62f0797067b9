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
none) — ``vs_trl.rlhflab_config`` and ``vs_trl.run_trl`` with these sizes (so rlhflab
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
  digit); ``vs_trl.run_trl`` passes it as ``accelerate launch --mixed_precision bf16``
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
import importlib.util
import json
import statistics
import sys
from pathlib import Path

import vs_trl as base

HERE = Path(__file__).resolve().parent
SMOLLM2 = HERE.parent / "examples" / "smollm2"
NAME = "SmolLM2-135M"
ROLLOUTS, ANSWER, EPOCHS, THREADS = 8, 24, 2, 2
LORA_R, LORA_ALPHA, LEVER_LR = 8, 16.0, 1e-4  # examples/smollm2/ppo.yaml's LoRA
PAD = "[PAD]"  # TRL's side only (see the module docstring)
EVAL_SEED = 1234
ROWS = {
    "rlhflab": "rlhflab, native runtime, fp32",
    "trl": "TRL 1.12.0, fp32",
    "rlhflab-tf": "rlhflab, transformers runtime, fp32",
    "trl-bf16": "TRL 1.12.0, bf16=True",
    "levers": "rlhflab with levers",
}
FULL = "levers-fp32"  # the levers with the precision levers off: the KL's reference


def load_example(name: str):
    """A module of examples/smollm2 (task.py, prepare.py), imported from its file."""
    spec = importlib.util.spec_from_file_location(f"smollm2_{name}", SMOLLM2 / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ---------------------------------------------------------------- set-up (our interpreter)
def build_real_models(policy: Path, folder: Path) -> Path:
    """policy/ (a link to the converted checkpoint), reward/ (a one-label classifier with
    SmolLM2's backbone and a fresh score head, seed 0; also the critic's start),
    prompts.jsonl (the 70 training sums, chat-rendered) and eval.jsonl (8 held-out ones)."""
    if (folder / "prompts.jsonl").exists():
        return folder
    import torch
    from transformers import (
        AutoTokenizer,
        LlamaConfig,
        LlamaForCausalLM,
        LlamaForSequenceClassification,
    )

    if not (policy / "config.json").is_file():
        sys.exit(f"{policy}: no converted SmolLM2; run python examples/smollm2/prepare.py first")
    folder.mkdir(parents=True, exist_ok=True)
    link = folder / "policy"
    if not link.exists():
        link.symlink_to(policy.resolve(), target_is_directory=True)
    tok = AutoTokenizer.from_pretrained(policy)
    torch.manual_seed(0)
    reward = LlamaForSequenceClassification(LlamaConfig.from_pretrained(policy, num_labels=1))
    backbone = LlamaForCausalLM.from_pretrained(policy).model.state_dict()
    reward.model.load_state_dict(backbone)  # strict: every backbone weight, nothing else
    reward.save_pretrained(folder / "reward")
    tok.save_pretrained(folder / "reward")
    task = load_example("task")
    train, heldout = task.problems()
    for name, items in (("eval.jsonl", heldout[:ROLLOUTS]), ("prompts.jsonl", train)):
        rows = [
            {
                "prompt": tok.apply_chat_template(
                    [{"role": "user", "content": task.QUESTION.format(a=a, b=b)}],
                    tokenize=False,
                    add_generation_prompt=True,
                )
            }
            for a, b in items
        ]
        (folder / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder


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


# ------------------------------------------------------------- workers (one process each)
def rlhflab_real_config(folder: Path, iterations: int, side: str, opts: dict) -> dict:
    """``vs_trl.rlhflab_config`` at this benchmark's sizes; the levers on top for
    ``levers`` and (precision off) ``levers-fp32``."""
    levers = side in ("levers", FULL)
    runtime = "transformers" if side == "rlhflab-tf" or levers else "native"
    compute = opts["compute"] if side == "levers" else "fp32"
    # numpy multiplies fp32 only (model.cpu_matmul): bf16 compute goes through torch
    cpu_matmul = "torch" if compute == "bf16" else opts["cpu_matmul"]
    cfg = base.rlhflab_config(folder, ANSWER, iterations, runtime, cpu_matmul, ROLLOUTS, EPOCHS)
    cfg["threads"] = THREADS
    cfg["log"]["output_dir"] = str(folder / f"run-{side}")
    if levers:
        cfg["model"].update(
            lora_r=LORA_R,
            lora_alpha=LORA_ALPHA,
            lora_targets="all-linear",
            value_model="shared",
            reward_precision=opts["reward"] if side == "levers" else "fp32",
            compute_dtype=compute,
        )
        cfg["ppo"]["lr"] = LEVER_LR
    return cfg


def run_rlhflab_real(folder: Path, iterations: int, side: str, opts: dict) -> dict:
    import torch

    torch.set_num_threads(THREADS)
    from rlhflab.config import load_config
    from rlhflab.trainers.ppo import PPOTrainer

    trainer = PPOTrainer(load_config(base=rlhflab_real_config(folder, iterations, side, opts)))
    trainer.save = lambda *a, **k: None  # no end-of-run checkpoint: TRL writes none either
    out = base.timed_fit(trainer)  # its peak is read here, before the evaluation below
    answers = folder / "eval-answers.pt"
    if side == FULL:
        out.update(write_eval_answers(trainer, folder, answers))
    elif side == "levers" and opts.get("kl"):
        out.update(kl_to_full_precision(trainer, answers))
    return out


def answer_logprobs(model, ids, mask):
    """log-softmax (N, A, V) of ``model``'s next-token distributions at the answer
    positions of prompt + answer sequences ``ids``, fp32, no autocast."""
    import torch

    from rlhflab.models.forward import causal_forward

    with torch.no_grad():
        logits = causal_forward(model, ids, mask, keep_last=ANSWER + 1).logits[:, :ANSWER]
    return torch.log_softmax(logits.float(), dim=-1)


def mean_kl(p_log, q_log) -> tuple[float, float]:
    """KL(p ‖ q) over the vocabulary per position, in nats: (mean, max) over positions."""
    kl = (p_log.exp() * (p_log - q_log)).sum(-1)
    return kl.mean().item(), kl.max().item()


def write_eval_answers(trainer, folder: Path, path: Path) -> dict:
    """The full-precision run's side of the KL: its answers to the held-out prompts and its
    distributions on them (saved to ``path``); how far it moved from the base."""
    import torch

    from rlhflab.experience.rollout import generate_rollout

    cast = trainer.cast
    cast.policy.eval()
    prompts = [
        json.loads(x)["prompt"] for x in (folder / "eval.jsonl").read_text().split("\n") if x
    ]
    gen = torch.Generator(device=trainer.device).manual_seed(EVAL_SEED)
    with torch.no_grad():  # T = 1, no top-k or top-p, EOS ignored: as the runs sample
        ro = generate_rollout(
            cast.policy_lm,
            cast.tokenizer,
            prompts,
            max_new_tokens=ANSWER,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            generator=gen,
            device=trainer.device,
            ignore_eos=True,
        )
    ids, mask = ro.sequences, ro.attention_mask
    policy = answer_logprobs(cast.policy_lm, ids, mask)
    moved, moved_max = mean_kl(policy, answer_logprobs(cast.reference, ids, mask))
    torch.save({"ids": ids, "mask": mask, "logprobs": policy}, path)
    return {"kl_from_base": moved, "kl_from_base_max": moved_max}


def kl_to_full_precision(trainer, path: Path) -> dict:
    """KL(p_full ‖ p_levers) on the full-precision run's answers (``write_eval_answers``)."""
    import torch

    full = torch.load(path)
    trainer.cast.policy.eval()
    levers = answer_logprobs(trainer.cast.policy_lm, full["ids"], full["mask"])
    kl, kl_max = mean_kl(full["logprobs"], levers)
    return {"kl_to_full": kl, "kl_to_full_max": kl_max}


def worker_main(argv: list[str]) -> None:
    side, folder, iterations, opts = argv[0], Path(argv[1]), int(argv[2]), json.loads(argv[3])
    if side in ("trl", "trl-bf16"):
        out = base.run_trl(
            folder, ANSWER, iterations, ROLLOUTS, EPOCHS, THREADS, PAD, bf16=side == "trl-bf16"
        )
    else:
        out = run_rlhflab_real(folder, iterations, side, opts)
    print("RESULT " + json.dumps(out), flush=True)


# ------------------------------------------------------------------------------ the driver
def run_row(python: str, side: str, folder: Path, iterations: int, opts: dict, args) -> dict:
    trl = side.startswith("trl")
    return base.launch(
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
        low = base.frozen_precision_rates(hidden, inter, rows, THREADS)
        out["reward"] = max(low, key=low.get)
        print(f"levers' reward model in {out['reward']} (GFLOP/s {fmt_rates(low)})", flush=True)
    if args.lever_compute == "auto":
        rates = compute_rates(hidden, inter, rows, THREADS)
        out["compute"] = "bf16" if rates["bf16"] > rates["fp32"] else "fp32"
        print(f"levers' compute in {out['compute']} (GFLOP/s {fmt_rates(rates)})", flush=True)
    return out


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
    trl_py = str(base.setup_trl_env(work / f"trl-{base.TRL_VERSION}"))
    if args.setup:
        print(f"TRL {base.TRL_VERSION} environment ready: {trl_py}")
        return
    policy = Path(args.policy) if args.policy else load_example("prepare").default_folder()
    folder = build_real_models(policy, work / "models-smollm2")
    config = json.loads((folder / "policy" / "config.json").read_text())
    prompt_tokens = base.prompt_length(folder)
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


def summarise(runs: list[dict], warmup: int) -> dict:
    """``vs_trl.summarise`` plus the KL figures a levers run carries."""
    out = base.summarise(runs, warmup)
    if any("mixed_precision" in r for r in runs):  # TRL's accelerator, as it ran
        out["mixed_precision"] = sorted({r["mixed_precision"] for r in runs})
    for key in ("kl_to_full", "kl_to_full_max", "kl_from_base", "kl_from_base_max"):
        values = [r[key] for r in runs if key in r]
        if values:
            out[key] = statistics.median(values)
            out[key + "_runs"] = values
    return out


def row_label(side: str, record: dict) -> str:
    if side in ("levers", FULL):
        lv = record["levers"]
        reward, compute = (lv["reward"], lv["compute"]) if side == "levers" else ("fp32", "fp32")
        return (
            f"rlhflab levers: LoRA r={LORA_R} all-linear, shared value head, reward {reward}, "
            f"compute {compute}" + (" (full precision; one run)" if side == FULL else "")
        )
    ran = record["rows"].get(side, {}).get("mixed_precision")
    return ROWS[side] + (f" (accelerator mixed precision: {'/'.join(ran)})" if ran else "")


def format_table(record: dict) -> str:
    res, floor, trl = record["rows"], record["floor_s"], record["rows"].get("trl")
    lines = [
        f"## {NAME}-Instruct, {record['rollouts']} rollouts × {record['answer']} tokens, "
        f"{record['epochs']} epochs, {record['threads']} threads; {record['rounds']} round(s) "
        f"of {record['warmup']} + {record['iterations']} iterations",
        "| row | s/iteration (median) | min–max | gen tokens/s | peak MiB | time / TRL fp32 "
        "| memory / TRL fp32 |",
        "| --- | ---: | --- | ---: | ---: | ---: | ---: |",
    ]
    for side in [*ROWS, FULL]:
        if side in res:
            r = res[side]
            t = f"{r['s_per_it'] / trl['s_per_it']:.3f}" if trl else "–"
            m = f"{r['peak_mib'] / trl['peak_mib']:.3f}" if trl else "–"
            lines.append(
                f"| {row_label(side, record)} | {r['s_per_it']:.2f} | {r['spread'][0]:.2f}–"
                f"{r['spread'][1]:.2f} | {r['gen_tps']:.0f} | {r['peak_mib']:.0f} | {t} | {m} |"
            )
        elif side in record["errors"]:
            first = record["errors"][side].strip().splitlines()[-1][:160]
            lines.append(f"| {row_label(side, record)} | failed: {first} | | | | | |")
    if floor:
        from time_floor import describe  # this folder's benchmark

        lines.append(describe(floor, 2))
    return "\n".join(lines)


def ratio_lines(record: dict) -> list[str]:
    """The closing lines: floor, equal settings, levers against TRL fp32 and bf16, KL."""
    res, errors = record["rows"], record["errors"]

    def missing(side: str) -> str:
        return f"n/a ({side} failed)" if side in errors else f"n/a ({side} not run)"

    def ratio(a: str, b: str, key: str) -> str:
        for side in (a, b):
            if side not in res:
                return missing(side)
        return f"{res[a][key] / res[b][key]:.3f}"

    out = []
    if record["floor_s"]:
        trl = res.get("trl")
        value = f"{record['floor_s']['total'] / trl['s_per_it']:.3f}" if trl else missing("trl")
        out.append(f"floor / TRL {NAME}: {value}")
        floor = record["floor_s"]
        for side in ("rlhflab", "trl"):
            if side in res:
                r = res[side]["s_per_it"]
                out.append(
                    f"{side} / floor {NAME}: {r / floor['total']:.2f} (against the products "
                    f"and attention alone, decode in cache: {r / floor['products_and_attention']:.2f})"
                )
    pairs = [
        ("equal", "rlhflab", "trl"),
        ("equal transformers runtime", "rlhflab-tf", "trl"),
        ("TRL bf16 vs TRL fp32", "trl-bf16", "trl"),
        ("levers", "levers", "trl"),
        ("levers vs TRL bf16", "levers", "trl-bf16"),
    ]
    for name, a, b in pairs:
        if a in record["asked"]:
            out.append(f"time ratio {NAME} {name}: {ratio(a, b, 's_per_it')}")
            out.append(f"memory ratio {NAME} {name}: {ratio(a, b, 'peak_mib')}")
    lv = res.get("levers", {})
    if "kl_to_full" in lv:
        full = res.get(FULL, {})
        out.append(
            f"KL {NAME} levers to full precision: {lv['kl_to_full']:.2e} nats per answer token "
            f"(max {lv['kl_to_full_max']:.2e}); the full-precision run moved "
            f"{full.get('kl_from_base', float('nan')):.2e} from the base"
        )
    elif "levers" in res:
        reason = errors.get(FULL, "the levers' precision is full: nothing to compare")
        out.append(f"KL {NAME} levers to full precision: n/a ({reason.strip().splitlines()[-1]})")
    return out


if __name__ == "__main__":
    main()
