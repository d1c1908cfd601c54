"""A trainer rank's memory per phase: its roles' states where they live in that phase (device
or host, by the offload settings), the traced transients of its micro-steps, FSDP2's gathered
units, and what the rollout engine holds in the same process (its planner's
:meth:`~fitrl.memory.engines.EnginePlanner.in_trainer`: the HF engine's generation, or a vLLM
engine on CPU; on CUDA the vLLM engine is a process kind of its own). Under
Ray the reference's and the critic's ranks are processes of their own beside it, planned here
the same way (:func:`rank_plans`). With
LoRA the reference log-probs come from the policy itself, adapters off (fitrl/roles/workers.py,
``PolicyWorker.compute_ref_logprob``): its micro-batches and compute dtype, no model of its own."""

from __future__ import annotations

from fitrl.memory import calibration as C
from fitrl.memory import mapped
from fitrl.memory.engines import active_phases, engine_planner
from fitrl.memory.gpu_terms import NCCL, OUTSIDE_ALLOCATOR, nccl_buffers, pinned_optimizer
from fitrl.memory.model import ProcessPlan, Usage
from fitrl.memory.passes import (adapter_params, autocast_weights, bf16_widening, micro_images, pass_transient,
                                 traced_transient, vision_activations)
from fitrl.memory.roles import ROLE_PLANNERS, process_roles, resident, role_states
from fitrl.memory.run import Run
from fitrl.memory.sharding import sharding_plan
from fitrl.models.shape import numel
from fitrl.memory.states import DTYPE_BYTES, States, full_weights, layer_bytes, root_bytes


def _logits_part(run: Run, batch: int, grad: bool) -> int:
    """The fp32 logits chunks inside the traced transient, for the breakdown: two (chunk, V)."""
    tokens = min(run.cfg.actor.logprob_chunk_size, batch * run.response_len)
    return 2 * tokens * run.shape.vocab * 4 + (run.shape.vocab * run.shape.hidden * 4 if grad else 0)


def rank_plans(run: Run, notes: list[str]) -> list[ProcessPlan]:
    """The per-device processes (:func:`~fitrl.memory.roles.process_roles`): the trainer rank, and
    under Ray the reference's and the critic's ranks beside it. Each holds its own roles' states
    in every phase (where the offload settings put them) and its own runtime and CUDA context; the
    traced transients of a log-prob pass or an update are the process's that runs it: the
    reference's in ``ref_logprob`` (the policy's with LoRA), the policy's in ``old_logprob`` and
    ``update``; a Ray critic rank's values and update passes (:func:`_critic_pass`; in one
    process the policy's passes in those phases are the larger: the critic's are not added), and
    its gradients in ``update`` where it is the process's largest trained role (one role updates
    at a time)."""
    roles = role_states(run)
    held = process_roles(run)
    plans = [_rank_plan(run, kind, {r: roles[r] for r in names}, notes) for kind, names in held.items()]
    if run.lora:
        notes.append(_lora_note(run))
    notes.extend(engine_planner(run.cfg).notes(run))
    return plans


