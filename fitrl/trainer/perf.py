"""Throughput and MFU of one RL step, logged under ``perf/*`` (docs/metrics.md).

Tokens are counted from the batch masks: a sequence's prompt tokens are the attention mask's
ones left of the response columns, its response tokens the response mask's. FLOPs come from the
policy's ``config.json`` (:mod:`fitrl.models.flops`), the device peak from
:mod:`fitrl.telemetry.perf`. Per phase:

- rollout: tokens generated / ``time/rollout`` (every dynamic-sampling round);
- log-prob: (prompt + response tokens) x passes / (``time/old_logprob`` + ``time/ref`` +
  ``time/teacher_logprob``), a pass for the recomputed old log-probs, one for the reference and
  one for the distillation teacher (``algorithm.distill``), whose FLOPs are its own model's
  (``teacher.model.path``'s ``config.json``): a forward over the step's sequences, as the
  reference's; no teacher runs, and none is counted, with distillation off;
- update: (prompt + response tokens) x ``actor.ppo_epochs`` / ``time/update``;
- overall: the step batch's prompt + response tokens / ``time/step``, and MFU = the model FLOPs
  of the rollout (ReMax's greedy baseline included), log-prob and update phases / (``time/step``
  x peak x devices). The critic's phases take time but their FLOPs are not counted. A
  vision-language model's tower is counted over each sequence's image patches.

FLOPs are those the phases ran: where a forward ran a prompt once for the rows of a micro-batch
that share it (``actor.share_prompts`` in the log-prob and update passes, the HF engine's decode
loop in its prefill: fitrl/ops/shared_prompt.py), the passes report the copies they skipped
(:data:`fitrl.ops.sharing.SKIPPED_PROMPTS`, per process and phase, collected from every rank:
:func:`skipped_prompts`) and their FLOPs are not counted. Tokens/s count every sequence's tokens
(the work done for the user).
"""

from __future__ import annotations

import logging
from typing import Iterable, Optional

from fitrl.config.schema import FitrlConfig
from fitrl.core.device import resolve_device
from fitrl.data.batch import Batch
from fitrl.models.description import RunModels
from fitrl.models.flops import FlopsShape
from fitrl.ops.sharing import SKIPPED_PROMPTS, merge_skipped
from fitrl.telemetry.perf import device_peak_flops, mfu

log = logging.getLogger("fitrl.trainer")

Lengths = tuple[list[int], list[int]]


def sequence_lengths(batch: Batch) -> Lengths:
    """(prompt tokens, response tokens) of every sequence of a rollout batch (layout in
    fitrl/rollout/engine.py: prompt left-padded | response right-padded)."""
    response = batch["response_mask"]
    attention = batch["attention_mask"]
    prompt = attention[:, :attention.shape[1] - response.shape[1]].sum(-1)
    return [int(x) for x in prompt.tolist()], [int(x) for x in response.sum(-1).tolist()]


def image_patches(batch: Batch) -> list[list[int]]:
    """Vision-tower patches of each image and video of every sequence (a VL rollout's per-prompt
    ``multi_modal_inputs``: t x h x w of each grid); empty lists for text."""
    if "multi_modal_inputs" not in batch:
        return [[] for _ in range(len(batch))]
    out = []
    for mm in batch["multi_modal_inputs"]:
        grids = [mm[k] for k in ("image_grid_thw", "video_grid_thw") if mm is not None and mm.get(k) is not None]
        out.append([int(g.prod()) for grid in grids for g in grid])
    return out


def compute_dtype(cfg: FitrlConfig) -> str:
    """The dtype the policy's matmuls run in: bf16 with mixed precision (FSDP2 or autocast), else its weights'."""
    if cfg.actor.fsdp.mixed_precision:
        return "bfloat16"
    return cfg.actor.model.dtype


def load_flops_shape(model_path: str) -> tuple[Optional[FlopsShape], str]:
    """(shape, why there is none)."""
    try:
        return FlopsShape.from_path(model_path), ""
    except (OSError, ValueError) as e:
        return None, str(e)


def skipped_prompts(groups: Iterable) -> dict[str, list[int]]:
    """Phase -> prompt lengths of the copies the step's passes skipped: this process's own and,
    under Ray, every rank's of ``groups`` (each role's worker group)."""
    return merge_skipped([SKIPPED_PROMPTS.drain(), *(r for g in groups for r in g.skipped_prompts())])


