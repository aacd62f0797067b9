"""The sampler: batched ancestral sampling with a KV cache, and what the sampling pass can
record on the way (the drawn tokens' log-probs, entropy and values).

It sits behind ``rlhflab.experience.rollout.generate_rollout``, the seam a faster engine (vLLM on a
GPU) would replace; prompts come left-padded (see ``rlhflab.experience.rollout``).
"""

from __future__ import annotations

import inspect
import warnings
from typing import TYPE_CHECKING

import torch

from rlhflab import models as M
from rlhflab.core import algorithms as A

if TYPE_CHECKING:
    from rlhflab.experience.rollout import Rollout


class SamplingScores:
    """Per-token outputs of the sampling pass itself (``rollout.logprobs_from_sampling``).

    Each decoding step already has the logits that predict the token it draws, so the old
    log-probs and the full-distribution entropy come for free, as TRL's PPOTrainer takes
    them; with a shared backbone, ``value_head`` applied to the same last hidden state gives
    the values. That spares the separate no-grad policy forward over prompt + answer.
    The numbers equal a full forward's only to float rounding (the KV-cached pass sums in
    another order); another engine or precision for sampling would widen the gap.
    """

    def __init__(self, lm: torch.nn.Module | None = None, value_head=None):
        if (lm is None) != (value_head is None):
            raise ValueError("SamplingScores: the values need both the LM and the value head")
        self.value_head, self.lm = value_head, lm
        self.logprobs: list[torch.Tensor] = []
        self.entropy: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self._hidden: torch.Tensor | None = None

    def watching(self, model):
        """``model`` as a function that also keeps the last position's input to the LM's
        head (its final hidden state) when values are wanted; the hook lives for one call."""
        if self.value_head is None:
            return model

        def grab(_module, args):
            self._hidden = args[0][:, -1]

        def forward(**kwargs):
            hook = self.lm.get_output_embeddings().register_forward_pre_hook(grab)
            try:
                return model(**kwargs)
            finally:
                hook.remove()

        return forward

    def record(self, scaled_logits: torch.Tensor, tokens: torch.Tensor) -> None:
        """scaled_logits: (B, V) float, already divided by the temperature; tokens: (B,)."""
        z = scaled_logits.unsqueeze(1)
        self.logprobs.append(A.logprobs_from_logits(z, tokens.unsqueeze(1)).squeeze(1))
        self.entropy.append(A.entropy_from_logits(z).squeeze(1))
        if self.value_head is not None:
            self.values.append(M.fp32_head(self.value_head, self._hidden).squeeze(-1).float())

    def fill(self, rollout: Rollout) -> None:
        """Write old_logprobs, entropy (and values) of the T sampled steps into the rollout."""
        rollout.old_logprobs = torch.stack(self.logprobs, 1)
        rollout.entropy = torch.stack(self.entropy, 1)
        if self.value_head is not None:
            rollout.values = torch.stack(self.values, 1)


def filter_logits(logits: torch.Tensor, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """Top-k then nucleus filtering: removed tokens get −inf. (B, V) → (B, V)."""
    if top_k and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        cum = torch.softmax(sorted_logits, -1).cumsum(-1)
        drop_sorted = (cum - torch.softmax(sorted_logits, -1)) >= top_p  # keep the first over p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


_warned_truncated = False


def cache_kwarg(model) -> str:
    """transformers 5.x renamed ``past_key_values`` to ``cache``; support both."""
    core = model
    if isinstance(core, M.Offloaded):
        core = core.model
    if isinstance(core, M.LoraReference):
        core = core.peft_model
    if hasattr(core, "get_base_model"):
        core = core.get_base_model()
    params = inspect.signature(type(core).forward).parameters
    return "cache" if "cache" in params else "past_key_values"


@torch.no_grad()
# Just over 80 lines: the KV-cached sampling loop is kept in one piece, since it is the
# hot path of every iteration and its per-step state (cache, finished rows, scores) is local.
def sample(
    model,
    prompt_ids,
    prompt_mask,
    max_new_tokens: int,
    eos_id: int | None,
    pad_id: int,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
    all_done=None,
    scores: SamplingScores | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sample answers with a KV cache. Returns (response_ids, response_mask, ended).

    Tokens after a row's first EOS are pad and masked out; the EOS itself is kept in the
    mask. Generation stops early once every row has ended. ``eos_id=None`` makes EOS an
    ordinary token: every answer is ``max_new_tokens`` long (benchmarks need equal work).
    ``scores`` records each step's log-prob and entropy (and value) of the drawn token,
    computed from the untruncated distribution at ``temperature``, as training computes them.
    """
    global _warned_truncated
    if (top_k or top_p < 1.0) and not _warned_truncated:
        warnings.warn(
            "top_k/top_p sampling: training log-probs use the full softmax, so they "
            "differ from the truncated sampling distribution (PPO becomes slightly "
            "off-policy)",
            stacklevel=2,
        )
        _warned_truncated = True
    B, device = prompt_ids.shape[0], prompt_ids.device
    mask = prompt_mask.clone()
    positions = M.position_ids_from_mask(mask)
    cache_key = cache_kwarg(model)
    forward = model if scores is None else scores.watching(model)
    # logits of the last position only: the prompt's would be (B, P, V) of waste
    out = forward(
        input_ids=prompt_ids,
        attention_mask=mask,
        position_ids=positions,
        use_cache=True,
        logits_to_keep=1,
    )
    next_pos = positions[:, -1:] + 1
    finished = torch.zeros(B, dtype=torch.bool, device=device)
    tokens = []
    for step in range(max_new_tokens):
        logits = out.logits[:, -1, :].float() / temperature
        probs = torch.softmax(filter_logits(logits, top_k, top_p), dim=-1)
        nxt = torch.multinomial(probs, 1, generator=generator).squeeze(1)
        nxt = torch.where(finished, torch.full_like(nxt, pad_id), nxt)
        if scores is not None:
            scores.record(logits, nxt)
        tokens.append(nxt)
        done = False
        if eos_id is not None:  # (without one, nothing finishes early: no host sync a step)
            finished = finished | (nxt == eos_id)
            done = bool(finished.all())
        if all_done is not None:  # data parallel with sharded weights: stop together
            done = all_done(done)
        if done or step == max_new_tokens - 1:
            break
        mask = torch.cat([mask, torch.ones((B, 1), dtype=mask.dtype, device=device)], dim=1)
        out = forward(
            input_ids=nxt[:, None],
            attention_mask=mask,
            position_ids=next_pos,
            use_cache=True,
            **{cache_key: getattr(out, cache_key)},
        )
        next_pos = next_pos + 1
    response = torch.stack(tokens, dim=1)
    # mask: everything up to and including the first EOS
    is_eos = (
        response == eos_id if eos_id is not None else torch.zeros_like(response, dtype=torch.bool)
    )
    after_eos = (is_eos.long().cumsum(1) - is_eos.long()) > 0
    response_mask = (~after_eos).long()
    response = torch.where(after_eos, torch.full_like(response, pad_id), response)
    return response, response_mask, is_eos.any(dim=1)
