"""The kernel's half of the tool sandbox (fitrl/agents/sandbox.py): bounds that hold for every
process a tool's code starts, by whatever route (``os.posix_spawn``, ``ctypes`` calling
``execve``, ``_posixsubprocess``, a native library), not only for the tool's Python calls.

The audit hook of fitrl/agents/sandbox.py sees Python's own calls, and code in the same
interpreter can switch it off; what is here cannot be undone from inside:

* **a PID namespace** (:func:`enter_pid_namespace`): the worker runs in a namespace of its own,
  so every program a tool starts lives in it, ``setsid`` or not. The worker kills them
  all when a call returns (:func:`end_programs`), and the kernel kills whatever is left when the
  worker dies (a timeout's SIGKILL, a crash, the driver's exit);
* **a filesystem view** (:func:`confine`): a mount namespace whose root is an empty read-only
  tmpfs holding, read-only, the system's software directories (``SYSTEM_DIRS``), Python's
  installation and the fitrl package, five character devices, and the worker's scratch
  directory, the one writable place. Nothing else is there (no home, ``/tmp``, ``/proc``, run
  directories or datasets), so no descendant can read or write it;
* **a network namespace** with no interface up, unless ``rollout.agent.tool_network``;
* **no capabilities**: the worker is root of its user namespace only while it builds the view,
  then drops every capability and the bounding set (``no_new_privs``), so neither it nor a
  program it starts can remount, unmount, ``chroot`` out or gain privileges by ``exec``.

All of it needs Linux with user namespaces (root, or ``user.max_user_namespaces > 0`` and, on
Debian/Ubuntu kernels, ``kernel.unprivileged_userns_clone=1``); elsewhere :func:`enter_pid_namespace`
returns False and the sandbox refuses tools that run code unless the user opts in
(``rollout.agent.allow_unconfined_tools``, docs/agents.md "The sandbox").

Standard library only, Linux only where it acts: the sandbox's workers import this module.
"""

from __future__ import annotations

import os
import select
import signal
import sys
from typing import Any

CLONE_NEWNS, CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x00020000, 0x10000000, 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT = 1, 2, 4, 8, 32
MS_BIND, MS_REC, MS_PRIVATE = 4096, 16384, 1 << 18
MS_NOATIME, MS_NODIRATIME, MS_RELATIME = 1024, 2048, 1 << 21
ST_RELATIME = 4096                       # statvfs's bit for MS_RELATIME (the other bits are the MS_ ones)
PR_SET_PDEATHSIG, PR_CAPBSET_DROP, PR_SET_NO_NEW_PRIVS = 1, 24, 38
PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "riscv64": 41, "ppc64le": 203, "s390x": 217}
"""``pivot_root``'s syscall number (glibc has no wrapper for it)."""

SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc")
"""Shown read-only in the view: what the programs a tool starts need to run (``/etc`` for the
dynamic loader's cache, ``alternatives`` links, certificates and resolver settings)."""
DEVICES = ("/dev/null", "/dev/zero", "/dev/full", "/dev/random", "/dev/urandom")


def _libc() -> Any:
    import ctypes

    return ctypes.CDLL(None, use_errno=True)


