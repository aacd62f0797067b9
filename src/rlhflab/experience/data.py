"""Prompt and preference data from JSONL, Parquet or CSV, with errors that name file, line, field.

A prompt row holds a ``prompt`` string or chat ``messages`` (a list of {role, content}),
rendered with the tokenizer's chat template. A malformed row, a missing field, an empty
prompt or one longer than the prompt limit is a :class:`DataError` naming the file, the line
and the field — or, with ``on_bad_row='skip'``, dropped and counted.
"""

from __future__ import annotations

import csv
import io
import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)


class DataError(ValueError):
    """Bad input data; the message names the file, line and field."""


def iter_rows(path: str | Path) -> Iterator[tuple[int, dict | DataError]]:
    """(line number, row) pairs. JSONL lines and CSV rows are numbered as a text editor shows
    them (CSV: the header is line 1); Parquet rows from 1. A JSONL line that cannot be read
    (not UTF-8, not JSON, not an object) comes as a :class:`DataError` in place of its row,
    so that ``on_bad_row='skip'`` can drop it; a file that cannot be read at all raises."""
    path = Path(path)
    if not path.exists():
        raise DataError(f"{path}: no such file")
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".json"):
        yield from _jsonl_rows(path)
    elif suffix == ".csv":
        yield from _csv_rows(path)
    elif suffix == ".parquet":
        yield from _parquet_rows(path)
    else:
        raise DataError(f"{path}: unsupported file type {suffix!r}; use .jsonl, .csv or .parquet")


def _utf8_error(path: Path, line: int, exc: UnicodeDecodeError, line_start: int = 0) -> DataError:
    """``exc.start`` is a byte offset into the decoded bytes; ``line_start`` that of the line."""
    column = exc.start - line_start + 1
    return DataError(
        f"{path}:{line}: not valid UTF-8 (byte 0x{exc.object[exc.start]:02x} at column {column})"
    )


def _jsonl_rows(path: Path) -> Iterator[tuple[int, dict | DataError]]:
    # read as bytes and decode line by line: a bad byte then names its line, and only that
    # line is lost (a text-mode file raises from inside the iteration, with no line number)
    with path.open("rb") as f:
        for n, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                yield n, _utf8_error(path, n, exc)
                continue
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                yield n, DataError(f"{path}:{n}: not valid JSON ({exc.msg})")
                continue
            if not isinstance(row, dict):
                row = DataError(f"{path}:{n}: expected a JSON object, got {type(row).__name__}")
            yield n, row


def _csv_rows(path: Path) -> Iterator[tuple[int, dict]]:
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        start = raw.rfind(b"\n", 0, exc.start) + 1
        raise _utf8_error(path, raw.count(b"\n", 0, exc.start) + 1, exc, start) from None
    # The csv module reads a quote that never closes as one field running to the end of
    # the file: every later row would silently become part of one long prompt.
    opened = unclosed_quote_line(text)
    if opened is not None:
        raise DataError(
            f"{path}:{opened}: a quote opened here is never closed (the rest of the file "
            "would be read as one field)"
        )
    reader = csv.DictReader(io.StringIO(text, newline=""))
    try:
        for row in reader:
            yield reader.line_num, row
    except csv.Error as exc:  # e.g. a NUL byte, a field over the size limit
        raise DataError(f"{path}:{reader.line_num}: not valid CSV ({exc})") from None


def unclosed_quote_line(text: str, delimiter: str = ",", quote: str = '"') -> int | None:
    """The line (1-based) where a quoted CSV field opens that never closes, or None.

    Follows the csv module's default dialect: a quote opens a quoted field only at the start
    of a field; inside one, a doubled quote is a literal quote and any other quote closes it.
    """
    line, opened_at, state = 1, 0, "start"  # start | plain | quoted | quote_in_quoted
    for ch in text:
        if state == "quoted":
            if ch == quote:
                state = "quote_in_quoted"
        elif state == "quote_in_quoted" and ch == quote:
            state = "quoted"  # a doubled quote: a literal quote, still inside the field
        elif ch in (delimiter, "\n"):
            state = "start"
        elif ch == quote and state == "start":
            state, opened_at = "quoted", line
        else:
            state = "plain"  # after a closing quote, the csv module reads on as plain text
        if ch == "\n":
            line += 1
    return opened_at if state == "quoted" else None


def _parquet_rows(path: Path) -> Iterator[tuple[int, dict | DataError]]:
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(
            f"{path}: reading Parquet needs pyarrow (pip install 'rlhflab[data]')"
        ) from None
    try:
        table = pq.read_table(path)
    except (pa.ArrowException, OSError) as exc:
        raise DataError(f"{path}: not a readable Parquet file ({exc})") from None
    n = 0
    for batch in table.to_batches(max_chunksize=1024):
        try:
            rows = batch.to_pylist()
        except UnicodeDecodeError:
            rows = None  # a string that is not UTF-8 somewhere in this batch: find it
        for i in range(batch.num_rows):
            n += 1
            yield n, rows[i] if rows is not None else _parquet_row(path, batch, i, n)