class StepPerf:
    """``perf/*`` metrics of a step from its batch, the sequences generated and the phase times."""

    def __init__(self, cfg: FitrlConfig, models: Optional[RunModels] = None):
        # (``models``: the run's model descriptions, fitrl/models/description.py; else the directory is read)
        self.shape, why = models.actor.flops_shape() if models is not None else load_flops_shape(cfg.actor.model.path)
        if self.shape is None:
            log.warning("perf/mfu not logged: no FLOPs formula for %s (%s)", cfg.actor.model.path, why)
        self.teacher_shape: Optional[FlopsShape] = None
        self.distill = cfg.algorithm.distill.enabled and cfg.teacher.model is not None  # (off: no teacher is built)
        if self.distill:
            self.teacher_shape, why = load_flops_shape(cfg.teacher.model.path)
            if self.teacher_shape is None and self.shape is not None:
                log.warning("perf/* FLOPs leave out the teacher's pass: no FLOPs formula for %s (%s)",
                            cfg.teacher.model.path, why)
        self.lora = cfg.actor.lora.enabled
        self.frozen_tower = cfg.actor.model.freeze_vision_tower
        self.ppo_epochs = cfg.actor.ppo_epochs
        self.recompute_old_logprob = cfg.old_logprob_source == "pass"  # (folded into the update: no pass)
        self.devices = cfg.world_size
        self.device = resolve_device(cfg.trainer.device)
        self.dtype = compute_dtype(cfg)
        self.num_threads = cfg.trainer.num_threads or None
        self._peak: Optional[float] = cfg.trainer.peak_flops or None
        self._peak_known = self._peak is not None
        self.peak_source = "trainer.peak_flops" if self._peak_known else ""

    def peak(self) -> Optional[float]:
        """Peak FLOP/s of one device, resolved on first use (on CPU: a cached benchmark)."""
        if not self._peak_known:
            self._peak_known = True
            if self.shape is not None:
                self._peak, self.peak_source = device_peak_flops(self.device, self.dtype, self.num_threads)
                if self._peak is None:
                    log.warning("perf/mfu not logged: %s", self.peak_source)
        return self._peak

    def metrics(self, batch: Batch, generated: dict[str, list[Lengths]], times: dict[str, float],
                skipped: Optional[dict[str, list[int]]] = None) -> dict[str, float]:
        """``generated``: phase name (``rollout``, ``baseline_rollout``) -> lengths of each
        generate call's sequences; ``times``: seconds per phase (PhaseTimer.times); ``skipped``:
        phase -> prompt lengths of the copies its passes did not run (:func:`skipped_prompts`)."""
        prompt, response = sequence_lengths(batch)
        tokens = sum(prompt) + sum(response)
        step_time = sum(times.values())
        rollout = generated.get("rollout", [])
        teacher = self.distill and "teacher_logprob" in times  # (the teacher's pass ran this step)
        policy_passes = int(self.recompute_old_logprob) + int("ref" in times)  # (the policy's weights, or the ref's)
        logprob_passes = policy_passes + int(teacher)
        logprob_time = ((times.get("old_logprob", 0.0) if self.recompute_old_logprob else 0.0) + times.get("ref", 0.0)
                        + (times["teacher_logprob"] if teacher else 0.0))
        m: dict[str, float] = {}

        def rate(key: str, amount: float, seconds: float) -> None:
            if seconds > 0:
                m[key] = amount / seconds

        rate("perf/rollout_tokens_per_s", sum(sum(r) for _, r in rollout), times.get("rollout", 0.0))
        if logprob_passes:
            rate("perf/logprob_tokens_per_s", logprob_passes * tokens, logprob_time)
        if "update" in times:
            rate("perf/update_tokens_per_s", self.ppo_epochs * tokens, times["update"])
        rate("perf/tokens_per_s", tokens, step_time)
        if self.shape is None or tokens == 0:
            return m

        forward = self.shape.batch_forward_flops(prompt, response)
        skipped = skipped or {}

        def saved(phase: str, training: bool = False, shape: FlopsShape = self.shape) -> int:
            """The FLOPs of the prompt copies the phase's passes did not run."""
            if training:
                return sum(shape.training_flops(p, 0, lora=self.lora) for p in skipped.get(phase, ()))
            return sum(shape.forward_flops(p, 0) for p in skipped.get(phase, ()))

        passes = [p for p, on in (("old_logprob", self.recompute_old_logprob), ("ref", "ref" in times)) if on]
        phase_flops = {
            "rollout": sum(self.shape.batch_forward_flops(p, r) for p, r in rollout) - saved("rollout"),
            "logprob": sum(forward - saved(p) for p in passes),
            "update": (self.ppo_epochs * self.shape.batch_training_flops(prompt, response, lora=self.lora)
                       - saved("update", training=True) if "update" in times else 0),
        }
        # a VL model's tower encodes every sequence's images in each pass (the rollout too: the n
        # samples of a prompt are generated as n sequences). In the update: frozen, forward only
        # (nothing upstream of it needs a gradient); LoRA, forward + activation gradients (2x);
        # trained, forward + backward (3x)
        patches = image_patches(batch)
        vision = sum(self.shape.vision_flops(p) for p in patches)
        if teacher and self.teacher_shape is not None:  # its own model's forward over the same sequences
            t = self.teacher_shape
            phase_flops["logprob"] += (t.batch_forward_flops(prompt, response) - saved("teacher_logprob", shape=t)
                                       + sum(t.vision_flops(p) for p in patches))
        if vision:
            phase_flops["rollout"] += vision
            phase_flops["logprob"] += policy_passes * vision
            if phase_flops["update"]:
                phase_flops["update"] += self.ppo_epochs * vision * (1 if self.frozen_tower else 2 if self.lora else 3)
        # (ReMax's greedy baseline: one sequence per prompt, nothing shared)
        baseline = sum(self.shape.batch_forward_flops(p, r) for p, r in generated.get("baseline_rollout", []))
        total = sum(phase_flops.values()) + baseline
        m["perf/flops_per_token"] = forward / tokens
        m["perf/step_flops"] = float(total)
        peak = self.peak()
        if peak is None:
            return m
        m["perf/peak_flops"] = peak
        m["perf/mfu"] = mfu(total, step_time, peak, self.devices)
        phase_time = {"rollout": times.get("rollout", 0.0), "logprob": logprob_time, "update": times.get("update", 0.0)}
        for phase, flops in phase_flops.items():
            if flops and phase_time[phase] > 0:
                m[f"perf/{phase}_mfu"] = mfu(flops, phase_time[phase], peak, self.devices)
        return m
