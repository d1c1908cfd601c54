"""``fitrl checkpoint verify PATH``: every file of a checkpoint against the sizes and checksums
its ``COMPLETE`` marker recorded when it was saved (fitrl/checkpoint/layout.py).

PATH is a ``step_N`` directory, or a run directory (or its ``checkpoints`` directory): then every
complete checkpoint in it. One line per file, ``OK`` or what is wrong, a summary per checkpoint;
exit status 0 when every file is intact, 1 otherwise. Beyond the files the marker lists, every
rank's files are checked against the role's world size and its DCP metadata
(fitrl/checkpoint/ranks.py): a checkpoint saved where a rank's shard never reached this directory
has a marker that does not list it either. Checkpoints written before checksums existed
are checked by size (said per file). Import-light: the CLI builds its parser from here.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from fitrl.checkpoint import layout, ranks
from fitrl.checkpoint.layout import Checkpoint
from fitrl.core.errors import CheckpointUsageError


def checkpoints_at(spec: str) -> list[Checkpoint]:
    """The checkpoints PATH names: one ``step_N`` (complete or not: an incomplete one is
    reported by :func:`layout.read`), or every complete one of a run directory, oldest first."""
    p = Path(spec)
    if (p / layout.MARKER).is_file() or layout.is_checkpoint_name(p.name):
        return [layout.read(p, verify=False)]
    root = p / layout.CHECKPOINTS if (p / layout.CHECKPOINTS).is_dir() else p
    if not root.is_dir():
        raise CheckpointUsageError(f"checkpoint {spec} does not exist")
    found = layout.list_complete(root)
    if not found:
        raise CheckpointUsageError(f"no complete checkpoint in {root}")
    return found


def verify(spec: str, out=print) -> bool:
    """Check every file of the checkpoints at ``spec``, printing one line per file; True when all are intact."""
    intact = True
    for point in checkpoints_at(spec):
        start = time.perf_counter()
        results = layout.verify_files(point.path, point.meta)
        for rel, status in results:
            where = f"{point.path.name}/{rel}"
            if status.startswith("ok"):  # "ok", or "ok (size only: ...)" for a marker without checksums
                out(f"OK   {where} {status[2:].strip()}".rstrip())
            else:
                out(f"BAD  {where}: {status}")
        unlisted = _unlisted(point, out)
        bad = layout.damaged(results) + [(m.file, m.status) for m in unlisted]
        size = sum((point.path / rel).stat().st_size for rel, _ in results if (point.path / rel).is_file())
        seconds = time.perf_counter() - start
        how = "checksums" if point.meta.get("hashes") else "sizes only (saved before checksums were recorded)"
        out(f"{point.path}: " + (f"{len(bad)} of {len(results) + len(unlisted)} files damaged or missing" if bad else
                                 f"intact, {len(results)} files, {size / 2**20:.1f} MiB checked by {how} in "
                                 f"{seconds:.2f} s"))
        intact &= not bad
    return intact


def _unlisted(point: Checkpoint, out) -> list[ranks.Missing]:
    """Rank files the checkpoint lacks beyond those its marker lists (which verify_files reported),
    one ``BAD`` line each."""
    listed = set(point.meta.get("files", {}))
    found = [m for m in ranks.missing_in_checkpoint(point.path, point.meta) if m.file not in listed]
    for m in found:
        out(f"BAD  {point.path.name}/{m.file}: {m.status}: {m.owner()}'s file, not listed in the {layout.MARKER} "
            "marker (saved where this directory does not see it, e.g. on a node's own disk: trainer.run_dir must be "
            "one filesystem shared by every node)")
    return found


def cmd_checkpoint_verify(args: argparse.Namespace) -> int:
    return 0 if verify(args.path) else 1


def add_checkpoint_command(subparsers) -> None:
    """Register ``fitrl checkpoint verify PATH`` on the CLI's subparsers."""
    p = subparsers.add_parser("checkpoint", help="inspect checkpoints: `fitrl checkpoint verify PATH`")
    sub = p.add_subparsers(dest="checkpoint_command", metavar="ACTION", required=True)
    v = sub.add_parser("verify", help="check every checkpoint file against the sizes and checksums recorded at save "
                                      "time (exit 0: all intact, 1: a file is missing, cut or changed)")
    v.add_argument("path", help="a checkpoint (RUN_DIR/checkpoints/step_N) or a run directory (all its checkpoints)")
    # as on every command (fitrl/cli.py): SUPPRESS keeps an earlier --debug from being reset
    v.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show the traceback of every error")
    v.set_defaults(fn=cmd_checkpoint_verify)
