"""The four-model cast of PPO for RLHF, built from the config.

policy (trained) · reference (frozen initial policy, for the KL penalty) · reward (scores a
finished answer) · critic (trained, for GAE). :func:`build_cast` applies every memory lever
the config asks for: shared policy/value backbone, a smaller critic, low-precision or int8
frozen models, CPU offload, LoRA with the adapter-disabled base as the reference, and a
critic trained through LoRA adapters on a frozen (possibly 16-bit) backbone.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass

import torch
from torch import nn

from rlhflab import models as M
from rlhflab.config import Config
from rlhflab.experience.ensemble import SCORE, EnsembleReward
from rlhflab.experience.rewards import (
    CompositeReward,
    FunctionReward,
    ModelReward,
    default_head_weights,
)
from rlhflab.infra.distributed import resolve_device
from rlhflab.models.build import (
    finish_models,
    load_model,
    load_tokenizer_for,
    prepare_trained,
    to_trained,
)

log = logging.getLogger(__name__)


@dataclass
class ModelCast:
    tokenizer: object
    policy: nn.Module  # a causal LM (maybe LoRA-wrapped) or PolicyWithValueHead when shared
    critic: nn.Module | None  # sequence-classification critic; None with a shared backbone
    reference: object  # callable like a causal LM; frozen
    reward: CompositeReward
    device: torch.device
    value_layout: str  # shared | separate | from_reward | none
    compute_dtype: str = "fp32"  # model.compute_dtype
    reference_precision: str = "fp32"  # model.reference_precision

    def __post_init__(self):
        # the critic's values come through a forward() so DDP/FSDP can wrap the call
        self.critic_values = M.CriticValues(self.critic) if self.critic is not None else None

    def autocast(self):
        """The context of the trained models' forwards (model.compute_dtype)."""
        return M.compute_autocast(self.device, self.compute_dtype)

    def reference_autocast(self):
        """The reference's (models.frozen_compute_dtype): the trained models' when its
        weights are fp32, none when they are bf16, fp16 or int8."""
        dtype = M.frozen_compute_dtype(self.compute_dtype, self.reference_precision)
        return M.compute_autocast(self.device, dtype)

    @property
    def policy_lm(self) -> nn.Module:
        """The causal LM inside the policy (for generation and saving)."""
        return self.policy.lm if isinstance(self.policy, M.PolicyWithValueHead) else self.policy

    @property
    def shared(self) -> bool:
        """Policy and value head share one backbone."""
        return isinstance(self.policy, M.PolicyWithValueHead)

    @property
    def has_values(self) -> bool:
        """False for critic-free trainers (GRPO, RLOO, DPO)."""
        return self.shared or self.critic is not None

    def models(self) -> dict[str, object]:
        out = {"policy": self.policy, "reference": self.reference}
        if self.critic is not None:
            out["critic"] = self.critic
        for source, _ in self.reward.sources:
            if isinstance(source, ModelReward):
                out["reward"] = source.model
            for i, member in enumerate(getattr(source, "members", ())):
                out[f"reward-{i}"] = member.model  # an ensemble's
        return out


_OPPOSITES = ({"negative", "positive"}, {"neg", "pos"}, {"bad", "good"}, {"no", "yes"})


def summed_classes_warning(names: list[str], heads: dict[str, float]) -> str | None:
    """What to say when ``reward.heads`` is unset and the model's heads look like the
    classes of a classifier (LABEL_0, LABEL_1; NEGATIVE and POSITIVE…) rather than rlhflab's
    reward heads: weighted 1 each, the reward is the sum of opposite classes' logits."""
    if heads or len(names) < 2:
        return None
    lowered = {n.lower() for n in names}
    generic = all(re.fullmatch(r"LABEL_\d+", n) for n in names)
    if not generic and not any(pair <= lowered for pair in _OPPOSITES):
        return None
    return (
        f"reward.heads is unset, so the reward model's heads {names} are summed with weight "
        "1 each: for a classifier's classes that sum says nothing of which answer is better; "
        f"name the weights, e.g. reward.heads={{{names[-1]}: 1.0}}"
    )


def _reward_sources(cfg: Config, tokenizer, device, rm=None, rm_tokenizer=None):
    sources = []
    if rm is not None:
        names = [rm.config.id2label[i] for i in range(rm.config.num_labels)]
        unknown = [h for h in cfg.reward.heads if h not in names]
        if unknown:
            raise M.ModelLoadError(f"reward.heads: {unknown} not among the model's heads {names}")
        heads = default_head_weights(names, cfg.reward.heads)
        said = summed_classes_warning(names, cfg.reward.heads)
        if said:
            log.warning(said)
        source = ModelReward(
            rm, rm_tokenizer, tokenizer, device=device, micro_batch=cfg.rollout.score_micro_batch
        )
        sources.append((source, {f"rm/{h}": w for h, w in heads.items()}))
    if cfg.reward.ensemble:
        sources.append((ensemble_source(cfg, tokenizer, device), {SCORE: 1.0}))
    for spec, weight in cfg.reward.functions.items():
        sources.append((FunctionReward(spec), weight))
    return sources


