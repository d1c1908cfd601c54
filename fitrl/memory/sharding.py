"""What a sharding backend's choices cost: the planner twin of fitrl/distributed/sharding.py,
registered under the backend's name (the built-in FSDP2's: fitrl/sharding/fsdp2/plan.py).

The phase modules ask a role's config section (``run.cfg.actor``, a reward source) for its
planner with :func:`sharding_plan` and never read the backend's options themselves: how many
ranks a tensor is split over, whether states live in (pinned) host memory, which of them move
out between phases, the compute dtype, the communicators, how many units are gathered at once,
and what a CPU rank's heap keeps of the gathers. In one process (``trainer.backend=inprocess``)
nothing is sharded; the backend's options still say the dtype and the offloading there.
``fitrl/trainer/complete.py`` checks that every runtime backend has its planner.
"""

from __future__ import annotations

from typing import Any, Optional

from fitrl.core.registry import Registry

Run = Any
"""A :class:`fitrl.memory.run.Run` (which reads this module: named, not imported, here)."""


class ShardingPlanner:
    """The memory of one sharding backend's choices. The defaults describe a whole module that
    never moves (a rollout worker's replica): a backend overrides what its options change."""

    name = "plain"
    title = "one whole copy per rank"
    """How the plan's recommendations name the backend ("shard with FSDP2 over 8 devices")."""

    def world(self, run: Run, section: Any) -> int:
        """Ranks each of the role's states is split over (1: a whole copy per rank)."""
        return 1

    def host_only(self, run: Run, section: Any) -> bool:
        """Do the role's states live in host memory, the device computing on them layer by layer?"""
        return False

    def pinned(self, run: Run, section: Any) -> bool:
        """Are its weights and gradients pinned host tensors (rounded by the pinned allocator)?"""
        return False

    def offloads(self, section: Any, what: str) -> bool:
        """Does the role move ``what`` (``"params"``, ``"optimizer"``) to host memory between its phases?"""
        return False

    def offload_key(self, prefix: str, what: str) -> Optional[str]:
        """The config key that moves ``what`` (``"states"``: for good, ``"params"``, ``"optimizer"``:
        between phases) of the role at ``prefix`` (``actor``) to the host; None: no such setting."""
        return None

    def mixed_precision(self, section: Any) -> bool:
        """Does the role compute in bf16 on its stored weights (sharded, or under autocast in one process)?"""
        return False

    def communicators(self, run: Run, section: Any) -> int:
        """Communicators a rank of the role holds beyond its process's default group."""
        return 0

    def reads_checkpoint_once(self, section: Any) -> bool:
        """Under Ray: does one rank read the checkpoint and fill the others (the plan's "rank0" process)?"""
        return False

    def gathered(self, root: int, layer: int, whole: int, *, generation: bool = False) -> int:
        """Full weights in flight in one of the role's passes when sharded: ``root`` the bytes of the
        root unit (embeddings, norm, head), ``layer`` of one decoder layer, ``whole`` of the model;
        ``generation``: a ``generate`` call (the weights held for the whole call)."""
        return 0

    def heap_buffers(self, run: Run, cb: int, trained: int) -> tuple[str, int]:
        """``(label, bytes)`` a CPU rank's glibc heap keeps of the gathers over an update (``cb``:
        the compute dtype's bytes; ``trained``: parameters with gradients)."""
        return "", 0

    def candidates(self, prefix: str, section: Any, distributed: bool) -> list[tuple[str, Any, str, str]]:
        """Changes of its options the recommender may try: ``(key, value, cost, text)``."""
        return []


PLAIN_PLAN = ShardingPlanner()

SHARDING_PLANNERS: Registry[ShardingPlanner] = Registry("sharding backend memory planner", "")
"""Registered beside each runtime backend (fitrl/sharding/<name>/plan.py), under its name."""


def sharding_plan(section: Any) -> ShardingPlanner:
    """The planner of the backend ``section.sharding`` names; :data:`PLAIN_PLAN` for None (a role
    that is never sharded nor offloaded)."""
    if section is None:
        return PLAIN_PLAN
    if not SHARDING_PLANNERS.names():
        raise RuntimeError("no sharding backend planner is registered: import fitrl.sharding first (a bug in fitrl)")
    return SHARDING_PLANNERS.get(section.sharding)