def _check(ret: int, what: str) -> None:
    if ret != 0:
        import ctypes

        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def enter_pid_namespace(conn_fd: int) -> bool:
    """Move this (single-threaded) worker into new user and PID namespaces.

    Forks twice. The process the driver started and kills stays outside: it closes the driver's
    socket ``conn_fd``, waits, and exits as the worker did (it never returns). Its child is the
    namespace's process 1: it reaps the orphans the tools' programs leave and exits when the
    worker does, and the kernel then kills every process left in the namespace. Its child, the
    worker, returns True; the kernel kills each of the three when its parent dies. The worker is
    not process 1 itself because that one ignores the signals it sends itself (``raise(SIGSEGV)``
    would not end it). False, with nothing changed, where the kernel refuses the namespaces."""
    global _NAMESPACED
    if not sys.platform.startswith("linux"):
        return False
    libc = _libc()
    uid, gid = os.getuid(), os.getgid()
    if libc.unshare(CLONE_NEWUSER | CLONE_NEWPID) != 0:
        return False
    _map_ids(uid, gid)
    init = _fork_dying_with_parent(libc)
    if init:
        os.close(conn_fd)                    # the driver reads EOF when the worker dies, not when this one does
        code = os.waitstatus_to_exitcode(os.waitpid(init, 0)[1])
        if code > 128:                       # the worker's signal (the driver reads "exit code -11" for a segfault)
            import resource

            resource.setrlimit(resource.RLIMIT_CORE, (0, 0))   # the signal's, not a core file of this process
            signal.signal(code - 128, signal.SIG_DFL)
            os.kill(os.getpid(), code - 128)
        os._exit(code)
    worker = _fork_dying_with_parent(libc)
    if worker:
        os.close(conn_fd)
        while True:                          # process 1: reap every orphan until the worker ends
            pid, status = os.wait()
            if pid == worker:
                code = os.waitstatus_to_exitcode(status)
                os._exit(128 - code if code < 0 else code)
    _NAMESPACED = True
    return True


_NAMESPACED = False
"""Whether this process is the worker :func:`enter_pid_namespace` made."""


def _fork_dying_with_parent(libc: Any) -> int:
    """``os.fork()``, the child armed to be SIGKILLed when its parent dies."""
    alive_r, alive_w = os.pipe()             # EOF on alive_r: the parent is gone
    pid = os.fork()
    if pid:
        os.close(alive_r)
        return pid                           # alive_w stays open as long as the parent lives
    os.close(alive_w)
    _check(libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "prctl(PR_SET_PDEATHSIG)")
    if select.select([alive_r], [], [], 0)[0]:   # the parent died before the signal was armed
        os._exit(0)
    os.close(alive_r)
    return 0


def _map_ids(uid: int, gid: int) -> None:
    """Inside a new user namespace, keep this process's own user and group ids (unmapped, it
    would be "nobody" and could not write its own scratch directory)."""
    with open("/proc/self/setgroups", "w") as f:
        f.write("deny")
    with open("/proc/self/uid_map", "w") as f:
        f.write(f"{uid} {uid} 1")
    with open("/proc/self/gid_map", "w") as f:
        f.write(f"{gid} {gid} 1")


def confine(scratch: str, view: str, network: bool, readable: list[str]) -> list[str]:
    """In the worker :func:`enter_pid_namespace` made: new mount (and network) namespaces, the
    filesystem view built on the empty directory ``view`` (``readable``: the directories shown
    read-only besides ``SYSTEM_DIRS``), then every capability dropped. The layers that took
    effect; raises where capabilities could not be dropped (nothing may run with them)."""
    libc = _libc()
    layers = []
    if libc.unshare(CLONE_NEWNS | (0 if network else CLONE_NEWNET)) == 0:
        layers += [] if network else ["network namespace"]
        try:
            _build_view(libc, scratch, view, readable)
            layers.append("filesystem view")
        except OSError:
            pass                             # reported as a missing layer; the caller decides
    _drop_capabilities(libc)
    return layers


