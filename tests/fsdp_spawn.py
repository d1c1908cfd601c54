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


def guard_check_on_rank(rank, world, port, low_on, queue):
    """Rank ``low_on`` sees memory under its threshold; every rank calls one collective safe point."""
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        from fitrl.telemetry.guard import GUARD, MemoryPressure

        GUARD.settings.enabled, GUARD.process, GUARD.phase = True, f"policy.rank{rank}", "old_logprob"
        GUARD.settings.min_available_bytes = 2**60 if rank == low_on else 0
        try:
            GUARD.check()
            queue.put((rank, None))
        except MemoryPressure as p:
            queue.put((rank, (p.origin, p.kind, p.process)))
        dist.barrier()  # every rank is still in step with the others after the safe point
    finally:
        dist.destroy_process_group()


def ulysses_update_on_rank(rank, world, port, model_dir, batch, sp, fsdp, checkpointing, queue):
    """An actor update with ``sp``-way Ulysses sequence parallelism (a group of every ``sp``
    consecutive ranks; each group gets the same ``batch``), FSDP2-sharded over every rank when
    ``fsdp``, with activation checkpointing when ``checkpointing``. Rank 0 reports the
    log-probs, metrics and the full updated weights."""
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        from transformers import AutoModelForCausalLM

        from fitrl.config.schema import ActorConfig, AlgorithmConfig, FSDPConfig
        from fitrl.distributed.fsdp import shard
        from fitrl.distributed.state import full_state_dict
        from fitrl.distributed.ulysses import sequence_groups
        from fitrl.roles.actor import Actor

        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if fsdp:
            shard(model, FSDPConfig(), model.model.layers, torch.device("cpu"))
        actor = Actor(model, ActorConfig(micro_batch_size=4, packing=True), AlgorithmConfig(use_kl_loss=True),
                      total_steps=1, max_response_length=12, sequence_group=sequence_groups(sp))
        logp = actor.compute_logprob(batch, temperature=1.0)["old_logprobs"]
        metrics = actor.update(batch, sequences_per_mini_batch=len(batch), temperature=1.0)
        state = full_state_dict(model) if fsdp else {k: v.detach().clone() for k, v in model.state_dict().items()}
        if rank == 0:
            queue.put(pickle.dumps((logp, metrics, state)))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def replicated_on_rank(rank, world, port, model_dir, queue):
    """A model built by ``build_model`` under a dummy sharding backend of the test's own
    ("replicate": the whole model on every rank, rank 0's weights broadcast into the others'
    meta-built copies), registered in this process as a user's backend would be."""
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        import fitrl.sharding  # noqa: F401  (the built-in backends, as the roles register them)
        from fitrl.config.schema import ActorConfig, ModelConfig
        from fitrl.distributed.sharding import SHARDING_BACKENDS, backend_of, sharded_over_ranks
        from fitrl.models.loading import build_model
        from sharding_dummy import ReplicateBackend

        SHARDING_BACKENDS.add("replicate", ReplicateBackend())
        section = ActorConfig(model=ModelConfig(path=model_dir), sharding="replicate")
        model = build_model("causal_lm", section.model, section, torch.device("cpu"))
        ids = torch.arange(1, 9).unsqueeze(0)
        with torch.no_grad():
            logits = model(input_ids=ids).logits
        queue.put((rank, backend_of(model).name, sharded_over_ranks(model), getattr(model, "filled_by", None),
                   pickle.dumps(logits)))
        dist.barrier()
    finally:
        dist.destroy_process_group()
