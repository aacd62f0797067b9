"""Supervised fine-tuning: next-token loss on the response tokens only (``rlhflab sft``).

A sequence is ``prompt + response + EOS``; the loss covers the response tokens and the EOS
(the model must learn to stop) and never the prompt.
"""

from __future__ import annotations

import random
from pathlib import Path

import torch

from rlhflab import models as M
from rlhflab.builtin import tasks
from rlhflab.config import Config
from rlhflab.core import algorithms as A
from rlhflab.experience.data import (
    BadRows,
    DataError,
    check_fits,
    open_rows,
    sft_answer_field,
    sft_pair,
)
from rlhflab.infra.distributed import resolve_device
from rlhflab.models.build import finish_models, load_model, load_tokenizer_for, to_trained
from rlhflab.trainers.common import refuse_before_models
from rlhflab.trainers.supervised import RUN, SupervisedTrainer


def builtin_sft_pairs(
    n: int, seed: int, skills: tuple[str, ...] = tasks.SKILLS
) -> list[tuple[str, str]]:
    """(prompt, response) pairs from the noisy teacher of the built-in task."""
    rng = random.Random(seed + 17)
    examples = tasks.make_examples(n, seed, skills)
    return [(ex.prompt, " " + tasks.teacher_response(ex, rng)) for ex in examples]


def load_sft_pairs(
    source, tokenizer=None, split="train", max_tokens: int | None = None, on_bad_row="error"
) -> list[tuple[str, str]]:
    """(prompt, response) pairs of a data file, dataset folder, Dataset or list of dicts:
    strings as they are, chat messages rendered with ``tokenizer``'s chat template
    (:func:`rlhflab.experience.data.sft_pair`). ``split``: a DatasetDict's part.
    ``max_tokens``: the model's positions, which prompt + response + EOS must fit.
    ``on_bad_row``: as ``data.on_bad_row``."""
    rows = open_rows(source, split)
    pairs, skip = [], BadRows(on_bad_row)
    for n, row in rows:
        try:
            if isinstance(row, DataError):
                raise row
            prompt, response = sft_pair(row, tokenizer, rows.where(n))
            answer = {sft_answer_field(row): response}  # the row's own field named
            check_fits(tokenizer, max_tokens, rows.where(n), prompt, answer)
            pairs.append((prompt, response))
        except DataError as exc:
            skip.bad(exc)
    skip.say(rows.name)
    if not pairs:
        raise DataError(f"{rows.name}: no SFT rows")
    return pairs


def encode_pairs(tokenizer, pairs: list[tuple[str, str]]):
    """Right-padded ids (B, L), attention mask (B, L), and a loss mask that is 1 on the
    response tokens and the EOS."""
    rows, masks = [], []
    for prompt, response in pairs:
        p = M.encode_prompt(tokenizer, prompt)  # with the tokenizer's BOS, if it adds one
        r = tokenizer(response, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        rows.append(p + r)
        masks.append([0] * len(p) + [1] * len(r))
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), tokenizer.pad_token_id, dtype=torch.long)
    attn = torch.zeros((len(rows), width), dtype=torch.long)
    loss_mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, (r, m) in enumerate(zip(rows, masks)):
        ids[i, : len(r)] = torch.tensor(r)
        attn[i, : len(r)] = 1
        loss_mask[i, : len(m)] = torch.tensor(m)
    return ids, attn, loss_mask


def response_nll(model, tokenizer, pairs, device) -> torch.Tensor:
    """Mean negative log-likelihood per response token (the SFT loss)."""
    ids, attn, loss_mask = (t.to(device) for t in encode_pairs(tokenizer, pairs))
    logits = M.causal_forward(model, ids, attn).logits[:, :-1]
    logp = A.logprobs_from_logits(logits, ids[:, 1:])
    return -A.masked_mean(logp, loss_mask[:, 1:])


def response_nll_parts(model, tokenizer, pairs, device, size: int):
    """:func:`response_nll` of ``pairs`` in parts of ``size`` rows (sft.micro_batch_size):
    each part's summed token loss over the whole batch's response tokens, so the parts'
    gradients add up to the batch's. A generator: each part's forward runs when it is asked
    for, after the one before was backpropagated."""
    ids, attn, loss_mask = encode_pairs(tokenizer, pairs)  # right-padded: trimmed per part
    tokens = loss_mask[:, 1:].sum().clamp(min=1).to(device)
    for start in range(0, len(pairs), size):
        rows = slice(start, start + size)
        width = int(attn[rows].sum(1).max())
        i, a, m = (t[rows, :width].to(device) for t in (ids, attn, loss_mask))
        logp = A.logprobs_from_logits(M.causal_forward(model, i, a).logits[:, :-1], i[:, 1:])
        yield -torch.where(m[:, 1:].bool(), logp, 0.0).sum() / tokens


def sft_trainer(cfg: Config) -> SupervisedTrainer:
    """The SFT run of ``cfg``: the tokenizer and the data read first (a bad row is reported
    before any model is loaded), then the policy, prepared as every command prepares it."""
    s = cfg.sft
    torch.manual_seed(cfg.seed)
    device = resolve_device(cfg.device)
    tokenizer = load_tokenizer_for(cfg.model.policy, cfg.model)  # renders chat rows
    limit = M.position_limit(cfg.model.policy, "model.policy")
    if s.data:
        pairs = load_sft_pairs(s.data, tokenizer, cfg.data.split, limit, cfg.data.on_bad_row)
    else:
        pairs = builtin_sft_pairs(s.examples, cfg.seed, tasks.skills_of(cfg.data.task))
        for i, (prompt, response) in enumerate(pairs):
            where = f"the built-in task's SFT example {i + 1}"
            check_fits(tokenizer, limit, where, prompt, {"response": response})
    refuse_before_models(cfg, Path(s.output_dir) / RUN, "sft.output_dir")
    model = load_model(cfg.model.policy, tokenizer, cfg.model)
    finish_models(cfg.model, device, trained=(model,))
    model = to_trained(model, device, "the SFT policy")

    def batch_loss(idx: list[int]):
        rows, size = [pairs[i] for i in idx], s.micro_batch_size
        if size and size < len(rows):
            return response_nll_parts(model, tokenizer, rows, device, size)
        return response_nll(model, tokenizer, rows, device)

    return SupervisedTrainer(cfg, "sft", model, tokenizer, len(pairs), batch_loss)


def train_sft(cfg: Config, resume: bool = False) -> dict:
    """``rlhflab sft``: train, write the model to ``sft.output_dir``, summarise."""
    return run_sft(sft_trainer(cfg), resume)


def run_sft(trainer: SupervisedTrainer, resume: bool = False) -> dict:
    """Run an SFT trainer of :func:`sft_trainer` to its end; its summary."""
    done = trainer.fit(resume)
    result = {
        "loss_first": trainer.losses[0],
        "loss_last": trainer.recent_loss(),
        "steps": done.steps,
        "examples": trainer.n_examples,
        "seconds": done.seconds,
        "output_dir": str(trainer.out),
    }
    return result  # `rlhflab sft` says it in one line
