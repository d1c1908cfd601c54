"""Where the ranks of a Ray worker group run: placement groups and the rank numbering.

One bundle per rank (``num_cpus_per_worker`` CPUs, plus one GPU with ``use_gpu``): with
``nnodes=1`` one ``PACK`` group of ``world_size`` bundles; with ``nnodes>1`` one ``STRICT_PACK``
group of ``devices_per_node`` bundles per node, each placed on a node none of the earlier ones
is on (a label selector on Ray's ``ray.io/node-id`` excludes them), so every rank group has a
node of its own or the placement is refused. Ranks are numbered node by node
(:func:`rank_layout`), so ``LOCAL_RANK``/``LOCAL_WORLD_SIZE`` describe the real layout.

Every wait is bounded by ``timeout_s`` (``trainer.placement_timeout_s``, default
:data:`PLACEMENT_TIMEOUT_S`), and every refusal is one :class:`ClusterError` line naming what was
asked and each live node with its free and total CPUs and GPUs:

- a request the live nodes can never hold (fitrl/workers/ray_nodes.py, ``never_fits``: their
  totals, less what this process's own placements hold) is refused at once on a cluster this
  process started, which no node can join; on a joined cluster it waits for nodes to join (or a
  lost one to come back) up to the limit;
- a request that fits but whose room other jobs hold waits up to the limit.

A signal during the wait lands within a second (fitrl/workers/ray_cluster.py, ``wait``): the
placement groups made so far are removed and the stop names the wait.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace

from fitrl.core.errors import ClusterError, Interrupted
from fitrl.workers.ray_cluster import STARTED_HERE, wait
from fitrl.workers.ray_nodes import Node, add, describe, live_nodes, never_fits

# ray is imported inside Placement: importing this module (rank_layout) needs no ray.

log = logging.getLogger(__name__)

PLACEMENT_TIMEOUT_S = 300.0
"""How long a worker group waits for its bundles when ``trainer.placement_timeout_s`` is not given."""

NODE_LABEL = "ray.io/node-id"  # the label Ray gives every node: its id

POLL_S = 1.0  # between looks at the cluster's nodes while a placement waits

_LIVE: list["Placement"] = []  # this process's placements: what they hold is not free for the next


@dataclass(frozen=True)
class RankSlot:
    """Where one rank runs: bundle ``bundle`` of placement group ``pg`` on node ``node_id``."""

    pg: int
    bundle: int
    node_id: str
    local_rank: int
    local_world_size: int


def rank_layout(bundle_nodes: list[list[str]]) -> list[RankSlot]:
    """Ranks numbered node by node: ``bundle_nodes[pg][bundle]`` is the node of each bundle.

    Nodes are taken in order of first appearance (the node of the first bundle holds rank 0);
    within a node, bundles keep their order.

    >>> [(s.pg, s.bundle, s.local_rank, s.local_world_size) for s in rank_layout([["a", "b", "a"]])]
    [(0, 0, 0, 2), (0, 2, 1, 2), (0, 1, 0, 1)]
    """
    by_node: dict[str, list[tuple[int, int]]] = {}
    for p, nodes in enumerate(bundle_nodes):
        for b, node in enumerate(nodes):
            by_node.setdefault(node, []).append((p, b))
    return [RankSlot(p, b, node, i, len(slots)) for node, slots in by_node.items() for i, (p, b) in enumerate(slots)]


def held_by_node(exclude: "Placement | None" = None) -> dict[str, dict[str, float]]:
    """Node id -> the resources this process's live placements reserve there."""
    held: dict[str, dict[str, float]] = {}
    for p in _LIVE:
        if p is not exclude:
            for slot in p.slots:
                add(held.setdefault(slot.node_id, {}), p.bundle)
    return held


def cluster_nodes() -> list[Node]:
    """The live nodes, with their free resources where Ray tells them."""
    import ray

    try:
        from ray._private.state import available_resources_per_node  # (a DeveloperAPI)

        free = available_resources_per_node()
    except Exception as e:  # an older or newer Ray without it: totals only
        log.debug("free resources per node: %s", e)
        free = None
    return live_nodes(ray.nodes(), free)


