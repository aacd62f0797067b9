"""Step 9 of a PPO-family iteration: what is logged, each name explained in METRICS.

The estimators add their own (``grpo/zero_std_fraction``, ``rloo/zero_std_fraction``) and
the monitor its ``monitor/`` signals.
"""

from __future__ import annotations

from pathlib import Path

import torch

from rlhflab.core import algorithms as A
from rlhflab.diagnostics.gold_curve import story_from_rows
from rlhflab.experience.ensemble import SPREAD
from rlhflab.experience.rollout import Rollout
from rlhflab.infra.runlog import read_jsonl
from rlhflab.models.frozen import is_quantized

METRICS = {
    "objective/scores": "mean combined score after the missing-EOS penalty, before normalisation",
    "objective/scores/<name>": "mean of each reward component (each head, each function)",
    "objective/scores/missing_eos_penalty": "reward.missing_eos_penalty: mean penalty "
    "(≤ 0) of answers without EOS, the part of objective/scores beside the components",
    "objective/ensemble_std": "reward.ensemble: batch mean of the members' per-answer std "
    "of their weighted head sums (disagreement; monitor.ensemble_spread watches its growth)",
    "objective/ensemble_offset_range": "reward.ensemble_center=reference: largest minus "
    "smallest member offset (each member's mean on the reference's answers less the "
    "members' average), what centring removed",
    "objective/reference_scores": "reward.shaping=par: mean score of the reference's answers "
    "to the batch's prompts (after the missing-EOS penalty)",
    "objective/shaped_scores": "reward.shaping=par: mean of σ(score − reference score), the "
    "RL reward before normalisation",
    "objective/kl": "KL to the reference: batch mean of Σ_t (logp_old − logp_ref) (k1, nats "
    "per answer; OAI19)",
    "objective/kl_k3": "the same KL with the k3 estimator, never negative (a negative "
    "objective/kl beside it: the answers were not sampled by π; a warning says so)",
    "objective/kl_coef": "β used this iteration",
    "objective/non_score_reward": "batch mean of Σ_t −β·kl_t (the KL part of the RLHF reward)",
    "objective/rlhf_reward": "objective/scores + objective/non_score_reward",
    "objective/entropy": "batch mean of Σ_t −logp_old (sampled entropy per answer)",
    "policy/entropy": "token mean of the full-distribution entropy H_t at the sampling τ",
    "policy/approx_kl": "KL(π_old‖π) k3 estimate, mean over PPO minibatches",
    "policy/clipfrac": "fraction of tokens where the clipped surrogate binds, mean over minibatches",
    "policy/ratio_mean": "mean ρ over minibatches (should stay ≈ 1)",
    "policy/ratio_max": "largest ρ seen in the iteration",
    "policy/loss": "policy loss, mean over minibatches",
    "policy/grad_norm": "policy gradient norm before its own clip (a shared value head in it)",
    "val/loss": "value loss, mean over minibatches",
    "val/clipfrac": "fraction of tokens where the value clip binds (|V − V_old| > "
    "ppo.value_clip) and the clipped error is the larger",
    "val/explained_variance": "1 − Var(R − V_old)/Var(R) over response tokens",
    "val/grad_norm": "a separate critic's gradient norm before its own clip",
    "response/length_mean": "mean answer length in tokens (EOS included)",
    "response/length_max": "longest answer in tokens",
    "response/eos_rate": "fraction of answers that ended with EOS",
    "response/count": "answers generated this iteration, all ranks",
    "response/tokens": "answer tokens generated this iteration, all ranks (the compute budget)",
    "<estimator>/zero_std_fraction": "grpo, rloo: share of groups whose answers all scored "
    "the same (no signal)",
    "time/generate": "seconds sampling",
    "time/score": "seconds scoring",
    "time/train": "seconds in the PPO epochs",
    "time/monitor_probe": "seconds in the monitor's flattery-opener probe (0 when it is off "
    "or skips the iteration: monitor.opener_every)",
    "time/refresh": "reward.refresh_every: seconds in the reward-model refresh (step 11), "
    "in the iterations that end with one",
    "refresh/pairs": "fresh pairs labelled by this refresh (one per distinct prompt of the "
    "iteration; a pair of identical answers is dropped)",
    "refresh/pool": "fresh pairs of every refresh so far, which each refresh trains on",
    "refresh/rm_loss": "mean Bradley-Terry loss of the refresh's steps (over every reward "
    "model of an ensemble; the batches mix fresh and replayed pairs)",
    "refresh/rm_accuracy_before": "share of this refresh's pairs with a preference label "
    "(≠ 0.5) that the reward model's weighted score orders as the labeller did, before the "
    "fine-tune (absent when no pair has one)",
    "refresh/rm_accuracy_after": "the same after the fine-tune (pairs it was just trained on: "
    "a check that it learnt them, not a held-out accuracy)",
    "throughput/tokens_per_sec": "generated answer tokens per second of sampling",
    "memory/peak_mib": "peak resident memory (CPU) or peak allocated (CUDA), MiB",
    "faults/skipped_updates": "updates skipped so far for a non-finite reward, loss or gradient",
    "faults/overflow_skips": "model.compute_dtype=fp16 only: updates skipped so far because the "
    "scaled gradients overflowed (each halves the loss scale; not counted above)",
    "faults/loss_scale": "model.compute_dtype=fp16 only: the loss scale after this iteration",
    "lr/policy": "policy learning rate after this iteration",
}


