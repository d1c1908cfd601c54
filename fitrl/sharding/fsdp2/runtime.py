"""FSDP2 as a sharding backend: fitrl/distributed/fsdp.py's primitives behind the seam of
fitrl/distributed/sharding.py."""

from __future__ import annotations

from typing import Any, ContextManager, Iterable, Optional

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

from fitrl.distributed import fsdp
from fitrl.distributed.sharding import SHARDING_BACKENDS, ShardingBackend

NAME = "fsdp2"


class FSDP2Backend(ShardingBackend):
    name = NAME
    options_key = "fsdp"

    def owns(self, m: nn.Module) -> bool:
        return any(isinstance(x, FSDPModule) for x in m.modules())

    def reads_checkpoint_once(self, options: Any) -> bool:
        return options.init == "rank0"

    def shard(self, m: nn.Module, options: Any, blocks: Iterable[nn.Module], device: torch.device, *,
              nnodes: int = 1) -> None:
        fsdp.shard(m, options, blocks, device, nnodes=nnodes)

    def fill_from_rank0(self, m: nn.Module, full_state: Optional[dict[str, torch.Tensor]],
                        source: Optional[nn.Module], device: torch.device, options: Any) -> None:
        fsdp.broadcast_from_rank0(m, full_state, source, device, cpu_offload=options.cpu_offload)

    def units(self, m: nn.Module) -> list[nn.Module]:
        return fsdp.fsdp_modules(m)

    def gathered_for_generation(self, m: nn.Module) -> ContextManager[None]:
        return fsdp.gathered_for_generation(m)


SHARDING_BACKENDS.add(NAME, FSDP2Backend())
