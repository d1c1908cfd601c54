"""What a Ulysses split (fitrl/distributed/ulysses.py) requires of a model, from its config
alone: no torch here, so config and model-directory checks can import it cheaply."""

from __future__ import annotations

import math
from typing import Optional

INNER = ("sdpa", "eager")
"""The attention implementations the head exchange wraps (it hands them a whole-row mask)."""


def check_heads(heads: Optional[int], kv_heads: Optional[int], size: int) -> Optional[str]:
    """Why ``size``-way sequence parallelism cannot split a model with these attention and
    key/value head counts (a ``config.json``'s ``num_attention_heads``, ``num_key_value_heads``;
    None: it can)."""
    kv_heads = kv_heads or heads
    if not heads:
        return "the model's config has no num_attention_heads"
    if heads % size or kv_heads % size:
        return (f"{size} must divide the model's attention heads ({heads}) and key/value heads "
                f"({kv_heads}); use a divisor of {math.gcd(heads, kv_heads)}")
    return None
