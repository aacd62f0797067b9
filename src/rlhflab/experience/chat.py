"""Chat rows (TRL's conversational format) rendered with the tokenizer's chat template.

A message list is a non-empty list of ``{role, content}`` strings. A data row holds one as
a prompt (PPO's ``prompt`` or ``messages``; the ``prompt`` of SFT, RM and DPO rows), as an
answer after such a prompt (SFT's ``completion``; ``chosen`` and ``rejected``), or as a
whole conversation whose last message is the assistant's answer (SFT's ``messages``;
``chosen`` and ``rejected`` of a pair without a ``prompt``, which share every message
before their answers). Every error names the row, the field and, where it is one message's
fault, that message (from 1).
"""

from __future__ import annotations

import json
import os

from rlhflab.experience.rows import DataError

MESSAGES = "a non-empty list of {role, content} messages"


def parse_json_messages(value, where: str, field: str):
    """``value``, or the JSON it holds when it is a string (a CSV cell holds JSON text)."""
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except json.JSONDecodeError:
        raise DataError(f"{where}: field '{field}' is not a JSON list of messages") from None


def message_list(value, where: str, field: str) -> list[dict]:
    """``value`` checked as a message list. Keys whose value is None are dropped: a datasets
    column of messages gives each message every key any message has (None where it had
    none), and a template that asks whether ``message.name`` is defined would print None."""
    if not isinstance(value, list) or not value:
        raise DataError(f"{where}: field '{field}' must be {MESSAGES}")
    out = []
    for i, m in enumerate(value, start=1):
        if not (
            isinstance(m, dict)
            and isinstance(m.get("role"), str)
            and isinstance(m.get("content"), str)
        ):
            raise DataError(
                f"{where}: field '{field}': message {i} is not a {{role, content}} pair of strings"
            )
        out.append({k: v for k, v in m.items() if v is not None})
    return out


def answer_messages(value, where: str, field: str) -> list[dict]:
    """An answer after a prompt: a string is the content of one assistant message; a message
    list must end with the assistant's message, whose content is not blank."""
    if isinstance(value, str):
        value = [{"role": "assistant", "content": value}]
    messages = message_list(value, where, field)
    _check_answer(messages, where, field)
    return messages


def split_conversation(messages: list[dict], where: str, field: str) -> list[dict]:
    """The prompt of a whole conversation: every message before the last, which must be the
    assistant's answer (a later message would otherwise be dropped unread)."""
    _check_answer(messages, where, field)
    if len(messages) < 2:
        raise DataError(f"{where}: field '{field}' has no message before the assistant's answer")
    return messages[:-1]


def shared_prompt(chosen: list[dict], rejected: list[dict], where: str) -> list[dict]:
    """The prompt of a pair given as two whole conversations: the messages before each final
    assistant answer, which must be the same in both."""
    prompt = split_conversation(chosen, where, "chosen")
    other = split_conversation(rejected, where, "rejected")
    for i, (a, b) in enumerate(zip(prompt, other), start=1):
        if a != b:
            raise DataError(
                f"{where}: fields 'chosen' and 'rejected' differ at message {i}: they must share "
                "every message before their final assistant answers"
            )
    if len(prompt) != len(other):
        raise DataError(
            f"{where}: fields 'chosen' and 'rejected' have {len(prompt)} and {len(other)} "
            "messages before their final assistant answers; they must share them all"
        )
    return prompt


def render_prompt(messages: list[dict], tokenizer, where: str, field: str) -> str:
    """The prompt as the policy sees it when it answers (``add_generation_prompt=True``)."""
    return _template(tokenizer, messages, where, field, generation=True)


