"""Bradley-Terry reward-model training, multi-head with weights (``rlhflab rm``).

Head ``preference`` learns the annotator's overall choice (chosen ≻ rejected); every other
head learns the per-attribute label of its name (1: chosen better, 0: worse, 0.5: tie) with
the soft Bradley-Terry loss. The training loss is the weighted mean of the head losses.
Held-out pairwise accuracy is reported per head (ties excluded), with calibration and
length-bias checks (``rlhflab.diagnostics.rm_checks``) written to ``rm_checks.json`` beside the model.
"""

from __future__ import annotations

import json
import logging
import math
import random
from pathlib import Path
from types import SimpleNamespace

import torch

from rlhflab import models as M
from rlhflab.builtin import tasks
from rlhflab.config import Config, ConfigError
from rlhflab.config.stages import RMConfig
from rlhflab.core import guards as G
from rlhflab.core import losses as L
from rlhflab.diagnostics.rm_checks import gold_warning, length_warning, reward_checks
from rlhflab.experience.cast import load_frozen_reward_model, load_reward_tokenizer
from rlhflab.experience.data import (
    DataError,
    PreferencePair,
    check_pairs_fit,
    load_preferences,
    source_name,
)
from rlhflab.experience.rewards import (
    LENGTH_HEAD,
    FunctionReward,
    RewardBatch,
    default_head_weights,
    encode_for_reward,
    reward_scores,
)
from rlhflab.infra.distributed import resolve_device
from rlhflab.infra.files import write_text_atomic
from rlhflab.models.build import finish_models, load_model, load_tokenizer_for, to_trained
from rlhflab.trainers.common import refuse_before_models
from rlhflab.trainers.rm_odin import (  # noqa: F401  (ODIN_EXEMPT, trained_odin: imported from here)
    ODIN_EXEMPT,
    length_exempt_names,
    odin_settings,
    trained_odin,
)
from rlhflab.trainers.supervised import RUN, SupervisedTrainer

log = logging.getLogger(__name__)


def builtin_pairs(cfg: Config) -> list[PreferencePair]:
    """Two distinct noisy-teacher answers per prompt, labelled by the simulated annotator."""
    r = cfg.rm
    rng = random.Random(cfg.seed + 29)
    pairs = []
    for ex in tasks.make_examples(r.pairs, cfg.seed + 3, tasks.skills_of(cfg.data.task)):
        a = tasks.teacher_response(ex, rng)
        b = a
        for _ in range(20):
            if b != a:
                break
            b = tasks.teacher_response(ex, rng)
        if a == b:
            continue
        pref = tasks.annotate(
            ex.prompt, " " + a, " " + b, rng, r.noise, r.length_bias, r.flattery_bias
        )
        pairs.append(PreferencePair(pref.prompt, pref.chosen, pref.rejected, pref.labels))
    return pairs


def head_targets(
    pairs: list[PreferencePair], heads: list[str], where: str, strict: bool = True
) -> torch.Tensor:
    """(N, K) labels in [0, 1], NaN where a pair has no label for a head. ``preference``
    takes the pair order (chosen ≻ rejected: 1). ``strict`` (training): a head no pair
    has a label for is an error; otherwise (checking a model made elsewhere) the only head
    of a single-head model takes the pair order too, and an unlabelled head stays NaN."""
    out = torch.full((len(pairs), len(heads)), float("nan"))
    for i, p in enumerate(pairs):
        for k, h in enumerate(heads):
            if h == "preference" or (not strict and len(heads) == 1):
                out[i, k] = 1.0
            elif h in p.labels:
                out[i, k] = float(p.labels[h])
    unused = sorted({name for p in pairs for name in p.labels} - set(heads))
    if strict and unused:  # a misspelled head's labels would train nothing, unsaid
        log.warning("%s: labels %s match no rm.heads entry; not trained", where, unused)
    for k, h in enumerate(heads):
        if strict and torch.isnan(out[:, k]).all():
            raise ConfigError(
                f"rm.heads: no pair in {where} has a label for head '{h}'; name the heads "
                "your pairs are labelled for ('preference' needs no label: chosen is better), "
                "e.g. rm.heads={preference: 1.0} for plain pairs"
            )
    return out


def score_pairs(model, tokenizer, pairs: list[PreferencePair], device) -> torch.Tensor:
    """(2N, K) head scores of the chosen answers, then the rejected ones, each encoded as PPO
    encodes an answer (:func:`rlhflab.experience.rewards.encode_for_reward`: prompt and answer
    apart, EOS after an answer that ended: every answer of a preference file)."""
    prompts = [p.prompt for p in pairs] * 2
    answers = [p.chosen for p in pairs] + [p.rejected for p in pairs]
    ended = [p.chosen_ended for p in pairs] + [p.rejected_ended for p in pairs]
    ids, mask = encode_for_reward(tokenizer, prompts, answers, ended)
    return reward_scores(model, ids.to(device), mask.to(device))