def ensemble_source(cfg: Config, tokenizer, device) -> EnsembleReward:
    """``reward.ensemble``'s members, each loaded and frozen as ``reward.model`` is (in
    model.reward_precision, offloaded with model.offload_frozen) and scored by a
    ModelReward of its own, combined by reward.ensemble_combine."""
    members, rw, mc = [], cfg.reward, cfg.model
    for i, folder in enumerate(rw.ensemble):
        field = f"reward.ensemble[{i}]"
        rm_tok = load_tokenizer_for(folder, mc, field)
        rm = load_model(
            folder,
            rm_tok,
            mc,
            "classifier",
            field=field,
            trained=False,
            precision=mc.reward_precision,
            trained_head_for=field,
        )
        rm = freeze_reward_model(rm, cfg, device, mc.offload_frozen)
        finish_models(mc, device, frozen=(rm,))
        micro = cfg.rollout.score_micro_batch
        members.append(ModelReward(rm, rm_tok, tokenizer, device, micro, name=f"rm{i}"))
    names = members[0].head_names
    unknown = [h for h in rw.heads if h not in names]
    if unknown:
        raise M.ModelLoadError(f"reward.heads: {unknown} not among the members' heads {names}")
    weights = default_head_weights(names, rw.heads)
    return EnsembleReward(members, weights, rw.ensemble_combine, rw.uwo_lambda)


def head_weight_vector(rm, heads: dict[str, float]) -> torch.Tensor:
    names = [rm.config.id2label[i] for i in range(rm.config.num_labels)]
    return torch.tensor(list(default_head_weights(names, heads).values()))


def load_policy_tokenizer(cfg: Config):
    """The policy's tokenizer alone: cheap, so that the data can be checked before any
    model is loaded."""
    return load_tokenizer_for(cfg.model.policy, cfg.model)


def load_reward_tokenizer(cfg: Config):
    """The tokenizer of ``reward.model``."""
    return load_tokenizer_for(cfg.reward.model, cfg.model, "reward.model")


def load_reward_model(cfg: Config, tokenizer, dtype: torch.dtype | None = None) -> nn.Module:
    """``reward.model`` as a finished reward model: refused without a trained ``score``
    head. ``dtype``: by default the float dtype of ``model.reward_precision`` (fp32 for
    int8, which quantises an fp32 model), whatever dtype the folder was saved in."""
    return load_model(
        cfg.reward.model,
        tokenizer,
        cfg.model,
        "classifier",
        field="reward.model",
        trained=False,
        precision=cfg.model.reward_precision,
        trained_head_for="reward.model",
        dtype=dtype,
    )


def freeze_reward_model(rm: nn.Module, cfg: Config, device, offload: bool) -> nn.Module:
    """The reward model frozen, in ``model.reward_precision``, on ``device`` (kept on the
    CPU between its forward passes with ``offload``)."""
    precision = cfg.model.reward_precision
    rm = M.freeze(M.set_precision(rm, precision, "cpu" if offload else device))
    if offload:
        return M.Offloaded(rm, device)
    return rm.to(device) if precision != "int8" else rm


def load_frozen_reward_model(cfg: Config, device, tokenizer=None) -> tuple[nn.Module, object]:
    """(frozen reward model, its tokenizer) of ``reward.model``, as the cast holds it
    (without offloading): for ``rlhflab rm --check`` and the evaluation helpers.
    ``tokenizer``: the reward tokenizer where the caller has already loaded it."""
    if tokenizer is None:
        tokenizer = load_reward_tokenizer(cfg)
    rm = load_reward_model(cfg, tokenizer)
    return freeze_reward_model(rm, cfg, torch.device(device), offload=False), tokenizer


def load_frozen_policy(cfg: Config, tokenizer, device="cpu") -> nn.Module:
    """``model.policy`` frozen in ``model.reference_precision``, as the cast's reference:
    the reference of the held-out evaluations (demo, compare)."""
    lm = load_model(cfg.model.policy, tokenizer, cfg.model, trained=False)
    return M.make_reference(lm, cfg.model.reference_precision, device=device)


