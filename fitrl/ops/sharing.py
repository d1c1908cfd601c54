"""Where a shared-prompt forward applies and what it saves (:mod:`fitrl.ops.shared_prompt`), from
plain data: no torch here, so the memory planner and the step's FLOP count can import it cheaply."""

from __future__ import annotations


def full_attention(config: dict) -> bool:
    """Does every layer of a ``config.json`` attend to the whole sequence (no sliding window)?"""
    types = config.get("layer_types")
    if types is not None:
        return all(t == "full_attention" for t in types)
    return not config.get("use_sliding_window", config.get("sliding_window"))


def copies_saved(inverse: list[int], size: int) -> list[int]:
    """Rows whose prompt a shared-prompt forward does not run, for micro-batches of ``size``
    consecutive rows; ``inverse``: each row's prompt group. Each micro-batch runs the first row
    of each of its groups."""
    saved = []
    for start in range(0, len(inverse), max(1, size)):
        seen: set[int] = set()
        for row in range(start, min(start + size, len(inverse))):
            if inverse[row] in seen:
                saved.append(row)
            seen.add(inverse[row])
    return saved
