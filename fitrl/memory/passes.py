"""What one forward (or forward and backward) of a trainer rank or an engine holds besides the
model's states: the traced transients of the real log-prob code (:mod:`.trace`), the vision
tower's activations, a micro-batch's pixel values, autocast's fp32 widening on a CPU, and LoRA's
adapter parameters. Shared by a trainer rank's phases (:mod:`.trainer`) and the engines'
planners (fitrl/rollout/*_plan.py)."""

from __future__ import annotations

from typing import Optional

from fitrl.memory import calibration as C
from fitrl.memory.run import Run
from fitrl.models.shape import numel
from fitrl.memory.states import DTYPE_BYTES, lora_layer_params
from fitrl.memory.trace import trace_spec, transient_bytes


def traced_transient(run: Run, phase: str, batch: int, seq_len: int, dtype: Optional[str] = None, adapters: bool = True,
                     response_len: Optional[int] = None, **kw) -> int:
    """``adapters``: the forward runs through the LoRA adapters (when LoRA is on; not the reference's)."""
    a = run.cfg.actor
    spec = trace_spec(run.shape, phase=phase, batch=batch, seq_len=seq_len,
                      response_len=run.response_len if response_len is None else response_len,
                      dtype=dtype or run.compute_dtype, chunk=a.logprob_chunk_size,
                      attn=a.model.attn_implementation, lora=run.lora if adapters else None, **kw)
    return transient_bytes(spec, run.shape.layers)


def pass_transient(run: Run, phase: str, batch: int, seq_len: int, **kw) -> int:
    """A log-prob or update pass's transient on one rank: traced (:func:`traced_transient`), or
    with ``actor.ulysses_size`` = u > 1 (fitrl/distributed/ulysses.py) the trace of the rank's
    chunk (``batch`` rows of ceil(seq_len / u) positions, at most that many response tokens) plus,
    in flight in one layer, its queries, keys and values twice more (the contiguous chunks sent
    and the buffers received). Everything the rank saves has its chunk's size: the exchanged
    queries, keys, values and attention output hold (heads / u) x seq_len positions, as many
    values as the chunk's. Less the chunk's attention mask, which the trace of a padded batch
    holds (a bool one, and per layer SDPA's additive copy: kept for backward in an update) and a
    Ulysses pass never builds: it keeps one sequence per row, attending plain causal."""
    u = run.ulysses
    if u <= 1:
        return traced_transient(run, phase, batch, seq_len, **kw)
    chunk = -(-seq_len // u)
    local = traced_transient(run, phase, batch, chunk, response_len=min(run.response_len, chunk - 1), **kw)
    return max(0, local + ulysses_beyond_trace(run.shape, phase, batch, chunk,
                                               DTYPE_BYTES[kw.get("dtype") or run.compute_dtype]))


def ulysses_beyond_trace(shape, phase: str, batch: int, chunk: int, dtype_bytes: int) -> int:
    """What a Ulysses pass holds beyond the trace of its chunk (:func:`pass_transient`): one
    layer's queries, keys and values twice over, less the chunk's masks."""
    in_flight = 2 * (shape.heads + 2 * shape.kv_heads) * shape.head_dim * batch * chunk * dtype_bytes
    masks = batch * chunk * chunk * (1 + dtype_bytes * (shape.layers if phase == "update" else 1))
    return in_flight - masks


def bf16_widening(run: Run, head_rows: int, tokens: int) -> int:
    """Autocast on a CPU runs each bf16 product in the fp32 kernel (fitrl/core/bf16_matmul.py): one
    product at a time holds its operands and its result in fp32 beside the bf16 tensors. The
    largest is the head over ``head_rows`` rows or an MLP projection over ``tokens`` rows, times
    the RSS measured per byte of it (an upper bound on CPUs with bf16 kernels, which widen nothing)."""
    s = run.shape

    def product(rows: int, k: int, n: int) -> int:
        return 4 * (rows * k + k * n + rows * n)

    largest = max(product(head_rows, s.hidden, s.vocab), product(tokens, s.hidden, s.intermediate))
    return int(C.CPU_BF16_WIDENING_RSS_FACTOR * largest)


def vision_activations(run: Run, seqs: int, grad: bool, checkpointing: bool, mapped_only: bool = False) -> int:
    """The vision tower over a micro-batch's images, in the compute dtype. Every sequence brings
    its prompt's images (the forward concatenates each sample's pixel values, shared prompt or
    not): ``seqs * images_per_prompt * patches`` tokens; what each token holds is the tower's own
    description (``VisionTower.activation_widths``; the Qwen-VL towers' measured counts are in
    fitrl/models/families/qwen_vl/tower.py). A frozen tower (``actor.model.freeze_vision_tower``)
    is a pass without gradients: autograd records nothing of its forward.

    ``mapped_only``: the part held in tensors of at least
    :data:`~fitrl.memory.calibration.GLIBC_MMAP_THRESHOLD_MAX` (each ``tokens x width``), which
    glibc maps and unmaps: what a CPU process's heap cannot keep after the update."""
    v, visual = run.shape.vision, run.visual
    if visual is None:
        return 0
    tokens = seqs * run.images_per_prompt * visual.patches
    b = DTYPE_BYTES[run.compute_dtype]
    grad = grad and not run.cfg.actor.model.freeze_vision_tower
    parts = [(k, tokens * width * b) for k, width in v.activation_widths(grad, checkpointing)]  # (count, bytes of one)
    return sum(k * one for k, one in parts if not mapped_only or one >= C.GLIBC_MMAP_THRESHOLD_MAX)


def micro_images(run: Run, seqs: int) -> int:
    """A forward's pixel values: ``concat_multi_modal`` (fitrl/models/families/qwen_vl/family.py)
    concatenates the micro-batch's ``seqs`` samples' fp32 ``pixel_values`` (a copy per sample, shared
    prompt or not) and moves them to the device (on CUDA via a host tensor of the same size, freed
    after the copy)."""
    return seqs * run.images_per_prompt * run.visual.pixel_values_bytes if run.visual else 0


def autocast_weights(run: Run, grad: bool, frozen: bool | None = None) -> int:
    """The bf16 copies of the weights that autocast holds through one pass of the model. Autocast
    caches the cast of a leaf weight that requires a gradient for the whole autocast region; a
    frozen weight (LoRA's base; a reference model: ``frozen=True``) is cast again at every use, and
    the cast lives as long as something keeps it: a pass with gradients keeps every one for its
    backward (the input's gradient needs it), a pass without keeps one at a time, at most the
    largest matrix (the head or the MLP's). ``frozen`` None: frozen exactly when LoRA is on.
    Measured on an H100 (bench/gpu_calibration/h100-2026-11-27.json, the LoRA case: its rollout
    held 7.24 GiB, the base's full cast would have made it 9.6)."""
    cb = DTYPE_BYTES[run.compute_dtype]
    shape = run.shape
    frozen = bool(run.lora) if frozen is None else frozen
    if not frozen or grad:
        return (shape.num_params + adapter_params(run)[1]) * cb
    return (max(shape.vocab, shape.intermediate) * shape.hidden + adapter_params(run)[1]) * cb


def adapter_params(run: Run) -> tuple[int, int]:
    """LoRA adapter parameters (one decoder layer's, all of them); (0, 0) without LoRA."""
    if not run.lora:
        return 0, 0
    adapters = run.shape.lora_tensors(run.lora.rank, run.lora_targets)
    return lora_layer_params(run.shape, run.lora.rank, run.lora_targets), sum(numel(s) for _, s in adapters)
