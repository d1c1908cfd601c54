"""Processes besides the trainer ranks and the engines' own (those are their planners',
fitrl/memory/engines.py): the driver, and what belongs to a node (Ray, its object store, reward
workers, rank 0's checkpoint copies and its weight-channel bucket)."""

from __future__ import annotations

from fitrl.memory import calibration as C
from fitrl.memory.engines import engine_planner
from fitrl.memory.gpu_terms import DRIVER_CONTEXT
from fitrl.memory.model import ProcessPlan, Usage, listed_phases
from fitrl.memory.run import Run
from fitrl.memory.sharding import sharding_plan
from fitrl.memory.states import DTYPE_BYTES, WEIGHT_CHANNEL, full_weights, tensors_bytes


def driver_images(run: Run, phase: str) -> int:
    """Host bytes of images the driver holds in ``phase`` (in-process, the driver is the trainer's
    process and this is the only copy). ``PromptDataset.batch`` (fitrl/data/dataset.py) makes each
    drawn prompt's fp32 ``pixel_values`` (patches, 3 * 2 * p * p), decoding and processing one
    prompt at a time (:meth:`Run.image_processing_bytes`; in one process that transient is over
    before ``generate`` starts, see ``fitrl/planner/plan.py``); the n samples of a prompt share its
    tensors (one dict per prompt, repeated by reference), so a step holds
    ``data.rollout_batch_size`` prompts' worth (:meth:`Run.pixel_values_bytes`), not x n. Under
    Ray ``generate`` returns the rollout with its prompts' images, unpickled here: a second copy
    until the prompts batch is dropped after the rollout is scored. The later phases of the step
    hold the rollout batch's copy, counted as long as the token batch is (every phase but load
    and validation)."""
    d = run.cfg.data
    if phase == "load":
        return 0
    if phase in ("rollout", "validation"):
        prompts = d.rollout_batch_size if phase == "rollout" else d.val_batch_size
        copies = 2 if run.distributed else 1
        return copies * run.pixel_values_bytes(prompts) + run.image_processing_bytes()
    return run.pixel_values_bytes(d.rollout_batch_size)


def driver_and_node_plans(run: Run) -> list[ProcessPlan]:
    cfg, hw = run.cfg, run.hw
    seqs_step = run.batch.sequences_per_step
    driver, node, rank0 = {}, {}, {}
    for ph in listed_phases(run.layout):
        d, n, r0 = Usage(), Usage(), Usage()
        if run.distributed:  # in-process, the driver is the trainer's process (runtime and batch counted there)
            d.add("host", "runtime", C.DRIVER_RUNTIME)
            if run.cuda:  # named though 0 (Usage.add keeps no 0): the table says it was not forgotten
                d.gpu[DRIVER_CONTEXT] = C.DRIVER_CUDA_CONTEXT
        d.add("host", "image buffers", driver_images(run, ph))
        if ph not in ("load", "validation") and run.distributed:
            d.add("host", "batch", run.batch_bytes(seqs_step))
        n.add("host", "reward workers", cfg.reward.num_workers * C.REWARD_WORKER_HOST)
        agent = cfg.rollout.agent
        if agent.enabled and agent.tools:  # each policy rank's sandbox (fitrl/agents/sandbox.py)
            tool_workers = agent.tool_workers * (max(cfg.world_size // hw.nodes, 1) if run.distributed else 1)
            n.add("host", "tool workers", tool_workers * C.TOOL_WORKER_HOST)
            if ph in ("rollout", "validation"):  # what a call may allocate: its RLIMIT_AS, the bound
                n.add("host", "tool calls (bound)", tool_workers * max(agent.memory_bytes() - C.TOOL_WORKER_HOST, 0))
        if run.distributed:
            n.add("host", "ray", C.RAY_SYSTEM_HOST)
            if ph != "load":
                seqs = seqs_step if ph != "validation" else cfg.data.val_batch_size * cfg.rollout.val.n
                # a call's arguments over 100 KiB go through the object store: the shards of the
                # token batch (and the ranks' results: RAY_OBJECT_COPIES), and each rank's pickled
                # images for as long as the call runs; generate's results carry them back again
                copies = 2 if ph in ("rollout", "validation") else 1
                images = copies * hw.gpus_per_node * run.pixel_values_bytes(run.prompts_received(ph))
                store = min(C.RAY_OBJECT_COPIES * run.batch_bytes(seqs) // hw.nodes + images,
                            int(run.cfg.plan.object_store_fraction * hw.host_memory))
                n.add("host", "object store", store)
        if ph == "load" and run.distributed and sharding_plan(cfg.actor).reads_checkpoint_once(cfg.actor):
            r0.add("host", "checkpoint copy", full_weights(run.shape, cfg.actor.model.dtype))
        if ph == "load" and (run.distributed or not run.cuda or engine_planner(cfg).maps_checkpoint(run)):
            # the checkpoint file mapped by safetensors (page cache shared by a node's readers)
            on_disk = run.shape.raw.get("torch_dtype") or run.shape.raw.get("dtype")
            n.add("host", "checkpoint pages", full_weights(run.shape, on_disk if on_disk in DTYPE_BYTES else "bfloat16"))
        r = cfg.rollout
        # rollout workers of their own under Ray (fitrl/trainer/pipeline.py), as the layout starts them
        if run.layout.rollout is not None and run.distributed:
            if ph == "weight_sync" and run.weight_channel:  # broadcast from rank 0's device, a bucket at a time
                r0.add("gpu" if run.cuda else "host", WEIGHT_CHANNEL, run.channel_bytes("rank0"))
            elif ph == "weight_sync":  # rank 0 gathers the full weights into the object store
                weights = full_weights(run.shape, run.compute_dtype)  # (sent in the compute dtype)
                r0.add("host", "weights sent", weights)
                n.add("host", "object store (weights)", weights)
            if r.lead and ph not in ("load", "validation", "checkpoint_save"):
                # up to `lead` steps' generations finished and waiting to be taken, in the object store
                n.add("host", "samples in flight", r.lead * run.batch_bytes(seqs_step))
        if ph == "checkpoint_save":  # a LoRA checkpoint holds the adapters only (fitrl/checkpoint/manager.py)
            saved = (tensors_bytes([s for _, s in run.shape.lora_tensors(run.lora.rank, run.lora_targets)],
                                   DTYPE_BYTES[cfg.actor.model.dtype]) if run.lora
                     else full_weights(run.shape, cfg.actor.model.dtype))
            r0.add("host", "checkpoint copy", saved)
        driver[ph], node[ph], rank0[ph] = d, n, r0
    return [ProcessPlan("driver", 1, driver), ProcessPlan("node", 1, node), ProcessPlan("rank0", 1, rank0)]

