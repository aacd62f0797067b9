"""Generation tokens/s of rlhflab's sampler against transformers' ``model.generate`` on
SmolLM2-135M-Instruct.

rlhflab's side is the rollout's generation path PPO runs (``experience.rollout.generate_rollout``
→ ``sampling.sample``: a KV-cached loop of ancestral sampling over left-padded prompts), on
the policy loaded as PPO loads it (``models.load_model``: fp32 master weights, the lean
activations), under each runtime that applies (``model.runtime=transformers`` and
``native``). transformers' side is ``generate`` on the very model object of the transformers
runtime, with ``do_sample=True``, the same temperature, no top-k/top-p (rlhflab samples from
the full distribution), the same ``max_new_tokens`` and ``min_new_tokens`` = it (EOS can
not end an answer, as rlhflab's ``rollout.ignore_eos``), so both produce batch × max_new_tokens
tokens. ``model.compute_dtype=bf16`` runs both under the same ``torch.autocast`` (fp32
weights, bf16 products: ``models.precision.compute_autocast``, as PPO samples).

Prompts: `examples/smollm2` training problems rendered with the model's chat template
(``experience.data.load_prompts``, as PPO reads them), repeated to fill a batch. Each
(batch, dtype) cell runs one warm-up of every engine, then ``--repeats`` rounds of the
engines in turn (rlhflab, rlhflab native, generate, …); tokens/s is the median round.

    .venv/bin/python benchmarks/generation_speed.py [--batches 8 32] [--dtypes fp32 bf16]
        [--max-new-tokens 64] [--repeats 3] [--threads 2] [--model FOLDER]

Prints a table, then ``generation tok/s SmolLM2 b8 fp32: rlhflab X, rlhflab native Y,
generate Z`` per cell.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
EXAMPLE = HERE.parent / "examples" / "smollm2"


def prompts_for(tokenizer, batch: int) -> list[str]:
    """``batch`` of the example's training problems, chat-rendered as PPO renders them."""
    from rlhflab.experience.data import load_prompts

    data = EXAMPLE / "data" / "train.jsonl"
    if not data.exists():
        sys.path.insert(0, str(EXAMPLE))
        import task

        task.write(EXAMPLE / "data")
    prompts, _ = load_prompts(str(data), tokenizer, max_tokens=512)
    return [prompts[i % len(prompts)] for i in range(batch)]


def load(path: str, runtime: str):
    """The policy and its tokenizer as PPO loads them, under ``runtime``."""
    from rlhflab.config import load_config
    from rlhflab.models.build import finish_models, load_model, load_tokenizer_for

    overrides = [f"model.policy={path}", f"model.runtime={runtime}"]
    options = load_config(overrides=overrides, reward_given=True).model
    tok = load_tokenizer_for(path, options)
    model = load_model(path, tok, options).eval()
    finish_models(options, "cpu", trained=(model,))
    return model, tok


def rlhflab_seconds(model, tok, prompts, args, autocast) -> float:
    from rlhflab.experience.rollout import generate_rollout

    gen = torch.Generator().manual_seed(0)
    t0 = time.perf_counter()
    ro = generate_rollout(
        model, tok, prompts, args.max_new_tokens, args.temperature, 0, 1.0, gen, "cpu",
        ignore_eos=True, autocast=autocast,
    )  # fmt: skip
    seconds = time.perf_counter() - t0
    assert ro.response_ids.shape == (len(prompts), args.max_new_tokens)
    return seconds


def generate_seconds(model, tok, prompts, args, autocast) -> float:
    tok.padding_side = "left"
    enc = tok(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    torch.manual_seed(0)
    t0 = time.perf_counter()
    with torch.no_grad(), autocast():
        out = model.generate(
            **enc,
            do_sample=True,
            temperature=args.temperature,
            top_k=0,
            top_p=1.0,
            max_new_tokens=args.max_new_tokens,
            min_new_tokens=args.max_new_tokens,
            pad_token_id=tok.pad_token_id,
        )
    seconds = time.perf_counter() - t0
    assert out.shape == (len(prompts), enc["input_ids"].shape[1] + args.max_new_tokens)
    return seconds


def cell(batch: int, dtype: str, args) -> dict[str, float]:
    """tokens/s of each engine at one batch size and compute dtype (this process)."""
    from rlhflab.models.precision import compute_autocast

    torch.set_num_threads(args.threads)
    autocast = lambda: compute_autocast("cpu", dtype)  # noqa: E731
    hf, tok = load(args.model, "transformers")
    prompts = prompts_for(tok, batch)
    engines = {}
    if "transformers" in args.runtimes:
        engines["rlhflab"] = lambda: rlhflab_seconds(hf, tok, prompts, args, autocast)
    if "native" in args.runtimes:
        native, ntok = load(args.model, "native")
        engines["rlhflab native"] = lambda: rlhflab_seconds(native, ntok, prompts, args, autocast)
    engines["generate"] = lambda: generate_seconds(hf, tok, prompts, args, autocast)
    seconds: dict[str, list[float]] = {name: [] for name in engines}
    for run in engines.values():
        run()  # warm-up
    for _ in range(args.repeats):
        for name, run in engines.items():
            seconds[name].append(run())
    tokens = batch * args.max_new_tokens
    return {name: tokens / statistics.median(s) for name, s in seconds.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", nargs="+", type=int, default=[8, 32])
    ap.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16"])
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.7, help="examples/smollm2/ppo.yaml's")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--runtimes",
        nargs="+",
        default=["transformers", "native"],
        choices=["transformers", "native"],
    )
    ap.add_argument(
        "--model", default=str(Path("~/.cache/rlhflab/smollm2-135m-instruct").expanduser())
    )
    ap.add_argument("--cell", nargs=2, help=argparse.SUPPRESS)  # BATCH DTYPE, in a worker
    args = ap.parse_args()
    if args.cell:
        print("RESULT " + json.dumps(cell(int(args.cell[0]), args.cell[1], args)))
        return
    print(
        f"load average {os.getloadavg()[0]:.1f}; {args.threads} threads; torch {torch.__version__}"
    )
    print(
        f"{args.max_new_tokens} new tokens per answer, T = {args.temperature}, median of {args.repeats}"
    )
    results = {}
    for batch in args.batches:
        for dtype in args.dtypes:  # each cell in its own process: no state carried over
            cmd = [sys.executable, __file__, "--cell", str(batch), dtype]
            cmd += sys.argv[1:]
            env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
            env.setdefault("PYTHONPATH", str(HERE.parent / "src"))
            res = subprocess.run(cmd, capture_output=True, text=True, env=env)
            if res.returncode:
                sys.exit(f"cell b{batch} {dtype} failed:\n{res.stderr[-3000:]}")
            results[batch, dtype] = json.loads(res.stdout.split("RESULT ")[-1])
    engines = list(next(iter(results.values())))
    print("| batch | compute dtype | " + " | ".join(f"{e} tok/s" for e in engines) + " |")
    print("| ---: | --- |" + " ---: |" * len(engines))
    for (batch, dtype), r in results.items():
        print(f"| {batch} | {dtype} | " + " | ".join(f"{r[e]:.1f}" for e in engines) + " |")
    print(f"load average after: {os.getloadavg()[0]:.1f}")
    for (batch, dtype), r in results.items():
        parts = ", ".join(f"{e} {r[e]:.1f}" for e in engines)
        print(f"generation tok/s SmolLM2 b{batch} {dtype}: {parts}")


if __name__ == "__main__":
    main()