def answer_kl(ro: Rollout) -> torch.Tensor:
    """Σ_t (logp_old − logp_ref) over each answer's tokens (B,): the k1 KL per answer."""
    return torch.where(ro.response_mask.bool(), ro.old_logprobs - ro.ref_logprobs, 0.0).sum(1)


def iteration_metrics(
    ro: Rollout,
    raw_scores: torch.Tensor,
    seq_kl: torch.Tensor,
    kl: torch.Tensor,
    beta: float,
    kl_in_reward: bool,
    world: int,
    update: dict[str, float],
    advantages: dict[str, float],
    times: dict[str, float],
    run: dict[str, float],
) -> dict[str, float]:
    """One rank's metrics of one iteration, named as in METRICS. ``raw_scores`` (B,) are
    the scores before normalisation, ``seq_kl`` (B,) :func:`answer_kl`, ``kl`` (B, T) the
    per-token estimate the reward was shaped with; ``update``, ``advantages`` and ``run``
    (memory, faults, learning rate) are added as they are, ``times`` are the seconds of
    time/generate, time/score, time/train and time/monitor_probe."""
    mask = ro.response_mask.bool()
    k3 = A.kl_estimate(ro.old_logprobs, ro.ref_logprobs, "k3")
    non_score = (-beta * kl).sum(1) if kl_in_reward else torch.zeros_like(seq_kl)
    lengths = ro.response_mask.sum(1).float()
    return {
        "objective/scores": raw_scores.mean().item(),
        **{f"objective/scores/{k}": v.mean().item() for k, v in ro.components.items()},
        **(
            {"objective/ensemble_std": ro.components[SPREAD].mean().item()}
            if SPREAD in ro.components
            else {}
        ),
        "objective/kl": seq_kl.mean().item(),
        "objective/kl_k3": torch.where(mask, k3, 0.0).sum(1).mean().item(),
        "objective/kl_coef": beta,
        "objective/non_score_reward": non_score.mean().item(),
        "objective/rlhf_reward": (raw_scores + non_score).mean().item(),
        "objective/entropy": torch.where(mask, -ro.old_logprobs, 0.0).sum(1).mean().item(),
        "policy/entropy": A.masked_mean(ro.entropy, ro.response_mask).item(),
        **update,
        **advantages,
        "response/length_mean": lengths.mean().item(),
        "response/length_max": lengths.max().item(),
        "response/eos_rate": ro.ended.float().mean().item(),
        # rank-mean × world = global total once mean_metrics has averaged over ranks
        "response/count": float(len(ro) * world),
        "response/tokens": lengths.sum().item() * world,
        "time/generate": times["time/generate"],
        "time/score": times["time/score"],
        "time/train": times["time/train"],
        "time/monitor_probe": times["time/monitor_probe"],
        "throughput/tokens_per_sec": lengths.sum().item() / max(times["time/generate"], 1e-9),
        **run,
    }


def sample_rows(ro: Rollout, n: int) -> list[dict]:
    """Up to ``n`` answers of a rollout with their scores and KL, as samples.jsonl keeps
    them."""
    rows = []
    for i in range(min(n, len(ro))):
        m = ro.response_mask[i].bool()
        rows.append(
            {
                "prompt": ro.prompts[i],
                "response": ro.responses[i],
                "score": ro.scores[i].item(),
                "components": {k: v[i].item() for k, v in ro.components.items()},
                "kl": (ro.old_logprobs[i] - ro.ref_logprobs[i])[m].sum().item(),
            }
        )
    return rows


def progress_summary(metrics: dict) -> dict[str, str]:
    """What the progress bar shows after each iteration."""
    return {
        "reward": f"{metrics['objective/scores']:.3f}",
        "kl": f"{metrics['objective/kl']:.3f}",
        "beta": f"{metrics['objective/kl_coef']:.3g}",
    }


def model_sizes(cast) -> dict[str, dict[str, int]]:
    """Parameters of each model of the cast, all and trained (a LoRA policy trains few)."""
    out = {}
    for name, model in cast.models().items():
        if not hasattr(model, "parameters"):  # a LoRA reference: the policy, adapters off
            out[name] = {"parameters": 0, "trained": 0, "shares_policy": True}
            continue
        params = list(model.parameters())
        out[name] = {
            "parameters": sum(p.numel() for p in params) + _packed_weights(model),
            "trained": sum(p.numel() for p in params if p.requires_grad),
        }
    return out


def _packed_weights(model) -> int:
    """Weights an int8 model holds outside its parameters: torch's dynamically quantised
    Linear layers keep weight and bias packed (an int8 reference counted only its norms
    and embeddings)."""
    n = 0
    for m in model.modules():
        if is_quantized(m) and callable(getattr(m, "weight", None)):
            bias = m.bias() if callable(getattr(m, "bias", None)) else None
            n += m.weight().numel() + (bias.numel() if bias is not None else 0)
    return n


def run_facts(cast, run_dir: Path, smoothing: float, keep_best: bool) -> dict:
    """What a PPO-family run adds to run.json: its models' sizes and, where the monitor
    logged a gold reward, the gold reward's story (:func:`~rlhflab.diagnostics.gold_curve.
    story_from_rows`: best iteration, fall, over-optimisation fit) from metrics.jsonl, with
    the folder log.keep_best writes (None when it is off)."""
    facts: dict = {"models": model_sizes(cast)}
    path = Path(run_dir) / "metrics.jsonl"
    story = story_from_rows(read_jsonl(path), smoothing) if path.is_file() else {}
    if story:
        facts["gold"] = story
        best = Path(run_dir) / "checkpoints" / "best"
        facts["gold"]["best_checkpoint"] = str(best) if keep_best and best.is_dir() else None
    return facts