class Placement:
    """Bundles reserved for ``world_size`` ranks, shared by colocated groups (refcounted)."""

    def __init__(self, world_size: int, nnodes: int, devices_per_node: int, bundle: dict,
                 timeout_s: float | None, role: str):
        from ray.util.placement_group import placement_group

        timeout_s = PLACEMENT_TIMEOUT_S if timeout_s is None else timeout_s
        self.world_size, self.bundle, self.users = world_size, dict(bundle), 0
        self.nnodes, self.per_node, self.role, self.timeout_s = nnodes, devices_per_node, role, timeout_s
        self.pgs: list = []
        self.slots: list[RankSlot] = []
        self._nodes: list[list[str]] = []  # per placement group, the node of each bundle
        self._warned = False
        start = time.monotonic()
        deadline = start + timeout_s
        try:
            self._check_nodes(deadline)
            if nnodes == 1:
                self._place(placement_group([self.bundle] * world_size, strategy="PACK", name=f"fitrl-{role}"),
                            deadline)
            for i in range(nnodes if nnodes > 1 else 0):
                taken = [ids[0] for ids in self._nodes]
                selector = [{NODE_LABEL: f"!in({','.join(taken)})"}] * devices_per_node if taken else None
                self._place(placement_group([self.bundle] * devices_per_node, strategy="STRICT_PACK",
                                            name=f"fitrl-{role}-node{i}", bundle_label_selector=selector), deadline)
        except Interrupted as e:
            self._remove_all()
            raise Interrupted(f"{e}, while {role} waited {time.monotonic() - start:.0f} s for the Ray cluster to "
                              f"place its ranks", e.signum) from None
        except BaseException:
            self._remove_all()
            raise
        if nnodes > 1 and len({ids[0] for ids in self._nodes}) < nnodes:  # (the selector forbids it)
            err = self._refusal(f"Ray put two of its per-node groups on one node ({self._nodes})")
            self._remove_all()
            raise err
        self.slots = rank_layout(self._nodes)
        nodes = {n.id: n for n in cluster_nodes()}
        self.node_ips = [nodes[s.node_id].ip if s.node_id in nodes else "?" for s in self.slots]
        self.node_hosts = [nodes[s.node_id].host if s.node_id in nodes else "?" for s in self.slots]
        _LIVE.append(self)

    def asked(self) -> str:
        if self.nnodes == 1:
            return f"{self.world_size} bundle(s) of {self.bundle} (one per rank)"
        return (f"{self.nnodes} distinct nodes x {self.per_node} bundle(s) of {self.bundle} (one rank group per "
                f"node)")

    def _place(self, pg, deadline: float) -> None:
        """Wait for ``pg`` until ``deadline``, looking at the cluster's nodes between waits."""
        from ray.util.placement_group import placement_group_table

        self.pgs.append(pg)
        ready = pg.ready()
        while True:
            done, _ = wait([ready], 1, max(0.0, min(POLL_S, deadline - time.monotonic())))
            if done:
                table = placement_group_table(pg)["bundles_to_node_id"]
                self._nodes.append([table[b] for b in range(len(pg.bundle_specs))])
                return
            self._check_nodes(deadline)

    def _check_nodes(self, deadline: float) -> None:
        """Refuse now when the request can never be given here, or when ``deadline`` has passed."""
        nodes, held = cluster_nodes(), held_by_node(exclude=self)
        never = never_fits(nodes, self.bundle, self.world_size, self.nnodes, held)
        late = time.monotonic() >= deadline
        if never and STARTED_HERE["value"]:
            raise self._refusal(f"{never}, and no node can join the cluster this process started", nodes, held)
        if never and late:
            raise self._refusal(f"{never}, and no node joined within {self.timeout_s:.0f} s "
                                "(trainer.placement_timeout_s)", nodes, held)
        if late:
            raise self._refusal(f"{len(self._nodes)} of {self.nnodes if self.nnodes > 1 else 1} placement group(s) "
                                f"were placed within {self.timeout_s:.0f} s (trainer.placement_timeout_s): other "
                                "jobs hold the room (`ray status` shows them)", nodes, held)
        if never and not self._warned:
            self._warned = True
            log.warning("%s: the Ray cluster cannot hold %s now (%s); waiting up to %.0f s "
                        "(trainer.placement_timeout_s) for nodes to join", self.role, self.asked(), never,
                        max(0.0, deadline - time.monotonic()))

    def _refusal(self, why: str, nodes: list[Node] | None = None, held: dict | None = None) -> ClusterError:
        """The refusal, each node's free resources counted as they are without this placement's
        groups placed so far (removed as it is raised)."""
        nodes = cluster_nodes() if nodes is None else nodes
        held = held_by_node(exclude=self) if held is None else held
        mine: dict[str, dict[str, float]] = {}
        for ids in self._nodes:
            for node_id in ids:
                add(mine.setdefault(node_id, {}), self.bundle)
        nodes = [replace(n, free={**n.free, **{k: n.free.get(k, 0.0) + v for k, v in mine[n.id].items()}})
                 if n.free is not None and n.id in mine else n for n in nodes]
        return ClusterError(
            f"could not place {self.role}: asked for {self.asked()}; {why}. The cluster's {len(nodes)} live "
            f"node(s): {describe(nodes, self.bundle, held)}. Start more nodes (`ray start --address=HEAD:6379`), "
            f"lower trainer.devices_per_node / trainer.nnodes / rollout.workers or the CPUs per worker, or share "
            f"another role's bundles with colocate_with=")

    def _remove_all(self) -> None:
        from ray.util.placement_group import remove_placement_group

        for pg in self.pgs:
            try:
                remove_placement_group(pg)
            except Exception as e:  # the cluster may already be gone
                log.debug("removing placement group failed: %s", e)
        self.pgs = []

    def release(self) -> None:
        self.users -= 1
        if self.users <= 0:
            self._remove_all()
            if self in _LIVE:
                _LIVE.remove(self)
