"""Calls in worker processes, each under a wall-clock limit: the one pool behind the reward
workers (fitrl/rewards/pool.py) and the agents' tool sandbox (fitrl/agents/sandbox.py), which
differ only in what a worker loads and how it answers one call.

Why processes: a verifier can hang where no signal reaches it (sympy evaluating ``9^{9^{9^9}}``
spends minutes inside one C-level integer power), and math-verify's own ``signal.alarm`` timeout
only works on a main thread. Killing the process is the one bound that always holds.

Why not ``concurrent.futures.ProcessPoolExecutor``: it cannot kill one hung worker, and a worker
that dies breaks the whole pool. Here each worker has its own socket and at most one call in
flight, so the driver knows which call each worker is running and since when; a call past its
deadline gets its worker killed (SIGKILL) and a fresh one started in its place, not waited for.

Why a plain ``python -c`` subprocess and not ``multiprocessing.Process``: ``fork`` would copy a
driver holding torch's threads and maybe a CUDA context, and ``spawn``/``forkserver`` re-import
the driver's ``__main__`` in every worker: with a training script that imports torch, that is
~3 s and ~170 MB per worker (measured) instead of ~0.4 s and ~60 MB. Workers ignore SIGINT
(Ctrl-C stops the driver, which shuts them down) and exit when the driver's end of their socket
closes; on Linux the kernel also kills them when the driver dies (``PR_SET_PDEATHSIG``), even in
the middle of a hung call. That signal follows the *thread* that started the worker: call from
threads that live as long as the pool (the main thread, or a long-lived executor thread).
Each worker leads a process group of its own (a new session), and a worker stopped or replaced
takes its whole group with it (``killpg``): a program that user code started and left running
ends with its worker (the tool sandbox confines them further, fitrl/agents/confine.py).

Calls are submitted and collected by key (:meth:`ProcessPool.submit`, :meth:`ProcessPool.collect`),
so a caller can go on while they run (the agents' tools, fitrl/rollout/agent.py); ``run()`` is
both at once. Not thread-safe. Standard library only: the workers import this module.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import weakref
from collections import deque
from multiprocessing.connection import Connection, Pipe, wait
from pathlib import Path
from typing import Any, Callable, NamedTuple, Optional

START_TIMEOUT_S = 120.0
"""A worker that has not loaded what it serves after this long is an error, not a wait."""
_FITRL_ROOT = str(Path(__file__).resolve().parents[2])     # where ``import fitrl`` works from


class Outcome(NamedTuple):
    status: str          # "ok" | "error" | "timeout"
    value: Any = None    # the function's return value when ok
    detail: str = ""     # "ValueError: ..." plus the worker's traceback, or why it timed out / died


Call = Callable[[tuple, dict], tuple[str, Any, str]]
"""A worker's answer to one call ``(args, kw)``: ``(status, value, detail)`` as in :class:`Outcome`."""


class _Worker:
    def __init__(self, proc: subprocess.Popen, conn: Connection):
        self.proc, self.conn = proc, conn
        self.started = time.monotonic()
        self.ready = False
        self.call: Optional[int] = None      # key of the call in flight
        self.info: Any = None
        self.deadline = 0.0


