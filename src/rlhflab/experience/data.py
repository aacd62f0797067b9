"""Prompt, SFT and preference rows, as plain strings or chat messages, from any source.

Sources (:mod:`rlhflab.experience.rows`): JSONL, CSV and Parquet files, ``save_to_disk``
folders, ``datasets.Dataset``/``DatasetDict`` objects and lists of dicts. Chat messages
(:mod:`rlhflab.experience.chat`) are rendered with the tokenizer's chat template:

- a prompt row holds ``prompt``: a string or a message list, or ``messages`` (a list);
- an SFT row holds ``prompt`` and ``completion`` (or ``response``): two strings, or a
  message list and an answer (a message list or the assistant's string); or ``messages``,
  a whole conversation whose last message is the assistant's answer;
- a preference row holds ``prompt``, ``chosen`` and ``rejected``: three strings, or a
  message list and two answers; or only ``chosen`` and ``rejected``, two whole
  conversations that share every message before their final answers.

A malformed row, a missing field, an empty prompt or one longer than the prompt limit is a
:class:`DataError` naming the source, the row and the field — or, for prompts with
``data.on_bad_row='skip'``, dropped and counted (prompt, SFT and preference rows alike).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field

from rlhflab.experience import chat
from rlhflab.experience.rows import (  # noqa: F401  (re-exported: the names callers import)
    DataError,
    Rows,
    iter_rows,
    open_rows,
    source_name,
    unclosed_quote_line,
)
from rlhflab.models.text import encode_prompt

log = logging.getLogger(__name__)


@dataclass
class LoadReport:
    rows: int = 0
    skipped: int = 0
    reasons: list[str] = field(default_factory=list)


class BadRows:
    """``data.on_bad_row`` over one source: 'error' raises a bad row's DataError, 'skip'
    counts it into ``report`` and :meth:`say` names how many went and the first."""

    def __init__(self, on_bad_row: str, report: LoadReport | None = None):
        self.on_bad_row, self.report = on_bad_row, report or LoadReport()

    def bad(self, exc: DataError) -> None:
        if self.on_bad_row == "error":
            raise exc
        self.report.skipped += 1
        self.report.reasons.append(str(exc))

    def say(self, name: str) -> None:
        n = self.report.skipped
        if n:
            first = self.report.reasons[0]
            log.warning("%s: skipped %d bad row%s (first: %s)", name, n, "s" * (n > 1), first)


def load_prompts(
    source,
    tokenizer,
    max_tokens: int,
    prompt_field="prompt",
    messages_field="messages",
    on_bad_row="error",
    split="train",
) -> tuple[list[str], LoadReport]:
    """Read prompts; each must be non-empty and at most ``max_tokens`` tokens long.
    ``split``: the part of a DatasetDict to read (``data.split``)."""
    prompts, report = [], LoadReport()
    skip = BadRows(on_bad_row, report)
    rows = open_rows(source, split)
    both = 0  # rows with both fields (many Hub prompt sets): the prompt field is read
    answered = []  # rows whose messages end with the assistant's turn (an SFT conversation)
    for n, row in rows:
        try:
            if isinstance(row, DataError):
                raise row
            both += row.get(prompt_field) not in (None, "") and bool(row.get(messages_field))
            prompts.append(
                _prompt_from_row(
                    row, tokenizer, max_tokens, rows.where(n), prompt_field, messages_field
                )
            )
            report.rows += 1
            if _ends_answered(row, prompt_field, messages_field):
                answered.append(rows.where(n))
        except DataError as exc:
            skip.bad(exc)
    if both:
        log.warning(
            "%s: %d row%s both '%s' and '%s'; '%s' is read (data.prompt_field / "
            "data.messages_field name the fields)",
            rows.name, both, "s hold" if both > 1 else " holds", prompt_field, messages_field,
            prompt_field,
        )  # fmt: skip
    if answered:
        log.warning(
            "%s: %d prompt%s end%s with the assistant's turn (first: %s): the policy answers "
            "after that answer; a prompt's messages end with the user's turn",
            rows.name, len(answered), "s" * (len(answered) > 1), "s" * (len(answered) == 1),
            answered[0],
        )  # fmt: skip
    skip.say(rows.name)
    if not prompts:
        raise DataError(f"{rows.name}: no usable prompt rows")
    return prompts, report


def _ends_answered(row: dict, prompt_field: str, messages_field: str) -> bool:
    """Whether the row's prompt messages (read as :func:`_prompt_from_row` reads them) end
    with an assistant turn."""
    value = row.get(prompt_field)
    if value in (None, ""):
        value = row.get(messages_field)
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError:
                return False
    last = value[-1] if isinstance(value, list) and value else None
    return isinstance(last, dict) and last.get("role") == "assistant"


def _prompt_from_row(row: dict, tokenizer, max_tokens, where, prompt_field, messages_field) -> str:
    if row.get(prompt_field) not in (None, ""):
        name, text = prompt_field, row[prompt_field]
        if isinstance(text, list):
            text = chat.render_prompt(chat.message_list(text, where, name), tokenizer, where, name)
        elif not isinstance(text, str):
            raise DataError(
                f"{where}: field '{name}' must be a string or {chat.MESSAGES}, "
                f"got {type(text).__name__}"
            )
    elif row.get(messages_field) not in (None, ""):
        name = messages_field
        messages = chat.parse_json_messages(row[name], where, name)
        text = chat.render_prompt(chat.message_list(messages, where, name), tokenizer, where, name)
    elif prompt_field in row or messages_field in row:
        raise DataError(f"{where}: field '{prompt_field}' is empty")
    else:
        raise DataError(f"{where}: missing field '{prompt_field}' (or '{messages_field}')")
    if not text.strip():
        raise DataError(f"{where}: field '{name}' is empty")
    n_tokens = len(encode_prompt(tokenizer, text))
    if n_tokens > max_tokens:
        raise DataError(
            f"{where}: field '{name}' is {n_tokens} tokens, over the limit of "
            f"{max_tokens} (rollout.max_prompt_tokens)"
        )
    return text


def sft_answer_field(row: dict) -> str:
    """The field an SFT row's answer came from (for messages naming it)."""
    if row.get("prompt") in (None, "") and row.get("messages") not in (None, ""):
        return "messages"
    return "completion" if row.get("completion") is not None else "response"


