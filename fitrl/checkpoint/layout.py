"""Where checkpoints live on disk and the rules that make a save atomic (files only, no torch).

A save is written under a temporary name and becomes ``step_N`` by one ``rename`` once every
file is on disk and the ``COMPLETE`` marker (written last) lists them with their sizes. So a
crash at any moment leaves either the previous checkpoints untouched plus an ignorable
``step_N.tmp-<id>`` directory, or a whole new ``step_N``; never a half checkpoint under a real
name. Deleting works the other way round: the marker goes first, so a half-deleted directory
is incomplete, not corrupt. Both kinds of leftover are removed at the next start.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from fitrl.core.errors import CheckpointError

MARKER = "COMPLETE"
CHECKPOINTS = "checkpoints"  # the sub-directory of a run directory
_STEP_RE = re.compile(r"^step_(\d+)$")
_TMP_RE = re.compile(r"^step_\d+\.tmp-[0-9a-f]+$")



@dataclass(frozen=True)
class Checkpoint:
    """A complete checkpoint directory and what its marker says about it."""

    path: Path
    step: int
    meta: dict

    @property
    def model_only(self) -> bool:
        return bool(self.meta.get("model_only"))

    @property
    def adapter_only(self) -> bool:
        """The actor's weights are LoRA adapters only (``meta["lora"]``: their settings,
        ``meta["base_model"]``: the frozen base's directory); the base is not in the checkpoint."""
        return bool(self.meta.get("adapter_only"))

    @property
    def run_dir(self) -> Optional[Path]:
        """The run directory it belongs to (``RUN/checkpoints/step_N``), if laid out that way."""
        return self.path.parent.parent if self.path.parent.name == CHECKPOINTS else None


def begin(root: Path, step: int) -> Path:
    """A fresh temporary directory for the save of ``step``."""
    tmp = root / f"step_{step}.tmp-{uuid.uuid4().hex[:12]}"
    tmp.mkdir(parents=True)
    return tmp


def finalize(tmp: Path, meta: dict) -> Path:
    """Make ``tmp`` the checkpoint ``step_N``: fsync every file, write the marker with the file
    list, rename. An existing ``step_N`` (from an abandoned later branch of the run) is replaced."""
    files = {}
    for f in sorted(p for p in tmp.rglob("*") if p.is_file()):
        _fsync(f)  # DCP syncs its shards already; this covers ours (and is cheap for synced files)
        files[f.relative_to(tmp).as_posix()] = f.stat().st_size
    marker = tmp / (MARKER + ".part")
    marker.write_text(json.dumps({**meta, "files": files}, indent=1))
    _fsync(marker)
    marker.rename(tmp / MARKER)
    final = tmp.parent / tmp.name.split(".tmp-")[0]
    if final.exists():
        remove(final)
    tmp.rename(final)
    _fsync(tmp.parent)  # the rename itself must survive a power loss
    return final


def remove(path: Path) -> None:
    """Delete a checkpoint: the marker first, so an interrupted delete leaves an incomplete dir."""
    (path / MARKER).unlink(missing_ok=True)
    shutil.rmtree(path, ignore_errors=True)


def clean_partial(root: Path) -> list[str]:
    """Remove interrupted saves (``*.tmp-*``) and interrupted deletes (``step_N`` without a
    marker) under ``root``; returns their names. Only names this module writes are touched."""
    removed = []
    if not root.is_dir():
        return removed
    for d in sorted(root.iterdir()):
        if d.is_dir() and (_TMP_RE.match(d.name) or (_STEP_RE.match(d.name) and not (d / MARKER).is_file())):
            shutil.rmtree(d, ignore_errors=True)
            removed.append(d.name)
    return removed


def read(path: Path) -> Checkpoint:
    """The checkpoint at ``path`` (a ``step_N`` directory), with its files checked against the marker."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {path} does not exist")
    marker = path / MARKER
    if not marker.is_file():
        raise CheckpointError(f"{path} is not a complete checkpoint (no {MARKER} marker: the save was interrupted, "
                              "or this is not a checkpoint directory)")
    try:
        meta = json.loads(marker.read_text())
        step = int(meta["step"])
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{marker}: unreadable checkpoint marker ({e})") from None
    for rel, size in meta.get("files", {}).items():
        f = path / rel
        if not f.is_file():
            raise CheckpointError(f"checkpoint {path} is missing {rel}, listed in its {MARKER} marker")
        if f.stat().st_size != size:
            raise CheckpointError(f"checkpoint file {f} is {f.stat().st_size} bytes, {size} when it was saved "
                                  "(truncated or overwritten)")
    return Checkpoint(path, step, meta)


def list_complete(root: Path) -> list[Checkpoint]:
    """Complete checkpoints under ``root``, oldest first (files not verified: see :func:`read`)."""
    out = []
    if root.is_dir():
        for d in root.iterdir():
            m = _STEP_RE.match(d.name)
            if m and (d / MARKER).is_file():
                try:
                    meta = json.loads((d / MARKER).read_text())
                except ValueError:
                    continue  # reported by read() if someone asks for this one
                out.append(Checkpoint(d, int(m.group(1)), meta))
    return sorted(out, key=lambda c: c.step)


def find(spec: str) -> Checkpoint:
    """A checkpoint named by the user: a ``step_N`` directory, or a run directory or its
    ``checkpoints`` directory (then its newest complete checkpoint)."""
    p = Path(spec)
    if (p / MARKER).is_file() or _STEP_RE.match(p.name) or _TMP_RE.match(p.name):
        return read(p)
    root = p / CHECKPOINTS if (p / CHECKPOINTS).is_dir() else p
    if not root.is_dir():
        raise CheckpointError(f"checkpoint {spec} does not exist")
    found = list_complete(root)
    if not found:
        raise CheckpointError(f"no complete checkpoint in {root}")
    return read(found[-1].path)


def prune(root: Path, keep_last: int, best_metric: Optional[str], mode: str, protect: Path) -> list[Path]:
    """Delete complete checkpoints beyond the newest ``keep_last`` (0 keeps all), sparing the
    best one by ``best_metric`` and ``protect`` (the one just written)."""
    found = list_complete(root)
    if keep_last <= 0 or len(found) <= keep_last:
        return []
    keep = {c.path for c in found[-keep_last:]} | {protect}
    if best_metric:
        scored = [c for c in found if isinstance(c.meta.get("metrics", {}).get(best_metric), (int, float))]
        if scored:
            pick = max if mode == "max" else min
            keep.add(pick(scored, key=lambda c: c.meta["metrics"][best_metric]).path)
    doomed = [c.path for c in found if c.path not in keep]
    for path in doomed:
        remove(path)
    return doomed


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
