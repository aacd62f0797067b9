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
import os
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path

HERE = Path(__file__).resolve().parent
TRL_VERSION = "1.12.0"
ROLLOUTS, EPOCHS, KL_COEF, LR = 16, 4, 0.05, 3e-6
# every TRL run: fp32 on the CPU, seed 0, no logging, saving or progress bars
TRL_COMMON = dict(
    report_to="none",
    save_strategy="no",
    logging_steps=10_000,
    disable_tqdm=True,
    seed=0,
    bf16=False,
    fp16=False,
    use_cpu=True,
)
# name → (hidden, intermediate, layers, heads, answer tokens); ~440-token vocabulary, tied
SIZES = {
    "0.2M": (64, 192, 3, 2, 32),
    "4M": (256, 704, 5, 4, 64),
    "25M": (512, 1408, 8, 8, 64),
}


# ---------------------------------------------------------------- set-up (our interpreter)
def setup_trl_env(env: Path) -> Path:
    """A venv with TRL 1.12.0 and our torch/transformers versions; returns its python."""
    import torch
    import transformers

    py = env / "bin" / "python"
    stamp = env / f".trl-{TRL_VERSION}"
    if stamp.exists():
        return py
    subprocess.run([sys.executable, "-m", "venv", str(env)], check=True)
    pins = [
        f"torch=={torch.__version__.split('+')[0]}",
        f"transformers=={transformers.__version__}",
        f"trl=={TRL_VERSION}",
    ]
    subprocess.run([str(py), "-m", "pip", "install", "--quiet", *pins], check=True)
    stamp.touch()
    return py