def reference_low_dtype(cfg: Config) -> torch.dtype | None:
    """The 16-bit dtype to store an fp32 reference's Linear weights in
    (model.reference_low_weights), or None: compute in fp32, a 16-bit, int8 or LoRA
    reference, or one that fsdp will shard (its shards need one dtype)."""
    mc = cfg.model
    if not mc.reference_low_weights or mc.compute_dtype == "fp32" or mc.lora_r:
        return None
    if mc.reference_precision != "fp32":
        return None
    sharded = cfg.dist.strategy == "fsdp" and cfg.dist.shard_reference
    if sharded and torch.distributed.is_available() and torch.distributed.is_initialized():
        return None
    return M.PRECISION_DTYPES[mc.compute_dtype]


def build_cast(
    cfg: Config, device: torch.device | None = None, tokenizer=None, extra_rewards=()
) -> ModelCast:
    """Load the configured models; ``tokenizer``: the policy's, where the caller has
    already loaded it (``load_policy_tokenizer``). ``extra_rewards``: ``(source, weight)``
    pairs a Python caller brings beside the configured ones (e.g. a
    :class:`~rlhflab.experience.rewards.CallableReward` of a lambda, which no config can
    name)."""
    device = device or resolve_device(cfg.device)
    mc = cfg.model
    tokenizer = tokenizer or load_policy_tokenizer(cfg)
    lm = load_model(mc.policy, tokenizer, mc)

    rm_tokenizer = load_reward_tokenizer(cfg) if cfg.reward.model else None
    layout = mc.value_model
    if layout == "auto" and mc.lora_r > 0 and not mc.critic_lora_r:
        # a LoRA user trains adapters to save memory: a full critic (a copy of the model with
        # full AdamW moments) would cost more than the policy; a value head on the LoRA
        # policy's backbone trains the head alone beside the adapters (issue #26), unless
        # model.critic_lora_r asks for a critic of its own, trained through adapters too
        layout = "shared"
    elif layout == "auto":
        layout = (
            "from_reward"
            if rm_tokenizer is not None and M.same_tokenizer(rm_tokenizer, tokenizer)
            else "separate"
        )
    # Reward model first: a critic initialised from it is copied in fp32 (trained weights are
    # fp32 master weights) before the reward model is cast to its own precision.
    rm = None
    if cfg.reward.model:
        rm = load_reward_model(
            cfg, rm_tokenizer, torch.float32 if layout == "from_reward" else None
        )
    critic = None
    if layout == "none":
        pass
    elif layout == "from_reward":
        if not M.same_tokenizer(rm_tokenizer, tokenizer):
            raise M.ModelLoadError(
                "model.value_model: 'from_reward' needs the reward model to "
                "share the policy's tokenizer; use 'separate'"
            )
        critic = M.critic_from_reward_model(rm, head_weight_vector(rm, cfg.reward.heads))
        critic = prepare_trained(critic, mc)
    elif layout == "separate":
        spec, field = (mc.critic, "model.critic") if mc.critic else (mc.policy, "model.policy")
        if not M.same_tokenizer(load_tokenizer_for(spec, mc, field), tokenizer):
            raise M.ModelLoadError(
                f"model.critic: {spec} does not share the policy's "
                "tokenizer; the critic reads the policy's token ids"
            )
        critic = load_model(spec, tokenizer, mc, "critic", field=field)
    if critic is not None and mc.critic_lora_r > 0:
        # adapters and the whole head train; the backbone freezes in the reference's
        # precision where that is 16-bit (models.lora.lora_critic)
        critic = M.lora_critic(
            critic,
            mc.critic_lora_r,
            mc.lora_alpha,
            mc.lora_targets,
            mc.reference_precision,
            seed=cfg.seed + 1,  # not the policy's draws
        )

    if mc.lora_r > 0:
        lm = M.apply_lora(lm, mc.lora_r, mc.lora_alpha, mc.lora_targets, seed=cfg.seed)
    reference = M.make_reference(
        lm, mc.reference_precision, mc.offload_frozen, device, reference_low_dtype(cfg)
    )

    if rm is not None:
        rm = freeze_reward_model(rm, cfg, device, mc.offload_frozen)
    finish_models(mc, device, trained=(lm, critic), frozen=(reference, rm))
    policy = to_trained(
        M.PolicyWithValueHead(lm) if layout == "shared" else lm, device, "the policy"
    )
    if critic is not None:
        critic = to_trained(critic, device, "the critic")
    sources = _reward_sources(cfg, tokenizer, device, rm, rm_tokenizer) + list(extra_rewards)
    reward = CompositeReward(sources)
    log.info(
        "cast built: value layout %s%s, reference %s%s, device %s",
        layout,
        f" (LoRA r={mc.critic_lora_r})" if critic is not None and mc.critic_lora_r else "",
        mc.reference_precision,
        " (offloaded)" if mc.offload_frozen else "",
        device,
    )
    return ModelCast(
        tokenizer,
        policy,
        critic,
        reference,
        reward,
        device,
        layout,
        mc.compute_dtype,
        mc.reference_precision,
    )
