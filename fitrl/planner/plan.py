"""The entry point: :func:`plan_config` composes the processes of a run into a :class:`Plan`.

The trainer ranks' phases (and under Ray the reference's and critic's ranks') come from
:mod:`fitrl.memory.trainer`, the rollout engine's own processes from its planner
(fitrl/memory/engines.py, registered beside the engine in fitrl/rollout/), the driver and the
node's services from :mod:`fitrl.memory.services`; the types they share are in
:mod:`fitrl.memory.model`.
"""

from __future__ import annotations

from typing import Optional

from fitrl.config import FitrlConfig
from fitrl.memory import calibration as C
from fitrl.memory.lengths import Lengths, expected_lengths
from fitrl.memory.model import Hardware, Plan
from fitrl.memory.engines import active_phases, engine_planner
from fitrl.memory.run import Run
from fitrl.memory.services import driver_and_node_plans
from fitrl.models.shape import ModelShape
from fitrl.memory.trainer import TRANSIENT, rank_plans


def plan_config(cfg: FitrlConfig, hardware: Hardware, shape: Optional[ModelShape] = None,
                lengths: Optional[Lengths] = None, expected_if_needed: bool = False,
                supervised: bool = False) -> Plan:
    """The memory plan of ``cfg`` on ``hardware`` (``cfg.plan.hardware`` is not read here: see
    :meth:`Hardware.for_config`); ``shape``: the actor's, when already read.

    The run is planned at the caps and, when ``lengths`` (the expected lengths; unset: read now,
    :func:`~fitrl.memory.lengths.expected_lengths`) are shorter, a second time at them: the same
    code with :attr:`Run.lengths` set, so every per-token term follows the lengths and what is
    allocated at the caps stays there (:attr:`Plan.expected`; the verdict rule is
    :class:`Plan`'s). ``expected_if_needed``: skip the second plan when the caps plan's verdict is
    ``fits``, the one case where the verdict does not read it (pre-flight, recommendations).
    ``supervised``: a ``fitrl sft`` run (no rollout workers, reference or critic: :attr:`Plan.layout`)."""
    # lazy: fitrl.config.choices imports fitrl.algo and so torch, which `fitrl --help` must not wait for;
    # fitrl.rollout registers every engine's planner
    import fitrl.rollout  # noqa: F401
    import fitrl.sharding  # noqa: F401  (registers the sharding backends and their planners)
    from fitrl.config.choices import algorithm_needs

    cfg = cfg.with_device_defaults(hardware.device)  # what the run there computes in (bf16 on CUDA)
    shape = shape or ModelShape.from_path(cfg.actor.model.path)
    ref_shape = ModelShape.from_path(cfg.ref.model.path) if cfg.ref.model and cfg.ref.model.path else None
    spec = algorithm_needs(cfg)
    lengths = (expected_lengths(cfg) if lengths is None else lengths).within(cfg)
    plan = _plan(Run(cfg, hardware, shape, ref_shape, spec, supervised=supervised))
    plan.lengths = lengths
    if lengths.note and lengths.prompt_source != "dataset":  # auto could not read the data here
        plan.notes.append(f"{lengths.note}: the expected prompt length is the cap")
    if not lengths.at_caps(cfg) and not (expected_if_needed and plan.verdict == "fits"):
        plan.expected = _plan(Run(cfg, hardware, shape, ref_shape, spec, lengths, supervised))
        plan.expected.at, plan.expected.lengths = "expected", lengths
    return plan


def _plan(run: Run) -> Plan:
    """The processes of ``run`` at its lengths, composed."""
    cfg, hardware, shape, spec = run.cfg, run.hw, run.shape, run.spec
    notes: list[str] = []
    processes = rank_plans(run, notes)  # the trainer rank; under Ray the reference and critic ranks too
    engines, growth = engine_planner(cfg).processes(run, notes)  # the engine's processes of its own
    processes += engines
    processes += driver_and_node_plans(run)
    if not run.distributed:  # one process: trainer, driver and node share it
        processes = [p for p in processes if p.kind != "rank0"]
        _decoding_before_generate(run, processes)
    _image_notes(run, notes)
    return Plan(cfg, hardware, shape, spec, phases=active_phases(cfg, spec), processes=processes, notes=notes,
                growth_per_step=growth, layout=run.layout)


def _decoding_before_generate(run: Run, processes: list) -> None:
    """In one process the driver decodes and processes a phase's prompts (``PromptDataset.batch``, one
    prompt at a time: :meth:`Run.image_processing_bytes`) and frees that working memory before
    ``generate`` makes its own (a micro-batch's images, the KV cache and activations, and on CPU
    the heap glibc kept from the last update, which both reuse): the phase's peak holds the larger
    of the two transients, not their sum (measured: telemetry's ``data`` and ``rollout`` phases,
    ``bench/vl_image_memory.py``). Under Ray the driver is a process of its own, counted apart."""
    decoding = run.image_processing_bytes()
    if not decoding:
        return
    trainer, driver = (next(p for p in processes if p.kind == kind) for kind in ("trainer", "driver"))
    for ph in ("rollout", "validation"):
        if ph not in trainer.phases:
            continue
        engine = trainer.phases[ph].host
        generating = sum(engine.get(k, 0) for k in (*TRANSIENT, "allocator (retained)", "image buffers"))
        driver.phases[ph].host["image buffers"] -= min(decoding, generating)


def _image_notes(run: Run, notes: list[str]) -> None:
    visual, k = run.visual, run.images_per_prompt
    if visual is None:
        return
    d = run.cfg.data
    notes.append(f"images: up to data.limit_images={k} per prompt, each up to data.max_pixels={d.max_pixels:,} -> "
                 f"{visual.height:,} x {visual.width:,} pixels -> {visual.patches:,} patches, {visual.llm_tokens:,} "
                 f"LM tokens, {visual.pixel_values_bytes / C.MIB:.0f} MiB of fp32 pixel values (host: x "
                 f"{d.rollout_batch_size} prompts on the driver, not x rollout.n)")
    tokens = k * visual.llm_tokens
    if tokens > run.prompt_len:
        notes.append(f"a prompt with {k} image(s) of the largest size takes {tokens:,} LM tokens, more than "
                     f"data.max_prompt_length={run.prompt_len:,}: such prompts are dropped")