def answer_lengths(tokenizer, pairs: list[PreferencePair]) -> torch.Tensor:
    """(2N,) answer lengths in tokens, chosen answers then rejected (score_pairs' order)."""
    answers = [p.chosen for p in pairs] + [p.rejected for p in pairs]
    return torch.tensor([len(tokenizer(a, add_special_tokens=False)["input_ids"]) for a in answers])


def pair_loss(model, tokenizer, pairs, targets, weights, margin, device, odin=None):
    """Weighted soft Bradley-Terry loss over heads; also returns the (N, K) score gaps.

    ``odin``: None, or (length head index, correlation-loss weight, orthogonality weight,
    exempt head indices) for rm.length_head: each other head's Bradley-Terry loss is then on
    its score plus the length head's (ODIN: the sum is ranked, so the length preference can
    flow into the length head), and ODIN's correlation and orthogonality losses are added
    over those heads; the exempt heads (rm.length_exempt) are ranked on their own scores and
    left out of both."""
    scores = score_pairs(model, tokenizer, pairs, device)
    n = len(pairs)
    ranked = scores if odin is None else G.odin_ranked_scores(scores, odin[0], odin[3])
    diff = scores[:n] - scores[n:]
    total = diff.new_zeros(())
    for k in range(diff.shape[1]):
        has = ~torch.isnan(targets[:, k])
        if has.any():
            loss_k = L.pairwise_reward_loss(
                ranked[:n][has, k], ranked[n:][has, k], margin, labels=targets[has, k].to(device)
            )
            total = total + weights[k] * loss_k
    total = total / sum(weights)
    if odin is not None:
        li, length_w, orth_w, exempt = odin
        quality = G.odin_quality_heads(scores.shape[1], li, exempt)
        lengths = answer_lengths(tokenizer, pairs).to(device)
        total = total + length_w * G.odin_length_loss(scores[:, quality], scores[:, li], lengths)
        total = total + orth_w * G.head_orthogonality_loss(model.score.weight, li, quality)
    return total, diff.detach()


@torch.no_grad()
def heldout_scores(model, tokenizer, pairs, device, batch=64):
    """(chosen, rejected) head scores (N, K) each of held-out pairs, in eval mode."""
    was_training = model.training
    model.eval()
    chosen, rejected = [], []
    for s in range(0, len(pairs), batch):
        part = pairs[s : s + batch]
        scores = score_pairs(model, tokenizer, part, device).cpu()
        chosen.append(scores[: len(part)])
        rejected.append(scores[len(part) :])
    model.train(was_training)
    return torch.cat(chosen), torch.cat(rejected)


def heldout_checks(
    chosen,
    rejected,
    targets,
    heads: list[str],
    tokenizer,
    pairs,
    reward_heads: dict,
    gold: str | None = None,
) -> dict[str, dict[str, float]]:
    """rm_checks.reward_checks per head, and for ``reward`` — the heads' weighted sum with
    ``reward_heads`` (reward.heads: what PPO will optimise; every head at 1 when empty),
    checked against the ``preference`` labels where that head exists, else against the
    pairs' order (chosen ≻ rejected). With ``gold``
    (monitor.gold, 'module:function'), also ``reward_vs_gold``: the same sum checked
    against which answer of each pair the gold reward scores higher."""
    answer_len = [
        torch.tensor(
            [len(tokenizer(getattr(p, side), add_special_tokens=False)["input_ids"]) for p in pairs]
        )
        for side in ("chosen", "rejected")
    ]
    out = {
        h: reward_checks(chosen[:, k], rejected[:, k], targets[:, k], *answer_len)
        for k, h in enumerate(heads)
    }
    weights = torch.tensor(list(default_head_weights(heads, reward_heads).values()))
    # without a preference head, the pair order (chosen is better: 1) is the sum's label
    order = torch.ones(len(pairs))
    label = targets[:, heads.index("preference")] if "preference" in heads else order
    out["reward"] = reward_checks(chosen @ weights, rejected @ weights, label, *answer_len)
    if gold:
        fn, prompts = FunctionReward(gold), [p.prompt for p in pairs]
        gc, gr = (
            sum(fn(RewardBatch(prompts, [getattr(p, side) for p in pairs])).values()).double()
            for side in ("chosen", "rejected")
        )
        gold_label = 0.5 + 0.5 * torch.sign(gc - gr)  # 1: chosen better by gold, 0.5: tie
        out["reward_vs_gold"] = reward_checks(
            chosen @ weights, rejected @ weights, gold_label.float(), *answer_len
        )
    return out