def _rank_plan(run: Run, kind: str, roles: dict, notes: list[str]) -> ProcessPlan:
    """One per-device process of ``kind`` holding ``roles`` (name -> (states, config section))."""
    cfg, cuda, dev = run.cfg, run.cuda, "gpu" if run.cuda else "host"
    trainer = kind == "trainer"
    # the passes this process runs: its roles' (the in-process trainer runs the reference's too)
    passes = set().union(*(ROLE_PLANNERS.get(r).passes(run) for r in roles))
    cb = DTYPE_BYTES[run.compute_dtype]
    engine = engine_planner(cfg)
    phases = {}
    unretained = 0  # the update's transient bytes glibc cannot keep (mapped tensors)
    # one role updates at a time: the critic's update (fitrl/trainer/loop.py, before the policy's)
    # frees its gradients when it ends, so a process holding both has one role's gradients at once
    updating = max((r for r in roles if roles[r][0].grads), key=lambda r: roles[r][0].grads, default=None)
    nccl = nccl_buffers(run, [(r, section) for r, (_, section) in roles.items()])  # (assumed: 0 off CUDA, in one process)
    # only the phases this run has: an absent one's traces would be wasted start-up
    for ph in active_phases(run.cfg, run.spec):
        u = Usage()
        # a Ray role actor of its own (reference, critic) costs a process runtime like a trainer rank's
        u.add("host", "runtime", C.CUDA_PROCESS_RUNTIME if cuda else C.CPU_PROCESS_RUNTIME + C.CPU_RANK_EXTRA * run.distributed)
        u.add("host", "runtime", C.PEFT_IMPORT_HOST if run.lora and trainer else 0)
        if cuda:  # every process on the device has its own context
            u.add("gpu", "cuda context", C.CUDA_CONTEXT)
        u.add("gpu", NCCL, nccl)
        for role, (st, section) in roles.items():
            full = st  # (the update's; st becomes what this phase holds)
            on_dev, opt_dev = resident(role, section, ph, run)
            label = "" if role == "actor" else f"{role} "
            pinned_grads = 0
            if ph == "load":  # no gradients or optimizer states yet
                st = States(st.params)
            elif ph == "update" and role != updating:
                st = States(st.params, optimizer=st.optimizer)
            elif ph != "update":  # Actor/Critic.update free their gradients after the last step
                if st.grads and sharding_plan(section).pinned(run, section):
                    # ... but gradients kept in pinned host memory (FSDP2's CPUOffloadPolicy) leave
                    # their freed blocks in the pinned caching allocator for the next update
                    pinned_grads = st.grads
                st = States(st.params, optimizer=st.optimizer)
            where_w = dev if on_dev else "host"
            offl = "" if where_w == dev else "offloaded "
            u.add(where_w, f"{offl}{label}{ROLE_PLANNERS.get(role).params_label(run)}", st.params)
            u.add(where_w, f"{offl}{label}grads", st.grads)
            u.add("host", f"pinned cache ({label}grads)", pinned_grads)
            u.add(dev if opt_dev else "host", f"{'' if opt_dev or not cuda else 'offloaded '}{label}optimizer",
                  st.optimizer)
            pinned_optimizer(run, section, full, st, opt_dev, u, label)  # its pinned blocks (assumed)
            if ph != "load":  # (loading's own checkpoint copy stands for the file's pages there)
                u.add("host", f"{label}{mapped.LABEL}", mapped.stacked_experts_mapped(run, section))
            for part, size in ROLE_PLANNERS.get(role).own_pass(run, ph).items():  # a reward model's, a judge's
                u.add(dev, part, size * (1.0 if cuda else C.CPU_ALLOCATOR_SLACK))
            for part, size in ROLE_PLANNERS.get(role).own_host(run, ph).items():  # a rollout worker's mailbox
                u.add("host", part, size)
        seqs = run.seqs_per_rank
        # under Ray each call's shard arrives pickled: the pixel values of the prompts it touches,
        # this process's own copy (in-process the driver's copy is the only one: counted there)
        if ph in passes or (trainer and ph in ("rollout", "validation")):
            u.add("host", "image buffers", run.pixel_values_bytes(run.prompts_received(ph)))
        if ph in passes:
            u.add("host", "batch", run.batch_bytes(seqs))
            if cuda:  # the rank's token tensors go to the device; pixel values one micro-batch at a time
                u.add("gpu", "batch", run.batch_bytes(seqs))
        slack = 1.0 if cuda else C.CPU_ALLOCATOR_SLACK  # (the GPU's caching allocator: allocator_reserve)
        if ph in passes:
            grad = ph == "update"
            ref_model = ph == "ref_logprob" and not run.lora  # a reference model of its own
            size = cfg.actor.micro_batch_size if grad else (
                cfg.ref.logprob_micro_batch_size if ref_model else cfg.actor.logprob_micro_batch_size)
            b = run.micro(size, update=grad)
            u.add(dev, "image buffers", micro_images(run, b))
            if cuda:
                u.add("host", "image buffers", micro_images(run, b))
            dtype = (cfg.ref.model or cfg.actor.model).dtype if ref_model and not run.distributed else None
            prompts = run.prompt_groups(b, update=grad)
            if prompts:
                _note(notes, f"{ph}: planned with a micro-batch's {b} sequences sharing {prompts} "
                             f"prompt{'s' if prompts > 1 else ''}, each run once (actor.share_prompts)")
            tr = pass_transient(run, "update" if grad else "logprob", b, run.seq_len, dtype=dtype,
                                  adapters=ph != "ref_logprob",
                                  checkpointing=grad and cfg.actor.model.gradient_checkpointing,
                                  entropy_grad=grad and cfg.actor.entropy_coeff != 0, prompts=prompts)
            ckpt = cfg.actor.model.gradient_checkpointing
            vit = vision_activations(run, b, grad, ckpt)
            heap = run.glibc_heap
            live = tr
            if grad and ckpt and not cuda and not heap:  # jemalloc's, tcmalloc's caches over the recompute
                tr = int(tr * C.CPU_RECOMPUTE_RSS_BY_ALLOCATOR.get(cfg.memory.host_allocator, 1.0))
            if heap:
                tr = _cpu_transient(run, tr, grad, ckpt, lora=run.lora is not None)
                # the vision tower's tensors get the same excess from glibc (measured, 2048 x 2048
                # pictures, bench/vl_image_memory.py: an update's tower took 0.95 GiB of RSS under
                # glibc's defaults, mean of 4 runs, against 0.70 with MALLOC_MMAP_THRESHOLD_: 1.36x);
                # LoRA's larger one is PEFT's adapter sum in the adapted language-model layers
                vit = _cpu_transient(run, vit, grad, ckpt)
                if grad:
                    unretained = _cpu_transient(run, vision_activations(run, b, grad, ckpt, mapped_only=True), grad,
                                                ckpt)
            if heap and grad and run.cfg.memory.trim_heap:
                u.add("host", "allocator (heap residue)", _update_heap_residue(run, live))
            logits = min(tr, _logits_part(run, b, grad and not run.lora))  # LoRA: no lm_head gradient
            _logits_note(run, ph, b, notes)
            u.add(dev, "logits", logits * slack)
            u.add(dev, "activations", (tr - logits + vit) * slack)
            section = cfg.ref if ref_model else cfg.actor
            sh = sharding_plan(section)
            if run.distributed:  # gathered units, as many at once as the backend gathers
                # (unsharded gradients are the traced incoming gradients already: not added again)
                # (LoRA: each unit gathers its adapters with its base weights)
                per_layer, total = adapter_params(run)
                root_adapters = total - per_layer * run.shape.layers
                u.add(dev, "gathered weights", sh.gathered(root_bytes(run.shape, cb) + root_adapters * cb,
                                                           layer_bytes(run.shape, cb) + per_layer * cb,
                                                           run.shape.num_params * cb + total * cb))
                if heap and grad:  # (the heap residue is there before the first unit gathers: on top)
                    label, buffers = sh.heap_buffers(run, cb, _trained_params(run))
                    u.add("host", label, max(0, buffers - (tr - live)))
            elif sh.mixed_precision(section):  # one process: autocast
                u.add(dev, "autocast weights", autocast_weights(run, grad, frozen=ref_model or None))
                if not cuda:
                    u.add(dev, "bf16 widening", bf16_widening(
                        run, min(cfg.actor.logprob_chunk_size, b * run.response_len), b * run.seq_len))
        if kind == "critic" and ph in ("old_logprob", "update"):  # its values and its update
            _critic_pass(run, ph, u, dev)
        if trainer:  # the policy's rollout engine, loading and saving
            engine.in_trainer(run, ph, u, dev)
            if ph == "load":  # (the reference and critic groups load after the policy's: one copy at a time)
                _load(run, u)
            if ph == "checkpoint_save":
                _checkpoint(run, u, roles)
        if cuda:
            allocator_reserve(ph, u)
        phases[ph] = u
    if run.glibc_heap:  # every role's process has glibc's heap
        _cpu_retention(phases, unretained, trimmed=run.cfg.memory.trim_heap)
    elif not cuda and run.cfg.memory.host_allocator in C.CPU_CACHED_AFTER_UPDATE:
        _cached_after_update(phases, C.CPU_CACHED_AFTER_UPDATE[run.cfg.memory.host_allocator])
    planner = ROLE_PLANNERS.get(kind) if kind in ROLE_PLANNERS else None  # (None: the trainer rank)
    own = planner.per_node(run) if planner else None  # (rollout workers: their count)
    # every process here is one per device: the trainer rank, or a role's ranks of their own
    return ProcessPlan(kind, (own or run.hw.gpus_per_node) if run.distributed else 1, phases, per_device=True,
                       own_device=bool(planner and planner.own_device))


