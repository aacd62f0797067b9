"""Memory accounting for the four-model cast (``rlhflab memory --config FILE``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlhflab.backends import weight_cast
from rlhflab.config.base import ConfigError
from rlhflab.core import algorithms as A

# re-exported: the trainers, the commands and the benchmarks read peak_rss_bytes here
from rlhflab.diagnostics.machine_memory import free_bytes, peak_rss_bytes, rss_bytes  # noqa: F401
from rlhflab.diagnostics.tensor_bytes import forward_backward_bytes, held_by
from rlhflab.experience.opener import PromptCaches, opener_logprobs, prompt_prefixes
from rlhflab.experience.rollout import answer_values, policy_outputs
from rlhflab.experience.sampling import cache_kwarg
from rlhflab.models import causal_forward, module_bytes
from rlhflab.models.precision import autocast_dtype


@dataclass
class ModelMemory:
    name: str
    weights: int  # bytes of all weights (shared tensors once; int8 at 1 byte)
    trainable: int  # bytes of the weights that get gradients
    gradients: int  # = trainable bytes
    optimizer: int  # AdamW keeps two moments per trainable weight
    # the 16-bit copies of a trained model's fp32 weights (a LoRA base's too) kept between
    # forwards (model.cast_cache)
    kept_casts: int = 0

    @property
    def total(self) -> int:
        return self.weights + self.kept_casts + self.gradients + self.optimizer


def _trainable_bytes(model) -> int:
    params = getattr(model, "parameters", None)
    if params is None:
        return 0
    return sum(p.numel() * p.element_size() for p in params() if p.requires_grad)


def cast_memory(cast) -> list[ModelMemory]:
    """Per-model bytes. The LoRA reference shares the policy's weights and counts as 0."""
    rows = []
    for name, model in cast.models().items():
        weights = module_bytes(model) if hasattr(model, "state_dict") else 0
        trainable = _trainable_bytes(model)
        kept = 0
        if isinstance(model, torch.nn.Module):  # 16-bit copies: 2 bytes an element
            kept = 2 * sum(w.numel() for w in weight_cast.kept_weights(model))
        rows.append(ModelMemory(name, weights, trainable, trainable, 2 * trainable, kept))
    return rows


# ----------------------------------------------------------------- what one iteration adds


def kv_cache_bytes(
    num_layers: int, num_kv_heads: int, head_dim: int, rows: int, positions: int, itemsize: int
) -> int:
    """Keys and values of every layer for ``rows`` sequences of ``positions`` tokens."""
    return 2 * num_layers * num_kv_heads * head_dim * rows * positions * itemsize


def cache_positions(prompt_len: int, new_tokens: int, doubling: bool) -> int:
    """Positions the sampler's KV cache holds when an answer of ``new_tokens`` is done.

    The last drawn token is never fed back, so the cache ends at prompt_len + new_tokens − 1.
    The native runtime's buffers start at the prompt's length and double when full
    (``native.KVCache``): they end at the first prompt_len·2^k that fits. transformers'
    cache grows by concatenation and holds exactly what it needs.
    """
    needed = prompt_len + max(new_tokens - 1, 0)
    if not doubling:
        return needed
    capacity = prompt_len
    while capacity < needed:
        capacity *= 2
    return capacity


@dataclass
class PhaseMemory:
    phase: str  # sampling | scoring | monitor | training | critic
    what: str  # what the bytes are, for the table
    bytes: int
    measured: bool  # measured on the built models, or computed from their shapes
    # the models whose gradients exist meanwhile (they live only during the PPO epochs:
    # every update ends with zero_grad(set_to_none))
    gradients_of: tuple[str, ...] = ()


def _lm_config(model):
    lm = getattr(model, "lm", model)  # PolicyWithValueHead
    base = getattr(lm, "get_base_model", None)  # peft
    return (base() if base else lm).config


def extrapolate(one: int, two: int, rows: int) -> int:
    """Bytes at ``rows`` from those measured at 1 and 2 rows: what a forward holds once
    (2·one − two) plus ``rows`` times what each row adds (two − one)."""
    return max(2 * one - two, 0) + rows * max(two - one, 0)


