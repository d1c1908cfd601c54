"""The worker-group interface the driver talks to.

A worker class marks each public method with how a call is spread over its ranks:

  @dispatch("dp")   the Batch argument is split evenly over ranks; the Batch results are
                    concatenated in rank order, dict results (metrics) averaged. A method whose
                    results need their own joining declares it: ``@dispatch("dp", gather=fn)``
                    (rollouts of different widths), so this layer knows no batch layout.
  @dispatch("all")  every rank gets the same arguments; rank 0's result is returned.
  @dispatch("dp", sequence_parallel=True)
                    as "dp", but the ranks of a sequence-parallel group (``RoleHandle``'s
                    ``sequence_parallel`` consecutive ranks, fitrl/distributed/ulysses.py) get
                    the same shard, and the group's first rank's result stands for the group.

The driver holds a :class:`RoleHandle` and calls ``policy.generate(batch, ...)`` the same way
whatever the backend: in-process (one worker, the embedded default) or one process per rank.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from typing import Any, Callable, Optional

from fitrl.data.balance import equal_count_shards
from fitrl.data.batch import Batch

log = logging.getLogger(__name__)

DISPATCH_ATTR = "_fitrl_dispatch"


def dispatch(mode: str, gather: Optional[Callable[[list[Any]], Any]] = None,
             sequence_parallel: bool = False) -> Callable:
    if mode not in ("dp", "all"):
        raise ValueError(f"dispatch mode must be 'dp' or 'all', got {mode!r}")

    def mark(fn: Callable) -> Callable:
        setattr(fn, DISPATCH_ATTR, (mode, gather, sequence_parallel))
        return fn
    return mark


class Pending:
    """A call in flight on a worker group (:meth:`WorkerGroup.submit`): ``result()`` waits for
    it and returns what the blocking call would have; ``done()`` asks without waiting."""

    def __init__(self, wait: Callable[[], list[Any]], done: Callable[[], bool],
                 finish: Callable[[list[Any]], Any] = lambda results: results):
        self._wait, self._done, self._finish = wait, done, finish

    def then(self, finish: Callable[[list[Any]], Any]) -> "Pending":
        """The same call, its per-rank results turned into one by ``finish`` when taken."""
        return Pending(self._wait, self._done, finish)

    def done(self) -> bool:
        return self._done()

    def result(self) -> Any:
        return self._finish(self._wait())


class WorkerGroup(ABC):
    """``world_size`` workers of one class; ``call_all`` runs a method on every rank."""

    world_size: int
    worker_cls: type

    @abstractmethod
    def call_all(self, method: str, per_rank_args: list[tuple], kwargs: dict) -> list[Any]:
        """Run ``method`` on each rank with its own positional args; results in rank order."""

    def submit(self, method: str, per_rank_args: list[tuple], kwargs: dict, phase: Optional[str] = None,
               mailbox: bool = False) -> Pending:
        """Start ``method`` on each rank without waiting (its results in rank order from
        ``result()``); a rank runs one call at a time, in no promised order. ``phase``: what the
        ranks record its memory under. ``mailbox``: run it beside a call in progress (a short,
        thread-safe method: a rollout worker's ``receive_weights``), under no phase. This default
        runs the call at once."""
        results = self.call_all(method, per_rank_args, kwargs)
        return Pending(lambda: results, lambda: True)

    def call_kept(self, method: str, per_rank_args: list[tuple], kwargs: dict) -> list[Any]:
        """As ``call_all``, but each rank's result stays where it is (under Ray, in the object
        store: handles the driver passes on as another group's arguments without fetching them)."""
        return self.call_all(method, per_rank_args, kwargs)

    def health(self, timeout_s: float) -> list[dict]:
        """Each rank's progress report (fitrl/telemetry/progress.py) for the hang watchdog; none
        for workers in the driver's own process (the driver's report covers them)."""
        return []

    def shutdown(self) -> None:
        """Stop the workers (nothing to do for workers in the driver's process)."""


class InProcessWorkerGroup(WorkerGroup):
    """One worker living in the driver's process (CPU or one GPU). ``threaded``: submitted calls
    run one after another on a thread of their own, beside the driver's (a rollout worker
    generating while the driver trains: fitrl/trainer/pipeline.py)."""

    def __init__(self, worker_cls: type, *args, threaded: bool = False, **kwargs):
        self.worker_cls = worker_cls
        self.world_size = 1
        self.workers = [worker_cls(*args, rank=0, world_size=1, **kwargs)]
        self._executor = None
        if threaded:
            from concurrent.futures import ThreadPoolExecutor

            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=worker_cls.__name__)

    def call_all(self, method: str, per_rank_args: list[tuple], kwargs: dict) -> list[Any]:
        return [getattr(w, method)(*args, **kwargs) for w, args in zip(self.workers, per_rank_args)]

    def submit(self, method: str, per_rank_args: list[tuple], kwargs: dict, phase: Optional[str] = None,
               mailbox: bool = False) -> Pending:
        if self._executor is None or mailbox:  # (a mailbox call runs in the caller's thread)
            return super().submit(method, per_rank_args, kwargs, phase)
        future = self._executor.submit(self.call_all, method, per_rank_args, kwargs)
        return Pending(future.result, future.done)

    def shutdown(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=True)
        # An engine left to the garbage collector may be collected during the next run in this
        # process (a restart, or fitrl.train called again), and vLLM's shutdown then tears down
        # the process-wide parallel state the new engine uses: each worker closes its own now.
        # (Ray workers end with their processes.)
        for w in self.workers:
            close = getattr(w, "close", None)
            if close is not None:
                try:
                    close()
                except Exception:  # (never hides why the run is ending)
                    log.warning("closing %s failed", type(w).__name__, exc_info=True)