def sft_pair(row: dict, tokenizer, where: str) -> tuple[str, str]:
    """(prompt, response) of an SFT row: ``prompt`` with ``completion`` or ``response``, or a
    whole conversation in ``messages`` (see :func:`chat.render_answers` for the cut)."""
    key = sft_answer_field(row)
    if key == "messages":
        messages = chat.parse_json_messages(row["messages"], where, "messages")
        messages = chat.message_list(messages, where, "messages")
        prompt = chat.split_conversation(messages, where, "messages")
        text, (response,) = chat.render_answers(
            prompt, [messages[-1:]], tokenizer, where, ("messages",), "messages"
        )
        return text, response
    if row.get("completion") is not None and row.get("response") is not None:
        raise DataError(f"{where}: fields 'completion' and 'response' are both set; keep one")
    prompt, answer = row.get("prompt"), row.get(key)
    if isinstance(prompt, list):
        if answer is None:
            raise DataError(f"{where}: missing field 'completion' (or 'response')")
        prompt = chat.message_list(prompt, where, "prompt")
        answer = chat.answer_messages(answer, where, key)
        text, (response,) = chat.render_answers(prompt, [answer], tokenizer, where, (key,))
        return text, response
    if prompt is None and "prompt" not in row:
        if "messages" in row:  # present, but None or ""
            raise DataError(f"{where}: field 'messages' is empty")
        raise DataError(f"{where}: missing field 'prompt' (or 'messages')")
    if answer is None and key not in row:
        raise DataError(f"{where}: missing field 'completion' (or 'response')")
    for name, value in (("prompt", prompt), (key, answer)):
        if isinstance(value, list):
            raise DataError(
                f"{where}: field '{name}' is a message list but field 'prompt' is a string: "
                "give the prompt as messages too"
            )
        if not isinstance(value, str) or not value.strip():
            raise DataError(f"{where}: field '{name}' must be a non-empty string")
    return prompt, answer


