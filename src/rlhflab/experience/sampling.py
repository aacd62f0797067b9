"""The sampler: batched ancestral sampling with a KV cache, and what the sampling pass can
record on the way (the drawn tokens' log-probs, entropy and values).

It sits behind ``rlhflab.experience.rollout.generate_rollout``, the seam a faster engine (vLLM on a
GPU) would replace; prompts come left-padded (see ``rlhflab.experience.rollout``).
"""

from __future__ import annotations

import inspect
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from rlhflab import models as M
from rlhflab.core import algorithms as A
from rlhflab.errors import RlhflabError

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


@dataclass
class PromptPrefix:
    """Distinct prompts of a rollout as a forward over them left them: its KV cache cut back
    to the P prompt positions (a copy, of these rows only) and the logits at the last prompt
    position (b, V), which predict the answer's first token. ``rows``: (b,) the rollout rows
    they are (int64)."""

    rows: torch.Tensor
    cache: object
    first_logits: torch.Tensor


class PromptCaches:
    """What the monitor's opener probe (``rlhflab.experience.opener``) takes from a forward
    the iteration runs anyway over the prompts, so that it need not run them again: the
    sampling pass's prefill (the policy's, filled by :func:`sample`) or the scoring forward
    (the reference's, ``rollout.score_rollout``).

    Each distinct prompt is kept once (GRPO repeats each G times; ``distinct=False`` keeps
    every row: under FSDP every rank must then run as many probe forwards as the others),
    in parts of at most ``chunk`` prompts (rollout.score_micro_batch: one probe forward
    each). ``parts`` stays None for a cache this cannot copy rows of (a sliding-window or
    quantised cache): the probe then runs the prompts itself.
    """

    def __init__(self, chunk: int, distinct: bool = True):
        self.chunk, self.distinct = chunk, distinct
        self.parts: list[PromptPrefix] | None = []

    def keep(self, cache, first_logits, prompt_ids, prompt_mask, offset: int = 0) -> None:
        """Keep rows of ``cache`` (over prompt_ids (b, P), left-padded, and maybe more
        positions after them) and ``first_logits`` (b, V); ``offset``: the rollout row of
        row 0."""
        if self.parts is None:
            return
        rows = distinct_rows(prompt_ids, prompt_mask)[0] if self.distinct else None
        if rows is None:
            rows = torch.arange(prompt_ids.shape[0], device=prompt_ids.device)
        for s in range(0, len(rows), self.chunk):
            part = rows[s : s + self.chunk]
            kept = cache_rows(cache, part, prompt_ids.shape[1])
            if kept is None:
                self.parts = None
                return
            self.parts.append(PromptPrefix(part + offset, kept, first_logits[part]))


def distinct_rows(prompt_ids, prompt_mask) -> tuple[torch.Tensor, torch.Tensor]:
    """(first, same): the first row of each distinct prompt (U,), and for every row the
    first row with its prompt (B,); prompts (B, P) left-padded as in a rollout."""
    B = prompt_ids.shape[0]
    _, inverse = torch.unique(
        torch.cat([prompt_ids, prompt_mask.to(prompt_ids.dtype)], 1), dim=0, return_inverse=True
    )
    order = torch.arange(B, device=prompt_ids.device)
    firsts = torch.full((B,), B, device=prompt_ids.device).scatter_reduce(0, inverse, order, "amin")
    same = firsts[inverse]
    return same.unique(), same


def cache_rows(cache, rows: torch.Tensor, length: int):
    """A new KV cache with rows ``rows`` and the first ``length`` positions of ``cache``,
    copied (the rest is freed with the original); None for a cache kind this does not know:
    transformers' ``DynamicCache`` of full-attention layers and the native runtime's
    ``KVCache`` are copied."""
    if hasattr(cache, "rows"):  # rlhflab.backends.native.KVCache
        return cache.rows(rows, length)
    layers = getattr(cache, "layers", None)
    if type(cache).__name__ != "DynamicCache" or layers is None:
        return None
    if any(type(layer).__name__ != "DynamicLayer" for layer in layers):
        return None  # sliding-window, quantised, linear-attention layers
    data = [(layer.keys[rows, :, :length], layer.values[rows, :, :length]) for layer in layers]
    return type(cache)(ddp_cache_data=data)


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


SAMPLERS = ("multinomial", "gumbel")


def draw_tokens(logits: torch.Tensor, generator, sampler: str = "multinomial") -> torch.Tensor:
    """One token per row drawn from softmax(``logits``): (B, V) float logits, ``-inf`` for
    tokens filtered out → (B,) int64 ids.

    'multinomial': ``torch.multinomial`` on the softmax. 'gumbel': ``argmax(logits + G)``
    with ``G = -log(-log U)``, U uniform from ``torch.rand`` — the Gumbel-max trick, an
    exact draw from the same softmax (Gumbel 1954; Maddison et al. 2014, arXiv:1411.0030).
    torch.multinomial draws one exponential per token for the equivalent race, with a
    scalar loop on the CPU: 9.9 ms per (8, 49,152) draw against 2.1 ms for this one
    (2-core Intel Xeon, 2026-12-06). U is float32 and kept above its smallest normal, so G
    lies in [-4.5, 16.6]: float32's uniforms cut the tails off either way. A row holding
    NaN or +inf, or with every token filtered out, is refused under both with a ValueError
    naming it (on a GPU, torch.multinomial's own check may fire asynchronously first, as
    a device-side assert). Different random streams: the same generator state gives different tokens
    under the two samplers."""
    if sampler not in SAMPLERS:
        raise ValueError(f"sampler must be one of {SAMPLERS}, got {sampler!r}")
    if sampler == "gumbel":
        _refuse_undrawable(logits.amax(-1))
        # float32 uniforms whatever the logits' dtype: 8-bit ones would cap the noise
        u = torch.rand(logits.shape, generator=generator, device=logits.device)
        noise = u.clamp_(min=torch.finfo(u.dtype).tiny).log_().neg_().log_().neg_()
        return torch.argmax(logits.float() + noise, dim=-1)
    probs = torch.softmax(logits, dim=-1)
    try:
        return torch.multinomial(probs, 1, generator=generator).squeeze(1)
    except RuntimeError:
        # only now look at why (no extra pass over the logits on the hot path)
        _refuse_undrawable(logits.amax(-1))
        raise


