"""The run directory: created and proven writable first, then held under an exclusive lock.

Two runs on one ``trainer.run_dir`` would damage each other: the second would resume from the
first's checkpoint, rewrite its ``metrics.jsonl`` and replace its checkpoints underneath it. So
:class:`RunDirLock` takes ``fcntl.flock`` on ``RUN/fitrl.lock`` before anything in the directory
is read for resuming or written, and holds it for the whole run:

- the lock file holds the holder's PID, host and start time, so a second run refuses in one line
  naming them;
- the kernel drops a ``flock`` when its process dies, however it dies (SIGKILL, OOM kill, a
  lost node's driver). A lock file left by such a run is taken over, with a notice naming the
  dead holder; a clean exit removes the file;
- creating the lock file is also the write probe: a directory that cannot be written (read-only,
  under /proc, a file in the way) is reported here, in one line, before the tokenizer, the data
  or any model loads.

``flock`` locks are per open file description: another process (or a second ``train()`` in
this process) gets ``EWOULDBLOCK``. On NFS, Linux maps ``flock`` to an NFS byte-range lock, so
runs on several machines sharing the directory exclude each other too (NFSv4, or v3 with lockd).

Every rank writes its checkpoint shards into the run directory as *it* sees it, so a run whose
ranks are Ray actors (possibly on other nodes) needs one directory for all of them: before step
1, :func:`check_shared` has the driver and every rank of the policy leave a marker in it and
look for each other's; a rank that does not see the driver's, or whose marker the driver does
not see, stops the run in one line naming it (docs/distributed.md, "Storage").
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import shutil
import socket
import sys
import time
import uuid
from pathlib import Path
from typing import Any, Callable, Optional

from fitrl.checkpoint.shared_dir import DRIVER_MARK, SHARE_DIR
from fitrl.core.errors import RunDirError

LOCK_NAME = "fitrl.lock"
MARK_WAIT_S = 3.0  # how long the driver looks again for a rank's marker (NFS attribute caching)


def run_dir_path(trainer) -> Path:
    """``trainer.run_dir``, or ``output_dir/<experiment_name>-<timestamp>`` when it is unset;
    absolute, because the ranks resolve it (a relative path would be relative to each worker
    process's own working directory)."""
    if trainer.run_dir:
        return Path(trainer.run_dir).absolute()
    return (Path(trainer.output_dir) / f"{trainer.experiment_name}-{time.strftime('%Y%m%d-%H%M%S')}").absolute()


def _key(trainer) -> str:
    return "trainer.run_dir" if trainer.run_dir else "trainer.output_dir"


def create_run_dir(path: Path, key: str = "trainer.run_dir") -> bool:
    """Make ``path`` (and its parents); True when it did not exist before. One line on failure."""
    existed = path.is_dir()
    try:
        path.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise RunDirError(f"cannot use {path} ({key}): a file is in the way; choose another "
                          f"{key} or move the file") from None
    except NotADirectoryError:
        raise RunDirError(f"cannot create {path} ({key}): a part of that path is a file, not a "
                          f"directory; choose another {key}") from None
    except OSError as e:
        raise RunDirError(f"cannot create {path} ({key}): {_reason(e)}; choose a writable "
                          f"{key}") from None
    return not existed


def _reason(e: OSError) -> str:
    return e.strerror or str(e)


class RunDirLock:
    """``with RunDirLock(path): ...``: the exclusive lock on a run directory for the ``with`` body.

    ``notice`` receives the one line saying a stale lock was taken over. ``remove_if_empty``
    deletes the directory on the way out when this lock created it and nothing else was written
    there (a run that failed its checks leaves no empty timestamped directory behind)."""

    def __init__(self, path: Path, *, key: str = "trainer.run_dir", notice: Optional[Callable[[str], None]] = None,
                 remove_if_empty: bool = False):
        self.path, self.key, self.notice = Path(path), key, notice or (lambda line: print(line, file=sys.stderr))
        self.file = self.path / LOCK_NAME
        self.remove_if_empty = remove_if_empty
        self._fd: Optional[int] = None

    # ------------------------------------------------------------------ taking and releasing

    def acquire(self) -> "RunDirLock":
        while True:
            fd = self._open()
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                os.close(fd)
                if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    raise RunDirError(self._in_use_message()) from None
                raise RunDirError(f"cannot lock {self.path} ({self.key}): {_reason(e)}") from None
            # The holder we waited on may have removed the file between our open and our flock:
            # then we locked an unlinked file, and another run could lock the new one. Retry.
            try:
                same = os.fstat(fd).st_ino == os.stat(self.file).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        self._fd = fd
        previous = _read_holder(fd)
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, (json.dumps(self.holder()) + "\n").encode(), 0)
        except OSError as e:
            self.release()
            raise RunDirError(f"cannot write to {self.path} ({self.key}): {_reason(e)}") from None
        if previous:
            self.notice(f"run directory: took over the lock of {_describe(previous)}, which is no longer running "
                        f"(it ended without removing {self.file})")
        return self

    def _open(self) -> int:
        try:
            return os.open(self.file, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as e:
            raise RunDirError(f"cannot write to {self.path} ({self.key}): {_reason(e)}; choose "
                              f"a writable {self.key}") from None

    def release(self) -> None:
        """Remove the lock file, then drop the lock (in that order: a run that opens the file
        after the unlink gets a new one; one that opened it before sees it is gone and retries)."""
        if self._fd is None:
            return
        try:
            os.unlink(self.file)
        except OSError:
            pass  # read-only by now, or removed by hand: the lock still ends with the descriptor
        os.close(self._fd)
        self._fd = None
        if self.remove_if_empty:
            try:
                self.path.rmdir()  # only if empty: anything the run wrote keeps it
            except OSError:
                pass

    def __enter__(self) -> "RunDirLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()

    # ------------------------------------------------------------------ holder

    @staticmethod
    def holder() -> dict:
        return {"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%dT%H:%M:%S"),
                "command": " ".join(sys.argv)[:500]}

    def _in_use_message(self) -> str:
        try:
            held = json.loads(self.file.read_text() or "{}")
        except (OSError, ValueError):
            held = {}
        who = _describe(held) if held else "another process (it has not written its PID yet)"
        gone = ""
        if held.get("host") == socket.gethostname() and isinstance(held.get("pid"), int) and not _alive(held["pid"]):
            # flock outlives its process only through an inherited descriptor
            gone = f" (PID {held['pid']} is not running: a process it started still holds the lock)"
        return (f"{self.path} is in use by another fitrl run: {who}{gone}; wait for it to end or "
                f"stop it, or choose another {self.key}")