def check_heldout(model, tokenizer, held, targets, heads, cfg: Config, device) -> dict:
    """heldout_checks on the model's scores of ``held``, with the config's reward.heads
    weights and monitor.gold."""
    scores = heldout_scores(model, tokenizer, held, device)
    reward_heads = dict(cfg.reward.heads or {})
    return heldout_checks(*scores, targets, heads, tokenizer, held, reward_heads, cfg.monitor.gold)


def split_pairs(pairs: list[PreferencePair], cfg: Config):
    """(held-out, training) pairs: the pairs shuffled with ``seed``, the first
    ``rm.heldout_fraction`` (at least one) held out — the same split for training and for
    ``rlhflab rm --check``."""
    pairs = list(pairs)
    random.Random(cfg.seed).shuffle(pairs)
    n_held = max(1, int(len(pairs) * cfg.rm.heldout_fraction))
    return pairs[:n_held], pairs[n_held:]


def write_checks(checks: dict, folder: Path) -> dict:
    """Write ``folder``/rm_checks.json; return the checks with NaN (a check with no pair to
    count) as None, as written: strict JSON, for any reader."""
    plain = {
        name: {k: None if isinstance(v, float) and math.isnan(v) else v for k, v in row.items()}
        for name, row in checks.items()
    }
    folder.mkdir(parents=True, exist_ok=True)
    write_text_atomic(folder / "rm_checks.json", json.dumps(plain, indent=2, allow_nan=False))
    return plain


def warn_about(checks: dict) -> None:
    for warning in (
        length_warning(checks["reward"]),
        gold_warning(checks.get("reward_vs_gold", {})),
    ):
        if warning:
            log.warning("%s", warning)


def check_reward_model(cfg: Config) -> dict:
    """``rlhflab rm --check``: the held-out checks of an existing reward model
    (``reward.model``, any sequence-classification folder), without training it.

    Pairs: ``rm.data`` or the built-in ones, split as training splits them. Labels: a head
    named ``preference`` — or the one head of a single-head model — takes the pair order
    (chosen ≻ rejected); any other head takes the pairs' label of its name where they have
    one. Writes ``log.output_dir``/rm_checks.json; returns the checks (NaN as None).
    """
    if not cfg.reward.model:
        raise ConfigError("rm --check: set reward.model to the reward model folder to check")
    device = resolve_device(cfg.device)
    tokenizer = load_reward_tokenizer(cfg)  # renders chat rows
    data, split = cfg.rm.data, cfg.data.split
    limit = M.position_limit(cfg.reward.model, "reward.model")
    pairs = load_preferences(data, tokenizer, split, limit, cfg.data.on_bad_row) if data else None
    # frozen: in model.reward_precision, as PPO will score with it; a causal LM is refused
    model, tokenizer = load_frozen_reward_model(cfg, device, tokenizer)
    heads = [model.config.id2label[i] for i in range(model.config.num_labels)]
    if pairs is None:
        pairs = builtin_pairs(cfg)
        check_pairs_fit(tokenizer, limit, pairs, "the built-in task's pair")
    held, _ = split_pairs(pairs, cfg)
    where = source_name(data, split) if data else "the built-in pairs"
    targets = head_targets(held, heads, where, strict=False)
    checks = check_heldout(model, tokenizer, held, targets, heads, cfg, device)
    warn_about(checks)
    return write_checks(checks, Path(cfg.log.output_dir))


def format_checks(checks: dict[str, dict[str, float]]) -> str:
    """The held-out checks as a small table (``rlhflab rm`` prints it)."""

    def cell(row: dict, key: str) -> str:
        v = row.get(key)
        return f"{'-':>9}" if v is None or math.isnan(v) else f"{v:>9.3f}"

    keys = ("accuracy", "calibration_error", "longer_preferred", "longer_preferred_by_labels")
    lines = [
        "held-out checks (rm_checks.json; docs/ppo.md, 'Is the reward model any good?'):",
        f"{'reward':<15}{'accuracy':>9}{'ECE':>9}{'longer:rm':>10}{'labels':>9}{'r(len)':>9}",
    ]
    for name, row in checks.items():
        cells = "".join(cell(row, k) for k in keys[:2])
        cells += " " + cell(row, keys[2]) + cell(row, keys[3]) + cell(row, "score_length_corr")
        lines.append(f"{name:<15}{cells}")
    return "\n".join(lines)


