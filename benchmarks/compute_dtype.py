"""model.compute_dtype: seconds per PPO phase in fp32, bf16 and fp16, and what each changes.

For one policy (a preset, or a local model folder such as the SmolLM2 conversion of
docs/real-models.md) the same PPO run (separate critic, toy vowel reward, answers forced to
full length) is timed under each compute dtype, in its own process: seconds per iteration in
generate, score and the PPO update (``time/*`` metrics), the median over the iterations after
the first (a warm-up). Then, on one rollout sampled from the untrained policy:

* the KL between the fp32 and each 16-bit policy's next-token distributions, KL(p_fp32 ‖
  p_dtype) per answer token (mean and max), on the same sequences;
* max |ratio − 1| at the first PPO update under each dtype: old log-probs scored in it (no
  grad, eval mode, one answer per forward: other matrix shapes than training's) against the
  training forward (grad, train mode, the whole batch), as step 8 computes them (fp32's
  for scale).

fp16 runs with its loss scale (backends/loss_scale.py); the timing run reports whether any
update overflowed.

Also printed: the CPU model, and whether ``lscpu`` lists amx_bf16 / avx512_bf16 (bf16
arithmetic in hardware; without it bf16 products are converted to fp32 and back). Each
worker starts on the allocator the ``rlhflab`` command starts on (mimalloc where installed,
rlhflab/backends/allocator.py), since 2026-12-07; the tables of docs/real-models.md from
before ran on glibc's.

    .venv/bin/python benchmarks/compute_dtype.py [--policy preset:small | PATH] [--iterations 3] \
        [--dtypes fp32 bf16 fp16]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
PHASES = ("time/generate", "time/score", "time/train")


def ppo_config(policy: str, dtype: str, args, out: str):
    from rlhflab.config import load_config

    base = {
        "device": "cpu",
        "threads": args.threads,
        "model": {"policy": policy, "value_model": "separate", "compute_dtype": dtype},
        "reward": {"functions": {"rlhflab.builtin.toy_rewards:vowel_reward": 1.0}},
        "rollout": {
            "prompts_per_iteration": args.prompts,
            "max_new_tokens": args.tokens,
            "ignore_eos": True,  # the same work every iteration and in both dtypes
        },
        "ppo": {"iterations": args.iterations, "epochs": 1, "minibatches": 1},
        "log": {"output_dir": out, "progress": False, "checkpoint_every": 10**6},
    }
    if policy.startswith("preset:"):
        return load_config(base=base)
    return load_config(base=base, overrides=["model.runtime=native"])


def timing_worker(policy: str, dtype: str, args) -> dict:
    """Seconds per phase, median over the iterations after the first, and the run's first
    update's ratio statistics."""
    from rlhflab.trainers.ppo import PPOTrainer

    with tempfile.TemporaryDirectory() as out:
        trainer = PPOTrainer(ppo_config(policy, dtype, args, out))
        rows = [trainer.step() for _ in range(args.iterations)]
    timed = rows[1:] or rows
    # the first minibatch whose update was applied (none: fp16 overflowed every update)
    first = trainer.first_minibatch or {"policy/ratio_max": math.nan, "policy/ratio_mean": math.nan}
    return {
        **{k: statistics.median(r[k] for r in timed) for k in PHASES},
        "ratio_max_minus_1": first["policy/ratio_max"] - 1,
        "ratio_mean_minus_1": first["policy/ratio_mean"] - 1,
        "overflow_skips": rows[-1].get("faults/overflow_skips", 0),
    }


def accuracy_worker(policy: str, args) -> dict:
    """KL(fp32 ‖ dtype) of the next-token distributions on one rollout for each 16-bit dtype
    of ``args.dtypes``, and max |ratio − 1| of the first update under every dtype."""
    import dataclasses

    import torch

    from rlhflab import models as M
    from rlhflab.experience.rollout import generate_rollout, policy_outputs, score_rollout
    from rlhflab.trainers.ppo import PPOTrainer

    with tempfile.TemporaryDirectory() as out:
        cfg = ppo_config(policy, "fp32", args, out)
        trainer = PPOTrainer(cfg)
    dtypes = ["fp32"] + [d for d in args.dtypes if d != "fp32"]
    casts = {d: dataclasses.replace(trainer.cast, compute_dtype=d) for d in dtypes}
    cast, r = trainer.cast, cfg.rollout
    cast.policy_lm.eval()
    ro = generate_rollout(
        cast.policy_lm, cast.tokenizer, trainer.next_prompts(), r.max_new_tokens,
        r.temperature, 0, 1.0, torch.Generator().manual_seed(0), "cpu", ignore_eos=True,
    )  # fmt: skip
    seqs, mask, T = ro.sequences, ro.attention_mask, ro.response_ids.shape[1]
    m = ro.response_mask.bool()
    logp = {}
    with torch.no_grad():
        for name, c in casts.items():
            with c.autocast():
                logits = M.causal_forward(cast.policy_lm, seqs, mask, keep_last=T + 1).logits
            logp[name] = torch.log_softmax(logits[:, :T].float(), -1)
    out = {}
    for name in dtypes[1:]:
        kl = (logp["fp32"].exp() * (logp["fp32"] - logp[name])).sum(-1)[m]
        out[f"kl_mean_{name}"], out[f"kl_max_{name}"] = kl.mean().item(), kl.max().item()
    for name, c in casts.items():
        score_rollout(c, ro, r.temperature, 1)  # one answer at a time: unlike training's
        cast.policy.train()
        lp, _, _ = policy_outputs(
            cast.policy, seqs, mask, ro.prompt_ids.shape[1], ro.response_ids, r.temperature,
            autocast=c.autocast,
        )  # fmt: skip
        gap = (lp.detach() - ro.old_logprobs).exp().sub(1).abs()[m]
        out[f"ratio_gap_{name}"] = gap.max().item()
        cast.policy.eval()
    return out


