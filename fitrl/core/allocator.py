"""The memory allocators of every fitrl process: the host's (``memory.host_allocator``) and
the GPU's expandable segments (``memory.expandable_segments``, :func:`cuda_alloc_env`).

glibc's malloc is what every process has by default. jemalloc and tcmalloc replace it when their
shared library is preloaded (``LD_PRELOAD``), which only works when a process starts: so the
``fitrl`` command re-executes itself with the library preloaded (:func:`reexec_with`) before any
model loads, and the variable stays in the environment that every process it starts inherits
(reward and tool workers, a local Ray cluster's raylet and so its actors). A joined Ray cluster's
workers get it through Ray's ``runtime_env`` (:func:`runtime_env_vars`); the library must then be
at the same path on every node.

What each allocator does to RSS and step time on CPU, measured: bench/RESULTS.md, "Host
allocators" (``make allocators`` unpacks the distribution's packages into ``.cache/allocators``
without installing anything system-wide).

Standard library only: the CLI calls this before torch is imported.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Optional

from fitrl.core.errors import ConfigError

LIBRARIES = {"jemalloc": ("libjemalloc.so.2",), "tcmalloc": ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4")}
"""The shared library names of each allocator, most likely first (Debian/Ubuntu package names:
libjemalloc2, libtcmalloc-minimal4 or libgoogle-perftools4)."""
ROOT = Path(__file__).resolve().parent.parent.parent
SYSTEM_DIRS = ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/lib",
               "/usr/local/lib")
REEXEC_MARK = "FITRL_ALLOCATOR_REEXEC"  # set on the re-executed process: never re-execute twice


def search_dirs() -> list[Path]:
    """Where a library is looked for: ``$FITRL_ALLOCATOR_DIR``, the checkout's ``.cache/allocators``
    (``make allocators``), then the system's library directories."""
    dirs = [Path(d) for d in os.environ.get("FITRL_ALLOCATOR_DIR", "").split(os.pathsep) if d]
    return [*dirs, ROOT / ".cache" / "allocators", *map(Path, SYSTEM_DIRS)]


def find_library(allocator: str) -> Optional[Path]:
    """The first of ``allocator``'s libraries found under :func:`search_dirs` (subdirectories
    included: an unpacked package keeps its ``usr/lib/<triplet>/`` layout), or None."""
    for name in LIBRARIES[allocator]:
        for d in search_dirs():
            if (d / name).is_file():
                return d / name
            if d.is_dir() and not str(d).startswith("/usr"):  # unpacked trees; never walk the system's
                found = sorted(p for p in d.rglob(name) if p.is_file())
                if found:
                    return found[0]
    return None


def loaded(allocator: str, pid: str = "self") -> bool:
    """Whether process ``pid`` has one of ``allocator``'s libraries mapped (glibc: neither of the
    others). Linux only (``/proc``); elsewhere False."""
    try:
        maps = Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return False
    found = {name for names in LIBRARIES.values() for name in names if name in maps}
    if allocator == "glibc":
        return not found
    return any(name in found for name in LIBRARIES[allocator])


def library_or_error(allocator: str) -> Path:
    """``allocator``'s library, found and loadable, or a :class:`ConfigError` naming where it was
    looked for (or the file the dynamic loader refused, and why) and the fix."""
    lib = find_library(allocator)
    if lib is None:
        where = ", ".join(str(d) for d in search_dirs())
        raise ConfigError(
            f"memory.host_allocator={allocator}: none of {', '.join(LIBRARIES[allocator])} in {where}; "
            f"`make allocators` unpacks it into .cache/allocators (or install the distribution's package, or "
            f"point FITRL_ALLOCATOR_DIR at a directory holding it), or set memory.host_allocator=glibc")
    why = _unloadable(lib)
    if why:
        raise ConfigError(
            f"memory.host_allocator={allocator}: {lib} cannot be preloaded ({why}); replace it with a library built "
            f"for this machine (`make allocators` unpacks the distribution's package into .cache/allocators; "
            f"FITRL_ALLOCATOR_DIR, looked in first, may point elsewhere), or set memory.host_allocator=glibc")
    return lib


_LOADABLE: dict[str, str] = {}  # library path -> "" or why the loader refused it, once per process


