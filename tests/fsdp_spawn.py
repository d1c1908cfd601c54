"""Rank entry point for FSDP2 tests that need more ranks than Ray can place on the CI machine
(spawned with torch.multiprocessing; importable because pytest puts tests/ on sys.path)."""

import os
import pickle


def update_on_rank(rank, world, port, cfg, batch, queue):
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        from fitrl.roles.workers import PolicyWorker

        worker = PolicyWorker(cfg, rank=rank, world_size=world)
        metrics = worker.update(batch.chunk(world)[rank])
        state = worker.state_dict()
        if rank == 0:  # pickled bytes: tensors shared through fds would die with this process
            queue.put(pickle.dumps((metrics, state)))
        dist.barrier()
    finally:
        dist.destroy_process_group()
