"""A generated section of a markdown document, between one pair of marker lines: spliced in,
checked against the document, or printed (bench/failure_stories.py, bench/switching_table.py)."""

from __future__ import annotations

import sys
from pathlib import Path


def splice(doc: str, body: str, begin: str, end: str, name: str) -> str:
    """``doc`` with ``body`` between its ``begin`` and ``end`` markers (``name``: the document, for the error)."""
    if doc.count(begin) != 1 or doc.count(end) != 1 or doc.index(begin) > doc.index(end):
        raise SystemExit(f"{name} needs one {begin} ... {end} pair")
    head, rest = doc.split(begin)
    _, tail = rest.split(end)
    return f"{head}{begin}\n{body}\n{end}{tail}"


def write_section(path: Path, body: str, begin: str, end: str, *, what: str, script: str,
                  check: bool = False, show: bool = False) -> int:
    """Print ``body`` (``show``), say whether the document holds it (``check``: exit status 1 when
    stale), or write it in; ``what`` names the section, ``script`` the command that writes it."""
    if show:
        print(body)
        return 0
    name = f"docs/{path.name}"
    doc = path.read_text()
    new = splice(doc, body, begin, end, name)
    if check:
        if new != doc:
            print(f"{name}'s {what} section is stale: run .venv/bin/python {script}", file=sys.stderr)
            return 1
        print(f"{name}'s {what} section is current")
        return 0
    if new != doc:
        path.write_text(new)
    print(f"{name}: {what} section {'rewritten' if new != doc else 'unchanged'}")
    return 0
