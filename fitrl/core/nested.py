"""Nested mappings and their dotted keys: ``{"a": {"b": 1}}`` <-> ``{"a.b": 1}``. The config's
comparison on resume, the MLflow parameters and ``fitrl import-config`` read configs this way."""

from __future__ import annotations

from typing import Any, Mapping


def flatten(data: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Leaves by dotted key; an empty mapping is a leaf."""
    out: dict[str, Any] = {}
    for key, value in data.items():
        if isinstance(value, Mapping) and value:
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def nest(flat: Mapping[str, Any]) -> dict[str, Any]:
    """The inverse of :func:`flatten`."""
    out: dict[str, Any] = {}
    for key, value in flat.items():
        node = out
        *parents, last = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = value
    return out
