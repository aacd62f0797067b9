"""How fast could one PPO iteration of ``vs_trl.py`` be on this CPU at all? (issue 7)

A lower bound, measured: the time of the iteration's matrix products, its attention and its
optimiser updates alone, each timed at its exact shape, fp32, and each taken at its best —
the faster of torch's MKL and numpy's OpenBLAS, of one thread and the run's threads, and of
every operand layout (either operand stored as is or transposed), attention the faster of
SDPA's flash and math kernels with no padding mask, the update the faster of torch's fused
and foreach AdamW. Everything else an iteration does (sampling's softmax and draws and the
attention of its decode steps, element-wise work, norms, the losses, GAE, Python) is left
out, so no implementation of the same work with these libraries can run an iteration
faster than the printed floor; a time-ratio target below ``floor / TRL's seconds`` cannot
be met on this machine at equal settings.

Two of the terms are bound by memory, not arithmetic, and are timed as the iteration must
run them (issue 27): a sampling step multiplies its few rows by *every* weight of the
model once, so its products are timed as one pass over a whole model's worth of distinct
weights, each product shape with its own best library and layout (``decode_streamed``; a
model larger than the cache streams them from memory, as a real decode step does), where
timing each product alone, repeated, keeps its one weight in cache (``decode_in_cache``,
what the floor counted before 2026-12-06: still printed, and the floor without both terms
is ``products_and_attention``); and AdamW reads and writes the parameters and both
moments of every trained parameter once per update (``optimizer``: the policy's and the
critic's parameters, one update of each per epoch, the gradient taken as in cache, as
``ppo.step_in_backward`` finds it). Both in ``floor_memory.py``.

The work is ``vs_trl.py``'s (its SIZES, 16 rollouts, 4 epochs of one minibatch; any other
shapes as a ``Work``, e.g. ``vs_trl_real.py``'s SmolLM2-135M from its config.json) with the
rows counted as ``ppo_flops.forward_flops`` counts them: the last layer's queries, attention
output and MLP only on the rows that are read, the value and reward heads omitted (one
column). Sampling: a prefill over the prompt, then one step of one row per answer for
each further answer token.

    python benchmarks/time_floor.py --size 4M     # ~30 s
    python benchmarks/time_floor.py --size 25M

The ratios at the end take both sides' seconds per iteration from ``vs_trl.py``'s last
results (``benchmarks/.vs_trl/results.json``) where they exist; ``--trl-seconds`` gives
TRL's by hand.

Nothing here runs inside ``make test``.
"""

from __future__ import annotations

import argparse
import itertools
import json
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from cpu_matmul import cpu_name, rate  # this folder's benchmark: one timing loop for all
from floor_memory import adamw_seconds_per_parameter, set_threads, streamed_step_seconds
from vs_trl_work import EPOCHS, ROLLOUTS, SIZES

from rlhflab.backends.cpu_blas import set_numpy_blas_threads

VOCAB = 440
RESULTS = Path(__file__).resolve().parent / ".vs_trl" / "results.json"


@dataclass(frozen=True)
class Work:
    """The shapes one PPO iteration multiplies: a Llama-style policy (its reference, reward
    and critic models share its backbone's shape), ``rollouts`` answers of ``answer``
    tokens, ``epochs`` PPO epochs of one minibatch."""

    hidden: int
    inter: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    rollouts: int
    epochs: int
    answer: int
    # the vocabulary head is the embedding matrix (vs_trl.py's models, SmolLM2): one
    # parameter matrix fewer for the optimiser
    tied: bool = True

    @classmethod
    def of_size(cls, size: str) -> Work:
        """``vs_trl.py``'s work at one of its sizes."""
        hidden, inter, layers, heads, answer = SIZES[size]
        return cls(
            hidden, inter, layers, heads, heads, hidden // heads, VOCAB, ROLLOUTS, EPOCHS, answer
        )

    @classmethod
    def of_config(cls, config: dict, rollouts: int, epochs: int, answer: int) -> Work:
        """The work of a Llama ``config.json`` (as a dict)."""
        heads = config["num_attention_heads"]
        return cls(
            config["hidden_size"],
            config["intermediate_size"],
            config["num_hidden_layers"],
            heads,
            config.get("num_key_value_heads") or heads,
            config.get("head_dim") or config["hidden_size"] // heads,
            config["vocab_size"],
            rollouts,
            epochs,
            answer,
            # transformers' default for a Llama config.json without the key is untied
            bool(config.get("tie_word_embeddings", False)),
        )


