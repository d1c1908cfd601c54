"""Tool calls in isolated worker processes: time, memory, files, processes and network bounded.

The pool is the reward pool's (fitrl/core/process_pool.py): one call in flight per worker, a call past
``rollout.agent.tool_timeout`` gets its worker SIGKILLed and replaced, a worker that dies (a
segfault) is replaced, and the call's outcome says which. Each worker, before it answers a call:

* works in a scratch directory of its own (its cwd, ``HOME`` and ``TMPDIR``), emptied after
  every call so that one episode never reads another's files;
* limits its address space to ``rollout.agent.tool_memory`` (``RLIMIT_AS``: an allocation past it
  raises ``MemoryError`` inside the call) and the size of a file it writes (``RLIMIT_FSIZE``);
* where the kernel lets it (Linux, root or unprivileged user namespaces), enters namespaces of its
  own: a network namespace with no interface up (no connection leaves the process) and a mount
  namespace in which every mount but the scratch directory is read-only;
* arms a Python audit hook (PEP 578) for the tool's code: no socket, no new process (``fork``,
  ``subprocess``, ``os.system``, ``exec``), no ``ctypes``, no signal to another process, no file
  opened for writing, created, removed or renamed outside the scratch directory, and no file read
  outside it and Python's own installation.

Each refusal is an exception inside the tool's call, returned to the model as the tool's error.
The layers active on this machine are in :attr:`ToolSandbox.layers` (logged once at start).
The audit hook is the one layer that always holds for Python code; the kernel layers also hold
for native code. See docs/agents.md ("The sandbox").
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
import weakref
from dataclasses import dataclass
from typing import Any, Optional

from fitrl.core.process_pool import Call, Outcome, ProcessPool, serve
from fitrl.rewards.functions import RewardError

_WORKER_CODE = "import sys; from fitrl.agents.sandbox import sandbox_main; sandbox_main(*map(int, sys.argv[1:]))"
FILE_SIZE_LIMIT = 64 << 20
"""Bytes one file written by a tool may reach (``RLIMIT_FSIZE``)."""


@dataclass(frozen=True)
class SandboxLimits:
    memory_bytes: int = 2 << 30
    """``RLIMIT_AS`` of a worker: its whole address space, the interpreter's ~0.1 GiB included."""
    network: bool = False
    """Whether tools may open sockets (a search tool); the code interpreter never needs to."""
    max_output_chars: int = 2000


class ToolSandbox(ProcessPool):
    """``num_workers`` isolated processes calling the tools ``specs`` names.

    ``call([(name, arguments), ...])`` returns one :class:`~fitrl.core.process_pool.Outcome` per call,
    its value the tool's reply as text; ``submit_call`` and ``collect`` run calls while the caller
    goes on."""

    worker_code = _WORKER_CODE
    what = "tool"
    error = RewardError  # (a tool that cannot load stops the run as a reward function that cannot does)

    def __init__(self, specs: list[str], *, num_workers: int, timeout: float, limits: SandboxLimits):
        self.scratch_root = tempfile.mkdtemp(prefix="fitrl-tools-")
        self.limits = limits
        super().__init__("rollout.agent.tools", (list(specs), limits, self.scratch_root), num_workers=num_workers,
                         timeout=timeout)
        self.layers: list[str] = []
        self._remove_scratch = weakref.finalize(self, shutil.rmtree, self.scratch_root, True)

    def call(self, calls: list[tuple[str, dict]], on_result=lambda: None) -> list[Outcome]:
        """Every call at once; outcomes in order."""
        return self.run([((name, args), {}) for name, args in calls], on_result)

    def submit_call(self, name: str, arguments: dict) -> int:
        """One call queued; :meth:`collect` reports its outcome under the key returned."""
        return self.submit((name, arguments), {})

    def collect(self, block: bool, on_result=lambda: None) -> dict[int, Outcome]:
        done = super().collect(block, on_result)
        if not self.layers:
            self.layers = self._layers()
        return done

    def _layers(self) -> list[str]:
        for w in self._workers:
            if w.ready and w.info:
                return list(w.info)
        return []

    def close(self) -> None:
        super().close()
        self._remove_scratch()


def sandbox_main(fd: int, driver_pid: int) -> None:
    """A sandbox worker: import the tools, isolate, then answer ``(i, (name, arguments), {})``."""
    serve(fd, driver_pid, _load)


def _load(specs: list[str], limits: SandboxLimits, scratch_root: str) -> tuple[Call, list[str]]:
    """The tools imported and this process isolated: answers a call with ``(reply text, seconds)``;
    the layers that took effect."""
    from fitrl.agents.tools import reply_text, resolve_tool

    tools = {}
    for spec in specs:
        fn = resolve_tool(spec)
        tools[fn.__name__] = fn
    scratch = tempfile.mkdtemp(prefix=f"w{os.getpid()}-", dir=scratch_root)
    layers = isolate(scratch, limits)

    def call(args: tuple, kw: dict) -> tuple[str, Any, str]:
        name, arguments = args
        started = time.monotonic()
        try:
            with GUARDED:
                value = tools[name](**arguments)
            return "ok", (reply_text(value, limits.max_output_chars), time.monotonic() - started), ""
        except BaseException as e:  # noqa: BLE001 -- whatever the tool raised is its reply
            return "error", None, f"{type(e).__name__}: {e}"
        finally:
            _empty(scratch)            # no episode reads another's files

    return call, layers


def _empty(scratch: str) -> None:
    for entry in os.scandir(scratch):
        if entry.is_dir(follow_symlinks=False):
            shutil.rmtree(entry.path, ignore_errors=True)
        else:
            try:
                os.unlink(entry.path)
            except OSError:
                pass


