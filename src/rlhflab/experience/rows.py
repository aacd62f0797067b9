"""Rows from any source a stage reads, each with a name for the error that points at it.

Files: JSONL, CSV and Parquet, their rows named ``FILE:LINE`` as a text editor shows them.
Datasets: a folder written by ``Dataset.save_to_disk`` or ``DatasetDict.save_to_disk``, an
in-memory ``datasets.Dataset`` or ``DatasetDict``, or a plain list of dicts, their rows named
``NAME row N`` from 1 (a DatasetDict's split in brackets: ``data/pairs[train] row 5``), so
that a message can never be read as a line number of a file that is not one.

``datasets`` is optional (``pip install 'rlhflab[data]'``): it is imported only to read a
dataset folder, and an in-memory dataset is recognised through ``sys.modules`` (it cannot
exist unless ``datasets`` was imported), so importing rlhflab never imports it.
"""

from __future__ import annotations

import csv
import io
import json
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from rlhflab.errors import RlhflabError


class DataError(RlhflabError, ValueError):
    """Bad input data; the message names the file or dataset, the row and the field."""


@dataclass
class Rows:
    """The rows of one source. Iterating gives (row number, row); a row that cannot be read
    comes as a :class:`DataError` in its place, so that ``on_bad_row='skip'`` can drop it.
    ``name`` names the whole source, :meth:`where` one row of it."""

    name: str
    rows: Iterable[tuple[int, dict | DataError]]
    by_line: bool = False  # files: FILE:LINE; datasets and lists: NAME row N

    def where(self, n: int) -> str:
        return f"{self.name}:{n}" if self.by_line else f"{self.name} row {n}"

    def __iter__(self) -> Iterator[tuple[int, dict | DataError]]:
        return iter(self.rows)


def open_rows(source, split: str = "train") -> Rows:
    """The rows of ``source``: a file or dataset-folder path, a ``datasets.Dataset`` or
    ``DatasetDict`` (``split`` picks the DatasetDict's part), or a list of dicts. A source
    that cannot be read at all raises :class:`DataError`."""
    if isinstance(source, list):
        return Rows("list", _list_rows(source))
    dataset = _as_dataset(source, split)
    if dataset is not None:
        return dataset
    if not isinstance(source, (str, Path)):
        raise DataError(
            f"unsupported data source {type(source).__name__}: give a .jsonl, .csv or "
            ".parquet file, a save_to_disk folder, a datasets.Dataset or DatasetDict, or a "
            "list of dicts"
        )
    path = Path(source)
    if not path.exists():
        # a config file's relative paths are read from the working directory, not the
        # file's folder: the usual cause when a run started elsewhere
        where = "" if path.is_absolute() else f" (relative to the working directory {Path.cwd()})"
        raise DataError(f"{path}: no such file{where}")
    if path.is_dir():
        return _folder_rows(path, split)
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".json"):
        return Rows(str(path), _jsonl_rows(path), by_line=True)
    if suffix == ".csv":
        return Rows(str(path), _csv_rows(path), by_line=True)
    if suffix == ".parquet":
        return Rows(str(path), _parquet_rows(path), by_line=True)
    raise DataError(
        f"{path}: unsupported file type {suffix!r}; use .jsonl, .csv, .parquet or a "
        "save_to_disk folder"
    )


def iter_rows(source, split: str = "train") -> Iterator[tuple[int, dict | DataError]]:
    """(row number, row) pairs of :func:`open_rows` (``source``, ``split``)."""
    return iter(open_rows(source, split))


def source_name(source, split: str = "train") -> str:
    """How errors name ``source`` as a whole (``open_rows``'s name, without reading it)."""
    if isinstance(source, (str, Path)):
        path = Path(source)
        return f"{path}[{split}]" if (path / "dataset_dict.json").is_file() else str(path)
    if isinstance(source, list):
        return "list"
    kind = type(source).__name__
    return f"{kind}[{split}]" if kind == "DatasetDict" else kind


def _list_rows(items: list) -> Iterator[tuple[int, dict | DataError]]:
    for n, item in enumerate(items, start=1):
        if not isinstance(item, dict):
            item = DataError(f"list row {n}: expected a dict, got {type(item).__name__}")
        yield n, item


def _as_dataset(obj, split: str, name: str | None = None) -> Rows | None:
    """The rows of ``obj`` if it is a ``datasets.Dataset`` or ``DatasetDict``, else None;
    ``name``: the folder it was read from (else its type names it)."""
    datasets = sys.modules.get("datasets")
    if datasets is None:
        return None
    name = name or type(obj).__name__
    if isinstance(obj, getattr(datasets, "DatasetDict", ())):
        if split not in obj:
            raise DataError(
                f"{name}: no split {split!r} (data.split); it has "
                + ", ".join(repr(s) for s in sorted(obj))
            )
        return Rows(f"{name}[{split}]", enumerate(obj[split], start=1))
    if isinstance(obj, getattr(datasets, "Dataset", ())):
        return Rows(name, enumerate(obj, start=1))
    return None