def refuse_unmeasurable(cast, cfg, ids, scoring_rows: int, micro: int) -> None:
    """Refuse, naming the setting, a scoring or training forward that would not fit the
    memory free now, which measuring it would allocate: the policy's no-grad forward, and
    its forward and backward, measured on 1 and 2 answers (``ids(rows)``: ids and mask),
    and extrapolated to the rows of the configured micro-batch as fixed + rows × slope —
    what a forward holds once (a tied embedding's dense gradient, weight casts, the
    gradients) is not multiplied by the rows."""
    free = free_bytes(cast.device)
    if free is None or max(scoring_rows, micro) <= 2:
        return
    r, p = cfg.rollout, cfg.ppo
    P = r.max_prompt_tokens

    def outputs(seqs, mask, entropy: bool, shared: bool | None):  # as the phases run them
        return policy_outputs(
            cast.policy,
            seqs,
            mask,
            P,
            seqs[:, P:],
            r.temperature,
            entropy,
            shared=shared,
            autocast=cast.autocast,
        )

    def scoring(rows):
        with torch.no_grad():
            return held_by(lambda: outputs(*ids(rows), True, None))[2]

    def training(rows):
        forward = lambda: outputs(*ids(rows), p.entropy_coef > 0, cast.shared)  # noqa: E731
        return forward_backward_bytes(forward, cast.policy, False)[1]

    train_field = "ppo.micro_batch_size" if p.micro_batch_size else "ppo.minibatches"
    train_fix = "lower it" if p.micro_batch_size else "raise it, or set ppo.micro_batch_size"
    for measure, rows, field, fix in (
        (scoring, scoring_rows, "rollout.score_micro_batch", "lower it"),
        (training, micro, train_field, train_fix),
    ):
        need = extrapolate(measure(1), measure(2), rows)
        if need > free:
            gib = 2**30
            raise ConfigError(
                f"{field}: one forward over {rows} answers would hold about "
                f"{need / gib:.1f} GiB (measured on 1 and 2 answers, extrapolated), more than "
                f"the {free / gib:.1f} GiB free here: it does not fit (not measured, which "
                f"would take the machine down); {fix}"
            )


def _itemsize(model) -> int:
    return next(p for p in model.parameters() if p.is_floating_point()).element_size()


