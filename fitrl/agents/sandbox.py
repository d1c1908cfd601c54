"""Tool calls in isolated worker processes: time, memory, files, processes and network bounded.

The pool is the reward pool's (fitrl/core/process_pool.py): one call in flight per worker, each
worker in a process group of its own, a call past ``rollout.agent.tool_timeout`` gets its
worker's whole group SIGKILLed and the worker replaced, a worker that dies (a segfault) is
replaced, and the call's outcome says which. Each worker, before it answers a call:

* works in a scratch directory of its own (its cwd, ``HOME`` and ``TMPDIR``), emptied after
  every call so that one episode never reads another's files;
* limits its address space to ``rollout.agent.tool_memory`` (``RLIMIT_AS``: an allocation past it
  raises ``MemoryError`` inside the call), the size of a file it writes (``RLIMIT_FSIZE``) and
  the processes it may start (``RLIMIT_NPROC``); every program it starts inherits them;
* where the kernel lets it (Linux, root or unprivileged user namespaces), runs in a PID
  namespace of its own, sees a filesystem view holding only the system's software, Python and its scratch
  directory, has no network interface, and holds no capability (fitrl/agents/confine.py): these
  hold for every program a tool starts, by any route, and every such program is killed when its
  call returns;
* arms a Python audit hook (PEP 578) for the tool's code: no socket, no new process (``fork``,
  ``subprocess``, ``os.system``, ``exec``), no ``ctypes``, no signal to another process, no file
  opened for writing, created, removed or renamed outside the scratch directory, and no file read
  outside it and Python's own installation.

The audit hook turns a Python tool's usual escapes into readable errors, but it is no boundary
(code in the interpreter can switch it off, and native code never meets it); the namespaces are.
Where the kernel refuses them, the tools that run code (every tool but the built-in calculator)
are refused unless ``rollout.agent.allow_unconfined_tools`` says to run them confined by the
rlimits, the process group and the hook only. The layers active on this machine are in
:attr:`ToolSandbox.layers` (logged once at start). See docs/agents.md ("The sandbox").
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

from fitrl.agents import confine
from fitrl.core.process_pool import Call, Outcome, ProcessPool, serve
from fitrl.rewards.functions import RewardError

_WORKER_CODE = "import sys; from fitrl.agents.sandbox import sandbox_main; sandbox_main(*map(int, sys.argv[1:]))"
FILE_SIZE_LIMIT = 64 << 20
"""Bytes one file written by a tool may reach (``RLIMIT_FSIZE``)."""
PROCESS_LIMIT = 1024
"""``RLIMIT_NPROC`` of a confined worker (threads count): a fork bomb stops there. Linux 5.14+
counts the processes of the worker's own user namespace; older kernels count all of the user's."""
SAFE_TOOLS = frozenset({"calculator"})
"""Tools that run no code the model wrote and start nothing: the only ones run without the
kernel's confinement unless ``rollout.agent.allow_unconfined_tools``."""
_FITRL_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclass(frozen=True)
class SandboxLimits:
    memory_bytes: int = 2 << 30
    """``RLIMIT_AS`` of a worker: its whole address space, the interpreter's ~0.1 GiB included."""
    network: bool = False
    """Whether tools may open sockets (a search tool); the code interpreter never needs to."""
    max_output_chars: int = 2000
    allow_unconfined: bool = False
    """Run tools that run code although the kernel refused the namespaces (``rollout.agent.allow_unconfined_tools``)."""
    namespaces: bool = True
    """False: do not ask the kernel for namespaces, as on a machine that refuses them (tests)."""


class SandboxRefused(Exception):
    """The kernel refused the confinement the configured tools need, and the user did not opt out."""


def needs_confinement(specs: list[str]) -> list[str]:
    """The tools of ``specs`` that run code (every tool but ``SAFE_TOOLS``): a tool of the user's
    is a function fitrl cannot read, and the built-in ``python`` runs what the model wrote."""
    return [s for s in specs if s not in SAFE_TOOLS]


def missing_layers(layers: list[str], network: bool) -> list[str]:
    """The kernel layers ``layers`` lacks (the network namespace only where the network is off)."""
    wanted = ["pid namespace", "filesystem view"] + ([] if network else ["network namespace"])
    return [x for x in wanted if x not in layers]


