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
  :data:`CPU_UNIT_BUFFERS`).
"""

from __future__ import annotations

from typing import Any, Optional

from fitrl.memory import calibration as C
from fitrl.memory.run import Run
from fitrl.memory.sharding import SHARDING_PLANNERS, ShardingPlanner
from fitrl.sharding.fsdp2.runtime import NAME

_OPTIONS = {"states": "cpu_offload", "params": "offload_params", "optimizer": "offload_optimizer"}
UNIT_BUFFERS = "allocator (FSDP2 unit buffers)"
CPU_UNIT_BUFFERS = 1.06
"""Measured (default glibc, trimmed): on a CPU rank of two or more FSDP2 ranks an update's RSS
stays above its live tensors by about one unsharded copy of the parameters in the compute
dtype plus one of the gradients in fp32, however small its activations: the all-gather outputs
and unsharded gradients of unit after unit (layer-sized, below glibc's mmap threshold) leave
their blocks in the heap. The small model (32M parameters) on two fp32 ranks, 16 sequences P32
R128: RSS above the live tensors measured with ``MALLOC_MMAP_THRESHOLD_=65536`` 0.23-0.27 GiB
against 0.24 GiB of parameters and gradients, with one or two micro-batches and with or without
checkpointing (a /tmp script over ``bench/plan_accuracy.py``'s ``measure`` and ``predict``,
2026-11-24); 0.105 GiB for the deep model (18M) on two bf16 ranks (configuration 17 of
``bench/plan_accuracy.py``, 2 + 4 bytes per parameter and 2 per parameter of its shard: 0.12).
The planner counts the larger of this and the activations' own excess
(:meth:`FSDP2Planner.heap_buffers`), and the heap residue on top: FSDP2 ranks start
their update 0.04-0.05 GiB above runtime and states too (configurations 8, 9 and 17, and
``bench/cpu_corpus.py`` 5; the /tmp script of ``CPU_UPDATE_HEAP_PINNED`` in
fitrl/memory/calibration.py, 2026-11-24). 1.06:
configuration 17 (two bf16 ranks) measured 0.122 GiB above its held memory and transients,
against 0.115 of parameters and gradients."""


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
        return UNIT_BUFFERS, int(CPU_UNIT_BUFFERS * (n * cb + trained * 4 + cast))

    def candidates(self, prefix: str, section: Any, distributed: bool) -> list[tuple[str, Any, str, str]]:
        key = f"{prefix}.fsdp.init"
        if distributed and self._options(section).init == "every_rank":
            return [(key, "rank0", "faster: one checkpoint read per job, not per rank", f"{key} every_rank -> rank0")]
        return []


SHARDING_PLANNERS.add(NAME, FSDP2Planner())