@dataclass
class PreferencePair:
    prompt: str
    chosen: str
    rejected: str
    labels: dict = field(default_factory=dict)  # optional per-attribute labels in [0, 1]
    # whether each answer ended with EOS: every answer of a preference file did; a policy's
    # answer cut off at max_new_tokens (a reward-model refresh's) did not, and is encoded
    # without one, as PPO scores it (rewards.encode_for_reward)
    chosen_ended: bool = True
    rejected_ended: bool = True


def check_fits(tokenizer, limit: int | None, where: str, prompt: str, answers: dict) -> None:
    """A training sequence — prompt, answer (each encoded on its own, as the trainers do)
    and the EOS — must fit the model's ``limit`` positions (None: no limit known): the
    first answer (name → text) that does not is a DataError naming ``where`` and the field."""
    if limit is None:
        return
    n_prompt = len(encode_prompt(tokenizer, prompt))
    for name, answer in answers.items():
        n = n_prompt + len(tokenizer(answer, add_special_tokens=False)["input_ids"]) + 1
        if n > limit:
            raise DataError(
                f"{where}: prompt + '{name}' + EOS is {n} tokens, over the {limit} positions "
                "of the model (the position limit of its config.json): a shorter row "
                "or a model with more positions"
            )


def check_pairs_fit(tokenizer, limit: int | None, pairs: list, what: str) -> None:
    """:func:`check_fits` over pairs made in code (the built-in task's), named ``what``
    and their number."""
    for i, p in enumerate(pairs):
        answers = {"chosen": p.chosen, "rejected": p.rejected}
        check_fits(tokenizer, limit, f"{what} {i + 1}", p.prompt, answers)


def load_preferences(
    source, tokenizer=None, split="train", max_tokens: int | None = None, on_bad_row="error"
) -> list[PreferencePair]:
    """Preference pairs: ``prompt``, ``chosen`` and ``rejected`` as strings or chat messages
    (rendered with ``tokenizer``'s chat template), and optional ``labels``: attribute → 1
    if chosen is better, 0 if worse, 0.5 for a tie. ``split``: a DatasetDict's part.
    ``max_tokens``: the model's positions, which prompt + answer + EOS must fit
    (:func:`check_fits`; None: unchecked). ``on_bad_row``: as ``data.on_bad_row``."""
    pairs, skip = [], BadRows(on_bad_row)
    rows = open_rows(source, split)
    for n, row in rows:
        try:
            if isinstance(row, DataError):
                raise row
            pair = preference_pair(row, tokenizer, rows.where(n))
            if pair.chosen == pair.rejected:  # its loss would be a constant: nothing learnt
                raise DataError(f"{rows.where(n)}: 'chosen' and 'rejected' are the same answer")
            answers = {"chosen": pair.chosen, "rejected": pair.rejected}
            check_fits(tokenizer, max_tokens, rows.where(n), pair.prompt, answers)
            pairs.append(pair)
        except DataError as exc:
            skip.bad(exc)
    skip.say(rows.name)
    if not pairs:
        raise DataError(f"{rows.name}: no preference pairs")
    return pairs