class ProcessPool:
    """``num_workers`` processes, each started as ``python -c worker_code FD DRIVER_PID`` (a line
    that calls :func:`serve`) and sent ``(sys.path, *init)``; ``name`` is what the workers load,
    as load errors name it. A subclass sets ``worker_code``, ``what`` and ``error``."""

    worker_code = ""
    what = "worker"
    """The worker's kind, as errors name it (``a reward worker could not load ...``)."""
    error: type[Exception] = RuntimeError
    """What a worker that cannot load, or dies loading, raises in the driver."""

    def __init__(self, name: str, init: tuple, *, num_workers: int, timeout: float):
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        self.spec, self.timeout = name, timeout
        self.restarts = 0                      # workers replaced after a timeout or a crash, ever
        self._init = init
        self._queue: deque[tuple[int, tuple, dict[str, Any]]] = deque()  # submitted, not yet sent
        self._done: dict[int, Outcome] = {}    # outcomes not yet collected, by key
        self._next_key = 0
        # Started now and not waited for: they load while the driver loads the model.
        self._workers = [self._start() for _ in range(num_workers)]
        # Runs at close() or when the pool is garbage-collected; holds the list, not the pool.
        self._finalizer = weakref.finalize(self, _shutdown, self._workers)

    def _start(self) -> _Worker:
        parent, child = Pipe(duplex=True)
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [_FITRL_ROOT, os.environ.get("PYTHONPATH")])))
        proc = subprocess.Popen([sys.executable, "-c", self.worker_code, str(child.fileno()), str(os.getpid())],
                                pass_fds=[child.fileno()], env=env, stdin=subprocess.DEVNULL, start_new_session=True)
        child.close()                          # the worker holds the only other end: EOF when it dies
        parent.send((list(sys.path), *self._init))
        return _Worker(proc, parent)

    def _replace(self, w: _Worker) -> None:
        _stop(w, kill=True)
        self._workers[self._workers.index(w)] = self._start()
        self.restarts += 1

    def run(self, calls: list[tuple[tuple, dict[str, Any]]],
            on_result: Callable[[], None] = lambda: None) -> list[Outcome]:
        """Each ``(args, kw)`` called once; outcomes in order. Takes at most about
        ``ceil(len(calls) / num_workers) * timeout`` seconds once the workers are up. ``on_result``
        is called as results arrive (the hang watchdog's heartbeat)."""
        keys = [self.submit(args, kw) for args, kw in calls]
        results: dict[int, Outcome] = {}
        while len(results) < len(keys):
            results.update(self.collect(block=True, on_result=on_result))
        return [results[k] for k in keys]

    def submit(self, args: tuple, kw: dict[str, Any]) -> int:
        """Queue one call; returns its key, which :meth:`collect` reports with its outcome."""
        if not self._finalizer.alive:
            raise RuntimeError(f"the {self.what} pool is closed")  # fitrl's own misuse, not the user's code
        self._next_key += 1
        self._queue.append((self._next_key, args, kw))
        return self._next_key

    @property
    def in_flight(self) -> int:
        """Calls submitted and not yet reported by :meth:`collect`."""
        return len(self._queue) + len(self._done) + sum(w.call is not None for w in self._workers)

    def collect(self, block: bool, on_result: Callable[[], None] = lambda: None) -> dict[int, Outcome]:
        """The outcomes finished since the last call, by key: sends queued calls to idle workers,
        reads what came back, and kills the workers past their deadline. ``block``: wait until at
        least one outcome is ready (or the next deadline passes) when none is; else return at once."""
        while True:
            self._dispatch()
            waiting = [w for w in self._workers if w.call is not None or not w.ready]
            if self._done or not waiting or not block:
                timeout = 0.0
            else:
                until = min(w.deadline if w.ready else w.started + START_TIMEOUT_S for w in waiting)
                timeout = max(0.0, until - time.monotonic())
            ready = wait([w.conn for w in waiting], timeout=timeout) if waiting else []
            for w in waiting:
                if w.conn in ready:
                    self._receive(w, self._done)
                    on_result()
            now = time.monotonic()
            for w in list(self._workers):
                if w.call is not None and now >= w.deadline:
                    self._done[w.call] = Outcome("timeout", detail=f"no result within {self.timeout:g}s; worker killed")
                    self._replace(w)
                elif not w.ready and now >= w.started + START_TIMEOUT_S:
                    raise self.error(f"a {self.what} worker did not load {self.spec} within {START_TIMEOUT_S:g}s")
            if self._done or not block or self.in_flight == 0:
                done, self._done = self._done, {}
                return done

    def _dispatch(self) -> None:
        """Queued calls to the idle workers, oldest first."""
        for w in list(self._workers):
            if w.ready and w.call is None and self._queue:
                if _dead(w.proc):                        # died while idle: costs no call anything
                    self._replace(w)
                    continue
                key, args, kw = self._queue[0]
                try:
                    w.conn.send((key, args, kw))
                except (BrokenPipeError, ConnectionResetError):  # died just now: the call waits
                    self._replace(w)
                    continue
                self._queue.popleft()
                w.call, w.deadline = key, time.monotonic() + self.timeout

    def _receive(self, w: _Worker, results: dict[int, Outcome]) -> None:
        try:
            msg = w.conn.recv()
        except (EOFError, OSError):
            why = f"{self.what} worker process died (exit code {_end(w.proc, grace=1.0)})"
            if not w.ready:
                raise self.error(f"{why} while loading {self.spec}") from None
            if w.call is not None:
                results[w.call] = Outcome("error", detail=why)
            self._replace(w)
            return
        if msg[0] == "ready":
            w.ready = True
            w.info = msg[2]                    # what the worker reports of itself (a sandbox's layers)
        elif msg[0] == "init_error":
            raise self.error(f"a {self.what} worker could not load {self.spec}: {msg[1]}")
        else:
            i, status, value, detail = msg
            results[i] = Outcome(status, value, detail)
            w.call = None

    def close(self) -> None:
        self._finalizer()


