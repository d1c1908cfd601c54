"""DAPO dynamic sampling: groups whose samples all scored the same give every sample advantage 0
(no learning signal, but they still dilute the token-mean), so they are dropped."""

from __future__ import annotations

import torch


def group_is_informative(values: torch.Tensor, group_index: torch.Tensor) -> torch.Tensor:
    """(B,) bool: True for samples whose group's ``values`` (B,) are not all equal.

    >>> values = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.5])
    >>> groups = torch.tensor([0, 0, 1, 1, 2, 2, 3])
    >>> group_is_informative(values, groups).tolist()  # all-1, mixed, all-0, a group of one
    [False, False, True, True, False, False, False]
    """
    num_groups = int(group_index.max()) + 1
    values = values.float()
    empty = torch.zeros(num_groups, device=values.device)
    gmax = empty.scatter_reduce(0, group_index, values, "amax", include_self=False)
    gmin = empty.scatter_reduce(0, group_index, values, "amin", include_self=False)
    return (gmax > gmin)[group_index]