def _parquet_row(path: Path, batch, i: int, n: int) -> dict | DataError:
    row = {}
    for name, column in zip(batch.schema.names, batch.columns):
        try:
            row[name] = column[i].as_py()
        except UnicodeDecodeError:
            return DataError(f"{path}:{n}: not valid UTF-8 in field '{name}'")
    return row


@dataclass
class LoadReport:
    rows: int = 0
    skipped: int = 0
    reasons: list[str] = field(default_factory=list)


def _render_messages(messages, tokenizer, where: str) -> str:
    if isinstance(messages, str):  # CSV cells hold JSON text
        try:
            messages = json.loads(messages)
        except json.JSONDecodeError:
            raise DataError(f"{where}: not a JSON list of messages") from None
    if (
        not isinstance(messages, list)
        or not messages
        or not all(
            isinstance(m, dict)
            and isinstance(m.get("role"), str)
            and isinstance(m.get("content"), str)
            for m in messages
        )
    ):
        raise DataError(f"{where}: expected a non-empty list of {{role, content}} strings")
    if not getattr(tokenizer, "chat_template", None):
        raise DataError(f"{where}: chat messages need a tokenizer with a chat template")
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def load_prompts(
    path,
    tokenizer,
    max_tokens: int,
    prompt_field="prompt",
    messages_field="messages",
    on_bad_row="error",
) -> tuple[list[str], LoadReport]:
    """Read prompts; each must be non-empty and at most ``max_tokens`` tokens long."""
    prompts, report = [], LoadReport()
    for n, row in iter_rows(path):
        try:
            if isinstance(row, DataError):
                raise row
            prompts.append(
                _prompt_from_row(
                    row, tokenizer, max_tokens, f"{path}:{n}", prompt_field, messages_field
                )
            )
            report.rows += 1
        except DataError as exc:
            if on_bad_row == "error":
                raise
            report.skipped += 1
            report.reasons.append(str(exc))
    if report.skipped:
        log.warning("%s: skipped %d bad rows (first: %s)", path, report.skipped, report.reasons[0])
    if not prompts:
        raise DataError(f"{path}: no usable prompt rows")
    return prompts, report


def _prompt_from_row(row: dict, tokenizer, max_tokens, where, prompt_field, messages_field) -> str:
    if row.get(prompt_field) not in (None, ""):
        text = row[prompt_field]
        if not isinstance(text, str):
            raise DataError(
                f"{where}: field '{prompt_field}' must be a string, got {type(text).__name__}"
            )
        name = prompt_field
    elif row.get(messages_field) not in (None, ""):
        name = messages_field
        text = _render_messages(row[messages_field], tokenizer, f"{where}: field '{name}'")
    elif prompt_field in row or messages_field in row:
        raise DataError(f"{where}: field '{prompt_field}' is empty")
    else:
        raise DataError(f"{where}: missing field '{prompt_field}' (or '{messages_field}')")
    if not text.strip():
        raise DataError(f"{where}: field '{name}' is empty")
    n_tokens = len(tokenizer(text, add_special_tokens=False)["input_ids"])
    if n_tokens > max_tokens:
        raise DataError(
            f"{where}: field '{name}' is {n_tokens} tokens, over the limit of "
            f"{max_tokens} (rollout.max_prompt_tokens)"
        )
    return text


@dataclass
class PreferencePair:
    prompt: str
    chosen: str
    rejected: str
    labels: dict = field(default_factory=dict)  # optional per-attribute labels in [0, 1]


def load_preferences(path) -> list[PreferencePair]:
    """Preference pairs with string fields ``prompt``, ``chosen``, ``rejected`` (and optional
    ``labels``: attribute → 1 if chosen is better, 0 if worse, 0.5 for a tie)."""
    pairs = []
    for n, row in iter_rows(path):
        if isinstance(row, DataError):
            raise row
        for key in ("prompt", "chosen", "rejected"):
            if key not in row:
                raise DataError(f"{path}:{n}: missing field '{key}'")
            if not isinstance(row[key], str) or (key != "prompt" and not row[key].strip()):
                raise DataError(f"{path}:{n}: field '{key}' must be a non-empty string")
        labels = row.get("labels") or {}
        if isinstance(labels, str):  # CSV cells hold JSON text
            try:
                labels = json.loads(labels)
            except json.JSONDecodeError as exc:
                raise DataError(
                    f"{path}:{n}: field 'labels' is not a JSON object ({exc.msg})"
                ) from None
        if not isinstance(labels, dict) or not all(
            isinstance(v, (int, float)) and 0 <= v <= 1 for v in labels.values()
        ):
            raise DataError(f"{path}:{n}: field 'labels' must map attributes to numbers in [0, 1]")
        pairs.append(PreferencePair(row["prompt"], row["chosen"], row["rejected"], labels))
    if not pairs:
        raise DataError(f"{path}: no preference pairs")
    return pairs


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
