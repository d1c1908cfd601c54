"""Where a shared-prompt forward applies and what it saved (:mod:`fitrl.ops.shared_prompt`), from
plain data: no torch here, so the memory planner and the step's FLOP count can import it cheaply."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterable, Iterator, Optional


class SkippedPromptCopies:
    """The prompt copies this process's passes did not run, per phase: the token count of each
    row whose prompt another row of its micro-batch ran (a shared-prompt forward, the decode
    loop's prefill). ``perf/*`` subtracts their FLOPs (fitrl/trainer/perf.py): what ran, as the
    passes report it, not a re-derivation of when they share.

    The phase is set by whoever runs one: the driver's phase timer, a Ray rank's call (the
    outermost wins); outside any phase nothing is kept."""

    def __init__(self) -> None:
        self._phase: Optional[str] = None
        self._lengths: dict[str, list[int]] = {}

    @contextmanager
    def during(self, phase: str) -> Iterator[None]:
        if self._phase is not None:
            yield
            return
        self._phase = phase
        try:
            yield
        finally:
            self._phase = None

    def record(self, prompt_lengths: Iterable[int]) -> None:
        if self._phase is not None:
            self._lengths.setdefault(self._phase, []).extend(int(n) for n in prompt_lengths)

    def drain(self) -> dict[str, list[int]]:
        """Phase -> the skipped copies' prompt lengths since the last drain."""
        out, self._lengths = self._lengths, {}
        return out


SKIPPED_PROMPTS = SkippedPromptCopies()
"""This process's record (one per process: the driver's, or a Ray rank's)."""


def merge_skipped(reports: Iterable[dict[str, list[int]]]) -> dict[str, list[int]]:
    """Several processes' :meth:`SkippedPromptCopies.drain` results as one."""
    out: dict[str, list[int]] = {}
    for report in reports:
        for phase, lengths in report.items():
            out.setdefault(phase, []).extend(lengths)
    return out


def full_attention(config: dict) -> bool:
    """Does every layer of a ``config.json`` attend to the whole sequence (no sliding window)?"""
    types = config.get("layer_types")
    if types is not None:
        return all(t == "full_attention" for t in types)
    return not config.get("use_sliding_window", config.get("sliding_window"))
