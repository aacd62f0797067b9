"""Text to token ids as the model expects it: a prompt begins with the special tokens its
tokenizer puts before every text (Llama 2's, Mistral's, Gemma's and Llama 3's BOS).

rlhflab encodes a prompt and its answer each on their own with
``add_special_tokens=False`` (their token boundary then stays where sampling puts it), so
the tokenizer's own BOS would be lost: ``tokenizer(text)`` and ``generate`` see it, a
policy trained or scored without it sees other inputs than at serving time, and a reward
model trained elsewhere would score texts it never saw. A prompt that already begins with
those tokens (a chat template that writes ``{{ bos_token }}``) gets none again.
"""

from __future__ import annotations

_PROBE = "Hello world"


def leading_special_ids(tokenizer) -> list[int]:
    """The special tokens ``tokenizer`` puts before a text by default: [BOS] or [] (the
    presets', SmolLM2's, GPT-2's and Qwen2's tokenizers add none). Trailing ones (a
    tokenizer that ends every text with EOS) are not a prompt's: left out."""
    cached = tokenizer.__dict__.get("_rlhflab_leading")
    if cached is not None:
        return list(cached)
    plain = tokenizer(_PROBE, add_special_tokens=False)["input_ids"]
    full = tokenizer(_PROBE)["input_ids"]
    special = set(tokenizer.all_special_ids)
    lead: list[int] = []
    for k in range(len(full) - len(plain) + 1):  # where the plain ids sit inside the full
        if full[k : k + len(plain)] == plain:
            lead = list(full[:k]) if all(t in special for t in full[:k]) else []
            break
    tokenizer.__dict__["_rlhflab_leading"] = tuple(lead)
    return lead


def encode_prompt(tokenizer, text: str) -> list[int]:
    """``text``'s ids with the tokenizer's leading special tokens, unless it begins with
    them already (a chat template wrote them)."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    lead = leading_special_ids(tokenizer)
    if lead and ids[: len(lead)] != lead:
        return lead + ids
    return ids