def _folder_rows(path: Path, split: str) -> Rows:
    # save_to_disk writes state.json (a Dataset) or dataset_dict.json (a DatasetDict)
    if not ((path / "state.json").is_file() or (path / "dataset_dict.json").is_file()):
        raise DataError(
            f"{path}: a folder, but not one written by save_to_disk (it has no state.json "
            "or dataset_dict.json)"
        )
    try:
        import datasets
    except ImportError:
        raise DataError(
            f"{path}: reading a dataset folder needs datasets (pip install 'rlhflab[data]')"
        ) from None
    try:
        loaded = datasets.load_from_disk(str(path))
    except (OSError, ValueError, KeyError) as exc:  # a missing shard, broken JSON or Arrow
        raise DataError(f"{path}: not a readable dataset folder ({exc})") from None
    return _as_dataset(loaded, split, str(path))


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
            if n == 1:
                line = line.removeprefix("\ufeff")  # a byte-order mark, as some editors write
            if not line.strip():
                continue
            try:
                row = json.loads(line.rstrip("\r\n"), object_pairs_hook=_refuse_repeated_keys)
            except json.JSONDecodeError as exc:
                if n == 1 and line.lstrip().startswith("["):  # a pretty-printed .json array
                    raise DataError(
                        f"{path}: a JSON array over several lines; rlhflab reads "
                        f"{path.suffix} files as JSON Lines, one object per line"
                    ) from None
                yield n, DataError(f"{path}:{n}: not valid JSON ({exc.msg} at column {exc.colno})")
                continue
            except _RepeatedKey as exc:
                yield n, DataError(f"{path}:{n}: field '{exc}' appears twice; keep one")
                continue
            except RecursionError:
                yield n, DataError(f"{path}:{n}: not valid JSON here (nested too deeply)")
                continue
            if not isinstance(row, dict):
                row = DataError(f"{path}:{n}: expected a JSON object, got {type(row).__name__}")
            elif "\\ud" in line.lower():  # an escaped surrogate: paired, or a lone one?
                bad = _lone_surrogate_field(row)
                if bad is not None:
                    row = DataError(
                        f"{path}:{n}: field '{bad}' is not valid Unicode (a lone surrogate "
                        "escape such as \\ud800, which no text encoding can write)"
                    )
            yield n, row


def _lone_surrogate_field(row: dict) -> str | None:
    """The first top-level field of ``row`` holding a string with a lone surrogate."""

    def bad(value) -> bool:
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                return True
            return False
        if isinstance(value, dict):
            return any(bad(k) or bad(v) for k, v in value.items())
        return isinstance(value, list) and any(bad(v) for v in value)

    return next(
        (str(k.encode("utf-8", "replace"), "utf-8") for k, v in row.items() if bad(k) or bad(v)),
        None,
    )


class _RepeatedKey(Exception):
    """A JSON object with a key twice (json.loads would keep the last, silently)."""


def _refuse_repeated_keys(pairs: list) -> dict:
    """json.loads' object_pairs_hook: the object as a dict, or _RepeatedKey naming a key
    given twice."""
    seen = {}
    for key, value in pairs:
        if key in seen:
            raise _RepeatedKey(key)
        seen[key] = value
    return seen


def _csv_rows(path: Path) -> Iterator[tuple[int, dict | DataError]]:
    # the byte-order mark spreadsheet programs write ("CSV UTF-8") is not part of the
    # first column's name; dropped from the bytes, so a bad byte's line and column count
    # from the file's start as an editor shows it
    raw = path.read_bytes().removeprefix(b"\xef\xbb\xbf")
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
    # csv's default field limit is 128 KiB: a long document in one cell is valid CSV (the
    # unclosed-quote check above already guards against a field eating the file)
    csv.field_size_limit(max(csv.field_size_limit(), len(text) + 1))
    reader = csv.DictReader(io.StringIO(text, newline=""))
    try:
        header = reader.fieldnames or []
        # (empty names: the trailing empty columns spreadsheets leave are not a repeat)
        repeated = sorted({c for c in header if c and header.count(c) > 1})
        if repeated:
            raise DataError(f"{path}:1: column '{repeated[0]}' appears twice in the header")
        for row in reader:
            # more fields than the header names (csv.DictReader's restkey): data lost unless
            # they are empty (a trailing comma)
            if any(str(v).strip() for v in row.pop(None, None) or ()):
                yield (
                    reader.line_num,
                    DataError(
                        f"{path}:{reader.line_num}: more fields than the header's "
                        f"{len(header)} (a comma inside a field must be quoted)"
                    ),
                )
                continue
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
