"""The monitor's flattery-opener probe: log P(the answer opens with a listed phrase | prompt),
per prompt, by forced decoding (``flattery_opener_ratio``, docs/monitors.md).

Each phrase is tokenized on its own (as SFT tokenizes answers), with and without a leading
space, and cut to its first ``max_tokens`` tokens: K spellings. A spelling t1 … tl is
scored as the answer's first tokens, log P(t1 | prompt) + Σ_j log P(tj | prompt, t1 … tj−1),
and the K probabilities add (logsumexp). Sampling's top-k/top-p truncation is ignored, as
in training. No sampling: the same weights and prompts give the same number, so a drift in
it is the model's, not the dice's.

What it runs, and why so little (issue #27):

* **Not the prompts.** The iteration's own forwards over them keep their KV cache, cut back
  to the prompt, and the logits that predict the answer's first token
  (:class:`~rlhflab.experience.sampling.PromptCaches`): the sampling pass's prefill for the
  policy, the scoring forward for the reference. log P(t1 | prompt) is read off those
  logits. Without them (a direct call, an unknown cache kind) the probe runs the prompts
  itself, logits of the last position only.
* **The spellings' later tokens, once, in one row per prompt.** Every distinct prefix
  t1 … tj (j < l) of a spelling is one position after the prompt's cache; it attends to
  the prompt and to its own earlier tokens only (a tree-shaped attention mask, as
  speculative decoding scores a token tree), at the position it would have in the answer.
  A prefix two spellings share runs once; the prompt's cache is not copied per spelling.
* **Each distinct prompt once** (GRPO asks each prompt G times).

So a probe runs S positions per distinct prompt and model, S = the number of distinct
proper prefixes (24 for the default phrases and SmolLM2's tokenizer), where a forward per
spelling after a copy of the prompt's cache ran P + K·L (44 + 10·4 on SmolLM2's chat
prompts) and the vocabulary projection of every one of them.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

from rlhflab import models as M
from rlhflab.core import algorithms as A
from rlhflab.experience.sampling import PromptCaches, PromptPrefix, cache_kwarg, distinct_rows
from rlhflab.models.frozen import is_quantized, low_linear_dtype

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Spellings:
    """K spellings as a token tree packed into S positions (M: their tokens after the first).

    first (K,): each spelling's first token. tokens (S,): the last token of each distinct
    proper prefix, offset (S,): its place in the answer (0 = the first token), sees (S, S):
    position i may attend position j (j's prefix begins i's, or i = j). node, target, owner
    (M,): the position whose logits predict each later token, the token, its spelling.
    """

    first: torch.Tensor
    tokens: torch.Tensor
    offset: torch.Tensor
    sees: torch.Tensor
    node: torch.Tensor
    target: torch.Tensor
    owner: torch.Tensor

    def to(self, device) -> Spellings:
        return Spellings(*(getattr(self, f).to(device) for f in self.__dataclass_fields__))


def spellings(tokenizer, phrases: list[str], max_tokens: int) -> Spellings:
    """The phrases' spellings, each cut to its first ``max_tokens`` tokens (the prefix's
    probability bounds the phrase's from above; once a model has begun "What a won…" the
    rest is nearly certain, and cost grows with the length)."""
    # answers often start with a space (" Great question!"), which BPE folds into the first
    # token: score both spellings; their first tokens differ, so the probabilities add
    variants = [v for p in phrases for v in (p, " " + p.lstrip())]
    cut = [
        tuple(tokenizer(v, add_special_tokens=False)["input_ids"][:max_tokens]) for v in variants
    ]
    # a phrase given with its leading space, or two phrases alike in their first tokens,
    # would otherwise count the same opening twice
    enc = list(dict.fromkeys(cut))
    if not all(enc):
        raise ValueError("monitor.phrases: a phrase tokenizes to nothing")
    prefixes: dict[tuple[int, ...], int] = {}  # distinct proper prefix → its position
    node, target, owner = [], [], []
    for k, e in enumerate(enc):
        for j in range(1, len(e)):
            node.append(prefixes.setdefault(e[:j], len(prefixes)))
            target.append(e[j])
            owner.append(k)
    keys = list(prefixes)
    long = torch.long
    return Spellings(
        first=torch.tensor([e[0] for e in enc], dtype=long),
        tokens=torch.tensor([p[-1] for p in keys], dtype=long),
        offset=torch.tensor([len(p) - 1 for p in keys], dtype=long),
        sees=torch.tensor([[a[: len(b)] == b for b in keys] for a in keys], dtype=torch.bool),
        node=torch.tensor(node, dtype=long),
        target=torch.tensor(target, dtype=long),
        owner=torch.tensor(owner, dtype=long),
    )


@torch.no_grad()
def opener_logprobs(
    model,
    tokenizer,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    phrases: list[str],
    temperature: float,
    micro_batch: int,
    max_tokens: int = 4,
    prefixes: list[PromptPrefix] | None = None,
    distinct: bool = True,
) -> torch.Tensor:
    """log P(the answer opens with one of ``phrases`` | prompt), per prompt: (B,) float32
    (float64 for a float64 model).

    model: a causal LM (the policy's LM, or the reference). prompt_ids, prompt_mask: (B, P)
    left-padded as in a Rollout. ``prefixes``: the prompts' caches a forward of the same
    model on the same prompts kept (:class:`PromptCaches`), emptied as the probe uses them
    (each serves one probe; its memory is freed as soon as it has); None: run the prompts
    here (:func:`prompt_prefixes`). ``distinct=False`` probes a repeated prompt again
    (FSDP: every rank must run as many forwards as the others).
    """
    sp = spellings(tokenizer, phrases, max_tokens).to(prompt_ids.device)
    same = distinct_rows(prompt_ids, prompt_mask)[1] if distinct else None
    S = sp.tokens.shape[0]
    if S and (
        not within_window(model, prompt_ids.shape[1] + S)
        or not takes_tree_mask(model, sp, temperature)
    ):
        if isinstance(prefixes, list):
            prefixes.clear()  # the kept caches serve nothing here: freed now
        rows = distinct_rows(prompt_ids, prompt_mask)[0] if distinct else None
        if rows is None:
            rows = torch.arange(prompt_ids.shape[0], device=prompt_ids.device)
        out = None
        for s in range(0, len(rows), micro_batch):
            part = rows[s : s + micro_batch]
            lp = _opener_by_forwards(model, sp, prompt_ids[part], prompt_mask[part], temperature)
            if out is None:
                out = lp.new_full((prompt_ids.shape[0],), float("nan"))
            out[part] = lp
        return out if same is None else out[same]
    if not prefixes:  # None, or no forward kept them (e.g. a path that keeps no caches)
        prefixes = prompt_prefixes(model, prompt_ids, prompt_mask, micro_batch, distinct)
    out = None
    for prefix in _used_once(prefixes):
        lp = _opener_after(model, sp, prefix, prompt_mask[prefix.rows], temperature)
        if out is None:
            out = lp.new_full((prompt_ids.shape[0],), float("nan"))
        out[prefix.rows] = lp
    return out if same is None else out[same]


def _used_once(prefixes: Iterable[PromptPrefix]) -> Iterator[PromptPrefix]:
    if not isinstance(prefixes, list):
        yield from prefixes
        return
    while prefixes:  # no reference left to a part once it has been probed
        yield prefixes.pop(0)


def prompt_prefixes(
    model, prompt_ids, prompt_mask, micro_batch: int, distinct: bool = True
) -> Iterator[PromptPrefix]:
    """What the probe runs when no forward kept the prompts' caches: the prompts (each
    distinct one once, unless not ``distinct``), ``micro_batch`` to a forward that computes
    the logits of the last position only, each part made as it is used."""
    rows = distinct_rows(prompt_ids, prompt_mask)[0] if distinct else None
    if rows is None:
        rows = torch.arange(prompt_ids.shape[0], device=prompt_ids.device)
    key = cache_kwarg(model)
    for s in range(0, len(rows), micro_batch):
        part = rows[s : s + micro_batch]
        ids, mask = prompt_ids[part], prompt_mask[part]
        out = model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=M.position_ids_from_mask(mask),
            use_cache=True,
            logits_to_keep=1,
        )
        yield PromptPrefix(part, getattr(out, key), out.logits[:, -1])


def _opener_after(model, sp: Spellings, prefix: PromptPrefix, mask, temperature) -> torch.Tensor:
    """(b,) log P(open with a spelling) for the prompts of ``prefix`` (mask: theirs, (b, P));
    its cache is extended by the spellings' positions (it serves one probe)."""
    b, P = mask.shape
    K = sp.first.shape[0]
    # the prompt's last logits predict every spelling's first token
    logp = A.logprobs_at(prefix.first_logits[:, None], sp.first.new_zeros(K), sp.first, temperature)
    S = sp.tokens.shape[0]
    if S:  # spellings longer than one token: their later tokens, all in one row per prompt
        sees = torch.cat(
            [mask.bool()[:, None, None, :].expand(b, 1, S, P), sp.sees.expand(b, 1, S, S)], -1
        )
        out = model(
            input_ids=sp.tokens.expand(b, S),
            attention_mask=_as_model_mask(model, sees),
            position_ids=M.position_ids_from_mask(mask)[:, -1:] + 1 + sp.offset,
            use_cache=True,
            **{cache_kwarg(model): prefix.cache},
        )
        later = A.logprobs_at(out.logits, sp.node, sp.target, temperature)
        logp = logp.index_add(1, sp.owner, later.to(logp.dtype))
    return torch.logsumexp(logp, dim=1)


