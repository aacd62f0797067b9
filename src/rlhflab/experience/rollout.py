"""Rollouts: sampled answers (``rlhflab.experience.sampling``), then no-grad scoring of them.

Layout of a rollout (B answers): prompts are *left*-padded to P tokens so every answer
starts at column P; answers are *right*-padded to T tokens. ``response_mask`` is 1 on real
answer tokens including the EOS and 0 on the padding after it (the convention of
``rlhflab.core.algorithms``). The full sequence is ``cat(prompt_ids, response_ids)``, and the
logits at columns P−1 … P+T−2 predict the answer tokens.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch

from rlhflab import models as M
from rlhflab.core import algorithms as A
from rlhflab.experience.rewards import RewardBatch
from rlhflab.experience.sampling import PromptCaches, SamplingScores, cache_kwarg, sample


@dataclass
class Rollout:
    prompt_ids: torch.Tensor  # (B, P) left-padded
    prompt_mask: torch.Tensor  # (B, P)
    response_ids: torch.Tensor  # (B, T) right-padded; pad after the first EOS
    response_mask: torch.Tensor  # (B, T) 1 on answer tokens including EOS
    ended: torch.Tensor  # (B,) bool: the answer ended with EOS (not cut at max_new_tokens)
    prompts: list[str]
    responses: list[str]  # decoded answers without special tokens
    # filled by score_rollout:
    old_logprobs: torch.Tensor | None = None  # (B, T)
    ref_logprobs: torch.Tensor | None = None  # (B, T)
    values: torch.Tensor | None = None  # (B, T)
    entropy: torch.Tensor | None = None  # (B, T) full-distribution entropy per token
    scores: torch.Tensor | None = None  # (B,) combined reward-model/function score
    components: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def sequences(self) -> torch.Tensor:
        return torch.cat([self.prompt_ids, self.response_ids], dim=1)

    @property
    def attention_mask(self) -> torch.Tensor:
        return torch.cat([self.prompt_mask, self.response_mask.to(self.prompt_mask.dtype)], 1)

    def __len__(self) -> int:
        return self.response_ids.shape[0]


def left_pad(token_lists: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(t) for t in token_lists)
    ids = torch.full((len(token_lists), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(token_lists), width), dtype=torch.long)
    for i, toks in enumerate(token_lists):
        if toks:
            ids[i, width - len(toks) :] = torch.tensor(toks)
            mask[i, width - len(toks) :] = 1
    return ids, mask


def generate_rollout(
    model,
    tokenizer,
    prompts: list[str],
    max_new_tokens: int,
    temperature: float,
    top_k: int,
    top_p: float,
    generator,
    device,
    all_done=None,
    ignore_eos: bool = False,
    scores: SamplingScores | None = None,
    autocast=contextlib.nullcontext,
    prompt_caches: PromptCaches | None = None,
    sampler: str = "multinomial",
) -> Rollout:
    """Sample one answer per prompt; with ``scores``, the rollout also carries the sampling
    pass's old log-probs and entropy (and values), and scoring skips the policy forward.
    ``autocast``: the context sampling runs in (``ModelCast.autocast`` for the policy).
    ``prompt_caches`` keeps the prompts' KV cache for the monitor's opener probe;
    ``sampler``: how each token is drawn (``rollout.sampler``; sampling.draw_tokens)."""
    encoded = [M.encode_prompt(tokenizer, p) for p in prompts]
    prompt_ids, prompt_mask = left_pad(encoded, tokenizer.pad_token_id)
    prompt_ids, prompt_mask = prompt_ids.to(device), prompt_mask.to(device)
    with autocast():
        resp, resp_mask, ended = sample(
            model,
            prompt_ids,
            prompt_mask,
            max_new_tokens,
            None if ignore_eos else M.stop_ids(tokenizer),
            tokenizer.pad_token_id,
            temperature,
            top_k,
            top_p,
            generator,
            all_done,
            scores,
            prompt_caches,
            sampler,
        )
    texts = tokenizer.batch_decode(resp, skip_special_tokens=True)
    rollout = Rollout(prompt_ids, prompt_mask, resp, resp_mask, ended, list(prompts), texts)
    if scores is not None:
        scores.fill(rollout)
    return rollout


def response_slice(prompt_len: int, response_len: int) -> slice:
    """Columns of the full-sequence outputs that predict (logits) or value the answer."""
    return slice(prompt_len - 1, prompt_len + response_len - 1)


def answer_values(critic, seqs, mask, response_len: int) -> torch.Tensor:
    """A separate critic's values (B, T) for the answer columns (:func:`response_slice`) of
    prompt + answer sequences (B, P + T). It computes the last T + 1 positions only: the
    native runtime's last layer skips the prompt rows (``models.backbone_hidden``)."""
    return critic(seqs, mask, keep_last=response_len + 1)[:, :response_len]