def cpu_facts() -> tuple[str, list[str]]:
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return platform.processor() or "unknown", []
    model = next(
        (ln.split(":", 1)[1].strip() for ln in text.splitlines() if "Model name" in ln), "?"
    )
    flags = next((ln.split(":", 1)[1].split() for ln in text.splitlines() if "Flags" in ln), [])
    return model, [f for f in ("amx_bf16", "amx_tile", "avx512_bf16") if f in flags]


def run_worker(kind: str, policy: str, dtype: str, args) -> dict:
    cmd = [sys.executable, __file__, "--worker", kind, "--policy", policy, "--dtype", dtype]
    cmd += ["--iterations", str(args.iterations), "--prompts", str(args.prompts)]
    cmd += ["--tokens", str(args.tokens), "--threads", str(args.threads)]
    cmd += ["--dtypes", *args.dtypes]
    from rlhflab.backends.allocator import environment

    # the malloc the rlhflab command starts on (mimalloc where installed): on glibc the
    # 16-bit casts' fresh temporaries page-fault, which costs bf16 more than fp32 (2026-12-07,
    # AMX Xeon, under the torch profiler: SmolLM2's bf16 update 4.5 s on glibc, 2.0 on
    # mimalloc; fp32's 2.1 on mimalloc)
    env = environment("auto", {**os.environ, "PYTHONPATH": str(HERE.parent / "src")})
    res = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if res.returncode:
        sys.exit(f"worker {kind} {dtype} failed:\n{res.stderr[-3000:]}")
    return json.loads(res.stdout.split("RESULT ")[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--policy", default="preset:small", help="preset:NAME or a model folder")
    ap.add_argument("--iterations", type=int, default=3, help="per dtype; the first is warm-up")
    ap.add_argument("--prompts", type=int, default=8, help="rollout.prompts_per_iteration")
    ap.add_argument("--tokens", type=int, default=32, help="rollout.max_new_tokens")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    ap.add_argument(
        "--dtypes", nargs="+", default=["fp32", "bf16", "fp16"], choices=("fp32", "bf16", "fp16")
    )
    ap.add_argument("--worker", choices=("time", "accuracy"), help=argparse.SUPPRESS)
    ap.add_argument("--dtype", default="fp32", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker == "time":
        print("RESULT " + json.dumps(timing_worker(args.policy, args.dtype, args)))
        return
    if args.worker == "accuracy":
        print("RESULT " + json.dumps(accuracy_worker(args.policy, args)))
        return
    model, flags = cpu_facts()
    print(
        f"CPU: {model}, {os.cpu_count()} cores; bf16 in hardware (lscpu): {', '.join(flags) or 'none'}"
    )
    print(f"load average before: {os.getloadavg()[0]:.1f} (timings are wall seconds)")
    print(
        f"policy {args.policy}, {args.prompts} prompts x {args.tokens} answer tokens, "
        f"separate critic, 1 epoch, {args.threads} thread(s); median of iterations "
        f"2..{args.iterations}"
    )
    times = {d: run_worker("time", args.policy, d, args) for d in args.dtypes}
    print("| compute_dtype | generate s | score s | update s | iteration s | overflow skips |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for d, t in times.items():
        cells = " | ".join(f"{t[k]:.2f}" for k in PHASES)
        print(f"| {d} | {cells} | {sum(t[k] for k in PHASES):.2f} | {t['overflow_skips']} |")
    acc = run_worker("accuracy", args.policy, "fp32", args)
    for d in args.dtypes:
        if d != "fp32":
            print(
                f"KL(fp32 || {d}) per answer token: mean {acc[f'kl_mean_{d}']:.2e}, "
                f"max {acc[f'kl_max_{d}']:.2e}"
            )
    dtypes = ["fp32"] + [d for d in args.dtypes if d != "fp32"]
    gaps = ", ".join(f"{d} {acc[f'ratio_gap_{d}']:.2e}" for d in dtypes)
    print(f"first update, max |ratio - 1| over answer tokens: {gaps}")
    for d, t in times.items():
        print(
            f"the {d} run's first minibatch: ratio_max - 1 {t['ratio_max_minus_1']:.2e}, "
            f"ratio_mean - 1 {t['ratio_mean_minus_1']:.2e}"
        )
    print(f"load average after: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
