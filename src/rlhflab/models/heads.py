"""Value heads: a shared policy/value backbone, a separate critic's per-token values, and the
two ways a separate critic starts (from a causal LM with a zero head, or from the reward
model, head included)."""

from __future__ import annotations

import copy

import torch
from torch import nn

from rlhflab.models.forward import backbone_hidden
from rlhflab.models.loading import load_sequence_classifier
from rlhflab.models.precision import fp32_head
from rlhflab.models.prepare import ModelLoadError


class PolicyWithValueHead(nn.Module):
    """A causal LM plus a scalar value head on its last hidden state (shared backbone).

    One forward returns both logits and per-token values. The head is a Linear(H, 1)
    initialised to zero weight and bias (OAI19), so every value starts at 0 and the
    policy's outputs are exactly the plain model's.
    """

    def __init__(self, lm: nn.Module):
        super().__init__()
        self.lm = lm
        # as wide as what the output layer reads, which is not always config.hidden_size:
        # OPT-350m projects its 1024-wide hidden states to 512 before the vocabulary head
        head = lm.get_output_embeddings()
        if not isinstance(getattr(head, "weight", None), torch.Tensor) or head.weight.dim() != 2:
            raise ModelLoadError(
                f"model.value_model=shared: {type(lm).__name__} has no output layer whose input "
                "a value head could share; use model.value_model=separate"
            )
        hidden = head.weight.shape[1]
        self.value_head = nn.Linear(hidden, 1, dtype=lm.get_input_embeddings().weight.dtype)
        nn.init.zeros_(self.value_head.weight)
        nn.init.zeros_(self.value_head.bias)

    @property
    def config(self):
        return self.lm.config

    def forward(self, input_ids, attention_mask, keep_last: int = 0):
        """(logits (B, N, V), values (B, N)) for the last N = ``keep_last`` positions when
        > 0, else for all L."""
        hidden = backbone_hidden(self.lm, input_ids, attention_mask, keep_last)
        logits = self.lm.get_output_embeddings()(hidden)
        values = fp32_head(self.value_head, hidden).squeeze(-1).clone()  # not a view (FSDP2)
        return logits, values


class CriticValues(nn.Module):
    """A sequence-classification critic as a module whose forward gives per-token values,
    so DDP/FSDP see the training call go through ``forward``."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask, keep_last: int = 0):
        # a fresh tensor, not a view: FSDP2 hooks its backward onto the output
        return token_values(self.model, input_ids, attention_mask, keep_last).clone()


def token_values(critic, input_ids, attention_mask, keep_last: int = 0) -> torch.Tensor:
    """Per-token values (B, L) from a sequence-classification critic's ``score`` head; of the
    last ``keep_last`` positions only, (B, keep_last), when > 0 (see :func:`backbone_hidden`)."""
    hidden = backbone_hidden(critic, input_ids, attention_mask, keep_last)
    head = critic.score
    # a LoRA critic's frozen backbone may run in 16 bits while its trained head is fp32
    # (models.lora.lora_critic); a no-op where the dtypes agree
    return fp32_head(head, hidden.to(head.weight.dtype)).squeeze(-1).float()


def critic_from_causal_lm(
    path, tokenizer, trust_remote_code=False, runtime="transformers", field="model.critic"
):
    """A separate critic: the causal LM's backbone with a zero-initialised scalar head
    (``field``: the setting that named the folder, for errors)."""
    critic = load_sequence_classifier(
        path,
        tokenizer,
        trust_remote_code,
        num_labels=1,
        runtime=runtime,
        heads_reason=f"{field}: the critic starts from this folder with one value head; "
        "a reward model's folder goes in reward.model, with model.value_model=from_reward",
    )
    nn.init.zeros_(critic.score.weight)
    if critic.score.bias is not None:
        nn.init.zeros_(critic.score.bias)
    return critic


def critic_from_reward_model(reward_model, head_weights: torch.Tensor):
    """A critic initialised from the reward model, head included (N+, InstructGPT).

    A K-head reward model's heads are combined with the same weights as the reward itself:
    a weighted sum of linear heads is one linear head, so the critic starts out predicting
    exactly the combined score at every token.
    """
    # a trained model: fp32 master weights even where the reward model was loaded in 16 bits
    critic = copy.deepcopy(reward_model).to(torch.float32)
    old = critic.score
    head = nn.Linear(old.in_features, 1, bias=old.bias is not None, dtype=old.weight.dtype)
    with torch.no_grad():
        w = head_weights.to(old.weight.dtype)
        head.weight.copy_(w @ old.weight)
        if old.bias is not None:
            head.bias.copy_((w @ old.bias).reshape(1))
    critic.score = head
    critic.config.num_labels = 1
    critic.config.id2label, critic.config.label2id = {0: "value"}, {"value": 0}
    for p in critic.parameters():
        p.requires_grad_(True)
    return critic.train()
