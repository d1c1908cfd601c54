"""Processes besides the trainer ranks: a vLLM engine (``rollout.engine=vllm``), the driver, and what
belongs to a node (Ray, its object store, reward workers, rank 0's checkpoint copies)."""

from __future__ import annotations

from fitrl.config import ConfigError
from fitrl.config.plan import parse_bytes
from fitrl.memory import calibration as C
from fitrl.memory.model import PHASES, Hardware, ProcessPlan, Usage
from fitrl.memory.run import Run
from fitrl.memory.shapes import numel
from fitrl.memory.states import DTYPE_BYTES, full_weights, tensors_bytes


def vllm_plan(run: Run, notes: list[str]) -> tuple[ProcessPlan, int]:
    """On CUDA, a vLLM engine per ``rollout.tensor_parallel_size`` devices (``rollout.*``; on CPU
    the engine is part of each trainer rank's process: :func:`vllm_cpu_engine`), with the other
    frameworks' behaviours ``plan.emulate`` asks for; returns (plan, host growth/step). Device
    entries are per device: each of an engine's tp devices holds 1/tp of its weights and KV.

    Host entries are per engine, or where an engine spans nodes (tp > GPUs per node) per its part
    on one node: each of its TP workers on the node keeps its own host memory (vLLM's runtime, at
    sleep level 1 the pinned backup of its 1/tp weight shard, vLLM V0's swap space, which is per
    GPU), so an engine holds a full copy of the weights and a node one per its GPUs' worth of
    engines: ``GPUs per node / tp`` engines of ``tp`` shards, or one engine's ``GPUs per node``
    shards (:func:`engine_layout`). A node's host entries are its ``G`` workers' either way.

    vLLM's own runtime: fitrl's engine (and veRL's and EasyR1's hybrid engine) runs in the trainer
    rank's process, which has its CUDA runtime counted already: vLLM adds
    :data:`~fitrl.memory.calibration.VLLM_IN_PROCESS_RUNTIME` per worker; engines in processes of
    their own (``plan.emulate.separate_processes``) cost
    :data:`~fitrl.memory.calibration.VLLM_PROCESS_RUNTIME` per worker and a CUDA context."""
    e, em, shape, hw = run.cfg.rollout, run.cfg.plan.emulate, run.shape, run.hw
    tp = e.tensor_parallel_size
    engines, workers = engine_layout(tp, hw)
    weights = full_weights(shape, "bfloat16", tp)
    if e.kv_cache_memory is not None:  # a KV cache of this size per device, the rest as vLLM needs it
        kv = parse_bytes(e.kv_cache_memory, "rollout.kv_cache_memory")
        budget = weights + kv + C.VLLM_ACTIVATION_RESERVE
    else:  # gpu_memory_utilization x the device, on every device of the engine
        budget = int(e.gpu_memory_utilization * hw.gpu_memory)
        kv = budget - weights - C.VLLM_ACTIVATION_RESERVE
    demand = run.cfg.data.rollout_batch_size * run.cfg.rollout.n * tp // (hw.nodes * hw.gpus_per_node) * run.seq_len
    capacity = max(0, kv) // max(1, shape.kv_bytes_per_token(2) // tp)
    if kv <= 0:
        notes.append(f"vLLM: rollout.gpu_memory_utilization {e.gpu_memory_utilization} leaves no room for the KV "
                     f"cache after {weights / C.GIB:.1f} GiB of weights")
    elif demand > capacity:
        notes.append(f"vLLM: a rollout needs {demand:,} KV tokens per engine, the cache holds {capacity:,}: "
                     "sequences are preempted and recomputed (slower, not an OOM)")
    # sleep level 1: every TP worker backs its own shard up to pinned host memory (rounded per tensor)
    backup = workers * full_weights(shape, "bfloat16", tp, pinned=True) if e.sleep_level == 1 else 0
    swap = int(workers * em.swap_space_gib * C.GIB)  # vLLM's swap_space is per GPU: every TP worker's
    phases = {}
    for ph in PHASES:
        u = Usage()
        if em.separate_processes:  # each TP worker is a process of its own (CUDA runtime, vLLM)
            u.add("host", "runtime", workers * C.VLLM_PROCESS_RUNTIME)
        else:  # in the trainer rank's process: vLLM and the engine's structures
            u.add("host", "vLLM runtime", workers * C.VLLM_IN_PROCESS_RUNTIME)
        awake = ph in ("rollout", "validation") or e.sleep_level == 0
        # loading streams the checkpoint through the node's page cache (its RSS shows those shared
        # pages: ~runtime + weights per engine, failure story 2); they are counted once per node
        if awake:
            u.add("gpu", "engine (weights, kv cache)", budget)
        elif ph == "weight_sync":
            u.add("gpu", "engine weights", weights)
        elif ph != "load":
            u.add("host", "engine weights (asleep)", backup)
        if ph != "load":
            u.add("host", "engine swap space", swap)
        if em.separate_processes and run.cuda:
            u.add("gpu", "cuda context", C.CUDA_CONTEXT)
        phases[ph] = u
    # an engine awake through training (sleep_level 0: veRL's free_cache_engine=False) never frees its
    # cache, so it never rebuilds it: the emulated rebuild's growth needs an engine that sleeps
    growth = (swap + backup) * engines if em.free_cache_engine and e.sleep_level != 0 else 0
    if growth:
        where = "per engine" if workers == tp else f"per engine's {workers} workers on a node"
        notes.append(f"plan.emulate.free_cache_engine rebuilds the engine every step; its pinned host blocks "
                     f"({(swap + backup) / C.GIB:.1f} GiB {where}) stay cached: host grows "
                     f"{growth / C.GIB:.0f} GiB per step")
    return ProcessPlan("engine", engines, phases), growth


