"""Which nodes of a Ray cluster can hold a worker group's bundles, said in words a refusal prints.

Pure functions over what ``ray.nodes()`` and Ray's per-node free resources answer, so the rules
are tested on hand-written clusters (tests/test_ray_placement.py); :mod:`fitrl.workers.ray_placement`
asks Ray and acts on them.

A request is ``count`` bundles (one per rank) spread over ``nnodes`` nodes: with ``nnodes=1``
they may share or span nodes (``PACK``), with ``nnodes>1`` each of ``nnodes`` distinct nodes
holds ``count // nnodes`` of them (one rank group per node). It can *never* be given when the
live nodes' totals, less what this process's own placements hold, cannot hold it, whatever
frees up later; it is only *busy* when they can but other jobs hold the room.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

# Ray's own resources that every node has and no bundle asks for: not worth printing.
_HIDDEN = ("memory", "object_store_memory")
# A fraction of a CPU or GPU left over by float sums (0.1 * 3) must not make a bundle not fit.
_EPS = 1e-6


@dataclass(frozen=True)
class Node:
    """One live node as a refusal names it: Ray's node id, IP, hostname, and resources."""

    id: str
    ip: str
    host: str
    total: dict[str, float]
    free: Optional[dict[str, float]] = field(default=None, compare=False)  # None: Ray did not say

    @classmethod
    def from_ray(cls, entry: dict, free: Optional[dict] = None) -> "Node":
        """From one entry of ``ray.nodes()`` (and its free resources, when known)."""
        return cls(id=entry["NodeID"], ip=entry.get("NodeManagerAddress", "?"),
                   host=entry.get("NodeManagerHostname", "?"), total=dict(entry.get("Resources", {})),
                   free=dict(free) if free is not None else None)

    def name(self) -> str:
        """``node 1b4a5290 (10.0.0.2, host gpu-07)``: the id's first 8 characters, as ``ray status``."""
        return f"node {self.id[:8]} ({self.ip}, host {self.host})"


def live_nodes(table: list[dict], free_by_node: Optional[dict[str, dict]] = None) -> list[Node]:
    """The alive entries of ``ray.nodes()``, head first as Ray lists them."""
    free_by_node = free_by_node if free_by_node is not None else {}
    return [Node.from_ray(e, free_by_node.get(e["NodeID"])) for e in table if e.get("Alive", True)]


def fits(have: dict[str, float], bundle: dict[str, float], held: Optional[dict[str, float]] = None) -> int:
    """How many ``bundle`` fit in ``have`` less ``held``.

    >>> fits({"CPU": 4, "GPU": 2}, {"CPU": 1, "GPU": 1}), fits({"CPU": 4}, {"CPU": 1}, held={"CPU": 3})
    (2, 1)
    """
    held = held or {}
    counts = [int((have.get(k, 0.0) - held.get(k, 0.0)) / v + _EPS) for k, v in bundle.items() if v > 0]
    return max(0, min(counts)) if counts else 1 << 30


def add(into: dict[str, float], bundle: dict[str, float], times: int = 1) -> None:
    for k, v in bundle.items():
        into[k] = into.get(k, 0.0) + v * times


def never_fits(nodes: list[Node], bundle: dict[str, float], count: int, nnodes: int,
               held: dict[str, dict[str, float]]) -> Optional[str]:
    """Why the live ``nodes`` can never hold ``count`` bundles over ``nnodes`` distinct nodes, with
    ``held`` (node id -> resources) taken by this process's placements; None when they can.

    >>> a = Node("a" * 8, "10.0.0.1", "h1", {"CPU": 2.0}); b = Node("b" * 8, "10.0.0.2", "h2", {"CPU": 1.0})
    >>> never_fits([a, b], {"CPU": 1}, 2, 2, {}) is None
    True
    >>> never_fits([a, b], {"CPU": 1}, 4, 2, {})
    'only 1 of its 2 live node(s) have room for 2 bundle(s) each'
    >>> never_fits([a, b], {"CPU": 1}, 3, 1, {"a" * 8: {"CPU": 1.0}})
    'its 2 live node(s) have room for 2 such bundle(s) in all, besides what this run holds'
    """
    per_node = count // max(nnodes, 1)
    room = {n.id: fits(n.total, bundle, held.get(n.id)) for n in nodes}
    mine = ", besides what this run holds" if any(held.get(n.id) for n in nodes) else ""
    if nnodes <= 1:
        total = sum(room.values())
        return None if total >= count else (f"its {len(nodes)} live node(s) have room for {total} such bundle(s) in "
                                            f"all{mine}")
    enough = sum(1 for n in nodes if room[n.id] >= per_node)
    if enough >= nnodes:
        return None
    return f"only {enough} of its {len(nodes)} live node(s) have room for {per_node} bundle(s) each{mine}"


def _amount(v: float) -> str:
    return f"{v:g}"


def describe(nodes: list[Node], bundle: dict[str, float], held: dict[str, dict[str, float]]) -> str:
    """Each live node with the resources ``bundle`` asks for (CPU and GPU always): free of total,
    and what this run holds there.

    >>> n = Node("1b4a5290ff", "10.0.0.2", "gpu-07", {"CPU": 8.0, "GPU": 2.0, "memory": 1e9}, {"CPU": 6.0, "GPU": 0.0})
    >>> describe([n], {"CPU": 1, "GPU": 1}, {"1b4a5290ff": {"CPU": 2.0, "GPU": 2.0}})
    'node 1b4a5290 (10.0.0.2, host gpu-07): CPU 6 free of 8, GPU 0 free of 2 (this run holds CPU 2, GPU 2)'
    """
    if not nodes:
        return "no live node"
    keys = ["CPU", "GPU"] + [k for k in bundle if k not in ("CPU", "GPU") and k not in _HIDDEN]
    out = []
    for n in nodes:
        parts = []
        for k in keys:
            total = n.total.get(k, 0.0)
            parts.append(f"{k} {_amount(n.free.get(k, 0.0))} free of {_amount(total)}" if n.free is not None
                         else f"{k} {_amount(total)}")
        mine = held.get(n.id)
        note = (" (this run holds " + ", ".join(f"{k} {_amount(v)}" for k, v in mine.items() if v) + ")"
                if mine and any(mine.values()) else "")
        out.append(f"{n.name()}: {', '.join(parts)}{note}")
    return "; ".join(out)