def forward_products(work: Work, rows: int, kept: int, head: bool) -> Counter:
    """(m, k, n) → count of the Linear products of one batched forward: ``rows`` positions
    per sequence, the last layer's queries, output projection and MLP on the last ``kept``
    of them, a vocabulary head on those ``kept`` rows where ``head``."""
    w, b = work, work.rollouts
    q_width, kv_width = w.heads * w.head_dim, w.kv_heads * w.head_dim
    out: Counter = Counter()
    for layer in range(w.layers):
        q_rows = b * (kept if layer == w.layers - 1 else rows)
        out[(b * rows, w.hidden, kv_width)] += 2  # keys and values: every position
        out[(q_rows, w.hidden, q_width)] += 1  # queries
        out[(q_rows, q_width, w.hidden)] += 1  # the output projection
        out[(q_rows, w.hidden, w.inter)] += 2  # gate and up
        out[(q_rows, w.inter, w.hidden)] += 1  # down
    if head:
        out[(b * kept, w.hidden, w.vocab)] += 1
    return out


def backward_products(forward: Counter) -> Counter:
    """The input- and weight-gradient products of every forward product x·W (m×k · k×n):
    g·Wᵀ (m×n · n×k) and xᵀ·g (k×m · m×n)."""
    out: Counter = Counter()
    for (m, k, n), count in forward.items():
        out[(m, n, k)] += count
        out[(k, m, n)] += count
    return out


def iteration_products(work: Work, prompt: int) -> Counter:
    """Every Linear product of one iteration (see the module docstring)."""
    answer = work.answer
    rows = prompt + answer
    total: Counter = Counter()
    total.update(forward_products(work, prompt, 1, True))  # sampling's prefill
    for _ in range(answer - 1):  # one step of `rollouts` rows per further token
        total.update(forward_products(work, 1, 1, True))
    policy = forward_products(work, rows, answer, True)
    critic = forward_products(work, rows, answer, False)
    total.update(policy)  # the reference's log-probs
    total.update(forward_products(work, rows, 1, False))  # the reward model's score
    for _ in range(work.epochs):
        for model in (policy, critic):
            total.update(model)
            total.update(backward_products(model))
    return total


def best_product_seconds(m: int, k: int, n: int, threads: int = 1) -> float:
    """Seconds of the fastest (m×k)·(k×n) product over both libraries and all layouts, on
    one thread or ``threads`` (a few-row product can be faster on one: no threads to
    synchronise); leaves ``threads`` set."""
    best = 0.0
    flops = 2 * m * k * n
    for t in sorted({1, threads}):
        set_threads(t)
        for a_t, b_t in itertools.product((False, True), repeat=2):
            a = torch.randn(k, m).t() if a_t else torch.randn(m, k)
            b = torch.randn(n, k).t() if b_t else torch.randn(k, n)
            an, bn = a.numpy(), b.numpy()
            best = max(best, rate(lambda a=a, b=b: torch.mm(a, b), flops, seconds=0.15))
            best = max(best, rate(lambda a=an, b=bn: np.matmul(a, b), flops, seconds=0.15))
    set_threads(threads)
    return flops / (best * 1e9)


