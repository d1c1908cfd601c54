"""A disk cache of memory plans: a repeat of a config is planned once.

Planning traces the model's micro-steps (:mod:`.trace`): for ``examples/arith.yaml`` with the
31.7M model, 0.8-1.0 s on the meta device (1.6-2.7 s under ``FakeTensorMode``)
at every ``fitrl train`` start-up on a 2-core CPU, for a verdict that only changes when its inputs
do. :func:`plan_key` hashes everything a plan reads:

- the resolved config, but for the keys in :data:`NOT_READ` (where the run writes, how it logs),
  which the planner never reads;
- each model's ``config.json`` (its bytes: the planner reads nothing else of a model);
- the hardware it is planned for (detected by the caller: device, nodes, devices, memory);
- the code: fitrl's version and every source file of the package (what is traced lives outside
  :mod:`fitrl.memory`: the log-prob ops, the LoRA adapters), the Python, torch, transformers and
  peft installed (each package's ``__init__.py`` by size and mtime: no import, no metadata scan).

The planner reads no environment variable, and no data file but the sample of prompts behind
``plan.expected_prompt_length=auto`` (:mod:`.lengths`), which the caller reads before making the
key and passes in ``extra``: a changed dataset changes the number, and so the key. A hit
returns what was stored under the same key; an unreadable, truncated or foreign file is a miss,
never an error. Files live in ``$FITRL_CACHE_DIR/plans`` (default ``$XDG_CACHE_HOME/fitrl/plans``,
else ``~/.cache/fitrl/plans``), the newest :data:`KEEP` kept.

Below the plans, each traced micro-step's peak is kept too (``traces/``, :func:`trace_key`): the
traces are most of a cold plan's time (0.1-0.4 s each, a few per phase the run has), and a
config edited where no trace reads plans from them in milliseconds.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import pickle
import sys
import tempfile
from pathlib import Path
from typing import Any, Optional

import fitrl
from fitrl.core.cache import cache_root

log = logging.getLogger(__name__)

FORMAT = 2  # bump when what is stored changes shape (2: plans hold the plan at expected lengths)
KEEP = 64   # plans kept (~20 KiB each); the oldest go first
TRACE_KEEP = 1024  # traced peaks kept (one integer each)
NOT_READ = frozenset({
    "trainer.run_dir", "trainer.output_dir", "trainer.experiment_name", "trainer.progress_bar",
    "trainer.loggers", "trainer.project_name", "trainer.wandb_mode", "trainer.mlflow_tracking_uri",
    "trainer.seed", "trainer.num_threads",  # a run's random stream and CPU threads: no byte of memory
    "memory.plan",  # enforce / warn: what is done with the verdict, not the verdict
})
"""Config keys left out of the key: the planner does not read them, and they change between
launches of the same run (a new run directory) or say what to do with the plan."""
MODEL_PATHS = ("actor.model.path", "ref.model.path", "critic.model.path")
LIBRARIES = ("torch", "transformers", "peft")


def cache_dir() -> Path:
    return cache_root() / "plans"


def plan_key(cfg, hardware, extra: Any = None) -> str:
    """The hex digest of everything :func:`fitrl.planner.plan.plan_config` reads for ``cfg`` on
    ``hardware`` (a :class:`~fitrl.memory.model.Hardware`); ``extra``: what else the caller's
    result depends on (JSON-able)."""
    from dataclasses import asdict

    config = asdict(cfg)
    for dotted in NOT_READ:
        section, _, name = dotted.rpartition(".")
        config.get(section, {}).pop(name, None)
    record = {"format": FORMAT, "config": config, "hardware": asdict(hardware), "extra": extra,
              "models": {k: _model_config(_get(cfg, k)) for k in MODEL_PATHS}, "code": _code()}
    return hashlib.sha256(json.dumps(record, sort_keys=True, default=repr).encode()).hexdigest()


def trace_dir() -> Path:
    return cache_root() / "traces"


def trace_key(spec, layers: int) -> str:
    """The digest of one traced micro-step (:func:`fitrl.memory.trace.transient_bytes`): its
    :class:`~fitrl.memory.trace.TraceSpec`, depth and the code. A config that changes what no
    trace reads (a learning rate, a reward, the step count) misses :func:`plan_key` but finds its
    traces here, so its plan is the closed-form arithmetic only."""
    from dataclasses import asdict

    record = {"format": FORMAT, "spec": asdict(spec), "layers": layers, "code": _code()}
    return hashlib.sha256(json.dumps(record, sort_keys=True, default=repr).encode()).hexdigest()


def load(key: str, directory: Optional[Path] = None) -> Optional[Any]:
    """What :func:`store` stored under ``key``, or None (absent, unreadable, another key's)."""
    path = (directory or cache_dir()) / f"{key}.pkl"
    try:
        with open(path, "rb") as f:
            stored = pickle.load(f)
        if isinstance(stored, dict) and stored.get("key") == key:
            return stored["value"]
    except FileNotFoundError:
        return None
    except Exception as e:  # a torn write, a file from another version: plan afresh, say why in debug logs
        log.debug("ignoring unreadable plan cache file %s: %s: %s", path, type(e).__name__, e)
    return None


def store(key: str, value: Any, directory: Optional[Path] = None, keep: int = KEEP) -> None:
    """Writes ``value`` under ``key`` (atomically: readers see the old file or the new one);
    a cache that cannot be written is skipped."""
    directory = directory or cache_dir()
    try:
        directory.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-", suffix=".pkl")
        try:
            with os.fdopen(fd, "wb") as f:
                pickle.dump({"key": key, "value": value}, f, protocol=pickle.HIGHEST_PROTOCOL)
            os.replace(tmp, directory / f"{key}.pkl")
        except BaseException:
            os.unlink(tmp)
            raise
        _prune(directory, keep)
    except Exception as e:
        log.debug("plan cache not written to %s: %s: %s", directory, type(e).__name__, e)


def _prune(directory: Path, keep: int) -> None:
    files = sorted(directory.glob("*.pkl"), key=lambda p: p.stat().st_mtime)
    for old in files[:-keep]:
        old.unlink(missing_ok=True)


def _get(cfg, dotted: str):
    obj = cfg
    for part in dotted.split("."):
        obj = getattr(obj, part, None)
    return obj


def _model_config(path: Optional[str]) -> Optional[str]:
    """The digest of a model's ``config.json`` (a directory's, or the file itself), None without one."""
    if not path:
        return None
    p = Path(path)
    try:
        return hashlib.sha256((p / "config.json" if p.is_dir() else p).read_bytes()).hexdigest()
    except OSError as e:  # the planner will say what is wrong; nothing is stored for a failed plan
        return f"unreadable: {e}"


_CODE: Optional[dict] = None


def _code() -> dict:
    """fitrl's sources and the versions of what runs them (computed once per process: ~15 ms)."""
    global _CODE
    if _CODE is None:
        root = Path(fitrl.__file__).parent
        h = hashlib.sha256()
        for f in sorted(root.rglob("*.py")):
            h.update(str(f.relative_to(root)).encode() + b"\0" + f.read_bytes() + b"\0")
        libraries = {}
        for name in LIBRARIES:
            spec = importlib.util.find_spec(name)
            origin = spec.origin if spec is not None else None
            try:
                st = os.stat(origin) if origin else None
                libraries[name] = (origin, st.st_size, st.st_mtime_ns) if st else None
            except OSError:
                libraries[name] = None
        _CODE = {"fitrl": fitrl.__version__, "sources": h.hexdigest(), "python": sys.version, "libraries": libraries}
    return _CODE