def build_models(size: str, folder: Path) -> Path:
    """policy/, reward/ (one-label classifier, also the value model's start), prompts.jsonl."""
    if (folder / "prompts.jsonl").exists():
        return folder
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, LlamaForSequenceClassification

    from rlhflab.builtin import tasks
    from rlhflab.models.presets import build_tokenizer, default_corpus

    hidden, inter, layers, heads, _ = SIZES[size]
    tok = build_tokenizer(default_corpus())
    cfg = dict(
        vocab_size=len(tok),
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        pad_token_id=tok.pad_token_id,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
    )
    torch.manual_seed(0)
    for name, model in (
        ("policy", LlamaForCausalLM(LlamaConfig(**cfg))),
        ("reward", LlamaForSequenceClassification(LlamaConfig(**cfg, num_labels=1))),
    ):
        model.save_pretrained(folder / name)
        tok.save_pretrained(folder / name)
    rows = [{"prompt": ex.prompt} for ex in tasks.make_examples(512, seed=7)]
    (folder / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder


def bare_llama(size: str):
    """A freshly initialised (seed 0) Llama causal LM of one size, 440-token vocabulary, tied
    embeddings: the policy shape of that size, for the one-model benchmarks."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    hidden, inter, layers, heads, _ = SIZES[size]
    cfg = LlamaConfig(
        vocab_size=440,
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        tie_word_embeddings=True,
    )
    return LlamaForCausalLM(cfg)


# ------------------------------------------------------------- workers (one process each)
def _peak_rss_mib() -> float:
    # rlhflab.diagnostics.memory.peak_rss_bytes reads the same line, but the TRL worker runs in TRL's
    # venv, where rlhflab is not importable
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _worker_result(start: float, ticks: list, gen: list) -> dict:
    """What a worker reports: iteration end times, sampling speed, peak RSS, its malloc."""
    return {
        "start": start,
        "ticks": ticks,
        "gen_tps": gen,
        "peak_mib": _peak_rss_mib(),
        "allocator": _allocator_in_use(),
    }


def _allocator_in_use() -> str:
    with open("/proc/self/maps") as f:  # rlhflab.backends.allocator.in_use, for TRL's venv too
        return "mimalloc" if "libmimalloc" in f.read() else "system"


def rlhflab_config(
    folder: Path,
    answer: int,
    iterations: int,
    runtime: str = "native",
    cpu_matmul: str = "numpy",
    rollouts: int = ROLLOUTS,
    epochs: int = EPOCHS,
) -> dict:
    """rlhflab's side of the equal work, as a config dict: ``folder``'s policy/ and reward/
    (the critic initialised from the reward model), ``rollouts`` answers of exactly ``answer``
    tokens, ``epochs`` PPO epochs of one minibatch, TRL 1.12's PPO choices written out."""
    return {
        "device": "cpu",
        "seed": 0,
        "model": {
            "policy": str(folder / "policy"),
            "value_model": "from_reward",
            "runtime": runtime,
            # the Linear layers' products through torch's MKL or numpy's OpenBLAS, whichever
            # main() measured faster here (benchmarks/cpu_matmul.py); same FLOPs, same fp32
            "cpu_matmul": cpu_matmul,
        },
        "reward": {"model": str(folder / "reward"), "normalize": "none", "clip": None},
        "rollout": {
            "prompts_per_iteration": rollouts,
            "max_new_tokens": answer,
            "ignore_eos": True,
            "temperature": 1.0,
            # TRL 1.12 takes the policy's old log-probs from the generation logits
            # (ppo_trainer.py: logprob = selective_log_softmax(logitss[...], response)), with
            # no policy forward after sampling; the same here
            "logprobs_from_sampling": True,
            # TRL draws with torch.multinomial; the same softmax drawn by the Gumbel-max
            # trick (an exact draw from the same distribution, another random stream), whose
            # CPU draw is ~5x faster at a large vocabulary (docs/benchmarks.md, "What each
            # optimisation bought"). The work the floor counts is unchanged: it has no draw
            "sampler": "gumbel",
        },
        "ppo": {
            "iterations": iterations,
            "epochs": epochs,
            "minibatches": 1,
            "lr": LR,
            "critic_lr": LR,
            "kl_coef": KL_COEF,
            "kl_estimator": "k1",
            "gamma": 1.0,
            "lam": 0.95,
            "whiten_rewards": False,
            # TRL 1.12's PPOTrainer steps without clipping the gradient norm
            # (trl/experimental/ppo/ppo_trainer.py: backward, then optimizer.step()), so no
            # clip here either; which in turn lets AdamW run inside the backward (same
            # updates, no full set of gradients held: docs/benchmarks.md)
            "max_grad_norm": None,
            "step_in_backward": True,
            # the default, written out: the critic's first training forward gives the old
            # values (one minibatch), where TRL runs a separate no-grad value forward first
            "values_from_training_forward": True,
        },
        "data": {"prompts": str(folder / "prompts.jsonl")},
        "log": {
            "output_dir": str(folder / "run-rlhflab"),
            "progress": False,
            "sample_every": 10_000,
            "checkpoint_every": 10_000,
        },
        "monitor": {"enabled": False},
    }


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


def timed_fit(trainer) -> dict:
    """Train an rlhflab trainer, noting when each iteration ends and its sampling speed."""
    ticks, gen = [], []
    trainer.callbacks.append(
        lambda t, ro, m: (
            ticks.append(time.perf_counter()),
            gen.append(m["response/tokens"] / m["time/generate"]),
        )
    )
    start = time.perf_counter()
    trainer.fit()
    return _worker_result(start, ticks, gen)


def run_trl(
    folder: Path,
    answer: int,
    iterations: int,
    rollouts: int = ROLLOUTS,
    epochs: int = EPOCHS,
    threads: int = 1,
    pad_token: str | None = None,
    **overrides,
) -> dict:
    """TRL's side of the equal work (see :func:`rlhflab_config`), ``threads`` torch threads.
    ``pad_token``: a pad token added to the tokenizer first, as TRL's PPO example script
    does (examples/scripts/ppo/ppo.py: ``add_special_tokens({"pad_token": "[PAD]"})``; TRL
    builds every mask as ``ids != pad_token_id`` and zeroes those ids before a forward, so
    the new id never reaches the embedding); ``overrides``: PPOConfig fields that replace
    the ones set here (e.g. ``bf16=True``)."""
    import torch

    torch.set_num_threads(threads)
    if overrides.get("bf16") or overrides.get("fp16"):
        # TRL 1.12's PPOTrainer makes its own Accelerator without the config's precision
        # (ppo_trainer.py: Accelerator(gradient_accumulation_steps=...)) and transformers 5's
        # TrainingArguments no longer exports it, so bf16=True alone leaves the run in fp32;
        # through the environment, as `accelerate launch --mixed_precision bf16` passes it
        os.environ["ACCELERATE_MIXED_PRECISION"] = "bf16" if overrides.get("bf16") else "fp16"
    from datasets import Dataset
    from transformers import (
        AutoModelForCausalLM,
        AutoModelForSequenceClassification,
        AutoTokenizer,
        TrainerCallback,
    )
    from trl.experimental.ppo import PPOConfig, PPOTrainer
    from trl.experimental.ppo import ppo_trainer as trl_ppo

    tok = AutoTokenizer.from_pretrained(folder / "policy", padding_side="left")
    if pad_token is not None:
        tok.add_special_tokens({"pad_token": pad_token})
    prompts = [
        json.loads(x)["prompt"] for x in (folder / "prompts.jsonl").read_text().split("\n") if x
    ]
    ds = Dataset.from_dict(
        {"input_ids": [tok(p, add_special_tokens=False)["input_ids"] for p in prompts]}
    )
    config = dict(
        output_dir=str(folder / "run-trl"),
        per_device_train_batch_size=rollouts,
        gradient_accumulation_steps=1,
        num_mini_batches=1,
        num_ppo_epochs=epochs,
        total_episodes=rollouts * iterations,
        response_length=answer,
        stop_token=None,  # full length, as rlhflab's rollout.ignore_eos
        temperature=1.0,
        kl_coef=KL_COEF,
        kl_estimator="k1",
        cliprange=0.2,
        cliprange_value=0.2,
        vf_coef=0.1,
        gamma=1.0,
        lam=0.95,
        whiten_rewards=False,
        learning_rate=LR,
        local_rollout_forward_batch_size=rollouts,
        num_sample_generations=0,
        **TRL_COMMON,
    )
    args = PPOConfig(**{**config, **overrides})
    policy = AutoModelForCausalLM.from_pretrained(folder / "policy")
    ref = AutoModelForCausalLM.from_pretrained(folder / "policy")
    reward = AutoModelForSequenceClassification.from_pretrained(folder / "reward", num_labels=1)
    value = AutoModelForSequenceClassification.from_pretrained(folder / "reward", num_labels=1)

    gen, original = [], trl_ppo.batch_generation

    def timed_generation(model, queries, *a, **kw):
        t0 = time.perf_counter()
        out = original(model, queries, *a, **kw)
        new_tokens = out[0].shape[1] - queries.shape[1]
        gen.append(queries.shape[0] * new_tokens / (time.perf_counter() - t0))
        return out

    trl_ppo.batch_generation = timed_generation
    ticks = []

    class Tick(TrainerCallback):
        def on_step_end(self, *a, **kw):
            ticks.append(time.perf_counter())

    trainer = PPOTrainer(
        args=args,
        processing_class=tok,
        model=policy,
        ref_model=ref,
        reward_model=reward,
        train_dataset=ds,
        value_model=value,
        callbacks=[Tick()],
    )
    start = time.perf_counter()
    trainer.train()
    # the precision TRL's accelerator ran in ("no" = fp32)
    return {
        **_worker_result(start, ticks, gen),
        "mixed_precision": trainer.accelerator.mixed_precision,
    }


def worker_main(argv: list[str]) -> None:
    side, folder, answer, iterations = argv[0], Path(argv[1]), int(argv[2]), int(argv[3])
    if side == "trl":
        out = run_trl(folder, answer, iterations)
    else:
        levers = side == "rlhflab-levers"
        out = run_rlhflab(folder, answer, iterations, levers, *argv[4:7])
    print("RESULT " + json.dumps(out), flush=True)


# ------------------------------------------------------------------ FLOPs and the ceiling
def forward_flops(size: str, rows: int, kept: int, head: int) -> int:
    """Matmul FLOPs (2 per multiply-add) of one forward over ``rows`` causal positions whose
    last layer needs only the last ``kept`` of them (queries, attention output and MLP;
    keys and values still cover every row), plus an output head of ``head`` columns on the
    ``kept`` rows (the vocabulary for a causal LM, 1 for a value or reward head).

    Attention is counted causally: row i multiplies against i + 1 keys, twice (QKᵀ and
    the weighted sum of values)."""
    hidden, inter, layers, _, _ = SIZES[size]
    proj, mlp = 2 * hidden * hidden, 2 * 3 * hidden * inter
    keys_seen = rows * (rows + 1) // 2  # all rows of a full layer
    keys_seen_kept = kept * rows - kept * (kept - 1) // 2  # the last `kept` rows
    full_layer = rows * (4 * proj + mlp) + 4 * hidden * keys_seen
    last_layer = rows * 2 * proj + kept * (2 * proj + mlp) + 4 * hidden * keys_seen_kept
    return (layers - 1) * full_layer + last_layer + 2 * hidden * head * kept


def useful_flops(size: str, prompt_tokens: int, levers: bool = False) -> float:
    """Matmul FLOPs one iteration cannot avoid, both sides alike (see forward_flops).

    Per rollout of P prompt and A answer tokens: sampling (P + A − 1 positions through the
    policy, the last layer and vocabulary projection on the A positions that choose a
    token), the reference's log-probs (A rows kept of P + A), the reward model's score
    (1 row kept), then each PPO epoch a forward and backward (≈ 3 forwards) of the policy
    (A rows kept) and the value model (A values). The old values need no forward of their
    own: with one minibatch the first epoch's value forward runs on the same weights and
    answers (rlhflab's ppo.values_from_training_forward; TRL runs one more, not counted).
    TRL computes every row of every layer and every position's logits; what it computes
    beyond this count is not useful work. With the levers the value model is a head on the
    policy's backbone: its forward and backward vanish (bf16 or int8 matmuls of reference
    and reward are counted like fp32 ones).
    """
    answer, vocab = SIZES[size][4], 440
    rows = prompt_tokens + answer
    sample = forward_flops(size, rows - 1, answer, vocab)
    causal_lm = forward_flops(size, rows, answer, vocab)  # the reference's and the policy's
    critic = forward_flops(size, rows, answer, 1)
    reward = forward_flops(size, rows, 1, 1)
    train = EPOCHS * 3 * (causal_lm if levers else causal_lm + critic)
    return ROLLOUTS * (sample + causal_lm + reward + train)


def frozen_precision_rates(
    hidden: int, inter: int, rows: int, threads: int = 1
) -> dict[str, float]:
    """GFLOP/s of one no-grad Linear of an MLP shape (hidden → intermediate, ``rows``: all
    rollout tokens) in bf16 and in int8 (torch's dynamic quantisation, as rlhflab's
    ``int8`` precision runs it) on ``threads`` threads: which low precision the levers'
    reference and reward model should take here (bf16 is fast only where the CPU multiplies
    bf16 natively, e.g. AMX; int8 on AVX2/AVX-512 VNNI)."""
    import torch
    from cpu_matmul import rate  # this folder's benchmark: one timing loop for both scripts
    from torch.ao.quantization import quantize_dynamic

    torch.set_num_threads(threads)
    x, lin = torch.randn(rows, hidden), torch.nn.Linear(hidden, inter, bias=False)
    with warnings.catch_warnings():  # torch.ao's deprecation notices, not ours to act on
        warnings.simplefilter("ignore")
        int8 = quantize_dynamic(torch.nn.Sequential(lin), {torch.nn.Linear})
    models = {
        "bf16": (torch.nn.Linear(hidden, inter, bias=False).bfloat16(), x.bfloat16()),
        "int8": (int8, x),
    }
    flops = 2 * rows * hidden * inter
    with torch.no_grad():
        return {
            name: rate(lambda m=model, x=inp: m(x), flops, seconds=0.5)
            for name, (model, inp) in models.items()
        }


def matmul_ceiling(size: str, prompt_tokens: int) -> dict[str, float]:
    """Best GFLOP/s of one-thread fp32 matmuls with this size's MLP and head shapes, through
    torch.mm (MKL in torch's CPU wheels) and numpy.matmul (OpenBLAS in numpy's wheels)."""
    import numpy as np
    import torch
    from cpu_matmul import rate

    from rlhflab.backends.cpu_blas import set_numpy_blas_threads

    torch.set_num_threads(1)
    set_numpy_blas_threads(1)
    hidden, inter, _, _, answer = SIZES[size]
    rows = ROLLOUTS * (prompt_tokens + answer)
    rates: dict[str, float] = {"torch": 0.0, "numpy": 0.0}
    for k, n in ((hidden, inter), (inter, hidden), (hidden, 440)):
        a, b = torch.randn(rows, k), torch.randn(k, n)
        for lib, mm in (
            ("torch", torch.mm),
            ("numpy", lambda x, y: np.matmul(x.numpy(), y.numpy())),
        ):
            gflops = rate(lambda mm=mm, a=a, b=b: mm(a, b), 2 * rows * k * n, seconds=0.5)
            rates[lib] = max(rates[lib], gflops)
    return rates


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


def launch(
    python: str,
    worker_args: list[str],
    allocator: str = "system",
    threads: int = 1,
    ours: bool = True,
    script: Path = Path(__file__),
    what: str = "worker",
) -> dict:
    """Run ``script --worker *worker_args`` under ``python`` in a fresh process, on
    ``threads`` threads and the malloc ``allocator`` names, with torch's libraries evicted
    from the page cache first; the dict its ``RESULT`` line carries. ``ours``: rlhflab's
    src/ on its path (TRL's venv has no rlhflab)."""
    from rlhflab.backends.allocator import environment

    env = {
        **os.environ,
        "OMP_NUM_THREADS": str(threads),
        "MKL_NUM_THREADS": str(threads),
        "TOKENIZERS_PARALLELISM": "false",
    }
    # the malloc the worker starts on: rlhflab's command starts on mimalloc where installed
    # (rlhflab/backends/allocator.py); TRL on the system's unless --trl-allocator says otherwise
    env = environment(allocator, env)
    env["PYTHONPATH"] = str(HERE.parent / "src") if ours else ""
    cmd = [python, str(Path(script).resolve()), "--worker", *worker_args]
    evict_torch_libraries(python)
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    lines = [x for x in done.stdout.splitlines() if x.startswith("RESULT ")]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"{what} failed:\n{done.stderr[-3000:]}")
    return json.loads(lines[-1][7:])