def preference_pair(row: dict, tokenizer, where: str) -> PreferencePair:
    """One row as a pair; a message-list prompt or answer is rendered with the template."""
    if row.get("prompt") is None and isinstance(row.get("chosen"), list):
        # the implicit prompt: two whole conversations sharing every message before the answer
        if "rejected" not in row:
            raise DataError(f"{where}: missing field 'rejected'")
        chosen = chat.message_list(row["chosen"], where, "chosen")
        rejected = chat.message_list(row["rejected"], where, "rejected")
        prompt, prompt_field = chat.shared_prompt(chosen, rejected, where), "chosen"
        answers = [chosen[-1:], rejected[-1:]]
    else:
        for key in ("prompt", "chosen", "rejected"):
            if key not in row:
                raise DataError(f"{where}: missing field '{key}'")
        if not isinstance(row["prompt"], list):
            return PreferencePair(*_plain_pair(row, where), _labels(row, where))
        prompt, prompt_field = chat.message_list(row["prompt"], where, "prompt"), "prompt"
        answers = [chat.answer_messages(row[k], where, k) for k in ("chosen", "rejected")]
    text, (chosen, rejected) = chat.render_answers(
        prompt, answers, tokenizer, where, ("chosen", "rejected"), prompt_field
    )
    return PreferencePair(text, chosen, rejected, _labels(row, where))


def _plain_pair(row: dict, where: str) -> tuple[str, str, str]:
    for key in ("prompt", "chosen", "rejected"):
        value = row[key]
        if isinstance(value, list):
            raise DataError(
                f"{where}: field '{key}' is a message list but field 'prompt' is a string: "
                "give the prompt as messages too"
            )
        if not isinstance(value, str) or (key != "prompt" and not value.strip()):
            raise DataError(f"{where}: field '{key}' must be a non-empty string")
    return row["prompt"], row["chosen"], row["rejected"]


def _labels(row: dict, where: str) -> dict:
    labels = row.get("labels")
    if labels is None or labels == "":  # absent, or an empty CSV cell
        return {}
    if isinstance(labels, str):  # CSV cells hold JSON text
        try:
            labels = json.loads(labels)
        except json.JSONDecodeError:
            raise DataError(
                f"{where}: field 'labels' is not JSON (got {labels[:80]!r}); give an object of "
                'attributes to numbers in [0, 1], e.g. {"helpful": 1}'
            ) from None
    if isinstance(labels, dict):  # a struct column gives every row every key: None = unlabelled
        labels = {k: v for k, v in labels.items() if v is not None}
    # a bool is an int to Python, but true/false is no preference strength: said, not read
    if not isinstance(labels, dict) or not all(
        isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v <= 1
        for v in labels.values()
    ):
        raise DataError(
            f"{where}: field 'labels' must map attributes to numbers in [0, 1] "
            f"(1: chosen is better, 0: worse, 0.5: a tie), got {labels!r}"
        )
    return labels


class PromptStream:
    """Deterministic batches of prompts: a fresh permutation per pass over the data.

    The permutation of pass ``e`` comes from seed + e, so the state is just (pass, offset)
    and resuming needs no generator state.
    """

    def __init__(self, prompts: list[str], batch_size: int, seed: int):
        import torch

        self._torch = torch
        self.prompts, self.batch_size, self.seed = prompts, batch_size, seed
        self.epoch, self.offset = 0, 0
        self._order = self._permutation()

    def _permutation(self) -> list[int]:
        g = self._torch.Generator().manual_seed(self.seed + 7919 * self.epoch)
        return self._torch.randperm(len(self.prompts), generator=g).tolist()

    def next_batch(self) -> list[str]:
        out = []
        while len(out) < self.batch_size:
            if self.offset >= len(self._order):
                self.epoch, self.offset = self.epoch + 1, 0
                self._order = self._permutation()
            take = self._order[self.offset : self.offset + self.batch_size - len(out)]
            out += [self.prompts[i] for i in take]
            self.offset += len(take)
        return out

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "offset": self.offset}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.offset = int(state["epoch"]), int(state["offset"])
        self._order = self._permutation()