def _read_holder(fd: int) -> dict:
    try:
        raw = os.pread(fd, 4096, 0).decode("utf-8", "replace").strip()
        return json.loads(raw) if raw else {}
    except (OSError, ValueError):
        return {"pid": "?", "host": "?"}  # a lock file we cannot read still says a run ended badly


def _describe(holder: dict) -> str:
    text = f"PID {holder.get('pid', '?')} on host {holder.get('host', '?')}"
    if holder.get("started"):
        text += f", started {holder['started']}"
    return text


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def open_run_dir(trainer, notice: Optional[Callable[[str], None]] = None) -> RunDirLock:
    """Create the run directory of ``trainer`` (the config's section), prove it writable and lock
    it; the caller releases the returned lock (``with open_run_dir(cfg.trainer) as lock: ...``)."""
    path = run_dir_path(trainer)
    key = _key(trainer)
    created = create_run_dir(path, key)
    lock = RunDirLock(path, key=key, notice=notice, remove_if_empty=created)
    return lock


# ---------------------------------------------------------------------- one directory for every rank

def check_shared(run_dir: Path, group: Any, role: str = "policy") -> None:
    """Refuse the run (one line) unless every rank of ``group`` sees ``run_dir`` as the directory
    the driver sees: the driver leaves a marker there, each rank looks for it and leaves its own
    (:func:`fitrl.checkpoint.shared_dir.rank_view`, run on the ranks), the driver looks for theirs.
    Both ways round, so a rank whose directory is another node's local disk is found whichever side
    lacks what."""
    probe = Path(run_dir) / SHARE_DIR / uuid.uuid4().hex[:12]
    probe.mkdir(parents=True)
    try:
        token = probe.name
        (probe / DRIVER_MARK).write_text(json.dumps({"token": token, "host": socket.gethostname()}))
        views = group.call_all("run_dir_view", [(str(run_dir), token)] * group.world_size, {})
        unseen = _unseen_marks(probe, range(group.world_size))
        apart = [v for v in views if not v["sees_driver"] or v["rank"] in unseen]
        if apart:
            raise RunDirError(_apart_message(run_dir, apart, getattr(group, "node_ips", None), role))
    finally:
        shutil.rmtree(probe, ignore_errors=True)
        try:
            probe.parent.rmdir()  # only if empty
        except OSError:
            pass


def _unseen_marks(probe: Path, ranks) -> set[int]:
    """The ranks whose marker the driver does not find in ``probe``, looked for again for up to
    :data:`MARK_WAIT_S` (a network filesystem may show a new file to another client late)."""
    deadline = time.monotonic() + MARK_WAIT_S
    while True:
        unseen = {r for r in ranks if not (probe / f"rank{r}.json").is_file()}
        if not unseen or time.monotonic() >= deadline:
            return unseen
        time.sleep(0.2)


def _apart_message(run_dir: Path, apart: list[dict], node_ips: Optional[list], role: str) -> str:
    parts = []
    for v in apart:
        r = v["rank"]
        where = f"host {v['host']}" + (f", node {node_ips[r]}" if node_ips and r < len(node_ips) else "")
        where += f", Ray node id {v['node_id'][:12]}" if v.get("node_id") else ""
        if not v["sees_driver"]:
            why = "does not see the driver's marker there"
        elif v.get("cannot_write"):
            why = f"sees the driver's marker but cannot write beside it ({v['cannot_write']})"
        else:
            why = "wrote its marker where the driver does not see it"
        parts.append(f"{role} rank {r} ({where}) {why}")
    return (f"trainer.run_dir={run_dir} is not one directory for every rank: {'; '.join(parts)} (the driver runs on "
            f"host {socket.gethostname()}). Each rank writes its checkpoint shards there, so they would be lost: "
            "trainer.run_dir must be one filesystem shared by every node (NFS, Lustre, ...), mounted at the same path")
