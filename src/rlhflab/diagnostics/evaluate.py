"""Held-out evaluation of a policy on the built-in task: gold versus proxy reward.

The numbers that show whether a policy truly got better or only learned to please the
reward model: gold reward (correct, concise, no filler), proxy reward (what PPO optimised),
accuracy, KL to the reference, length, flattery rate and repetition rate.
"""

from __future__ import annotations

import torch

from rlhflab import models as M
from rlhflab.builtin import tasks
from rlhflab.core import algorithms as A
from rlhflab.experience.rewards import RewardBatch
from rlhflab.experience.rollout import generate_rollout, response_slice


def heldout_prompts(n: int, seed: int, task: str = "mixed") -> list[str]:
    """``n`` prompts of the built-in task (``data.task``) that training never sees (it draws
    from seed + 101; these from 10 000 + seed): the held-out set of the demo, ``compare``
    and ``eval``."""
    return [ex.prompt for ex in tasks.make_examples(n, 10_000 + seed, tasks.skills_of(task))]


@torch.no_grad()
def evaluate_policy(
    policy,
    reference,
    tokenizer,
    prompts: list[str],
    reward=None,
    max_new_tokens: int = 24,
    temperature: float = 1.0,
    seed: int = 0,
    device="cpu",
    batch: int = 64,
) -> dict[str, float]:
    """Sample one answer per prompt (seeded) and score it. Returns means over prompts.

    kl_to_reference: mean over answers of Σ_t (log π − log π_ref) at the sampling τ (nats
    per answer, the same unit as the PPO metric objective/kl).
    """
    policy.eval()
    gen = torch.Generator(device=device).manual_seed(seed)
    rows = {
        "gold": [],
        "proxy": [],
        "accuracy": [],
        "kl_to_reference": [],
        "length": [],
        "flattery_rate": [],
        "repetition_rate": [],
    }
    for s in range(0, len(prompts), batch):
        chunk = prompts[s : s + batch]
        ro = generate_rollout(
            policy, tokenizer, chunk, max_new_tokens, temperature, 0, 1.0, gen, device
        )
        seqs, attn = ro.sequences, ro.attention_mask
        cols = response_slice(ro.prompt_ids.shape[1], ro.response_ids.shape[1])
        lp = A.logprobs_from_logits(
            M.causal_forward(policy, seqs, attn).logits[:, cols], ro.response_ids, temperature
        )
        ref = A.logprobs_from_logits(
            M.causal_forward(reference, seqs, attn).logits[:, cols], ro.response_ids, temperature
        )
        mask = ro.response_mask.bool()
        rows["kl_to_reference"] += torch.where(mask, lp - ref, 0.0).sum(1).tolist()
        rows["length"] += ro.response_mask.sum(1).float().tolist()
        if reward is not None:
            rows["proxy"] += reward(
                RewardBatch(ro.prompts, ro.responses, seqs, attn, ro.ended)
            ).score.tolist()
        for key, values in judge_answers(ro.prompts, ro.responses).items():
            rows[key] += values
    return {k: sum(v) / len(v) for k, v in rows.items() if v}


def judge_answers(prompts: list[str], responses: list[str]) -> dict[str, list[float]]:
    """The built-in task's verdict on each answer (:func:`rlhflab.builtin.tasks.judge`): gold
    reward, exact accuracy (0/1), flattery and repetition (0/1)."""
    verdicts = [tasks.judge(p, r) for p, r in zip(prompts, responses)]
    return {
        "gold": [j.gold for j in verdicts],
        "accuracy": [float(j.correct == 1.0) for j in verdicts],
        "flattery_rate": [float(j.flattery) for j in verdicts],
        "repetition_rate": [float(j.repetitive) for j in verdicts],
    }
