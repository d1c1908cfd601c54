"""Per-phase wall-clock timing for the driver loop."""

from __future__ import annotations

import time
from contextlib import contextmanager

import torch


class PhaseTimer:
    def __init__(self) -> None:
        self.times: dict[str, float] = {}

    @contextmanager
    def phase(self, name: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            if torch.cuda.is_available():
                torch.cuda.synchronize()  # otherwise GPU work is billed to whichever phase syncs next
            self.times[name] = self.times.get(name, 0.0) + time.perf_counter() - start

    def metrics(self) -> dict[str, float]:
        out = {f"time/{k}": v for k, v in self.times.items()}
        out["time/step"] = sum(self.times.values())
        return out
