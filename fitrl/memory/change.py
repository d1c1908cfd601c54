"""A change the recommender may try: dotted overrides of the run's own keys, with what it costs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class Change:
    overrides: list[tuple[str, Any]]
    cost: str                 # what it costs in speed (or in the task), shown to the user
    text: str                 # "actor.model.gradient_checkpointing false -> true"
    only_if_fits: bool = False  # shown only when it alone makes the plan fit
