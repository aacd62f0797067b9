"""The KL of ``vs_trl_real.py``'s levers run to the same run at full precision.

The full-precision run samples answers to the held-out prompts and saves its next-token
distributions on them (``write_eval_answers``); the levers run computes its own on the
same tokens and the mean and maximum KL(p_full ‖ p_levers) per answer position
(``kl_to_full_precision``). Both run inside rlhflab's worker, after training.
"""

from __future__ import annotations

import json
from pathlib import Path

from vs_trl_real_work import ANSWER

EVAL_SEED = 1234


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
