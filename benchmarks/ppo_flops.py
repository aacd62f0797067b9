"""Useful FLOPs of a ``vs_trl.py`` PPO iteration and the rates measured to set them against.

``forward_flops`` counts one forward's matmul FLOPs, keeping only the rows that are read;
``useful_flops`` adds up an iteration's sampling, reference, reward and training passes
(``time_floor.py`` counts rows the same way). ``matmul_ceiling`` measures the best
one-thread fp32 rate of this size's shapes through torch (MKL) and numpy (OpenBLAS),
which picks rlhflab's ``model.cpu_matmul``; ``frozen_precision_rates`` measures bf16
against int8 for the levers' frozen models.
"""

from __future__ import annotations

import warnings

from vs_trl_work import EPOCHS, ROLLOUTS, SIZES


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
