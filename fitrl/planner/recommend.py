"""Recommendations: single changes to the config, ranked by what they cost in speed, each
re-planned so its effect is a prediction in GiB, not advice.

Every candidate is a list of dotted overrides of keys the run applies (``rollout.sleep_level``,
``rollout.gpu_memory_utilization``, ``data.max_pixels`` ...), except ``plan.emulate.*`` ones where
the fix is to drop another framework's engine behaviour that a reproduced run emulates.
Those that remove a problem, or are faster and keep the plan fitting, are reported in speed
order (the cheapest one that fits always among those shown); when no single one fits, the
cheapest ones are combined greedily until the plan fits. LoRA (``actor.lora.rank=16``) is
offered only where it alone makes the plan fit, with the other training changes, and only to
runs on an engine whose planner models LoRA (``EnginePlanner.plans_lora``: the HF engine; the
vLLM engine's plan does not model LoRA's merged-weight push). An engine's own candidates come
from its planner (fitrl/memory/engines.py), in the speed tier each belongs to.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from fitrl.config import ConfigError
from fitrl.config.loader import config_from_dict, config_to_dict
from fitrl.memory.change import Change
from fitrl.memory.sharding import sharding_plan
from fitrl.memory.engines import engine_planner
from fitrl.memory.model import Plan
from fitrl.models.check import ulysses_refusal
from fitrl.planner.plan import plan_config

LORA_RANK = 16  # the LoRA recommendation's rank (all-linear, the actor.lora defaults otherwise)


@dataclass
class Recommendation:
    change: Change
    plan: Plan
    gpu_delta: int            # device peak, new - old (bytes)
    host_delta: int           # node host peak, new - old
    base_growth: int = 0      # the original plan's host growth per step

    @property
    def fits(self) -> bool:
        """The change makes the verdict ``fits`` (not merely ``tight``)."""
        return self.plan.verdict == "fits"


def _get(cfg, key: str):
    obj = cfg
    for part in key.split("."):
        obj = obj[part] if isinstance(obj, dict) else getattr(obj, part)  # (reward.sources is by name)
    return obj


def candidates(plan: Plan) -> list[Change]:
    """Changes in order of speed cost: faster first, then free, then slower, then task changes."""
    cfg, out = plan.cfg, []
    engine = engine_planner(cfg)
    ray = cfg.trainer.backend == "ray"
    cuda = plan.hardware.device == "cuda"
    reference = plan.spec.reference and not cfg.actor.lora.enabled  # a reference model of its own

    def flip(key: str, cost: str, want: bool) -> None:
        if _get(cfg, key) != want:
            out.append(Change([(key, want)], cost, f"{key} {str(not want).lower()} -> {str(want).lower()}"))

    def offload(prefix: str, what: str) -> Optional[str]:  # the key of the section's sharding backend
        return sharding_plan(_get(cfg, prefix)).offload_key(prefix, what)

    hw = plan.hardware
    if not ray and cuda and hw.nodes * hw.gpus_per_node > 1:
        out.append(Change([("trainer.backend", "ray"), ("trainer.nnodes", hw.nodes),
                           ("trainer.devices_per_node", hw.gpus_per_node)], "faster: every device trains",
                          f"shard with {sharding_plan(cfg.actor).title} over {hw.nodes * hw.gpus_per_node} devices "
                          f"(trainer.backend=ray)"))
    out += [Change([(key, value)], cost, text) for key, value, cost, text in
            sharding_plan(cfg.actor).candidates("actor", cfg.actor, ray)]
    if cuda:
        roles = ["actor", "ref"] if reference else ["actor"]
        moves = [(r, w) for r in roles for w in ("states", "params", "optimizer") if not (r == "ref" and w == "optimizer")]
        keys = [k for k in (offload(r, w) for r, w in moves) if k is not None]
        on = [(k, False) for k in keys if _get(cfg, k)]
        if len(on) > 1:
            out.append(Change(on, "faster: no host<->device copies", "offload off (" + ", ".join(k for k, _ in on) + ")"))
        for key in keys:
            flip(key, "faster: no host<->device copies", False)
    if reference and (cfg.ref.model or cfg.actor.model).dtype == "float32":
        out.append(Change([("ref.model", {"path": (cfg.ref.model or cfg.actor.model).path, "dtype": "bfloat16"})],
                          "faster (bf16 forward of the frozen model)", "ref.model.dtype float32 -> bfloat16"))
    models = {n: src for n, src in cfg.reward.sources.items() if src.kind != "function"}  # reward models, judges
    for n, src in models.items():
        key = offload(f"reward.sources.{n}", "params")
        if cuda and key is not None and _get(cfg, key):
            flip(key, "faster: no host<->device copies", False)
        if src.model.dtype == "float32":
            out.append(Change([(f"reward.sources.{n}.model.dtype", "bfloat16")], "faster (bf16 forward of a frozen model)",
                              f"reward.sources.{n}.model.dtype float32 -> bfloat16"))
    out += engine.candidates(plan, "faster")
    longest = cfg.actor.micro_batch_size * cfg.rollout.max_response_length
    if cfg.actor.logprob_chunk_size > 1024 and longest > 1024:
        out.append(Change([("actor.logprob_chunk_size", 1024)], "no speed cost: chunked log-probs",
                          f"actor.logprob_chunk_size {cfg.actor.logprob_chunk_size} -> 1024 (chunked log-probs)"))
    if cfg.trainer.val_before_train and cfg.data.val_files:
        flip("trainer.val_before_train", "skips the validation before step 1", False)
    out += engine.candidates(plan, "slower")
    halve = [("data.val_batch_size", "smaller validation generate calls"),
             ("rollout.micro_batch_size", "slower generation (smaller batches)"),
             ("actor.logprob_micro_batch_size", "slightly slower log-probs"),
             ("ref.logprob_micro_batch_size", "slightly slower reference log-probs"),
             ("actor.micro_batch_size", "slower update (more, smaller micro-batches)")]
    halve += [(f"reward.sources.{n}.micro_batch_size", f"slower {n} scoring (smaller batches)") for n in models]
    for key, cost in halve:
        v = _get(cfg, key)
        if v > 1:
            out.append(Change([(key, v // 2)], cost, f"{key} {v} -> {v // 2}"))
    out += engine.candidates(plan, "cache")
    u = _next_ulysses(plan) if ray else None
    if u:
        out.append(Change([("actor.ulysses_size", u)],
                          f"slower: {u}x fewer data-parallel ranks, an all-to-all around every attention layer",
                          f"actor.ulysses_size {cfg.actor.ulysses_size} -> {u} (each sequence split over {u} ranks)"))
    flip("actor.model.gradient_checkpointing", "~30% slower update (recompute)", True)
    if cuda and ray:
        slower = [("actor", "optimizer", "slower: optimizer states copied each update"),
                  ("actor", "params", "slower: weights copied each phase")]
        slower += [("ref", "params", "slower: reference weights copied each step")] if reference else []
        # a reward model is on the device only in the phases it scores
        slower += [(f"reward.sources.{n}", "params", f"slower: {n}'s weights copied each step") for n in models]
        for prefix, what, cost in slower:
            key = offload(prefix, what)
            if key is not None:
                flip(key, cost, True)
    rbs, mini = cfg.data.rollout_batch_size, cfg.actor.mini_batch_size
    if rbs > 1 and rbs % 2 == 0:
        changes = [("data.rollout_batch_size", rbs // 2)] + ([("actor.mini_batch_size", mini // 2)]
                                                             if mini > rbs // 2 or (rbs // 2) % mini else [])
        out.append(Change(changes, "fewer prompts per step (training change)", f"data.rollout_batch_size {rbs} -> {rbs // 2}"))
    if not cfg.actor.lora.enabled and engine.plans_lora:
        out.append(Change([("actor.lora.rank", LORA_RANK)], "training change: adapters train, the base is frozen",
                          f"LoRA (actor.lora.rank={LORA_RANK})", only_if_fits=True))
    d = cfg.data
    if plan.shape.vision is not None and d.limit_images and d.max_pixels > 262144:
        out.append(Change([("data.max_pixels", d.max_pixels // 4)], "lower image resolution (task change)",
                          f"data.max_pixels {d.max_pixels:,} -> {d.max_pixels // 4:,}"))
    return out


def _next_ulysses(plan: Plan) -> Optional[int]:
    """The smallest Ulysses group above the current one that the world, the model's heads and
    the run allow (fitrl/models/check.py, ``check_sequence_parallel``), if any."""
    cfg = plan.cfg
    if cfg.algorithm.adv_estimator == "gae":
        return None
    for u in range(cfg.actor.ulysses_size + 1, cfg.world_size + 1):
        if not cfg.world_size % u and ulysses_refusal(plan.shape.raw, cfg.actor.model.attn_implementation, u) is None:
            return u
    return None


def _apply(plan: Plan, change: Change) -> Optional[Plan]:
    data = config_to_dict(plan.cfg)
    for key, value in change.overrides:
        parts = key.split(".")
        node = data
        for p in parts[:-1]:
            if not isinstance(node.get(p), dict):
                node[p] = {}
            node = node[p]
        node[parts[-1]] = value
    try:
        cfg = config_from_dict(data)
    except ConfigError:
        return None  # e.g. a micro-batch that no longer divides the mini-batch
    # the same expected lengths (the data is not read again); the verdict alone needs the second plan
    return plan_config(cfg, plan.hardware, shape=plan.shape, lengths=plan.lengths, expected_if_needed=True,
                       supervised=plan.layout is not None and plan.layout.mode == "supervised")


def _overshoot(plan: Plan) -> int:
    """Bytes over the limits at the top of the plan's band, summed over the problems (0 when it fits)."""
    return sum(p.short for p in plan.problems())