# One function on purpose (126 lines): the phases share the worst-case shapes, the random
# ids and the critic's measured forward, and their order mirrors one iteration's steps;
# split, each piece would need all of them passed in.
def iteration_memory(cast, cfg) -> list[PhaseMemory]:
    """What one PPO iteration holds on top of the weights, gradients and optimiser state,
    phase by phase, at the configured worst case: every prompt ``rollout.max_prompt_tokens``
    long and every answer ``rollout.max_new_tokens`` (no early EOS). The phases follow one
    another, so the iteration's peak is the largest phase's.

    * sampling: the policy's KV cache for all ``rollout.prompts_per_iteration`` answers,
      from the model's shapes (:func:`kv_cache_bytes`, :func:`cache_positions`);
    * scoring: the most that one no-grad forward of a ``rollout.score_micro_batch`` holds
      at once, policy or reference (they run in turn), measured on the built models;
    * training: what the policy's forward on one PPO micro-batch keeps for backward,
      measured on the built policy — lean activations, checkpointing and LoRA count as they
      are — plus a separate critic's, whose graph the first update keeps alongside the
      policy's by default (``ppo.values_from_training_forward``);
    * monitor: the flattery-opener probe (``experience.opener``), policy or reference,
      where ``monitor.flattery_opener_ratio`` is on: one part's forward, measured, beside
      the prompts' KV caches that sampling (policy) and scoring (reference) keep for it —
      which the sampling and scoring phases also hold from the moment they are kept.

    The measured forwards run on random token ids of those shapes; nothing is updated.
    """
    r, p, ac = cfg.rollout, cfg.ppo, cast.autocast
    dtype = autocast_dtype(cast.device, cfg.model.compute_dtype)
    if dtype is not None:  # the kept copies exist before any phase (cast_memory counts them)
        for model in cast.models().values():
            if isinstance(model, torch.nn.Module):
                weight_cast.make_copies(model, dtype)
    lm_cfg, itemsize = _lm_config(cast.policy), _itemsize(cast.policy)
    P, T, n = r.max_prompt_tokens, r.max_new_tokens, r.prompts_per_iteration
    kv_heads = getattr(lm_cfg, "num_key_value_heads", None) or lm_cfg.num_attention_heads
    head_dim = getattr(lm_cfg, "head_dim", None) or lm_cfg.hidden_size // lm_cfg.num_attention_heads
    positions = cache_positions(P, T, doubling=cfg.model.runtime == "native")
    kv = kv_cache_bytes(lm_cfg.num_hidden_layers, kv_heads, head_dim, n, positions, itemsize)

    def ids(batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        gen = torch.Generator().manual_seed(0)
        seqs = torch.randint(0, lm_cfg.vocab_size, (batch, P + T), generator=gen)
        return seqs.to(cast.device), torch.ones_like(seqs, device=cast.device)

    # measured at the configured shapes: refused first where the forward, extrapolated from
    # 1 and 2 answers, would not fit the memory free now (it would take the machine down)
    micro = p.micro_batch_size or n // p.minibatches
    refuse_unmeasurable(cast, cfg, ids, min(r.score_micro_batch, n), micro)
    seqs, mask = ids(min(r.score_micro_batch, n))
    b = len(seqs)  # random ids: b distinct prompts, the worst case of the probe
    mc = cfg.monitor
    probing = mc.enabled and mc.flattery_opener_ratio is not None and bool(mc.phrases)
    # the opener probe's prompt caches, kept by sampling (policy) and scoring (reference)
    kept = {"policy": 0, "reference": 0}
    if probing:
        kept = {role: n * per_prompt for role, per_prompt in _kept_per_prompt(cast, seqs[:, :P])}
    what = f"KV cache, {n} answers x {positions} positions"
    if probing:
        what += f" (+ {n} prompts' cache kept for the opener probe)"
    rows = [PhaseMemory("sampling", what, kv + kept["policy"], False)]

    with torch.no_grad():  # each model in its model.compute_dtype, as the run computes
        _, _, policy_peak = held_by(
            lambda: policy_outputs(
                cast.policy, seqs, mask, P, seqs[:, P:], r.temperature, True, autocast=ac
            )
        )
    caches = PromptCaches(r.score_micro_batch) if probing else None

    def reference_forward():
        out = causal_forward(cast.reference, seqs, mask, keep_last=T + 1, use_cache=probing)
        lp = A.logprobs_from_logits(out.logits[:, :T], seqs[:, P:], r.temperature)
        if caches is not None:  # as score_rollout keeps them (its last part: n − b before it)
            cache = getattr(out, cache_kwarg(cast.reference))
            caches.keep(cache, out.logits[:, 0], seqs[:, :P], mask[:, :P])
        return lp

    with torch.no_grad(), cast.reference_autocast():
        _, _, ref_peak = held_by(reference_forward)
    policy_peak += kept["policy"]
    ref_peak += kept["policy"] + kept["reference"] * (n - b) // n
    which = "policy" if policy_peak >= ref_peak else "reference"
    what = f"one no-grad forward, {which}, {b} x {P + T} tokens"
    if probing:
        what += " (+ prompt caches kept for the opener probe)"
    rows.append(PhaseMemory("scoring", what, max(policy_peak, ref_peak), True))

    accumulating = micro < n // p.minibatches  # gradient accumulation over micro-batches
    train_seqs, train_mask = ids(micro)
    tokens = f"{micro} x {P + T} tokens"
    critic = None
    if cast.critic is not None:
        critic = forward_backward_bytes(
            lambda: (answer_values(cast.critic_values, train_seqs, train_mask, T),),
            cast.critic,
            accumulating,
            ac,
        )
    # ppo.values_from_training_forward: step 2 runs the critic's first training forward on
    # the whole rollout and its graph stays until the first update, which backpropagates it
    # before the policy's forward (trainers.ppo_epochs.PPOUpdate.critic_forward_kept)
    kept_from_scoring = (
        critic is not None and p.values_from_training_forward and p.minibatches == 1 and micro >= n
    )

    if probing:
        # the probe's forward over one part's spellings, after that part's prompt cache
        # (made beforehand: it is among the kept caches), beside every kept cache; the
        # forward replaces the part's cache by a longer one, so its prompt-only keys and
        # values are gone by the probe's peak (its logits)
        prompts, prompt_mask = seqs[:, :P], mask[:, :P]
        peaks = []
        for model, autocast in (
            (cast.policy_lm, ac),
            (cast.reference, cast.reference_autocast),
        ):
            with torch.no_grad(), autocast():
                part, held, _ = held_by(
                    lambda m=model: list(prompt_prefixes(m, prompts, prompt_mask, b))
                )
                replaced = held - part[0].first_logits.untyped_storage().nbytes()
                args = (model, cast.tokenizer, prompts, prompt_mask, mc.phrases, r.temperature, b)
                probe = held_by(
                    lambda a=args, p=part: opener_logprobs(*a, mc.opener_tokens, prefixes=p)
                )
                peaks.append(probe[2] - replaced)
        what = (
            f"opener probe, {b} prompts x {len(mc.phrases)} phrases, 2 spellings each, "
            f"beside {n} prompts' caches of each model"
        )
        rows.append(PhaseMemory("monitor", what, max(peaks) + sum(kept.values()), True))
        if kept_from_scoring:  # the probe runs between steps 2 and 8
            what = f"+ beside the probe: the critic's graph kept from scoring, {tokens}"
            rows.append(PhaseMemory("monitor", what, critic[0], True))

    policy_kept, policy_peak = forward_backward_bytes(
        lambda: policy_outputs(
            cast.policy,
            train_seqs,
            train_mask,
            P,
            train_seqs[:, P:],
            r.temperature,
            with_entropy=p.entropy_coef > 0,
            shared=cast.shared,
            autocast=ac,
        ),
        cast.policy,
        accumulating,
    )
    what = f"policy{' + value head' if cast.shared else ''} forward+backward, {tokens}"
    what = f"{what} ({policy_kept / 2**20:.2f} kept)"
    # Gradients wait for the minibatch's end. A model's own appear during its backward as
    # its activations are freed, and are in its measured peak — unless micro-batches
    # accumulate, when they already exist. A separate critic's backward follows the
    # policy's, or precedes it where step 2 kept its graph.
    own = ("policy",) if accumulating else ()
    rows.append(
        PhaseMemory("training", what, policy_peak, True, own + ("critic",) * kept_from_scoring)
    )
    if critic is not None:
        what = f"critic forward+backward, {tokens} ({critic[0] / 2**20:.2f} kept)"
        grads = () if kept_from_scoring else ("policy",)
        grads += ("critic",) if accumulating else ()
        rows.append(PhaseMemory("critic", what, critic[1], True, grads))
    return rows


def _kept_per_prompt(cast, prompts: torch.Tensor) -> list[tuple[str, int]]:
    """Bytes per prompt of what the opener probe keeps of each model's forward over the
    prompts (b, P): the KV cache of the P positions and the logits that predict the
    answer's first token; measured on a forward of the built model, in its arithmetic."""
    out = []
    ones = torch.ones_like(prompts)
    for role, model, autocast in (
        ("policy", cast.policy_lm, cast.autocast),
        ("reference", cast.reference, cast.reference_autocast),
    ):
        with torch.no_grad(), autocast():
            part, held, _ = held_by(lambda m=model: list(prompt_prefixes(m, prompts, ones, 10**9)))
        out.append((role, held // len(prompts)))
        del part
    return out
