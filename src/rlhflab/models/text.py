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

import json
import logging
from pathlib import Path

log = logging.getLogger(__name__)

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


def record_stop_ids(tokenizer, folder: Path) -> None:
    """Note on ``tokenizer`` the tokens that end an answer: its EOS, and every id of the
    folder's ``generation_config.json`` ``eos_token_id`` (an int or a list), as ``generate``
    stops on them. Chat checkpoints end a turn with a token that is not the tokenizer's EOS
    (Gemma 2's ``<end_of_turn>``, Phi-3's ``<|end|>``, Llama 3's ``<|eot_id|>`` in some
    releases): stopping at EOS alone ran every answer to ``max_new_tokens`` into a made-up
    next turn, each one penalised as unfinished."""
    ids = [tokenizer.eos_token_id]
    path = folder / "generation_config.json"
    adapter = folder / "adapter_config.json"
    if not path.is_file() and adapter.is_file():  # a LoRA folder: its base model's file
        try:
            base = json.loads(adapter.read_text()).get("base_model_name_or_path")
        except (OSError, ValueError, AttributeError):
            base = None
        if isinstance(base, str) and base:
            path = Path(base).expanduser() / "generation_config.json"
    if path.is_file():
        try:
            listed = json.loads(path.read_text()).get("eos_token_id")
        except (OSError, ValueError, AttributeError) as exc:
            log.warning("%s: unreadable (%s); answers end at EOS only", path, exc)
            listed = None
        listed = listed if isinstance(listed, list) else [listed]
        size = len(tokenizer)
        bad = [t for t in listed if t is not None and not (isinstance(t, int) and 0 <= t < size)]
        if bad:
            log.warning(
                "%s: eos_token_id %s are no token ids of the tokenizer; left out", path, bad
            )
        ids += [t for t in listed if t not in bad and t is not None and t not in ids]
    tokenizer.__dict__["_rlhflab_stop_ids"] = tuple(ids)
    if len(ids) > 1:
        names = ", ".join(repr(tokenizer.convert_ids_to_tokens(t)) for t in ids)
        log.info("answers end at any of %s (%s's generation_config.json)", names, folder.name)


def stop_ids(tokenizer) -> tuple[int, ...]:
    """The ids that end an answer (:func:`record_stop_ids`; a tokenizer rlhflab did not
    load from a folder: its EOS)."""
    return tokenizer.__dict__.get("_rlhflab_stop_ids") or (tokenizer.eos_token_id,)