def _worst(plan: Plan) -> int:
    """Bytes over the limit of the worst problem: the peak that decides the verdict (0 when it fits)."""
    return max((p.short for p in plan.problems()), default=0)


def _peaks(plan: Plan) -> tuple[int, int]:
    p = plan.peaks().values()
    return max(g for g, _ in p), max(h for _, h in p)


def recommend(plan: Plan, limit: int = 8, first_fit: bool = False) -> tuple[list[Recommendation], Optional[Recommendation]]:
    """(single changes worth showing, in speed order; a combination that fits when no single one does).
    ``first_fit``: stop at the cheapest single change that fits (the one ``fitrl train`` would name)."""
    base_gpu, base_host = _peaks(plan)
    failing = {p.resource for p in plan.problems()}
    shown: list[Recommendation] = []
    for change in candidates(plan):
        new = _apply(plan, change)
        if new is None:
            continue
        gpu, host = _peaks(new)
        rec = Recommendation(change, new, gpu - base_gpu, host - base_host, plan.growth_per_step)
        if change.only_if_fits and not (failing and new.verdict == "fits"):
            continue
        helps = _overshoot(new) < _overshoot(plan)
        faster_and_fits = not failing and change.cost.startswith("faster") and new.verdict == "fits"
        if (failing and helps) or faster_and_fits:
            shown.append(rec)
            if first_fit and failing and rec.fits:
                break
    combo = None
    if failing and not any(r.fits for r in shown):  # (combined cheapest in speed first)
        combo = _combine(plan, shown, base_gpu, base_host)
    if failing:  # shown: a change that leaves the worst overshoot where it is (it lowered a lesser peak) goes after
        shown.sort(key=lambda r: _worst(r.plan) >= _worst(plan))
    cheapest = next((i for i, r in enumerate(shown) if r.fits), None)
    if cheapest is not None and cheapest >= limit:  # the cheapest change that fits is always shown
        return shown[:limit - 1] + [shown[cheapest]], combo
    return shown[:limit], combo


def _combine(plan: Plan, singles: list[Recommendation], base_gpu: int, base_host: int) -> Optional[Recommendation]:
    """Apply helpful changes cheapest-first until the plan fits."""
    current, applied = plan, []
    for rec in singles:
        new = _apply(current, rec.change)
        if new is None:
            continue
        before, after = _overshoot(current), _overshoot(new)
        if after < before and not ({p.resource for p in new.problems()} - {p.resource for p in current.problems()}):
            current, applied = new, applied + [rec.change]
            if current.verdict == "fits":
                gpu, host = _peaks(current)
                change = Change([o for c in applied for o in c.overrides], "; ".join(c.cost for c in applied),
                                " + ".join(c.text for c in applied))
                return Recommendation(change, current, gpu - base_gpu, host - base_host, plan.growth_per_step)
    return None


def as_overrides(change: Change) -> list[str]:
    """The change as command-line overrides (``ref.model`` becomes its two keys)."""
    out = []
    for key, value in change.overrides:
        if isinstance(value, dict):
            out += [f"{key}.{k}={v}" for k, v in value.items()]
        else:
            out.append(f"{key}={str(value).lower() if isinstance(value, bool) else value}")
    return out