def _unloadable(lib: Path) -> str:
    """Why the dynamic loader refuses to preload ``lib`` ("" when it loads): a child process (this
    Python, without site) started with it in ``LD_PRELOAD`` says whether it is mapped. The loader
    does not fail a process over a bad preload, it prints a line and goes on without it: so the
    re-executed fitrl would run on glibc, or every worker print that line. Already mapped in this
    process: loadable. Not Linux (no ``/proc``): not checked. Costs one Python start (~20 ms)."""
    key = str(lib)
    if key not in _LOADABLE:
        if not Path("/proc/self/maps").is_file() or key in Path("/proc/self/maps").read_text():
            _LOADABLE[key] = ""
        else:
            probe = f"import sys; sys.exit(0 if {key!r} in open('/proc/self/maps').read() else 3)"
            env = {**os.environ, "LD_PRELOAD": key}
            env.pop(REEXEC_MARK, None)
            try:
                done = subprocess.run([sys.executable, "-S", "-c", probe], env=env, capture_output=True, text=True,
                                      timeout=60)
                said = [line for line in done.stderr.splitlines() if "LD_PRELOAD" in line or "ld.so" in line]
                why = "" if done.returncode == 0 else (said[0] if said else f"a process started with it exited "
                                                                            f"{done.returncode}")
            except (OSError, subprocess.TimeoutExpired) as e:
                why = f"a process started with it failed: {e}"
            _LOADABLE[key] = _loader_reason(why)
    return _LOADABLE[key]


def _loader_reason(line: str) -> str:
    """The reason in ld.so's line, ``ERROR: ld.so: object 'X' from LD_PRELOAD cannot be preloaded
    (invalid ELF header): ignored.`` -> ``invalid ELF header``; other text as it is."""
    start, end = line.find("("), line.rfind(")")
    return line[start + 1:end] if "cannot be preloaded" in line and 0 <= start < end else line.strip()


def preload_env(allocator: str, env: Optional[dict] = None) -> dict:
    """``env`` (default: this process's) with ``allocator``'s library first in ``LD_PRELOAD``."""
    env = dict(os.environ if env is None else env)
    lib = str(library_or_error(allocator))
    rest = [p for p in env.get("LD_PRELOAD", "").replace(":", " ").split() if p != lib]
    env["LD_PRELOAD"] = " ".join([lib, *rest])
    return env


def reexec_with(allocator: str, cwd: Optional[str] = None) -> None:
    """Replace this process with the same command under ``allocator`` (``os.execve``: same pid,
    same argv, started from ``cwd``, the directory it was launched in, so relative paths in its
    argv mean what they meant), unless it runs under it already. Call before anything worth
    keeping happened: only the config has been read. A second failure to load it is a config
    error, not a loop."""
    if allocator == "glibc" or loaded(allocator):
        return
    if os.environ.get(REEXEC_MARK):
        raise ConfigError(f"memory.host_allocator={allocator}: the process started with LD_PRELOAD="
                          f"{os.environ.get('LD_PRELOAD', '')} but {allocator} is not loaded (the dynamic loader "
                          f"refused the library: is it built for this machine?); set memory.host_allocator=glibc")
    env = preload_env(allocator)
    env[REEXEC_MARK] = "1"
    sys.stdout.flush()
    sys.stderr.flush()
    if cwd is not None:
        os.chdir(cwd)
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)


def runtime_env_vars(allocator: str) -> dict:
    """Environment variables for Ray's ``runtime_env`` that preload ``allocator`` in its workers
    (empty for glibc)."""
    if allocator == "glibc":
        return {}
    return {"LD_PRELOAD": preload_env(allocator)["LD_PRELOAD"]}


CUDA_ALLOC_CONF = "PYTORCH_CUDA_ALLOC_CONF"
EXPANDABLE = "expandable_segments:True"


def cuda_alloc_env(setting: str, vllm_sleeps: bool, env: Optional[dict] = None) -> tuple[dict, str]:
    """The environment variables that ``memory.expandable_segments`` (``auto`` | ``on`` | ``off``)
    asks of a GPU run's processes, and why, in a few words. ``vllm_sleeps``: the run's vLLM engine
    sleeps between rollouts (its memory pool refuses expandable segments). ``env``: the
    environment it starts from (default: this process's); a setting there is kept under ``auto``."""
    env = os.environ if env is None else env
    if setting == "off":
        return {}, "off (memory.expandable_segments=off)"
    if setting == "auto":
        if CUDA_ALLOC_CONF in env:
            return {}, f"{CUDA_ALLOC_CONF}={env[CUDA_ALLOC_CONF]} kept as set"
        if vllm_sleeps:
            return {}, "off: vLLM's sleep mode (rollout.sleep_level > 0) does not allow them"
    if vllm_sleeps:
        raise ConfigError("memory.expandable_segments=on with rollout.engine=vllm and rollout.sleep_level > 0: vLLM's "
                          "sleep mode allocates from a memory pool that refuses expandable segments; set "
                          "rollout.sleep_level=0 or memory.expandable_segments=auto")
    others = [p for p in env.get(CUDA_ALLOC_CONF, "").split(",") if p and not p.startswith("expandable_segments")]
    return {CUDA_ALLOC_CONF: ",".join([EXPANDABLE, *others])}, "on"