def _reap(proc: subprocess.Popen) -> Optional[int]:
    try:
        return proc.wait(timeout=1.0)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait()


def _stop(w: _Worker, kill: bool) -> None:
    w.conn.close()                             # an idle worker reads EOF and exits
    _end(w.proc, grace=0.0 if kill else 1.0)


def _end(proc: subprocess.Popen, grace: float) -> Optional[int]:
    """``proc``'s exit code once it and its whole process group are gone; it has ``grace``
    seconds to exit by itself first (and to report a crash's signal as its own)."""
    if grace:
        _exited(proc, grace)
    _kill_group(proc)                          # the worker, if still there, and what it started
    return _reap(proc)


def _exited(proc: subprocess.Popen, timeout: float) -> None:
    """Wait up to ``timeout`` for ``proc`` to exit, without reaping it (:func:`_dead`)."""
    until = time.monotonic() + timeout
    while not _dead(proc) and time.monotonic() < until:
        time.sleep(0.01)


def _dead(proc: subprocess.Popen) -> bool:
    """Whether ``proc`` has exited, left unreaped where the OS allows: while it is, its pid, which
    is its group's id, cannot be given to another process, so killpg hits only its group."""
    waitid = getattr(os, "waitid", None)
    if waitid is None or proc.returncode is not None:  # (macOS: a check that reaps)
        return proc.poll() is not None
    try:
        return waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:                  # reaped already
        return True


def _kill_group(proc: subprocess.Popen) -> None:
    if proc.returncode is not None:            # reaped: its group id may belong to someone else now
        return
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _shutdown(workers: list[_Worker]) -> None:
    for w in workers:
        _stop(w, kill=w.call is not None or not w.ready)


def serve(fd: int, driver_pid: int, load: Callable[..., tuple[Call, Any]]) -> None:
    """A worker process: ``load(*init)`` returns ``(call, info)`` (``info``: what the driver is
    told of this worker, or None), then ``(i, args, kw)`` calls are answered until EOF. A load
    that raises is reported to the driver, which raises; ``call`` catches what the call raises."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    die_with_driver(driver_pid)
    conn = Connection(fd)
    try:
        sys_path, *init = conn.recv()
        sys.path[:] = sys_path                 # ``package.module:function`` imports as in the driver
        call, info = load(*init)
    except BaseException as e:  # noqa: BLE001 -- reported to the driver, which raises
        conn.send(("init_error", f"{type(e).__name__}: {e}"))
        return
    conn.send(("ready", os.getpid(), info))
    while True:
        try:
            i, args, kw = conn.recv()
        except (EOFError, OSError):
            return
        reply = (i, *call(args, kw))
        try:
            conn.send(reply)
        except Exception as e:  # noqa: BLE001 -- an unpicklable return value
            conn.send((i, "ok", _Unpicklable(f"{type(reply[2]).__name__} ({e})"), ""))


def die_with_driver(driver_pid: int) -> None:
    """A worker stuck in C code never reads the EOF of a driver killed by the OOM killer; on Linux
    the kernel kills it instead (it then dies with the driver thread that started it)."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)   # PR_SET_PDEATHSIG
    if os.getppid() != driver_pid:                                   # the driver died before that
        os._exit(0)


class _Unpicklable:
    """Stands in for a return value that could not be sent back; the reward's read_result
    (fitrl/rewards/functions.py) rejects it by name."""

    def __init__(self, what: str):
        self.what = what

    def __str__(self) -> str:
        return f"unpicklable {self.what}"
