"""A sharding backend of a test's own ("replicate": every rank a whole copy, filled from rank 0)
and its memory planner, for tests/test_sharding_backend.py and its spawned ranks."""

import torch
import torch.distributed as dist

from fitrl.distributed.sharding import ShardingBackend
from fitrl.memory.sharding import ShardingPlanner


class ReplicateBackend(ShardingBackend):
    name = "replicate"

    def owns(self, m):
        return getattr(m, "replicated", False)

    def reads_checkpoint_once(self, options):
        return True

    def shard(self, m, options, blocks, device, *, nnodes=1):
        m.replicated = True  # nothing is split: each rank keeps every weight

    def fill_from_rank0(self, m, full_state, source, device, options):
        m.to_empty(device=device)
        state = dict(m.state_dict())
        for name, t in state.items():  # rank 0's tensors, sent to every rank
            if full_state is not None:
                t.copy_(full_state[name])
            dist.broadcast(t, src=0)
        if source is not None:  # buffers outside the state dict (rotary inv_freq) too
            for name, buf in source.named_buffers():
                m.get_buffer(name).copy_(buf)
        for _, buf in m.named_buffers():
            dist.broadcast(buf, src=0)
        m.filled_by = "rank0"


class ReplicatePlanner(ShardingPlanner):
    name, title = "replicate", "whole replicas"

    def mixed_precision(self, section):
        return False

    def gathered(self, root, layer, whole, *, generation=False):
        return 0  # nothing to gather: the weights are whole already