def engine_layout(tp: int, hw: Hardware) -> tuple[int, float]:
    """(engines on a node, TP workers of one engine on that node) for engines of ``tp`` devices,
    ``max(1, G // tp)`` engines per node of ``G`` devices: ``(G / tp, tp)`` with ``tp`` dividing
    ``G``, ``(1, G)`` for an engine that spans ``tp / G`` nodes. Every device of a node runs one
    worker, so the workers of a node's engines are its ``G`` either way: with a ``tp`` that
    neither divides ``G`` nor is a multiple of it, engines straddle nodes (ranks are numbered
    node by node) and a node's ``G // tp`` engines are planned with ``G / (G // tp)`` workers
    each, its ``G`` workers' host memory in all (more than ``tp``; not a whole number where
    ``G // tp`` does not divide ``G``). Refused: a ``tp`` the run's devices do not divide into
    (vLLM's and veRL's rule), or beyond them."""
    g, total = hw.gpus_per_node, hw.nodes * hw.gpus_per_node
    if tp > total or total % tp:
        raise ConfigError(f"rollout.tensor_parallel_size={tp}: the {hw.nodes} node(s) x {g} devices do not divide "
                          f"into engines of {tp}; use a divisor of {total}")
    engines = max(1, g // tp)
    return engines, (g // engines if g % engines == 0 else g / engines)


CPU_TP_WORKER_RUNTIME = int(0.46 * C.GIB)
"""A CPU TP worker process of vLLM's multiprocess executor without its weights and KV cache
(Python, torch, vLLM, gloo; its unique set size). Measured (vllm-cpu 0.32.0, tiny model, 2 cores):
722 MiB USS per worker with a 256 MiB KV cache (935 MiB RSS, the rest shared libraries)."""


def vllm_cpu_engine(run: Run) -> dict[str, int]:
    """The vLLM engine on CPU (``rollout.engine=vllm``, ``trainer.device=cpu``), by component, in
    host bytes: one engine per policy rank inside the policy's own process (vLLM's in-process
    mode, fitrl/rollout/vllm_engine.py), built at the end of loading and held to the end of the
    run, so every phase holds all of it, loading included. With ``rollout.tensor_parallel_size``
    tp > 1 the engine core stays in the policy's process and tp worker processes hold the rest;
    their bytes are counted here too (the same host, every phase):

    - ``vLLM runtime``: :data:`~fitrl.memory.calibration.VLLM_CPU_RUNTIME` (vLLM imported, the
      engine's structures; measured).
    - ``engine weights``: the engine's own copy of the policy in the engine dtype (the policy's
      compute dtype: ``actor.model.dtype`` in-process, bf16 under Ray with mixed precision), built
      with ``load_format="dummy"`` and overwritten in place by every push. On CPU vLLM repacks each
      linear weight for oneDNN after loading and drops the original (one copy), but keeps the output
      head's weight beside its packed copy: one more ``vocab x hidden``.
    - ``engine kv cache``: ``rollout.kv_cache_memory`` (256MiB unset), allocated zeroed when the
      engine is built: resident whether used or not (measured: 192 MiB more RSS for 256MiB than
      for 64MiB, at every size). Per TP worker: each holds a cache of this size for its share of
      the KV heads.
    - ``TP worker processes`` (tp > 1): tp x :data:`CPU_TP_WORKER_RUNTIME`. The weights term stays
      one copy: each worker holds a 1/tp shard (norms and replicated KV heads aside).

    With tp > 1 and several policy ranks, tp ranks share one engine (fitrl/rollout/vllm_build.py,
    ``shared``): each rank's process holds the runtime, a 1/tp shard of the weights and head and
    one KV cache of ``rollout.kv_cache_memory``, and no worker process exists.

    Measured (``bench/vllm_cpu_memory.py``, fp32, two runs): the engine's part of a step's update
    peak (the vLLM run minus the HF engine's) is these bytes within 5% for the tiny and small
    models (0.39-0.75 GiB), +1% to +17% over for the medium one (1.07 GiB planned; its update
    peak moves by ~0.15 GiB between runs under glibc). Not counted: what vLLM's profiling forward
    leaves in the heap at build (~0.1-0.2 GiB more at the medium model's widths than the tiny's),
    which an update's transients reuse."""
    from fitrl.rollout.vllm_build import CPU_KV_CACHE  # lazy: fitrl.rollout imports torch

    shape, b = run.shape, DTYPE_BYTES[run.compute_dtype]
    kv = run.cfg.rollout.kv_cache_memory or CPU_KV_CACHE
    tp = run.cfg.rollout.tensor_parallel_size
    if tp > 1 and run.world > 1:  # shared: this rank is one shard of its group's engine
        return {"vLLM runtime": C.VLLM_CPU_RUNTIME,
                "engine weights": -(-(full_weights(shape, run.compute_dtype) + shape.vocab * shape.hidden * b) // tp),
                "engine kv cache": parse_bytes(kv, "rollout.kv_cache_memory")}
    parts = {"vLLM runtime": C.VLLM_CPU_RUNTIME,
             "engine weights": full_weights(shape, run.compute_dtype) + shape.vocab * shape.hidden * b,
             "engine kv cache": tp * parse_bytes(kv, "rollout.kv_cache_memory")}
    if tp > 1:
        parts["TP worker processes"] = tp * CPU_TP_WORKER_RUNTIME
    return parts


def vllm_push_bytes(run: Run) -> int:
    """What a weight push holds beyond the two copies of the weights, one tensor at a time
    (``fitrl.distributed.fsdp.stream_full_tensors``): vLLM materialises the module being reloaded
    (its largest tensor, in the engine dtype) before processing it into place; the trainer side
    holds a full tensor of its own only when it makes one (an FSDP2 all-gather under Ray, a LoRA
    merge): in one process without LoRA it yields views of its own weights.

    On CPU with ``rollout.tensor_parallel_size`` tp > 1 the weights go to the TP workers in buckets
    (:data:`fitrl.rollout.vllm_engine.PUSH_BUCKET_BYTES`): each worker holds a received bucket and,
    as the layers it fills are materialised and repacked, about as much again, plus the largest
    tensor. Measured (``medium``, fp32, 128 MiB buckets, 2 workers): +290-330 MiB of peak RSS per
    worker for a push, planned 288 MiB."""
    from fitrl.rollout.vllm_engine import PUSH_BUCKET_BYTES  # lazy: fitrl.rollout imports torch

    largest = max(numel(s) for _, s in run.shape.tensors())
    copy = run.fsdp or run.lora is not None
    tp = run.cfg.rollout.tensor_parallel_size
    if tp > 1 and not run.cuda and run.world == 1:  # TP worker processes
        weights = full_weights(run.shape, run.compute_dtype)
        b = DTYPE_BYTES[run.compute_dtype]
        return tp * (2 * min(PUSH_BUCKET_BYTES, weights) + largest * b) + copy * largest * b
    return largest * (DTYPE_BYTES[run.compute_dtype] + copy * DTYPE_BYTES[run.cfg.actor.model.dtype])


def driver_images(run: Run, phase: str) -> int:
    """Host bytes of images the driver holds in ``phase`` (in-process, the driver is the trainer's
    process and this is the only copy). ``prompts_batch`` (fitrl/trainer/collect.py) makes each
    drawn prompt's fp32 ``pixel_values`` (patches, 3 * 2 * p * p), decoding and processing one
    prompt at a time (:meth:`Run.image_processing_bytes`; in one process that transient is over
    before ``generate`` starts, see ``fitrl/memory/plan.py``); the n samples of a prompt share its
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
        copies = 2 if run.fsdp else 1
        return copies * run.pixel_values_bytes(prompts) + run.image_processing_bytes()
    return run.pixel_values_bytes(d.rollout_batch_size)


def driver_and_node_plans(run: Run) -> list[ProcessPlan]:
    cfg, hw = run.cfg, run.hw
    seqs_step = cfg.data.rollout_batch_size * cfg.rollout.n
    driver, node, rank0 = {}, {}, {}
    for ph in PHASES:
        d, n, r0 = Usage(), Usage(), Usage()
        if run.fsdp:  # in-process, the driver is the trainer's process (runtime and batch counted there)
            d.add("host", "runtime", C.DRIVER_RUNTIME)
        d.add("host", "image buffers", driver_images(run, ph))
        if ph not in ("load", "validation") and run.fsdp:
            d.add("host", "batch", run.batch_bytes(seqs_step))
        n.add("host", "reward workers", cfg.reward.num_workers * C.REWARD_WORKER_HOST)
        if run.fsdp:
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
        if ph == "load" and run.fsdp and cfg.actor.fsdp.init == "rank0":
            r0.add("host", "checkpoint copy", full_weights(run.shape, cfg.actor.model.dtype))
        if ph == "load" and (run.fsdp or not run.cuda or run.cfg.rollout.engine == "vllm"):
            # the checkpoint file mapped by safetensors (page cache shared by a node's readers)
            on_disk = run.shape.raw.get("torch_dtype") or run.shape.raw.get("dtype")
            n.add("host", "checkpoint pages", full_weights(run.shape, on_disk if on_disk in DTYPE_BYTES else "bfloat16"))
        if ph == "checkpoint_save":  # a LoRA checkpoint holds the adapters only (fitrl/checkpoint/manager.py)
            saved = (tensors_bytes([s for _, s in run.shape.lora_tensors(run.lora.rank, run.lora_targets)],
                                   DTYPE_BYTES[cfg.actor.model.dtype]) if run.lora
                     else full_weights(run.shape, cfg.actor.model.dtype))
            r0.add("host", "checkpoint copy", saved)
        driver[ph], node[ph], rank0[ph] = d, n, r0
    return [ProcessPlan("driver", 1, driver), ProcessPlan("node", 1, node), ProcessPlan("rank0", 1, rank0)]