def best_attention_seconds(work: Work, rows: int, grad: bool, threads: int = 1) -> float:
    """Seconds of the fastest causal SDPA (and its backward where ``grad``) on ``rollouts``
    sequences of ``rows`` positions, flash or math kernel, no padding mask, one thread or
    ``threads``; with fewer key and value heads than query heads (grouped-query attention)
    also SDPA's ``enable_gqa`` on the unexpanded keys and values. Leaves ``threads`` set."""
    w = work
    q = torch.randn(w.rollouts, w.heads, rows, w.head_dim, requires_grad=grad)
    g = torch.randn(w.rollouts, w.heads, rows, w.head_dim)
    best = float("inf")
    for t, kv_heads in itertools.product(sorted({1, threads}), sorted({w.heads, w.kv_heads})):
        set_threads(t)
        k, v = (
            torch.randn(w.rollouts, kv_heads, rows, w.head_dim, requires_grad=grad)
            for _ in range(2)
        )
        gqa = {"enable_gqa": True} if kv_heads != w.heads else {}
        for backend in (
            torch.nn.attention.SDPBackend.FLASH_ATTENTION,
            torch.nn.attention.SDPBackend.MATH,
        ):
            with torch.nn.attention.sdpa_kernel(backend):

                def call(k=k, v=v, gqa=gqa):
                    with torch.set_grad_enabled(grad):
                        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, **gqa)
                        if grad:
                            torch.autograd.grad(out, (q, k, v), g)

                # rate() returns calls × flops / s / 1e9: with flops = 1e9, calls per second
                best = min(best, 1 / rate(call, 1e9, seconds=0.3))
    set_threads(threads)
    return best


def trained_parameters(work: Work) -> int:
    """Parameters the optimiser updates in one step of the policy and one of the critic:
    the policy (its head tied to the embedding or not) and a critic of the same backbone
    with a one-column value head, as ``vs_trl.py`` trains them (full fine-tuning)."""
    w = work
    q_width, kv_width = w.heads * w.head_dim, w.kv_heads * w.head_dim
    layer = (
        w.hidden * q_width  # queries
        + 2 * w.hidden * kv_width  # keys, values
        + q_width * w.hidden  # output projection
        + 3 * w.hidden * w.inter  # gate, up, down
        + 2 * w.hidden  # the two RMSNorm weights
    )
    backbone = w.vocab * w.hidden + w.layers * layer + w.hidden  # embedding, layers, final norm
    policy = backbone + (0 if w.tied else w.vocab * w.hidden)
    critic = backbone + w.hidden  # the value head's weight
    return policy + critic


def floor_seconds(
    work: Work, prompt_tokens: int, table: list[str] | None = None, threads: int = 1
) -> dict:
    """Measure the floor of one iteration of ``work`` on up to ``threads`` threads (each
    term at the faster of one thread and ``threads``). Seconds of: ``sampling``, the
    products of ``rollouts`` rows or fewer each timed alone (in cache); ``products``, the
    larger ones; ``attention``; ``products_and_attention``, their sum (the floor before
    2026-12-06); ``decode_in_cache`` (part of ``sampling``), the decode steps' products
    timed alone, and ``decode_streamed``, the same products timed as whole passes over
    distinct weights (``decode_gbps``: the weights' bytes a second); ``optimizer``, one
    AdamW update per epoch of the policy and of the critic (``trained_parameters``); and
    ``total``: ``products_and_attention`` with the decode steps as streamed, plus the
    optimiser. Appends one markdown row per product shape to ``table`` where given."""
    set_threads(threads)
    out = {"sampling": 0.0, "products": 0.0}
    products = iteration_products(work, prompt_tokens)
    per_call = {}
    for (m, k, n), count in sorted(products.items(), key=lambda x: -x[0][0] * x[1]):
        per_call[(m, k, n)] = best_product_seconds(m, k, n, threads)
        seconds = per_call[(m, k, n)] * count
        out["sampling" if m <= work.rollouts else "products"] += seconds
        if table is not None:
            table.append(
                f"| {m} × {k} · {k} × {n} | {count} | "
                f"{2 * m * k * n * count / seconds / 1e9:.0f} | {seconds:.3f} |"
            )
    rows = prompt_tokens + work.answer
    out["attention_forward"] = best_attention_seconds(work, rows, False, threads)
    out["attention_backward"] = best_attention_seconds(work, rows, True, threads)
    # the reference's and the reward model's forwards; per epoch policy and critic forward
    # and backward
    out["attention"] = work.layers * (
        2 * out["attention_forward"] + work.epochs * 2 * out["attention_backward"]
    )
    out["products_and_attention"] = out["sampling"] + out["products"] + out["attention"]
    steps = work.answer - 1  # the prefill samples the first token
    step = forward_products(work, 1, 1, True)
    out["decode_in_cache"] = steps * sum(per_call[s] * c for s, c in step.items())
    streamed, out["decode_gbps"] = streamed_step_seconds(list(step.elements()), threads)
    # never below the in-cache time: a model small enough to stay in cache streams nothing
    out["decode_streamed"] = max(steps * streamed, out["decode_in_cache"])
    out["trained_parameters"] = trained_parameters(work)
    out["optimizer"] = (
        work.epochs
        * out["trained_parameters"]
        * adamw_seconds_per_parameter(out["trained_parameters"], threads)
    )
    out["total"] = (
        out["products_and_attention"]
        - out["decode_in_cache"]
        + out["decode_streamed"]
        + out["optimizer"]
    )
    return out