def _critic_pass(run: Run, phase: str, u: Usage, dev: str) -> None:
    """PPO's critic in a Ray process of its own: the traced values pass (``old_logprob``) or
    update micro-step (a one-label head on every position: no vocabulary-wide logits), its
    gathered units, and on CPU glibc's heap as a trainer rank's update gets it (the same measured
    factors: the same decoder's forward and backward). In one process the policy's passes in the
    same phases are the larger, and the critic's are not added."""
    c, shape = run.cfg.critic, run.shape
    model = c.model or run.cfg.actor.model
    grad = phase == "update"
    sh = sharding_plan(c)
    dtype = "bfloat16" if sh.mixed_precision(c) else "float32"  # its weights are fp32 (CriticPlanner)
    ckpt = grad and model.gradient_checkpointing
    b = min(c.micro_batch_size if grad else c.values_micro_batch_size, run.seqs_per_rank)
    live = traced_transient(run, "value_update" if grad else "values", b, run.seq_len, dtype=dtype,
                            adapters=False, checkpointing=ckpt)
    tr = live
    heap = run.glibc_heap
    if heap and grad:
        tr = _cpu_transient(run, live, grad, ckpt, dtype=dtype)
        if run.cfg.memory.trim_heap:
            u.add("host", "allocator (heap residue)", _update_heap_residue(run, live, trained=shape.num_params))
    u.add(dev, "activations", tr * (1.0 if run.cuda else C.CPU_ALLOCATOR_SLACK))
    if run.distributed:
        cb = DTYPE_BYTES[dtype]
        u.add(dev, "gathered weights", sh.gathered(root_bytes(shape, cb), layer_bytes(shape, cb), shape.num_params * cb))
        if heap and grad:
            label, buffers = sh.heap_buffers(run, cb, shape.num_params)
            u.add("host", label, max(0, buffers - (tr - live)))