def _build_view(libc: Any, scratch: str, view: str, readable: list[str]) -> None:
    _check(libc.mount(None, b"/", None, MS_REC | MS_PRIVATE, None), "mount --make-rprivate /")
    _check(libc.mount(b"tmpfs", view.encode(), b"tmpfs", MS_NOSUID | MS_NODEV, b"size=1m,mode=755"), "mount tmpfs")
    shown: list[str] = []
    for d in sorted({os.path.realpath(p) for p in readable} | set(SYSTEM_DIRS)):
        if any(d == s or d.startswith(s + os.sep) for s in shown):
            continue                         # inside a directory already shown
        if os.path.islink(d) and d in SYSTEM_DIRS:   # /bin -> usr/bin on merged-/usr systems
            os.makedirs(os.path.dirname(view + d), exist_ok=True)
            os.symlink(os.readlink(d), view + d)
        elif os.path.isdir(d):
            _bind(libc, d, view + d, read_only=True)
        shown.append(d)
    if os.geteuid() == 0:
        _mask_private(libc, view)
    for dev in DEVICES:
        if os.path.exists(dev):
            _bind(libc, dev, view + dev, read_only=False)
    _bind(libc, scratch, view + scratch, read_only=False)
    os.makedirs(view + "/.old")
    os.chdir(view)
    import platform

    if platform.machine() not in PIVOT_ROOT:
        raise OSError(0, f"pivot_root: no syscall number known for {platform.machine()}")
    _check(libc.syscall(PIVOT_ROOT[platform.machine()], b".", b".old"), "pivot_root")
    _check(libc.umount2(b"/.old", 2), "umount /.old")               # MNT_DETACH: the host's tree is gone
    os.rmdir("/.old")
    _check(libc.mount(None, b"/", None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV, None), "remount / ro")
    os.chdir(scratch)


def _bind(libc: Any, src: str, dst: str, read_only: bool) -> None:
    if os.path.isdir(src):
        os.makedirs(dst, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        open(dst, "a").close()
    _check(libc.mount(src.encode(), dst.encode(), None, MS_BIND, None), f"bind {src}")
    if read_only:
        # A remount inside a user namespace must keep the flags the host's mount has (EPERM otherwise)
        f = os.statvfs(src).f_flag
        kept = f & (MS_NOSUID | MS_NODEV | MS_NOEXEC | MS_NOATIME | MS_NODIRATIME)
        kept |= MS_RELATIME if f & ST_RELATIME else 0
        _check(libc.mount(None, dst.encode(), None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | kept, None),
               f"remount {src} read-only")


def _mask_private(libc: Any, view: str) -> None:
    """Run as root, the worker is its namespace's root mapped to the host's, and owner-only files
    in /etc (``shadow``, ssh host keys) would stay readable to it without capabilities: each is
    covered by /dev/null, each such directory by an empty read-only tmpfs."""
    for top, dirs, files in os.walk("/etc"):
        for name in dirs + files:
            path = os.path.join(top, name)
            try:
                st = os.lstat(path)
            except OSError:
                continue
            if st.st_mode & 0o004 or os.path.islink(path):
                continue
            if name in dirs:
                dirs.remove(name)
                _check(libc.mount(b"tmpfs", (view + path).encode(), b"tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV,
                                  b"size=4k"), f"mask {path}")
            else:
                _check(libc.mount(b"/dev/null", (view + path).encode(), None, MS_BIND, None), f"mask {path}")


def _drop_capabilities(libc: Any) -> None:
    import ctypes

    class Header(ctypes.Structure):
        _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]

    class Data(ctypes.Structure):
        _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]

    for cap in range(64):                    # past the kernel's last capability: EINVAL, ignored
        libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0)
    _check(libc.capset(ctypes.byref(Header(0x20080522, 0)), (Data * 2)()), "capset")   # _LINUX_CAPABILITY_VERSION_3
    _check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(PR_SET_NO_NEW_PRIVS)")


def end_programs() -> None:
    """In the worker of :func:`enter_pid_namespace`: kill every other process in its namespace
    but process 1, the programs the last call started, and reap its own, so none outlives its
    call and none holds a file of the next episode's scratch directory."""
    if not _NAMESPACED or os.getpid() != 2:  # kill(-1) anywhere else would reach the user's every process
        raise RuntimeError("end_programs() outside the sandbox's PID namespace")
    try:
        os.kill(-1, signal.SIGKILL)          # all this one may signal but itself and process 1: its namespace's
    except ProcessLookupError:
        pass
    while True:
        try:
            os.waitpid(-1, 0)
        except ChildProcessError:
            return