def describe(floor: dict, digits: int = 3) -> str:
    """One sentence of a floor's terms, for the benchmarks' tables."""
    f = {k: f"{v:.{digits}f}" for k, v in floor.items() if isinstance(v, float)}
    return (
        f"floor: {f['total']} s per iteration, the products, attention and AdamW updates "
        f"alone at their best rates measured here (time_floor.py: sampling's products "
        f"{f['sampling']}, of which the decode steps' {f['decode_in_cache']} timed alone "
        f"and {f['decode_streamed']} as streamed passes over the weights "
        f"({floor['decode_gbps']:.1f} GB/s), the others {f['products']}, attention "
        f"{f['attention']}, AdamW {f['optimizer']}; products and attention alone, the "
        f"decode steps in cache: {f['products_and_attention']})"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="4M", choices=list(SIZES))
    ap.add_argument(
        "--prompt-tokens",
        type=int,
        default=7,
        help="vs_trl.py's mean prompt length, as its FLOP count takes it (a batch pads to "
        "its longest, 8, so both sides run more rows than the floor counts)",
    )
    ap.add_argument("--trl-seconds", type=float, help="TRL's s/it (default: vs_trl.py's last)")
    args = ap.parse_args()
    if not set_numpy_blas_threads(1):
        print("warning: numpy's BLAS thread count unknown; set OPENBLAS_NUM_THREADS=1")
    work = Work.of_size(args.size)
    products = iteration_products(work, args.prompt_tokens)
    gflop = sum(2 * m * k * n * c for (m, k, n), c in products.items()) / 1e9
    print(f"{cpu_name()}, torch {torch.__version__}, numpy {np.__version__}, one thread")
    print(f"size {args.size}: {len(products)} product shapes, {gflop:.1f} GFLOP")
    table = [
        "| m × k · k × n | per iteration | best GFLOP/s | seconds |",
        "| --- | ---: | ---: | ---: |",
    ]
    floor = floor_seconds(work, args.prompt_tokens, table)
    print("\n".join(table))
    print(f"\nproducts of 16 rows or fewer (sampling's steps): {floor['sampling']:.3f} s")
    print(f"larger products (prefill, scoring, training): {floor['products']:.3f} s")
    print(
        f"attention (scoring and training; {floor['attention_forward'] * 1e3:.2f} ms a "
        f"forward, {floor['attention_backward'] * 1e3:.2f} ms forward + backward): "
        f"{floor['attention']:.3f} s"
    )
    print(
        f"decode steps' products: {floor['decode_in_cache']:.3f} s timed alone, "
        f"{floor['decode_streamed']:.3f} s as streamed passes ({floor['decode_gbps']:.1f} GB/s)"
    )
    print(
        f"AdamW, {work.epochs} updates of {floor['trained_parameters']:,} parameters: "
        f"{floor['optimizer']:.3f} s"
    )
    print(f"products and attention alone, decode in cache: {floor['products_and_attention']:.3f} s")
    print(f"floor {args.size}: {floor['total']:.3f} s per iteration")
    measured = json.loads(RESULTS.read_text()).get(args.size, {}) if RESULTS.exists() else {}
    trl = args.trl_seconds or measured.get("trl", {}).get("s_per_it")
    if trl:
        print(f"floor / TRL {args.size}: {floor['total'] / trl:.3f} (TRL {trl:.2f} s/it)")
        alone = floor["products_and_attention"] / trl
        print(f"products and attention alone / TRL {args.size}: {alone:.3f}")
    if "rlhflab" in measured:
        ours = measured["rlhflab"]["s_per_it"]
        print(f"rlhflab / floor {args.size}: {ours / floor['total']:.2f} (rlhflab {ours:.2f} s/it)")


if __name__ == "__main__":
    main()