def evict_torch_libraries(python: str) -> None:
    """Drop torch's shared libraries of ``python``'s venv from the page cache, so that every
    worker maps them from a cold start.

    Peak RSS counts the file pages a process has mapped, and how many pages one fault maps
    depends on how the file sits in the page cache (its history: written by pip, read by
    other processes). On this VM the same libtorch_cpu.so, byte for byte, left
    ``import torch`` at 272 MiB in one venv and 224 MiB in the other until both were
    evicted; then 230 and 224. Files pip has just written sit in 1 MiB folios, which a fault
    maps whole: the 0.2M rlhflab worker peaked at 388 MiB on a fresh install against 317
    after eviction (rlhflab/infra/pagecache.py). Neither library's doing, so both sides
    start cold. Pages a process has mapped stay cached, so main() evicts rlhflab's before
    this process imports torch itself.
    """
    from rlhflab.infra.pagecache import drop

    venv = Path(python).parent.parent
    drop(venv.glob("lib/python3*/site-packages/torch/lib/*.so*"))


def per_iteration(result: dict, warmup: int) -> list[float]:
    ticks = [result["start"], *result["ticks"]]
    return [b - a for a, b in zip(ticks[warmup:], ticks[warmup + 1 :])]


def summarise(runs: list[dict], warmup: int) -> dict:
    secs = [s for r in runs for s in per_iteration(r, warmup)]
    gen = [g for r in runs for g in r["gen_tps"][warmup:]]
    return {
        "s_per_it": statistics.median(secs),
        "spread": (min(secs), max(secs)),
        "gen_tps": statistics.median(gen),
        "peak_mib": max(r["peak_mib"] for r in runs),
        "allocator": sorted({r.get("allocator", "?") for r in runs}),
    }


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


def prompt_length(folder: Path) -> int:
    """Mean prompt tokens (the batch pads to its longest; close enough for a FLOP count)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder / "policy")
    rows = [
        json.loads(x)["prompt"] for x in (folder / "prompts.jsonl").read_text().split("\n") if x
    ]
    return round(statistics.mean(len(tok(p, add_special_tokens=False)["input_ids"]) for p in rows))


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