def render_answers(
    prompt: list[dict],
    answers: list[list[dict]],
    tokenizer,
    where: str,
    fields: tuple[str, ...],
    prompt_field: str = "prompt",
) -> tuple[str, list[str]]:
    """The prompt's text and each answer's text, such that prompt + answer is exactly what
    the template renders for the whole conversation (prompt messages + answer messages).

    Why this cut: the answer trained on (SFT's response, DPO's log-probs, the reward
    model's input) must be what the model writes after the prompt it is given when it
    generates (rendered with ``add_generation_prompt=True``), and that includes the
    template's end-of-turn markup, so that the model learns to close its turn. The
    content alone would drop that markup; the answer message rendered alone would repeat
    the role header. So the whole conversation is rendered once and cut where the
    generation prompt ends. Most templates render the generation prompt as a prefix of
    the whole conversation; a few do not (DeepSeek-R1's adds ``<think>`` to the generation
    prompt only): then the cut falls at the longest prefix the generation prompt shares
    with every answer's rendering, so that prompt + answer still equals the whole (TRL
    cuts there too). ``fields`` names each answer's field, ``prompt_field`` the prompt's
    (errors name them); the caller adds EOS after the answer, as for plain strings — so
    where the template closes the turn with the EOS token itself (ChatML's ``<|im_end|>`` in
    SmolLM2 and Qwen), that token and what follows it are cut off here: the answer ends
    with one EOS, as a PPO rollout's does, not with the template's EOS, a newline and
    another EOS, a position no rollout produces.
    """
    head = render_prompt(prompt, tokenizer, where, prompt_field)
    wholes = [
        _template(tokenizer, prompt + a, where, f, generation=False)
        for a, f in zip(answers, fields)
    ]
    cut = len(os.path.commonprefix([head, *wholes]))
    texts = [_without_final_eos(w[cut:], tokenizer.eos_token) for w in wholes]
    for text, f in zip(texts, fields):
        if not text.strip():
            raise DataError(
                f"{where}: field '{f}': the chat template renders the answer as nothing"
            )
    return head[:cut], texts


def _without_final_eos(text: str, eos: str | None) -> str:
    """``text`` without a final EOS token (and the whitespace the template puts after it)."""
    stripped = text.rstrip()
    if eos and stripped.endswith(eos):
        return stripped[: -len(eos)]
    return text


def _check_answer(messages: list[dict], where: str, field: str) -> None:
    last = messages[-1]
    if last["role"] != "assistant":
        raise DataError(
            f"{where}: field '{field}': the last message must be the assistant's answer "
            f"(message {len(messages)} is {last['role']!r})"
        )
    if not last["content"].strip():
        raise DataError(f"{where}: field '{field}': the assistant's answer is empty")


def _template(tokenizer, messages: list[dict], where: str, field: str, generation: bool) -> str:
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise DataError(
            f"{where}: field '{field}' holds chat messages, which need a tokenizer with a "
            "chat template"
        )
    template = tokenizer.chat_template  # a str, or a dict of named templates
    text = " ".join(map(str, template.values())) if isinstance(template, dict) else str(template)
    _check_roles(messages, text, where, field)
    try:
        return tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=generation
        )
    except Exception as exc:  # the template is the model's own Jinja code: any error can come
        raise DataError(
            f"{where}: field '{field}': the chat template failed ({type(exc).__name__}: {exc})"
        ) from None


# the roles chat templates are written for; ChatML-style templates print any role as a
# header, so a misspelt one ('usr') became a turn of nobody's, silently
KNOWN_ROLES = ("system", "user", "assistant", "tool", "developer", "function", "ipython")


def _check_roles(messages: list[dict], template: str, where: str, field: str) -> None:
    """Each message's role is a known one or a role the template itself names in quotes
    (Gemma's 'model', say)."""
    for i, m in enumerate(messages, start=1):
        role = m["role"]
        if role in KNOWN_ROLES or f"'{role}'" in template or f'"{role}"' in template:
            continue
        raise DataError(
            f"{where}: field '{field}': message {i}'s role {role!r} is none of "
            f"{', '.join(KNOWN_ROLES)}, nor one the chat template names"
        )