class UndrawableLogits(RlhflabError, ValueError):
    """Logits no sampler can draw from: a user error the command line says in one line (a
    model whose arithmetic overflows in its dtype, or sampling settings that filter out
    every token), not a bug to trace."""


def _refuse_undrawable(top: torch.Tensor) -> None:
    """Refuse rows that no sampler can draw from, by each row's largest logit ``top``
    (B,): NaN or +inf anywhere, or every token filtered out (all -inf)."""
    if bool(torch.isfinite(top).all()):
        return
    bad = int((~torch.isfinite(top)).nonzero()[0, 0])
    if top[bad] == float("-inf"):
        raise UndrawableLogits(
            f"draw_tokens: every token of row {bad} is filtered out (all logits -inf); "
            "nothing is left to draw from"
        )
    raise UndrawableLogits(
        f"draw_tokens: the logits of row {bad} hold NaN or +inf (the model's arithmetic "
        "overflowed: try model.compute_dtype=fp32, or check the model's weights)"
    )


def _stop_test(eos_id, device):
    """tokens → bool of the same shape: which end an answer (one id, or any of several)."""
    if eos_id is None or isinstance(eos_id, int) or len(eos_id) == 1:
        one = eos_id if eos_id is None or isinstance(eos_id, int) else eos_id[0]
        return lambda t: t == one
    ids = torch.tensor(list(eos_id), dtype=torch.long, device=device)
    return lambda t: torch.isin(t, ids)


@torch.no_grad()
# Just over 80 lines: the KV-cached sampling loop is kept in one piece, since it is the
# hot path of every iteration and its per-step state (cache, finished rows, scores) is local.
def sample(
    model,
    prompt_ids,
    prompt_mask,
    max_new_tokens: int,
    eos_id: int | tuple[int, ...] | None,
    pad_id: int,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
    all_done=None,
    scores: SamplingScores | None = None,
    prompts: PromptCaches | None = None,
    sampler: str = "multinomial",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sample answers with a KV cache. Returns (response_ids, response_mask, ended).

    Tokens after a row's first EOS are pad and masked out; the EOS itself is kept in the
    mask. Generation stops early once every row has ended. ``eos_id``: the id, or the ids
    (``models.stop_ids``), that end an answer; None makes EOS an ordinary token: every
    answer is ``max_new_tokens`` long (benchmarks need equal work).
    ``scores`` records each step's log-prob and entropy (and value) of the drawn token,
    computed from the untruncated distribution at ``temperature``, as training computes them.
    ``prompts`` keeps the prompts' part of the KV cache and the prefill's logits for the
    monitor's opener probe, once sampling is done. ``sampler``: :func:`draw_tokens`.
    """
    global _warned_truncated
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    cuts = bool(top_k) and not (isinstance(vocab, int) and top_k >= vocab)  # else keeps all
    if (cuts or top_p < 1.0) and not _warned_truncated:
        warnings.warn(
            "top_k/top_p sampling: training log-probs use the full softmax, so they "
            "differ from the truncated sampling distribution (PPO becomes slightly "
            "off-policy)",
            stacklevel=3,  # past torch.no_grad's wrapper, to the caller
        )
        _warned_truncated = True
    B, device = prompt_ids.shape[0], prompt_ids.device
    ends = _stop_test(eos_id, device)
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
    first_logits = out.logits[:, -1]  # (B, V): they predict the answer's first token
    next_pos = positions[:, -1:] + 1
    finished = torch.zeros(B, dtype=torch.bool, device=device)
    tokens = []
    for step in range(max_new_tokens):
        logits = out.logits[:, -1, :].float() / temperature
        nxt = draw_tokens(filter_logits(logits, top_k, top_p), generator, sampler)
        nxt = torch.where(finished, torch.full_like(nxt, pad_id), nxt)
        if scores is not None:
            scores.record(logits, nxt)
        tokens.append(nxt)
        done = False
        if eos_id is not None:  # (without one, nothing finishes early: no host sync a step)
            finished = finished | ends(nxt)
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
    if prompts is not None:
        prompts.keep(getattr(out, cache_key), first_logits, prompt_ids, prompt_mask)
    response = torch.stack(tokens, dim=1)
    # mask: everything up to and including the first EOS
    is_eos = ends(response) if eos_id is not None else torch.zeros_like(response, dtype=torch.bool)
    after_eos = (is_eos.long().cumsum(1) - is_eos.long()) > 0
    response_mask = (~after_eos).long()
    response = torch.where(after_eos, torch.full_like(response, pad_id), response)
    return response, response_mask, is_eos.any(dim=1)