def isolate(scratch: str, limits: SandboxLimits) -> list[str]:
    """Bound this process as the module's docstring says; the layers that took effect."""
    import resource

    os.chdir(scratch)
    sys.dont_write_bytecode = True
    os.environ.update(HOME=scratch, TMPDIR=scratch, TMP=scratch, TEMP=scratch)
    tempfile.tempdir = scratch
    resource.setrlimit(resource.RLIMIT_AS, (limits.memory_bytes, limits.memory_bytes))
    resource.setrlimit(resource.RLIMIT_FSIZE, (FILE_SIZE_LIMIT, FILE_SIZE_LIMIT))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    layers = ["rlimits"]
    layers += _namespaces(scratch, network=limits.network)
    os.chdir(scratch)  # again: the cwd taken above is the directory under the scratch's bind mount (read-only)
    GUARDED.arm(scratch, network=limits.network)
    return layers + ["audit hook"]


def _namespaces(scratch: str, network: bool) -> list[str]:
    """Enter new mount (and network) namespaces where the kernel allows it; [] where it does not."""
    if not sys.platform.startswith("linux"):
        return []
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    newns, newnet, newuser = 0x00020000, 0x40000000, 0x10000000
    flags = newns | (0 if network else newnet)
    uid, gid = os.getuid(), os.getgid()
    if libc.unshare(flags) != 0:
        if libc.unshare(flags | newuser) != 0:
            return []
        _map_ids(uid, gid)  # unmapped, this process would be "nobody" and could not write its own scratch
    layers = [] if network else ["network namespace"]
    rdonly, remount, bind, rec, private = 1, 32, 4096, 16384, 1 << 18
    if libc.mount(None, b"/", None, rec | private, None) != 0:
        return layers
    if libc.mount(scratch.encode(), scratch.encode(), None, bind | rec, None) != 0:
        return layers
    with open("/proc/self/mountinfo") as f:
        points = [line.split()[4] for line in f]
    failed = 0
    for point in reversed(points):
        if point != scratch:
            failed += libc.mount(None, point.encode(), None, remount | bind | rdonly, None) != 0
    return layers + (["read-only mounts"] if not failed else [])


def _map_ids(uid: int, gid: int) -> None:
    """Inside a new user namespace, keep this process's own user and group ids."""
    try:
        with open("/proc/self/setgroups", "w") as f:
            f.write("deny")
        with open("/proc/self/uid_map", "w") as f:
            f.write(f"{uid} {uid} 1")
        with open("/proc/self/gid_map", "w") as f:
            f.write(f"{gid} {gid} 1")
    except OSError:
        pass


class _Guard:
    """The audit hook: refuses what a tool must not do once :meth:`arm` has run; inside a
    ``with GUARDED:`` block only (the worker's own messages to the driver use its socket)."""

    WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
    PROCESS = ("os.fork", "os.forkpty", "os.posix_spawn", "os.spawn", "os.exec", "os.system", "os.startfile",
               "subprocess.Popen", "pty.spawn")
    CHANGES = ("os.remove", "os.rename", "os.rmdir", "os.mkdir", "os.chmod", "os.chown", "os.link", "os.symlink",
               "os.truncate", "os.utime", "shutil.rmtree", "shutil.copyfile", "shutil.move")

    def __init__(self) -> None:
        self.scratch: Optional[str] = None
        self.readable: tuple[str, ...] = ()
        self.network = False
        self.active = False

    def arm(self, scratch: str, network: bool) -> None:
        self.scratch = os.path.realpath(scratch)
        roots = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix}
        self.readable = tuple(os.path.realpath(r) + os.sep for r in roots) + (self.scratch + os.sep,)
        self.network = network
        sys.addaudithook(self._hook)

    def __enter__(self) -> None:
        self.active = True

    def __exit__(self, *exc: Any) -> None:
        self.active = False

    def _inside(self, path: Any, roots: tuple[str, ...]) -> bool:
        if isinstance(path, int):
            return True  # an open file descriptor: opening it was checked
        p = os.path.realpath(os.fsdecode(path))
        return p == self.scratch or (p + os.sep).startswith(roots) or p in ("/dev/null", "/dev/urandom")

    def _hook(self, event: str, args: tuple) -> None:
        if not self.active:
            return
        if event == "open":
            path, mode, flags = (tuple(args) + (None, None))[:3]
            writes = (isinstance(mode, str) and any(c in mode for c in "wax+")) or \
                (isinstance(flags, int) and bool(flags & self.WRITE_FLAGS))
            if writes and not self._inside(path, (self.scratch + os.sep,)):
                raise PermissionError(f"sandbox: writing outside the scratch directory is not allowed: {path}")
            if not writes and not self._inside(path, self.readable):
                raise PermissionError(f"sandbox: reading outside the scratch directory is not allowed: {path}")
        elif event.startswith(self.PROCESS):
            raise PermissionError(f"sandbox: starting processes is not allowed ({event})")
        elif event.startswith(self.CHANGES):
            if not all(self._inside(a, (self.scratch + os.sep,)) for a in args[:2] if isinstance(a, (str, bytes))):
                raise PermissionError(f"sandbox: changing files outside the scratch directory is not allowed ({event})")
        elif event.startswith("socket.") and not self.network:
            raise PermissionError(f"sandbox: network access is not allowed ({event})")
        elif event.startswith("ctypes."):
            raise PermissionError(f"sandbox: ctypes is not allowed ({event})")
        elif event == "os.kill" and args and args[0] not in (0, os.getpid()):
            raise PermissionError("sandbox: signalling other processes is not allowed")


GUARDED = _Guard()
