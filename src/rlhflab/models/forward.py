"""Every forward pass in rlhflab: explicit ``position_ids`` computed from the attention
mask, so left-padded generation and right-padded training see the same positions, and only
the rows a caller needs (``keep_last``)."""

from __future__ import annotations

import torch
from torch import nn


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions counting real tokens only, so left padding does not shift them."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def backbone_hidden(model, input_ids, attention_mask, keep_last: int = 0) -> torch.Tensor:
    """Last hidden states (B, L, H) of a CausalLM or SequenceClassification model's backbone;
    ``keep_last=N`` > 0: of the last N positions only, (B, min(N, L), H). The native runtime
    then runs its last layer on those rows only (``NativeLlamaModel.forward``); transformers'
    models compute every row and the rest are dropped."""
    if hasattr(model, "get_base_model"):  # a peft model: LoRA layers are injected in place
        model = model.get_base_model()
    kwargs = {}
    # the native runtime's backbone can run its last layer on the kept rows only; asked by
    # attribute so that importing this module does not import the native runtime
    native = getattr(model.base_model, "computes_last_rows_only", False)
    if native and keep_last:
        kwargs["keep_last"] = keep_last
    out = model.base_model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids_from_mask(attention_mask),
        use_cache=False,
        **kwargs,
    )
    hidden = out.last_hidden_state
    return hidden[:, -keep_last:] if keep_last and not native else hidden


def last_token_hidden(model, input_ids, attention_mask) -> torch.Tensor:
    """Hidden states (B, H) at each row's last real token (a reward model's pooling), with
    the backbone's last layer run from the leftmost of those positions on (one host sync
    to find it): answers forced to full length need that layer for one row each."""
    last = last_real_index(attention_mask)
    keep = input_ids.shape[1] - int(last.min())
    hidden = backbone_hidden(model, input_ids, attention_mask, keep_last=keep)
    rows = torch.arange(input_ids.shape[0], device=hidden.device)
    return hidden[rows, last - (input_ids.shape[1] - hidden.shape[1])]


def last_real_index(attention_mask: torch.Tensor) -> torch.Tensor:
    """(B, L) mask → (B,) index of the last 1 (works for left and right padding)."""
    pos = torch.arange(attention_mask.shape[1], device=attention_mask.device)
    return torch.where(attention_mask.bool(), pos, -1).max(dim=1).values


def causal_forward(model, input_ids, attention_mask, keep_last: int = 0, **kwargs):
    """One forward of a causal LM. ``keep_last=N`` computes logits for the last N positions
    only (``logits_to_keep``): PPO needs them for the answer, not the prompt, and the
    vocabulary projection of the prompt positions is pure waste (with a 150k vocabulary it
    is the biggest matmul of the model)."""
    if keep_last:
        kwargs["logits_to_keep"] = keep_last
    kwargs.setdefault("use_cache", False)  # a scoring/training pass has no use for a KV cache
    return model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids_from_mask(attention_mask),
        **kwargs,
    )


def _contiguous_input(module: nn.Module, args: tuple):
    x = args[0] if args else None
    if isinstance(x, torch.Tensor) and not x.is_contiguous():
        return (x.contiguous(), *args[1:])
    return None


def contiguous_head_input(model: nn.Module) -> bool:
    """Make the vocabulary projection of ``model`` see a contiguous input, in place (a
    forward pre-hook on its output embeddings; True when there is one to hook).

    Why: transformers' causal LMs apply the head to ``hidden[:, -N:]`` for
    ``logits_to_keep=N``, a strided view, and ``F.linear`` cannot fold a strided 3-D input
    into one matrix product: it runs a batched product against the weight expanded per row
    of the batch, re-reading the (V, H) weight once per sequence. Measured on SmolLM2-135M
    (49,152 × 576 head, 8 × 25 answer rows, 2 threads, 2026-12-06): forward 156 → 95 ms,
    backward 190 → 137 ms, the prefill's last position 41 → 20 ms; the copy is B·N·H floats.
    Logits and gradients agree with the strided product's up to float rounding (the logits
    of many rows were equal bit for bit in that measurement; tests/test_models.py). The
    native runtime needs no hook: its backbone already returns the kept rows only."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if not isinstance(head, nn.Module):
        return False
    head.register_forward_pre_hook(_contiguous_input)
    return True