def _note(notes: list[str], text: str) -> None:
    if text not in notes:
        notes.append(text)


def _logits_note(run: Run, phase: str, batch: int, notes: list[str]) -> None:
    """Name the logits when one chunk covers a micro-batch and it costs a tenth of a device."""
    tokens = batch * run.response_len
    chunk = run.cfg.actor.logprob_chunk_size
    naive = 2 * min(chunk, tokens) * run.shape.vocab * 4
    if chunk > 1024 and run.cuda and naive > 0.1 * run.hw.gpu_memory:
        text = (f"{phase}: {tokens:,} response tokens x {run.shape.vocab:,} vocab: the fp32 logits need "
                f"{naive / C.GIB:.1f} GiB with actor.logprob_chunk_size={chunk:,}; chunks of 1,024 need "
                f"{2 * 1024 * run.shape.vocab * 4 / C.GIB:.1f} GiB (prompt: {run.prompt_len:,} tokens, no logits)")
        _note(notes, text)


def allocator_reserve(phase: str, u: Usage) -> None:
    """What PyTorch's caching allocator reserves beyond the live tensors in a phase that computes
    (one with transients): a measured multiple of everything it holds then
    (:data:`~fitrl.memory.calibration.GPU_RESERVED_FACTORS`); the CUDA context and NCCL's buffers
    are outside it (:data:`~fitrl.memory.gpu_terms.OUTSIDE_ALLOCATOR`)."""
    if not any(u.gpu.get(k, 0) for k in TRANSIENT):
        return
    factor = C.GPU_RESERVED_FACTORS.get(phase, C.GPU_RESERVED_FACTOR_OTHER)
    u.add("gpu", "allocator reserve", (factor - 1) * sum(v for k, v in u.gpu.items() if k not in OUTSIDE_ALLOCATOR))