def _opener_by_forwards(model, sp: Spellings, ids, mask, temperature) -> torch.Tensor:
    """(b,) as :func:`_opener_after`, one forward per spelling over prompt + spelling with a
    plain (b, P + l) mask: for a model whose attention takes no tree-shaped 4-D mask."""
    b, per = ids.shape[0], []
    for k in range(sp.first.shape[0]):
        spelled = torch.cat([sp.first[k : k + 1], sp.target[sp.owner == k]])  # (l,)
        n = spelled.shape[0]
        full_mask = torch.cat([mask, mask.new_ones(b, n)], 1)
        out = model(
            input_ids=torch.cat([ids, spelled.expand(b, n)], 1),
            attention_mask=full_mask,
            position_ids=M.position_ids_from_mask(full_mask),
            use_cache=False,
            logits_to_keep=n + 1,  # the last prompt position predicts the first token
        )
        positions = torch.arange(n, device=ids.device)
        per.append(A.logprobs_at(out.logits, positions, spelled, temperature).sum(1))
    return torch.logsumexp(torch.stack(per, 1), dim=1)


def within_window(model, length: int) -> bool:
    """Whether ``length`` positions stay within ``model``'s sliding attention window, if it
    has one (Gemma 2 and 3, Mistral; Qwen2 where ``use_sliding_window``; Llama 4's chunked
    attention, whose cache keeps a chunk's worth). Past it the
    prompts' cache has dropped its oldest positions — transformers' sliding-window cache
    keeps the last ``window`` only — so the spellings cannot be scored after it (PPO on
    Gemma 2 crashed on a shape mismatch there): the probe then runs a forward per spelling
    over prompt and spelling, which the model's own attention windows as it always does."""
    config = getattr(getattr(model, "peft_model", model), "config", None)
    if hasattr(config, "get_text_config"):  # Gemma 3/4's window is in their text config
        config = config.get_text_config(decoder=True)
    types = getattr(config, "layer_types", None)
    windows = []  # as transformers' cache sizes its windowed layers (cache_utils)
    sliding = getattr(config, "sliding_window", None)
    if sliding and getattr(config, "use_sliding_window", True) is not False:
        if types is None or "sliding_attention" in types:
            windows.append(int(sliding))
    chunk = getattr(config, "attention_chunk_size", None)  # Llama 4's chunked layers
    if chunk and (types is None or "chunked_attention" in types):
        windows.append(int(chunk))
    window = min(windows, default=None)
    if window is None or length <= window:
        return True
    if ("window", type(model).__name__) not in _SAID:
        _SAID.add(("window", type(model).__name__))
        log.warning(
            "monitor: prompts plus opener spellings (%d positions) exceed %s's sliding "
            "attention window (%d); the flattery-opener probe runs one forward per phrase "
            "spelling on it (same numbers, slower)",
            length,
            type(model).__name__,
            window,
        )
    return False


