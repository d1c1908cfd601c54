"""Random-number-generator states, so a resumed run draws exactly what the original would have.

The driver owns Python's, NumPy's and torch's global generators (data order is seeded
separately, by the sampler's position); each worker rank owns its torch generators, which
sample the rollouts (in-process, that is the driver's own). Python and NumPy states are saved as
JSON-able lists, torch's as tensors: nothing in a checkpoint needs unpickling arbitrary objects.
"""

from __future__ import annotations

import random

import numpy as np
import torch

from fitrl.core.device import cuda_here, cuda_in_use


def python_numpy_state() -> dict:
    version, internal, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state()
    return {"python": [version, list(internal), gauss],
            "numpy": [name, keys.tolist(), int(pos), int(has_gauss), float(cached)]}


def set_python_numpy_state(state: dict) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))


def torch_state() -> dict[str, torch.Tensor]:
    state = {"cpu": torch.get_rng_state()}
    if cuda_in_use():  # (a Ray driver has none: its ranks save theirs)
        state["cuda"] = torch.cuda.get_rng_state()  # this process's current device (one per rank)
    return state


def set_torch_state(state: dict[str, torch.Tensor]) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and cuda_here():  # (a Ray driver resuming an in-process run's state: the ranks' to set)
        torch.cuda.set_rng_state(state["cuda"])