# ("bf16 widening" is not one: its term is already RSS, CPU_BF16_WIDENING_RSS_FACTOR)
TRANSIENT = ("activations", "logits", "gathered weights", "autocast weights", "kv cache", "engine weight push")


def _cpu_retention(phases: dict[str, Usage], unretained: int = 0, trimmed: bool = True) -> None:
    """What glibc's heap adds to the phases besides the update (whose own excess is
    :func:`_cpu_transient`'s), shown as one "allocator" entry.

    ``trimmed`` (``memory.trim_heap``, the default: every role's phase ends with ``malloc_trim``,
    fitrl/roles/workers.py): a phase starts from what is held, and its heap regrows over the phase
    to a measured multiple of its own transients (activations, logits, gathered or autocast
    weights, KV cache: :data:`~fitrl.memory.calibration.CPU_TRIMMED_PHASE_RSS_FACTOR`,
    :data:`~fitrl.memory.calibration.CPU_TRIMMED_ROLLOUT_RSS_FACTOR` for generation).

    Untrimmed: glibc keeps the update's peak heap resident into the next step, so from step 2 on
    every other phase holds at least that share of the update's transients
    (:data:`~fitrl.memory.calibration.CPU_RETAINED_AFTER_UPDATE`). ``unretained``: the update's
    transient bytes in tensors glibc maps (the vision tower's of at least
    :data:`~fitrl.memory.calibration.GLIBC_MMAP_THRESHOLD_MAX`), which it cannot keep."""
    update = _host_transients(phases["update"])
    retained = int(C.CPU_RETAINED_AFTER_UPDATE * max(0, update - unretained))
    for ph, u in phases.items():
        if ph in ("update", "load"):
            continue
        own = _host_transients(u)
        if trimmed:
            factor = C.CPU_TRIMMED_ROLLOUT_RSS_FACTOR if ph in ("rollout", "validation") else C.CPU_TRIMMED_PHASE_RSS_FACTOR
            if ph == "teacher_logprob" and not update:  # the teacher's own process: no update ever shaped its heap
                factor = C.CPU_TRIMMED_TEACHER_PROCESS_RSS_FACTOR
            u.add("host", "allocator (regrown heap)", (factor - 1) * own)
        else:
            u.add("host", "allocator (retained)", retained - own)


def _cached_after_update(phases: dict[str, Usage], share: float) -> None:
    """jemalloc and tcmalloc keep freed memory in their own caches (``malloc_trim`` is glibc's):
    the phases after an update start with ``share`` of its transients still resident, and reuse
    it before asking for more, so each holds the larger of its own transients and that share
    (:data:`~fitrl.memory.calibration.CPU_CACHED_AFTER_UPDATE`). Never above the update's."""
    cached = int(share * _host_transients(phases["update"])) if "update" in phases else 0
    for ph, u in phases.items():
        if ph not in ("update", "load"):
            u.add("host", "allocator (cached)", max(0, cached - _host_transients(u)))


def _host_transients(u: Usage) -> int:
    """A phase's host bytes that last only while it runs (:data:`TRANSIENT`)."""
    return sum(u.host.get(k, 0) for k in TRANSIENT)


