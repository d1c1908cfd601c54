"""Every rank's files in a checkpoint: what each rank of a saved role must have left in the
directory the loader reads, and which of them are not there.

A role's directory (fitrl/checkpoint/sharded.py) is written by all of the role's ranks, each
into the path *it* sees: rank r writes ``__<r>_0.distcp`` (its shards) and ``rng_rank<r>.pt``;
rank 0 also writes ``.metadata`` (every shard file, with the bytes it must hold) and
``role_state.pt``. When ``trainer.run_dir`` is not one filesystem for every node, a rank's files
land on its own node's disk and the driver's copy silently lacks them; the ``COMPLETE`` marker,
built from what the driver sees, does not list them either, so checking a checkpoint against its
marker alone passes it. The save (fitrl/checkpoint/manager.py) and ``fitrl checkpoint verify``
check it against what the role's world size and its metadata say must be there.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

_SHARD_RE = re.compile(r"^__(\d+)_\d+\.distcp$")  # DCP's FileSystemWriter: __<rank>_<file>.distcp


@dataclass(frozen=True)
class Missing:
    """A file a rank should have written that the checkpoint directory lacks (or holds cut short)."""

    role: str
    rank: Optional[int]  # whose file it is; None when its name does not say
    file: str            # relative to the checkpoint directory (``actor/__1_0.distcp``)
    status: str          # ``missing``, or what is wrong with it

    def owner(self) -> str:
        return f"{self.role} rank {self.rank}" if self.rank is not None else f"{self.role} (rank unknown)"


def role_world_sizes(meta: dict) -> dict[str, int]:
    """The ranks that saved each role of a checkpoint, from its marker: recorded per role since
    this check exists, the run's world size before (every trained role had that many ranks)."""
    sizes = meta.get("role_world_sizes") or {}
    return {role: int(sizes.get(role, meta.get("world_size") or 1)) for role in meta.get("roles") or []}


def missing_in_checkpoint(path: Path, meta: dict) -> list[Missing]:
    """Every rank's files of every role of the checkpoint at ``path`` whose marker is ``meta``."""
    role_state = not meta.get("model_only")  # a weights-only save writes no role_state.pt
    out: list[Missing] = []
    for role, world in role_world_sizes(meta).items():
        out += missing_in_role(Path(path), role, world, role_state=role_state)
    return out


def check_checkpoint(path: Path, meta: dict) -> None:
    """Raise :class:`CheckpointError` naming the first rank's file the checkpoint lacks (before a
    resume loads anything: a missing generator file would otherwise be skipped silently)."""
    from fitrl.core.errors import CheckpointError

    missing = missing_in_checkpoint(path, meta)
    if missing:
        m = missing[0]
        more = (f" (and {len(missing) - 1} more: `fitrl checkpoint verify {path}` lists them)"
                if len(missing) > 1 else "")
        raise CheckpointError(f"checkpoint {path} lacks {m.file} of {m.owner()} ({m.status}){more}: saved where "
                              "that rank's files did not reach this directory (trainer.run_dir not shared by every "
                              "node?)")


def missing_in_role(ckpt: Path, role: str, world_size: int, *, role_state: bool) -> list[Missing]:
    """The files of ``role``'s ``world_size`` ranks that ``ckpt/<role>`` lacks."""
    from fitrl.checkpoint.sharded import METADATA, ROLE_STATE, read_metadata, rng_file, shard_ends  # (torch)
    from fitrl.core.errors import CheckpointError

    role_dir = ckpt / role  # (absent when every rank wrote elsewhere: then every file is missing)
    out = []
    # rank 0's: the index of every shard (written last, by the coordinator) and the role's counters
    rank0 = [METADATA] + ([ROLE_STATE] if role_state else [])
    out += [Missing(role, 0, f"{role}/{name}", "missing") for name in rank0 if not (role_dir / name).is_file()]
    if not (role_dir / METADATA).is_file():
        # without the index, each rank's shard file by DCP's naming (one file per rank)
        out += [Missing(role, r, f"{role}/__{r}_0.distcp", "missing") for r in range(world_size)
                if not (role_dir / f"__{r}_0.distcp").is_file()]
    else:
        try:
            ends = shard_ends(read_metadata(role_dir))
        except CheckpointError as e:
            out.append(Missing(role, 0, f"{role}/{METADATA}", f"unreadable ({e})"))
            ends = {}
        for rel, end in sorted(ends.items()):
            f, owner = role_dir / rel, _shard_owner(rel)
            if not f.is_file():
                out.append(Missing(role, owner, f"{role}/{rel}", "missing"))
            elif f.stat().st_size < end:
                out.append(Missing(role, owner, f"{role}/{rel}",
                                   f"{f.stat().st_size} bytes, its {METADATA} needs {end} (cut short)"))
    # every rank's generators: the one file each rank writes whatever its share of the shards
    out += [Missing(role, r, f"{role}/{rng_file(r)}", "missing") for r in range(world_size)
            if not (role_dir / rng_file(r)).is_file()]
    return out


def _shard_owner(name: str) -> Optional[int]:
    m = _SHARD_RE.match(Path(name).name)
    return int(m.group(1)) if m else None


def by_owner(missing: list[Missing]) -> dict[tuple[str, Optional[int]], list[Missing]]:
    """``missing`` grouped by role and rank, in the order found."""
    out: dict[tuple[str, Optional[int]], list[Missing]] = {}
    for m in missing:
        out.setdefault((m.role, m.rank), []).append(m)
    return out
