"""Reading a prompt file's rows: jsonl, json, parquet or a ``datasets.Dataset.save_to_disk``
directory, or a Hugging Face Hub dataset (``org/name@split``: fitrl/data/hub.py), each row an
object, each with where it is (``path:line`` for jsonl, 1-based, counting blank lines;
``path: row i``, 0-based, otherwise) for the one-line errors of fitrl/data/dataset.py.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Iterator

from fitrl.core.errors import DataError
from fitrl.data.hub import hub_rows, parse_dataset_ref, rows_dir

SUPPORTED_FORMATS = ".jsonl, .json, .parquet, or a directory written by datasets.Dataset.save_to_disk"


def iter_rows(path: str | os.PathLike) -> Iterator[tuple[str, dict]]:
    """Yield ``(source, row)`` for every row of one data file, ``save_to_disk`` directory or Hub dataset."""
    path = str(path)
    p = Path(path)
    if not p.exists():
        ref = parse_dataset_ref(path)
        if ref is not None:
            yield from hub_rows(ref)
            return
        raise DataError(f"data file not found: {path}")
    if p.is_dir():
        yield from _iter_saved_dataset(path)
        return
    suffix = p.suffix.lower()
    if suffix == ".jsonl":
        yield from _iter_jsonl(path)
    elif suffix == ".json":
        yield from _iter_json(path)
    elif suffix == ".parquet":
        yield from _iter_parquet(path)
    else:
        raise DataError(f"{path}: unsupported file type {suffix or '(no extension)'!r}; use {SUPPORTED_FORMATS}")


def rows_base_dir(path: str) -> str:
    """Where relative image paths of ``path``'s rows are read from: the directory of the file, the
    ``save_to_disk`` directory itself, or a Hub dataset's snapshot directory."""
    if Path(path).is_dir():
        return path
    ref = None if Path(path).exists() else parse_dataset_ref(path)
    return rows_dir(ref) if ref is not None else os.path.dirname(os.path.abspath(path))


def _iter_jsonl(path: str) -> Iterator[tuple[str, dict]]:
    # Read bytes and decode line by line so that a bad byte is reported at its own line.
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            source = f"{path}:{lineno}"
            try:
                line = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")
            except UnicodeDecodeError as e:
                raise DataError(f"{source}: not valid UTF-8 ({e.reason} at byte {e.start})") from None
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{source}: invalid JSON ({e.msg}: column {e.colno})") from None
            yield source, _check_object(source, row)


def _iter_json(path: str) -> Iterator[tuple[str, dict]]:
    try:
        with open(path, encoding="utf-8-sig") as f:
            doc = json.load(f)
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not valid UTF-8 ({e.reason} at byte {e.start})") from None
    except json.JSONDecodeError as e:
        raise DataError(f"{path}:{e.lineno}: invalid JSON ({e.msg}: column {e.colno})") from None
    # Two common layouts: a bare list of rows, or {"data": [rows]} as many hubs export.
    rows = doc.get("data") if isinstance(doc, dict) else doc
    if not isinstance(rows, list):
        raise DataError(
            f"{path}: expected a JSON list of objects or an object with a 'data' list, "
            f"got {kind_of(doc)}" + (f" with keys {', '.join(map(str, doc))}" if isinstance(doc, dict) else "")
        )
    for i, row in enumerate(rows):
        source = f"{path}: row {i}"
        yield source, _check_object(source, row)


def _iter_parquet(path: str) -> Iterator[tuple[str, dict]]:
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
    except Exception as e:  # pyarrow raises several types for a corrupt or non-parquet file
        raise DataError(f"{path}: cannot read as parquet ({e})") from None
    i = 0
    # Batches keep memory bounded by a batch, not the whole table, while converting to Python.
    for batch in pf.iter_batches():
        for row in batch.to_pylist():
            yield f"{path}: row {i}", row
            i += 1


def _iter_saved_dataset(path: str) -> Iterator[tuple[str, dict]]:
    import datasets  # imported here: it is slow to import and only directories need it

    try:
        ds = datasets.load_from_disk(path)
    except FileNotFoundError:
        raise DataError(f"{path}: directory is not a dataset saved by datasets.save_to_disk; use {SUPPORTED_FORMATS}") from None
    if isinstance(ds, datasets.DatasetDict):
        splits = ", ".join(ds)
        raise DataError(f"{path}: holds several splits ({splits}); list one split directory, e.g. {Path(path) / next(iter(ds))}")
    # Arrow rows, not Python-formatted ones: an Image column stays {"bytes", "path"} instead of
    # every image being decoded here (the vision path decodes, checks and drops each one itself).
    i = 0
    for batch in ds.with_format("arrow").iter(batch_size=1000):
        for row in batch.to_pylist():
            yield f"{path}: row {i}", row
            i += 1


def _check_object(source: str, row: Any) -> dict:
    if not isinstance(row, dict):
        raise DataError(f"{source}: row is {kind_of(row)}, expected an object (a mapping of column to value)")
    return row


def kind_of(value: Any) -> str:
    """A JSON value's kind in words, for error messages."""
    return {dict: "an object", list: "a list", str: "a string", type(None): "null"}.get(type(value), type(value).__name__)


MISSING = object()
"""What :func:`lookup` returns for a key the row does not hold."""


def lookup(row: dict, key: str) -> Any:
    """The value of column ``key`` in ``row``; a dotted key reaches into nested objects
    (``reward_model.ground_truth``, veRL's layout) when no column has that exact name.
    :data:`MISSING` when there is none."""
    if key in row:
        return row[key]
    value: Any = row
    for part in key.split("."):
        if not isinstance(value, dict) or part not in value:
            return MISSING
        value = value[part]
    return value


def missing_key_text(row: dict, key: str) -> str:
    """Which columns (or nested keys) a row has, for the error naming a missing ``key``."""
    value: Any = row
    parts = key.split(".")
    for i, part in enumerate(parts[:-1]):
        if not isinstance(value, dict) or part not in value:
            break
        value = value[part]
        if not isinstance(value, dict):
            return f"{'.'.join(parts[:i + 1])!r} is {kind_of(value)}, not an object"
    else:
        if value is not row and isinstance(value, dict):
            return f"{'.'.join(parts[:-1])!r} has keys: {', '.join(map(str, value))}"
    return f"columns: {', '.join(map(str, row))}"
