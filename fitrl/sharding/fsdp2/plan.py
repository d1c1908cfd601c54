"""FSDP2's memory plan: what a role's ``fsdp:`` options (``fitrl.config.FSDPConfig``) cost, as
fitrl/memory/sharding.py asks it.

- Sharded over every rank (``strategy: full``), or within a node and replicated across nodes
  (``hybrid`` with several nodes: a 2-D mesh whose two dimensions are communicators of their own).
- ``cpu_offload`` (FSDP2's CPUOffloadPolicy, under Ray): shards, gradients and the optimizer step
  in host memory, pinned on CUDA; ``offload_params`` / ``offload_optimizer``: fitrl's own moves
  between phases (fitrl/roles/offload.py).
- Gathered units in a pass: the root (embeddings, final norm, head) stays gathered forward to
  backward, two decoder layers in flight (one computing, one prefetched); a ``generate`` call
  gathers every weight once (``gathered_for_generation`` of the runtime, :mod:`.runtime`).
- On a CPU rank glibc's heap keeps FSDP2's per-unit buffers over an update (measured:
  :data:`fitrl.memory.calibration.CPU_FSDP_UNIT_BUFFERS`).
"""

from __future__ import annotations

from typing import Any, Optional

from fitrl.memory import calibration as C
from fitrl.memory.run import Run
from fitrl.memory.sharding import SHARDING_PLANNERS, ShardingPlanner
from fitrl.sharding.fsdp2.runtime import NAME

_OPTIONS = {"states": "cpu_offload", "params": "offload_params", "optimizer": "offload_optimizer"}
UNIT_BUFFERS = "allocator (FSDP2 unit buffers)"


class FSDP2Planner(ShardingPlanner):
    name, title = NAME, "FSDP2"

    @staticmethod
    def _options(section: Any) -> Any:
        return section.fsdp

    def world(self, run: Run, section: Any) -> int:
        hybrid = self._options(section).strategy == "hybrid" and run.hw.nodes > 1
        return run.hw.gpus_per_node if hybrid else run.world

    def host_only(self, run: Run, section: Any) -> bool:
        return self._options(section).cpu_offload and run.distributed  # (a policy of FSDP2's: Ray only)

    def pinned(self, run: Run, section: Any) -> bool:
        return run.cuda and self.host_only(run, section)  # (pin_memory needs an accelerator)

    def offloads(self, section: Any, what: str) -> bool:
        return bool(getattr(self._options(section), _OPTIONS[what]))

    def offload_key(self, prefix: str, what: str) -> Optional[str]:
        return f"{prefix}.fsdp.{_OPTIONS[what]}"

    def mixed_precision(self, section: Any) -> bool:
        return bool(self._options(section).mixed_precision)

    def communicators(self, run: Run, section: Any) -> int:
        # a hybrid mesh across nodes splits the default group into (replicate, shard): two
        # communicators; a 1-D mesh over the world reuses the default group (torch's DeviceMesh)
        return 2 if self._options(section).strategy == "hybrid" and run.hw.nodes > 1 else 0

    def reads_checkpoint_once(self, section: Any) -> bool:
        return self._options(section).init == "rank0"

    def gathered(self, root: int, layer: int, whole: int, *, generation: bool = False) -> int:
        return whole if generation else root + 2 * layer

    def heap_buffers(self, run: Run, cb: int, trained: int) -> tuple[str, int]:
        # one unsharded copy of every unit's parameters in the compute dtype (all-gather outputs;
        # with bf16 compute also the shards cast for the all-gather) and of its gradients in fp32
        # (the reduce dtype): layer-sized blocks the heap keeps in place as it goes through the units
        n = run.shape.num_params
        cast = n // run.world * cb if cb < 4 else 0  # bf16 all-gather inputs (shards)
        return UNIT_BUFFERS, int(C.CPU_FSDP_UNIT_BUFFERS * (n * cb + trained * 4 + cast))

    def candidates(self, prefix: str, section: Any, distributed: bool) -> list[tuple[str, Any, str, str]]:
        key = f"{prefix}.fsdp.init"
        if distributed and self._options(section).init == "every_rank":
            return [(key, "rank0", "faster: one checkpoint read per job, not per rank", f"{key} every_rank -> rank0")]
        return []


SHARDING_PLANNERS.add(NAME, FSDP2Planner())
