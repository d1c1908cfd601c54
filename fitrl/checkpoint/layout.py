"""Where checkpoints live on disk and the rules that make a save atomic (files only, no torch).

A save is written under a temporary name and becomes ``step_N`` by one ``rename`` once every
file is on disk and the ``COMPLETE`` marker (written last) lists them with their sizes. So a
crash at any moment leaves either the previous checkpoints untouched plus an ignorable
``step_N.tmp-<id>`` directory, or a whole new ``step_N``; never a half checkpoint under a real
name. Deleting works the same way round: ``step_N`` is renamed to a temporary name first, then
deleted. Temporary directories left by a crash are removed at the next start; a ``step_N``
without a marker is never written by fitrl (a copy cut short, a marker deleted by hand), so it
is reported and left alone, never deleted.

The marker also records a checksum of every file (xxh3-128, ~9 GiB/s on one core for data in the
page cache; disk speed otherwise). :func:`read` verifies sizes and checksums, so bytes changed
after the save (a bad disk, a partial copy, a stray write) are found, naming the file, before
anything loads them. Markers written before checksums existed carry sizes only and still load.
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

import xxhash

from fitrl.core.errors import CheckpointError, CheckpointUsageError

MARKER = "COMPLETE"
CHECKPOINTS = "checkpoints"  # the sub-directory of a run directory
_STEP_RE = re.compile(r"^step_(\d+)$")
_TMP_RE = re.compile(r"^step_\d+\.tmp-[0-9a-f]+$")
HASH = "xxh3_128"  # fast and non-cryptographic: it finds damage, it does not authenticate
_CHUNK = 8 * 2**20



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


def is_checkpoint_name(name: str) -> bool:
    """``step_N``, or the temporary name of its save in progress."""
    return bool(_STEP_RE.match(name) or _TMP_RE.match(name))


def begin(root: Path, step: int) -> Path:
    """A fresh temporary directory for the save of ``step``."""
    tmp = root / f"step_{step}.tmp-{uuid.uuid4().hex[:12]}"
    tmp.mkdir(parents=True)
    return tmp


def finalize(tmp: Path, meta: dict) -> Path:
    """Make ``tmp`` the checkpoint ``step_N``: fsync every file, write the marker with the file
    list, sizes and checksums, rename. An existing ``step_N`` (from an abandoned later branch of
    the run) is replaced."""
    files, hashes = {}, {}
    for f in sorted(p for p in tmp.rglob("*") if p.is_file()):
        _fsync(f)  # DCP syncs its shards already; this covers ours (and is cheap for synced files)
        rel = f.relative_to(tmp).as_posix()
        files[rel] = f.stat().st_size
        hashes[rel] = file_hash(f)  # just written: read back from the page cache
    marker = tmp / (MARKER + ".part")
    marker.write_text(json.dumps({**meta, "files": files, "hash": HASH, "hashes": hashes}, indent=1))
    _fsync(marker)
    marker.rename(tmp / MARKER)
    final = tmp.parent / tmp.name.split(".tmp-")[0]
    if final.exists():
        # Out of the way by a rename to a name clean_partial removes, then deleted: a kill in
        # between leaves two leftovers for the next start, never a half-deleted step_N.
        old = final.with_name(f"{final.name}.tmp-{uuid.uuid4().hex[:12]}")
        final.rename(old)
        tmp.rename(final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        tmp.rename(final)
    _fsync(tmp.parent)  # the rename itself must survive a power loss
    return final


def file_hash(path: Path) -> str:
    """The :data:`HASH` digest of a file, read in chunks into one reused buffer."""
    h = xxhash.xxh3_128()
    buf = bytearray(_CHUNK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            h.update(view[:n])
    return h.hexdigest()


def verify_files(path: Path, meta: dict) -> list[tuple[str, str]]:
    """Every file the marker lists, checked against it: ``(relative path, status)`` where status
    is ``ok``, ``ok (size only: no checksum recorded)`` (a marker older than checksums), or what
    is wrong (``missing``, ``N bytes, M when it was saved``, ``checksum differs ...``)."""
    hashes = meta.get("hashes") or {}
    if hashes and meta.get("hash", HASH) != HASH:
        return [(rel, f"checksums recorded with {meta.get('hash')!r}, which this fitrl cannot compute")
                for rel in meta.get("files", {})]
    out = []
    for rel, size in meta.get("files", {}).items():
        f = path / rel
        if not f.is_file():
            out.append((rel, f"missing (listed in the {MARKER} marker)"))
        elif f.stat().st_size != size:
            out.append((rel, f"{f.stat().st_size} bytes, {size} when it was saved (truncated or overwritten)"))
        elif rel not in hashes:
            out.append((rel, "ok (size only: no checksum recorded)"))
        elif file_hash(f) != hashes[rel]:
            out.append((rel, f"checksum differs from the one recorded when it was saved ({HASH}): its bytes "
                             "changed after the save (disk or copy corruption, or a write by something else)"))
        else:
            out.append((rel, "ok"))
    return out


def damaged(results: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """The entries of :func:`verify_files` that are not ok."""
    return [(rel, status) for rel, status in results if not status.startswith("ok")]


def remove(path: Path) -> None:
    """Delete a checkpoint: renamed to a temporary name first (removed by :func:`clean_partial`
    if this is interrupted), so no half-deleted ``step_N`` is ever left."""
    doomed = path.with_name(f"{path.name}.tmp-{uuid.uuid4().hex[:12]}")
    try:
        path.rename(doomed)
    except FileNotFoundError:
        return
    shutil.rmtree(doomed, ignore_errors=True)


def clean_partial(root: Path) -> list[str]:
    """Remove interrupted saves and deletes (``step_N.tmp-*``) under ``root``; returns their
    names. Only names this module writes are touched."""
    removed = []
    if not root.is_dir():
        return removed
    for d in sorted(root.iterdir()):
        if d.is_dir() and _TMP_RE.match(d.name):
            shutil.rmtree(d, ignore_errors=True)
            removed.append(d.name)
    return removed


def incomplete(root: Path) -> list[Path]:
    """``step_N`` directories under ``root`` without a readable marker: never fitrl's own
    leftovers (see the module's docstring), so the caller reports them and deletes nothing."""
    complete = {c.path.name for c in list_complete(root)}
    return sorted((d for d in root.iterdir() if d.is_dir() and _STEP_RE.match(d.name) and d.name not in complete),
                  key=lambda d: int(d.name.split("_")[1])) if root.is_dir() else []


def read(path: Path, *, verify: bool = True) -> Checkpoint:
    """The checkpoint at ``path`` (a ``step_N`` directory), with its files checked against the
    marker (``verify``): present, of the recorded size and of the recorded checksum. Without
    ``verify`` only the marker is read (the caller verifies later, e.g. to fall back)."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointUsageError(f"checkpoint {path} does not exist")
    marker = path / MARKER
    if not marker.is_file():
        raise CheckpointError(f"{path} is not a complete checkpoint (no {MARKER} marker: the save was interrupted, "
                              "or this is not a checkpoint directory)")
    try:
        meta = json.loads(marker.read_text())
        step = int(meta["step"])
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{marker}: unreadable checkpoint marker ({e})") from None
    if not verify:
        return Checkpoint(path, step, meta)
    for rel, size in meta.get("files", {}).items():
        f = path / rel
        if not f.is_file():
            raise CheckpointError(f"checkpoint {path} is missing {rel}, listed in its {MARKER} marker")
        if f.stat().st_size != size:
            raise CheckpointError(f"checkpoint file {f} is {f.stat().st_size} bytes, {size} when it was saved "
                                  "(truncated or overwritten)")
    # sizes first (above): a missing or cut file is named without reading every other file
    bad = damaged(verify_files(path, meta))
    if bad:
        rel, status = bad[0]
        more = f" (and {len(bad) - 1} more: `fitrl checkpoint verify {path}` lists them)" if len(bad) > 1 else ""
        raise CheckpointError(f"checkpoint file {path / rel}: {status}{more}")
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


def find(spec: str, *, verify: bool = True) -> Checkpoint:
    """A checkpoint named by the user: a ``step_N`` directory, or a run directory or its
    ``checkpoints`` directory (then its newest complete checkpoint); ``verify``: see :func:`read`."""
    p = Path(spec)
    if (p / MARKER).is_file() or _STEP_RE.match(p.name) or _TMP_RE.match(p.name):
        return read(p, verify=verify)
    root = p / CHECKPOINTS if (p / CHECKPOINTS).is_dir() else p
    if not root.is_dir():
        raise CheckpointUsageError(f"checkpoint {spec} does not exist")
    found = list_complete(root)
    if not found:
        raise CheckpointUsageError(f"no complete checkpoint in {root}")
    return read(found[-1].path, verify=verify)


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