def policy_outputs(
    policy,
    seqs,
    mask,
    prompt_len,
    response_ids,
    temperature,
    with_entropy=False,
    shared: bool | None = None,
    entropy_grad: bool = True,
    autocast=contextlib.nullcontext,
):
    """Log-probs (B, T), values (B, T) or None, entropy (B, T) or None from one forward.

    ``shared`` says the policy returns (logits, values); by default it is read off the
    module, which a DDP wrapper hides. ``entropy_grad=False`` computes the entropy from
    detached logits (a metric only: no graph kept for it). ``autocast``: the context the
    forward alone runs in (``ModelCast.autocast``); log-probs and entropy are computed after
    it, in fp32."""
    T = response_ids.shape[1]
    keep = T + 1  # logits of positions P-1 .. P+T-1; the last one predicts past the answer
    if shared is None:
        shared = isinstance(policy, M.PolicyWithValueHead)
    with autocast():
        if shared:
            logits, values = policy(seqs, mask, keep_last=keep)
        else:
            logits, values = M.causal_forward(policy, seqs, mask, keep_last=keep).logits, None
    if values is not None:
        values = values[:, :T].float()  # the last T + 1 positions' first T: response_slice
    logits = logits[:, :T]
    logprobs = A.logprobs_from_logits(logits, response_ids, temperature)
    entropy = None
    if with_entropy:
        entropy = A.entropy_from_logits(logits if entropy_grad else logits.detach(), temperature)
    return logprobs, values, entropy


@torch.no_grad()
def score_rollout(
    cast,
    rollout: Rollout,
    temperature: float,
    micro_batch: int,
    policy_forward: bool = True,
    critic_forward: bool = True,
    prompt_caches: PromptCaches | None = None,
) -> Rollout:
    """Fill old/ref log-probs, values, entropy and scores, micro-batched, without gradients.

    One forward of the policy (logits and, with a shared backbone, values), one of the
    reference, one of the critic (if separate), one of the reward model. The policy and
    critic run under ``cast.autocast()`` (model.compute_dtype), as in training, so the old
    log-probs and values come from the arithmetic of the new ones; the reference under
    ``cast.reference_autocast()``; the reward model in its own precision.
    ``policy_forward=False`` leaves old_logprobs and entropy (and a shared backbone's values)
    as they are: the sampling pass filled them (``rollout.logprobs_from_sampling``) or the
    training forward will (``ppo.reuse_training_forward``). ``critic_forward=False`` leaves
    a separate critic's values to its training forward (``ppo.values_from_training_forward``).
    ``prompt_caches`` keeps the reference's KV cache of the prompts and its logits at the
    last prompt position for the monitor's opener probe (the forward keeps its cache then;
    its outputs are the same).
    """
    if not policy_forward and cast.shared and rollout.values is None:
        raise ValueError("score_rollout: a shared backbone's values need the policy forward")
    seqs, mask = rollout.sequences, rollout.attention_mask
    if policy_forward:
        score_policy(cast, rollout, temperature, micro_batch)
    critic = cast.critic_values if critic_forward else None
    parts: dict[str, list] = {"ref": [], "val": []}
    P, keep = rollout.prompt_ids.shape[1], prompt_caches is not None
    for s in range(0, len(rollout), micro_batch):
        ids, am = seqs[s : s + micro_batch], mask[s : s + micro_batch]
        resp = rollout.response_ids[s : s + micro_batch]
        T = resp.shape[1]
        with cast.reference_autocast():
            out = M.causal_forward(cast.reference, ids, am, keep_last=T + 1, use_cache=keep)
        parts["ref"].append(A.logprobs_from_logits(out.logits[:, :T], resp, temperature))
        if keep:  # the first kept logits (position P − 1) predict the answer's first token
            cache = getattr(out, cache_kwarg(cast.reference))
            prompt_caches.keep(cache, out.logits[:, 0], ids[:, :P], am[:, :P], offset=s)
            del cache
        del out  # not alive during the next micro-batch's forward
        if critic is not None:
            with cast.autocast():
                parts["val"].append(answer_values(critic, ids, am, T))
    device = rollout.response_ids.device
    rollout.ref_logprobs = torch.cat(parts["ref"]).to(device)
    if critic is not None:
        rollout.values = torch.cat(parts["val"])
    reward = cast.reward(RewardBatch(rollout.prompts, rollout.responses, seqs, mask, rollout.ended))
    rollout.scores = reward.score.to(device)
    rollout.components = {k: v.to(device) for k, v in reward.components.items()}
    return rollout


@torch.no_grad()
def score_policy(cast, rollout: Rollout, temperature: float, micro_batch: int) -> Rollout:
    """The policy's part of scoring: old log-probs, full-distribution entropy and, with a
    shared backbone, the values, micro-batched, without gradients, under
    ``cast.autocast()`` as the training forward runs."""
    seqs, mask = rollout.sequences, rollout.attention_mask
    P = rollout.prompt_ids.shape[1]
    parts: dict[str, list] = {"old": [], "val": [], "ent": []}
    for s in range(0, len(rollout), micro_batch):
        ids, am = seqs[s : s + micro_batch], mask[s : s + micro_batch]
        resp = rollout.response_ids[s : s + micro_batch]
        lp, values, ent = policy_outputs(
            cast.policy, ids, am, P, resp, temperature, True, autocast=cast.autocast
        )
        parts["old"].append(lp)
        parts["val"].append(values)
        parts["ent"].append(ent)
    rollout.old_logprobs = torch.cat(parts["old"])
    rollout.entropy = torch.cat(parts["ent"])
    if parts["val"][0] is not None:  # shared backbone
        rollout.values = torch.cat(parts["val"])
    return rollout
