"""Where the ranks of a Ray worker group run: placement groups and the rank numbering.

One bundle per rank (``num_cpus_per_worker`` CPUs, plus one GPU with ``use_gpu``): with
``nnodes=1`` one ``PACK`` group of ``world_size`` bundles; with ``nnodes>1`` one ``STRICT_PACK``
group of ``devices_per_node`` bundles per node. Ranks are numbered node by node
(:func:`rank_layout`), so ``LOCAL_RANK``/``LOCAL_WORLD_SIZE`` describe the real layout.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

# ray is imported inside Placement: importing this module (rank_layout) needs no ray.

log = logging.getLogger(__name__)


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


class Placement:
    """Bundles reserved for ``world_size`` ranks, shared by colocated groups (refcounted)."""

    def __init__(self, world_size: int, nnodes: int, devices_per_node: int, bundle: dict, timeout_s: float,
                 role: str):
        import ray
        from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group

        self.world_size, self.bundle, self.users = world_size, dict(bundle), 0
        have = ray.cluster_resources()
        short = {k: v * world_size for k, v in bundle.items() if have.get(k, 0) < v * world_size}
        if short:  # nodes may still be joining, so wait anyway, but say why it may take long
            log.warning("%s needs %s but the cluster has %s in all; waiting up to %.0f s for more nodes",
                        role, short, {k: have.get(k, 0) for k in short}, timeout_s)
        if nnodes == 1:
            self.pgs = [placement_group([bundle] * world_size, strategy="PACK", name=f"fitrl-{role}")]
        else:
            self.pgs = [placement_group([bundle] * devices_per_node, strategy="STRICT_PACK",
                                        name=f"fitrl-{role}-node{i}") for i in range(nnodes)]
        ready, _ = ray.wait([pg.ready() for pg in self.pgs], num_returns=len(self.pgs), timeout=timeout_s)
        if len(ready) < len(self.pgs):
            for pg in self.pgs:
                remove_placement_group(pg)
            total = {k: v for k, v in ray.cluster_resources().items() if k in ("CPU", "GPU")}
            free = {k: v for k, v in ray.available_resources().items() if k in ("CPU", "GPU")}
            raise RuntimeError(
                f"could not place {role}: {nnodes} node(s) x {devices_per_node} bundle(s) of {bundle} "
                f"were not free within {timeout_s:.0f} s (cluster: {len(ray.nodes())} node(s), {total} in all, "
                f"{free} free). Start more nodes, lower trainer.devices_per_node / the CPUs per worker, or "
                f"share another role's bundles with colocate_with=")
        nodes = []
        for pg in self.pgs:
            table = placement_group_table(pg)["bundles_to_node_id"]
            nodes.append([table[b] for b in range(len(pg.bundle_specs))])
        self.slots = rank_layout(nodes)
        ips = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}
        self.node_ips = [ips.get(s.node_id, "?") for s in self.slots]
        if nnodes > 1 and len({s.node_id for s in self.slots}) < nnodes:
            log.warning("%s: %d per-node placement groups landed on only %d node(s); ranks still work, but "
                        "LOCAL_WORLD_SIZE differs from devices_per_node", role, nnodes,
                        len({s.node_id for s in self.slots}))
        self._remove = remove_placement_group

    def release(self) -> None:
        self.users -= 1
        if self.users <= 0 and self.pgs:
            for pg in self.pgs:
                try:
                    self._remove(pg)
                except Exception as e:  # the cluster may already be gone
                    log.debug("removing placement group failed: %s", e)
            self.pgs = []