# model → whether the probe's tree-shaped mask gives its numbers (decided once per model)
_TREE_MASK: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_SAID: set = set()


def takes_tree_mask(model, sp: Spellings, temperature: float) -> bool:
    """Whether ``model`` scores the spellings right with the tree-shaped 4-D mask, checked
    once per model against one forward per spelling. Not every attention takes a 4-D mask
    (Bloom's ALiBi wants a 2-D one and raises), and one that took it but read it otherwise
    would give wrong numbers silently: either way the probe then runs a forward per
    spelling (same numbers, more work), and says so once.

    The check runs on two made-up rows of the spellings' own tokens, one of them
    left-padded (a mask that mishandles padding shows there), without autocast: the same
    inputs and arithmetic on every rank, so under FSDP every rank decides alike and runs
    as many forwards as the others."""
    known = _TREE_MASK.get(model)
    if known is not None:
        return known
    pool = torch.cat([sp.first, sp.target, sp.tokens])
    base = pool.repeat(-(-6 // pool.numel()))[:6]
    ids = torch.stack([base, torch.cat([base[:3], base[:3]])])
    mask = torch.tensor([[1] * 6, [0, 0, 0, 1, 1, 1]], device=ids.device)
    weights = getattr(model, "peft_model", model)  # a LoRA reference: the policy's base
    # 16-bit or int8 weights round a cached and a whole forward apart by more than fp32
    low = any(p.dtype in (torch.bfloat16, torch.float16) for p in weights.parameters()) or any(
        is_quantized(m) for m in weights.modules()
    )
    # without autocast, except for a reference whose Linear weights are stored in 16 bits
    # (model.reference_low_weights), which computes only under its autocast
    stored = low_linear_dtype(weights)
    arithmetic = (
        torch.autocast(ids.device.type, dtype=stored)
        if stored is not None
        else torch.autocast(ids.device.type, enabled=False)
    )
    with arithmetic:
        want = _opener_by_forwards(model, sp, ids, mask, temperature)
        tol = (0.05 if low else 1e-3) * (1 + float(want.abs().max()))
        try:  # the model's forward with the tree-shaped mask, and nothing else
            prefix = next(iter(prompt_prefixes(model, ids, mask, 2, distinct=False)))
            got = _opener_after(model, sp, prefix, mask, temperature)
        except Exception as exc:  # any failure of the 4-D path means: do not use it
            why = f"{type(exc).__name__}: {exc}"
        else:
            diff = float((got.float() - want.float()).abs().max())
            why = None if diff <= tol else f"it differs by {diff:.3g} from a forward per spelling"
    if why is not None and type(model).__name__ not in _SAID:
        _SAID.add(type(model).__name__)  # once per kind of model (policy and reference alike)
        log.warning(
            "monitor: %s takes no tree-shaped attention mask (%s); the flattery-opener probe "
            "runs one forward per phrase spelling on it (same numbers, slower)",
            type(model).__name__,
            why.splitlines()[0][:200],
        )
    _TREE_MASK[model] = why is None
    return why is None


def _as_model_mask(model, sees: torch.Tensor) -> torch.Tensor:
    """The (b, 1, S, P + S) mask as the model's attention wants a 4-D mask: boolean (True:
    may attend) for SDPA and the native runtime, additive for transformers' eager attention."""
    config = getattr(model, "config", None) or getattr(model.peft_model, "config", None)
    if getattr(config, "_attn_implementation", None) != "eager":
        return sees
    return torch.zeros(sees.shape, device=sees.device).masked_fill(
        ~sees, torch.finfo(torch.float32).min
    )


__all__ = ["PromptCaches", "Spellings", "opener_logprobs", "prompt_prefixes", "spellings"]
