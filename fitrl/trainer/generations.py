"""Generation samples for people to read: reward hacking and format collapse show in the text
long before they show in a curve.

Each validation, and every ``trainer.log_samples_freq`` training steps, up to
``trainer.log_samples`` samples go to ``<run_dir>/generations.jsonl``, one JSON object each::

    {"step": 10, "split": "train", "source": "gsm8k", "origin": "train.jsonl:17",
     "prompt": "...", "response": "...", "answer": "42", "reward": 0.5,
     "reward_components": {"format": 1.0, "exact": 0.0}}

``source`` is the row's ``data.source_key`` column (absent without one), ``origin`` the file
and line of the row, ``prompt`` the exact text the policy saw (chat template applied),
``reward`` the score trained on (after overlong shaping, for training samples). A multi-turn
episode (``rollout.agent``) adds ``conversation`` (its messages: the model's turns with their
parsed ``tool_calls``, the tools' and environment's replies) and ``agent`` (its turns, tool calls,
errors, timeouts, tool seconds and ``cut``: the limit that ended it, if one did); its
``response`` is the last model turn. One sample per
prompt comes first (the first response of each group), so a table shows different prompts.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Optional

import torch

from fitrl.data.batch import Batch

GENERATIONS_FILE = "generations.jsonl"


def pick_samples(uids: list[str], count: int) -> list[int]:
    """Up to ``count`` indices: the first response of each prompt in batch order, then the rest."""
    seen: set[str] = set()
    first, rest = [], []
    for i, uid in enumerate(uids):
        (rest if uid in seen else first).append(i)
        seen.add(uid)
    return (first + rest)[:count]


def sample_rows(step: int, split: str, batch: Batch, scores: torch.Tensor, components: dict[str, torch.Tensor],
                count: int, source_key: Optional[str] = None) -> list[dict[str, Any]]:
    rows = []
    for i in pick_samples(batch["uid"], count):
        row: dict[str, Any] = {"step": step, "split": split}
        extra = batch["extra"][i] if "extra" in batch else {}
        if source_key and isinstance(extra, dict) and source_key in extra:
            row["source"] = extra[source_key]
        if "source" in batch:
            row["origin"] = batch["source"][i]
        row["prompt"] = batch["prompt_text"][i] if "prompt_text" in batch else None
        row["response"] = batch["response_text"][i]
        row["answer"] = batch["answer"][i]
        row["reward"] = float(scores[i])
        row["reward_components"] = {k: float(v[i]) for k, v in components.items()}
        if "conversation" in batch:  # a multi-turn episode: every turn, tool calls and results included
            row["conversation"] = batch["conversation"][i]
            row["agent"] = batch["agent_stats"][i]
        rows.append(row)
    return rows


def table_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Flat rows for tracker tables: components become ``reward/<name>`` columns."""
    flat = []
    for row in rows:
        out = {k: v for k, v in row.items() if k != "reward_components"}
        out.update({f"reward/{k}": v for k, v in row.get("reward_components", {}).items()})
        flat.append(out)
    return flat


class GenerationLog:
    """Appends sample rows to ``generations.jsonl``, at most ``count`` per (split, step) however
    many batches a validation generates. A run resumed from a checkpoint (or validating only)
    adds to the file; one starting at step 0 keeps an earlier run's file as ``.prev``."""

    def __init__(self, path: Path, count: int, source_key: Optional[str] = None, append: bool = False):
        self.path, self.count, self.source_key = path, count, source_key
        self.taken: dict[tuple[str, int], int] = {}
        self.file = None
        self.append = append  # resumed, or validation only: add to the file an earlier run wrote

    def add(self, step: int, split: str, batch: Batch, scores: torch.Tensor,
            components: dict[str, torch.Tensor]) -> list[dict[str, Any]]:
        room = self.count - self.taken.get((split, step), 0)
        if room <= 0:
            return []
        rows = sample_rows(step, split, batch, scores, components, room, self.source_key)
        self.taken[(split, step)] = self.taken.get((split, step), 0) + len(rows)
        if self.file is None:
            if not self.append and self.path.is_file() and self.path.stat().st_size:
                # a run starting at step 0 where an earlier one wrote samples: as metrics.jsonl,
                # a file of its own (steps would repeat), the old one kept beside it
                os.replace(self.path, self.path.with_name(self.path.name + ".prev"))
            self.file = open(self.path, "a", encoding="utf-8")
        for row in rows:
            self.file.write(json.dumps(row, ensure_ascii=False, default=str) + "\n")
        self.file.flush()
        return rows

    def drop_after(self, step: int) -> None:
        """A resumed run continues after ``step``: the interrupted run's later samples go, as its
        later metrics do."""
        self.append = True
        if not self.path.is_file():
            return
        kept = []
        for line in self.path.read_text(encoding="utf-8").splitlines():
            try:
                if json.loads(line).get("step", 0) <= step:
                    kept.append(line + "\n")
            except ValueError:  # a line cut by a kill
                continue
        tmp = self.path.with_name(self.path.name + ".tmp")  # a kill now leaves the old file whole
        tmp.write_text("".join(kept), encoding="utf-8")
        os.replace(tmp, self.path)

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None