def _cpu_transient(run: Run, traced: int, grad: bool, checkpointing: bool, lora: bool = False,
                   dtype: str | None = None) -> int:
    """glibc keeps freed heap memory: RSS above the traced live bytes by a measured factor, one
    set for a heap trimmed at every phase's end (``memory.trim_heap``, the default) and one for
    a heap that kept the last step's blocks. ``dtype``: the pass's compute dtype (the policy's)."""
    if run.cfg.memory.trim_heap:  # (a no-grad pass's excess is :func:`_cpu_retention`'s, with the rest of the phase)
        mixed = (dtype or run.compute_dtype) != "float32"  # bf16 compute casts fp32 weights every forward
        logprob, recompute, lora_bwd, bwd = (1.0, C.CPU_TRIMMED_RECOMPUTE_RSS_FACTOR,
                                             C.CPU_TRIMMED_LORA_BACKWARD_RSS_FACTOR,
                                             C.CPU_TRIMMED_MIXED_BACKWARD_RSS_FACTOR if mixed
                                             else C.CPU_TRIMMED_BACKWARD_RSS_FACTOR)
    else:
        logprob, recompute, lora_bwd, bwd = (C.CPU_LOGPROB_RSS_FACTOR, C.CPU_RECOMPUTE_RSS_FACTOR,
                                             C.CPU_LORA_BACKWARD_RSS_FACTOR, C.CPU_BACKWARD_RSS_FACTOR)
    if not grad:
        return int(traced * logprob)
    if checkpointing:
        return int(traced * recompute)
    return int(traced * (lora_bwd if lora else bwd))


def _update_heap_residue(run: Run, traced: int, trained: int | None = None) -> int:
    """What a trimmed glibc heap adds to an update besides its transients' factor: a fixed part,
    and a share of the smaller of its traced transients and its gradients (fp32, this rank's
    share of the trained parameters). The gradients are allocated in the first micro-batch's
    backward between blocks of activations that are freed right after, and ``malloc_trim``
    returns only whole free pages; sharded, it comes on top of the backend's unit buffers
    (:data:`~fitrl.memory.calibration.CPU_UPDATE_HEAP_FIXED`,
    :data:`~fitrl.memory.calibration.CPU_UPDATE_HEAP_PINNED`)."""
    grads = (_trained_params(run) if trained is None else trained) * 4 // run.world
    return int(C.CPU_UPDATE_HEAP_FIXED + C.CPU_UPDATE_HEAP_PINNED * min(traced, grads))


def _trained_params(run: Run) -> int:
    """Parameters that get gradients: the adapters with LoRA, else every parameter."""
    return adapter_params(run)[1] if run.lora else run.shape.num_params


def _lora_note(run: Run) -> str:
    lora, adapters = run.lora, run.shape.lora_tensors(run.lora.rank, run.lora_targets)
    text = (f"LoRA rank {lora.rank} on {', '.join(lora.target_modules)}: {len(adapters) // 2} linear layers, "
            f"{sum(numel(s) for _, s in adapters) / 1e6:,.2f}M adapter parameters train (gradients and AdamW "
            f"states for these only); the base's {run.shape.num_params / 1e6:,.1f}M are frozen")
    if run.spec.reference:
        text += "; the reference is the policy with its adapters off (no reference model)"
    return text + engine_planner(run.cfg).lora_note(run)


def _load(run: Run, u: Usage) -> None:
    """Every rank reads (one process, or a backend whose ranks each read, FSDP2's ``init=every_rank``): this rank reads the whole checkpoint, one full copy in
    the actor's dtype, into host memory; with ``plan.emulate.load_on_device`` (under Ray on CUDA)
    onto its device instead, as another framework's ranks do (EasyR1 without rank-0 init: each
    rank's ``from_pretrained(device_map="cuda")``, failure story 5). With ``init=rank0`` only rank
    0 reads, into host memory (the "rank0" process of the plan); the checkpoint file's pages are
    counted once per node."""
    a = run.cfg.actor
    if not run.distributed or not sharding_plan(a).reads_checkpoint_once(a):
        on_device = run.distributed and run.cuda and run.cfg.plan.emulate.load_on_device
        u.add("gpu" if on_device else "host", "checkpoint copy", full_weights(run.shape, run.cfg.actor.model.dtype))


def _checkpoint(run: Run, u: Usage, roles) -> None:
    """Saving: each rank stages its optimizer shard on the host (unless model-only or already
    there); rank 0 gathers the full weights (the "rank0" process of the plan)."""
    ck = getattr(run.cfg, "checkpoint", None)
    _, opt_on_device = resident("actor", run.cfg.actor, "checkpoint_save", run)
    if ck is not None and not getattr(ck, "model_only", False) and opt_on_device:
        u.add("host", "checkpoint buffers", roles["actor"][0].optimizer)