def rm_trainer(cfg: Config) -> SupervisedTrainer:
    """The reward-model run of ``cfg``; the held-out pairs ride along as ``trainer.heldout``
    for :func:`run_rm`."""
    r = cfg.rm
    torch.manual_seed(cfg.seed)
    device = resolve_device(cfg.device)
    init = r.init or cfg.model.policy
    tokenizer = load_tokenizer_for(init, cfg.model, "rm.init")  # renders chat rows
    limit = M.position_limit(init, "rm.init")  # data read before the model: bad rows in seconds
    bad = cfg.data.on_bad_row
    pairs = load_preferences(r.data, tokenizer, cfg.data.split, limit, bad) if r.data else None
    if pairs is not None and r.heads == RMConfig().heads and not any(p.labels for p in pairs):
        # the default heads are the built-in annotator's labels: plain pairs have only
        # the preference, which is what they mean (said, and saved with the run's config)
        r.heads = {"preference": 1.0}
        log.info("rm.heads: the pairs carry no labels, so one head: %s", r.heads)
    heads = list(r.heads)
    if not heads:
        raise ConfigError("rm.heads: at least one head is needed")
    all_heads = heads + [LENGTH_HEAD] if r.length_head else heads
    exempt = length_exempt_names(r, all_heads) if r.length_head else []
    odin = odin_settings(r, all_heads, exempt) if r.length_head else None
    refuse_before_models(cfg, Path(r.output_dir) / RUN, "rm.output_dir")
    # a causal LM (the SFT model) starts here with a fresh head; fp32: the trained weights
    model = load_model(
        init, tokenizer, cfg.model, "classifier", field="rm.init", num_labels=len(all_heads)
    )
    finish_models(cfg.model, device, trained=(model,))
    model = to_trained(model, device, "the reward model")
    model.config.id2label = dict(enumerate(all_heads))
    model.config.label2id = {h: i for i, h in enumerate(all_heads)}
    if r.length_head:  # saved with the model: a refresh fine-tunes it the same way
        setattr(model.config, ODIN_EXEMPT, exempt)
    if pairs is None:
        pairs = builtin_pairs(cfg)
        check_pairs_fit(tokenizer, limit, pairs, "the built-in task's pair")
    where = source_name(r.data, cfg.data.split) if r.data else "the built-in pairs"
    held, train = split_pairs(pairs, cfg)
    if not train:
        raise DataError(f"{where}: too few pairs to hold out {len(held)} and still train")
    # strict on the pairs trained on; the few held out may lack a sparse head's labels
    train_t = head_targets(train, heads, where)
    held_t = head_targets(held, heads, where, strict=False)
    weights = [r.heads[h] for h in heads]
    if odin is not None:  # the length head has no label of its own: trained through the sums
        train_t, held_t = (
            torch.cat([t, torch.full((len(t), 1), math.nan)], 1) for t in (train_t, held_t)
        )
        weights.append(0.0)

    def batch_loss(idx: list[int]) -> torch.Tensor:
        batch = [train[i] for i in idx]
        loss, _ = pair_loss(model, tokenizer, batch, train_t[idx], weights, r.margin, device, odin)
        return loss

    trainer = SupervisedTrainer(cfg, "rm", model, tokenizer, len(train), batch_loss)
    trainer.heldout = SimpleNamespace(pairs=held, targets=held_t, heads=all_heads, total=len(pairs))
    trainer.device = device
    return trainer


def run_rm(trainer: SupervisedTrainer, resume: bool = False) -> dict:
    """Run a reward-model trainer of :func:`rm_trainer`, then check it on its held-out pairs."""
    done = trainer.fit(resume)
    out, kept, cfg = trainer.out, trainer.heldout, trainer.cfg
    heads, held = kept.heads, kept.pairs
    checks = check_heldout(
        trainer.model, trainer.tokenizer, held, kept.targets, heads, cfg, trainer.device
    )
    accuracy = {h: checks[h]["accuracy"] for h in heads if checks[h]["pairs"]}
    plain = write_checks(checks, out)
    result = {
        "heldout_accuracy": accuracy,
        "heldout_checks": plain,
        "pairs": kept.total,
        "heldout_pairs": len(held),
        "loss_last": trainer.recent_loss(),
        "seconds": done.seconds,
        "stop_reason": done.stop_reason,
        "output_dir": str(out),
    }
    log.info(
        "RM done: held-out accuracy %s, saved to %s",
        {k: round(v, 3) for k, v in accuracy.items()},
        out,
    )
    warn_about(checks)
    return result