class RoleHandle:
    """What the driver calls: ``handle.method(...)`` dispatched per the worker's marks;
    ``handle.submit("method", ...)`` starts the same call without waiting (a :class:`Pending`)."""

    def __init__(self, group: WorkerGroup, sequence_parallel: int = 1):
        if group.world_size % sequence_parallel:
            raise ValueError(f"sequence-parallel groups of {sequence_parallel} do not divide {group.world_size} ranks")
        self._group = group
        self.sequence_parallel = sequence_parallel

    @property
    def world_size(self) -> int:
        return self._group.world_size

    @property
    def group(self) -> WorkerGroup:
        return self._group

    def _marks(self, name: str) -> tuple[str, Callable[[list[Any]], Any], int]:
        fn = getattr(self._group.worker_cls, name, None)
        marks = getattr(fn, DISPATCH_ATTR, None)
        if marks is None:
            raise AttributeError(f"{self._group.worker_cls.__name__}.{name} is not a dispatched worker method")
        mode, join, by_group = marks
        return mode, join or gather, self.sequence_parallel if by_group else 1

    def __getattr__(self, name: str):
        if name.startswith("_"):
            raise AttributeError(name)
        self._marks(name)
        return lambda *args, **kwargs: self._call(name, args, kwargs)

    def _call(self, name: str, args: tuple, kwargs: dict) -> Any:
        per_rank, finish = self._spread(name, args)
        return finish(self._group.call_all(name, per_rank, kwargs))

    def submit(self, name: str, *args, phase: Optional[str] = None, mailbox: bool = False, **kwargs) -> Pending:
        """``name``'s call started without waiting (:meth:`WorkerGroup.submit`: ``phase``, ``mailbox``)."""
        per_rank, finish = self._spread(name, args)
        return self._group.submit(name, per_rank, kwargs, phase, mailbox).then(finish)

    def _spread(self, name: str, args: tuple) -> tuple[list[tuple], Callable[[list[Any]], Any]]:
        """Each rank's arguments, and how their results become the caller's."""
        mode, join, copies = self._marks(name)
        world = self._group.world_size
        if mode == "all":
            return [args] * world, lambda results: results[0]
        n = world // copies  # shards: one per sequence-parallel group
        batch, rest = args[0], args[1:]
        if not isinstance(batch, Batch):
            raise TypeError(f"{name} is data-parallel: its first argument must be a Batch")
        order = None
        if n > 1 and "attention_mask" in batch:
            # equal sequence counts per rank, similar token totals: the slowest rank sets the pace
            order = equal_count_shards(batch["attention_mask"].sum(-1).tolist(), n)
            batch = batch.index(order)
        shards = batch.chunk(n) if n > 1 else [batch]

        def finish(results: list[Any]) -> Any:
            result = join(results[::copies])
            if order is not None and isinstance(result, Batch):
                result = result.index(sorted(range(len(order)), key=order.__getitem__))  # caller's order
            return result
        return [(s, *rest) for s in shards for _ in range(copies)], finish


def gather(results: list[Any]) -> Any:
    first = results[0]
    if isinstance(first, Batch):
        return Batch.concat(results)
    if isinstance(first, dict):
        return {k: sum(r[k] for r in results) / len(results) for k in first}
    if first is None:
        return None
    raise TypeError(f"cannot gather results of type {type(first).__name__}")