def refusal(missing: list[str], tools: list[str]) -> str:
    """Why tools that run code are refused on this machine, and the two ways on."""
    return (f"rollout.agent.tools: this machine refuses the sandbox's {', '.join(missing)} (no user namespaces, "
            f"or no mounts in them), so a program that the tools {', '.join(tools)} start could read and write what this "
            "user can and outlive the run; run where user namespaces are allowed (user.max_user_namespaces > 0, "
            "and kernel.unprivileged_userns_clone=1 on Debian/Ubuntu kernels), or set "
            "rollout.agent.allow_unconfined_tools=true to run them bounded by rlimits, a process group and "
            "Python's audit hook only")


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


def probe_layers(limits: SandboxLimits) -> list[str]:
    """The layers a worker gets on this machine (one worker started and stopped, ~0.5 s): the
    start-up check's, so that a refusal comes before any model loads."""
    sandbox = ToolSandbox(["calculator"], num_workers=1, timeout=60.0, limits=limits)
    try:
        sandbox.call([("calculator", {"expression": "1"})])
        return list(sandbox.layers)
    finally:
        sandbox.close()


def sandbox_main(fd: int, driver_pid: int) -> None:
    """A sandbox worker: import the tools, isolate, then answer ``(i, (name, arguments), {})``."""
    serve(fd, driver_pid, lambda *init: _load(*init, conn_fd=fd))


def _load(specs: list[str], limits: SandboxLimits, scratch_root: str, conn_fd: int) -> tuple[Call, list[str]]:
    """The tools imported and this process isolated: answers a call with ``(reply text, seconds)``;
    the layers that took effect."""
    own_group = os.getpgid(0) == os.getpid()          # the pool started it in a session of its own
    # First, before the tools load: the parent left behind is small and waits (confine.py)
    namespaced = limits.namespaces and confine.enter_pid_namespace(conn_fd)
    from fitrl.agents.tools import printable, reply_text, resolve_tool

    tools = {}
    for spec in specs:
        fn = resolve_tool(spec)
        tools[fn.__name__] = fn
    scratch = tempfile.mkdtemp(prefix="w-", dir=scratch_root)
    layers = (["own process group"] if own_group else []) + isolate(scratch, limits, namespaced, scratch_root)
    missing, risky = missing_layers(layers, limits.network), needs_confinement(specs)
    if missing and risky and not limits.allow_unconfined:
        raise SandboxRefused(refusal(missing, risky))

    def call(args: tuple, kw: dict) -> tuple[str, Any, str]:
        name, arguments = args
        started = time.monotonic()
        try:
            with GUARDED:
                value = tools[name](**arguments)
            return "ok", (reply_text(value, limits.max_output_chars), time.monotonic() - started), ""
        except BaseException as e:  # noqa: BLE001 -- whatever the tool raised is its reply
            return "error", None, printable(f"{type(e).__name__}: {e}")
        finally:
            if namespaced:
                confine.end_programs()  # no program a call started outlives it
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


def isolate(scratch: str, limits: SandboxLimits, namespaced: bool, scratch_root: str) -> list[str]:
    """Bound this process as the module's docstring says; the layers that took effect.
    ``namespaced``: it is process 1 of its own user and PID namespaces (confine.py)."""
    import resource

    os.chdir(scratch)
    sys.dont_write_bytecode = True
    os.environ.update(HOME=scratch, TMPDIR=scratch, TMP=scratch, TEMP=scratch)
    tempfile.tempdir = scratch
    resource.setrlimit(resource.RLIMIT_AS, (limits.memory_bytes, limits.memory_bytes))
    resource.setrlimit(resource.RLIMIT_FSIZE, (FILE_SIZE_LIMIT, FILE_SIZE_LIMIT))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    # Unconfined, a program started would outlive the worker: none may start (not enforced for root)
    nproc = PROCESS_LIMIT if namespaced else 0
    resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))
    layers = ["rlimits"]
    if namespaced:
        readable = [sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix, _FITRL_PACKAGE]
        if limits.network:  # the resolver's settings, where /etc/resolv.conf links out of /etc (systemd's /run)
            readable.append(os.path.dirname(os.path.realpath("/etc/resolv.conf")))
        layers += ["pid namespace"] + confine.confine(scratch, tempfile.mkdtemp(prefix="view-", dir=scratch_root),
                                                      limits.network, readable)
    os.chdir(scratch)  # again: the cwd taken above was the directory under the view's bind mount
    GUARDED.arm(scratch, network=limits.network)
    return layers + ["audit hook"]


class _Guard:
    """The audit hook: refuses what a tool must not do once :meth:`arm` has run; inside a
    ``with GUARDED:`` block only (the worker's own messages to the driver use its socket). It
    gives a Python tool's usual escapes a readable error; the tool's code can switch it off, so
    the boundary is confine.py's."""

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
