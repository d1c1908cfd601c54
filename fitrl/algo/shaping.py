"""Reward shaping that depends on the response, not its text: DAPO's soft overlong punishment."""

from __future__ import annotations

import torch


def overlong_penalty(
    lengths: torch.Tensor, *, max_response_length: int, buffer_length: int, penalty_factor: float
) -> torch.Tensor:
    """(B,) reward added for response ``lengths`` (B,): 0 up to ``max - buffer`` tokens, then linear
    down to ``-penalty_factor`` at ``max_response_length`` (and no lower).

    A soft ramp instead of a hard penalty on truncation, so the policy learns that length costs
    before it is cut off (DAPO, Yu et al. 2025).

    >>> overlong_penalty(torch.tensor([4, 6, 7, 8]), max_response_length=8, buffer_length=4, penalty_factor=1.0).tolist()
    [0.0, -0.5, -0.75, -1.0]
    """
    if not 0 < buffer_length <= max_response_length:
        raise ValueError(f"buffer_length must be in (0, max_response_length={max_response_length}], got {buffer_length}")
    excess = (lengths.float() - (max_response_length - buffer_length)).clamp(0, buffer_length)
    return 0.0 - excess * (penalty_factor / buffer_length)  # 0.0 - x: no -0.0 in the output
