"""Every extension owns its whole footprint: the completeness check behind
``tests/test_extension_points.py``.

- A rollout engine is registered twice, beside itself (fitrl/rollout/): its runtime in
  :data:`fitrl.rollout.engine.ROLLOUT_ENGINES` and its memory planner in
  :data:`fitrl.memory.engines.ENGINE_PLANNERS`, under the same name. A name with only one of the
  two would run unplanned or plan what cannot run. The config's ``rollout.engine`` is checked
  against the engines' registry when it loads (fitrl/core/registry.py, ``CHECKED_ON_LOAD``). What
  the engine declares it can do (its ``capabilities``) is the light table's entry for that name
  (fitrl/core/engines.py), and the default engine computes with the trained module
  (``RolloutConfig.trainer_engine`` runs it beside rollout workers).
- A vision-language model type (a ``vision`` row of fitrl/core/model_types.py) is claimed by a
  model family (fitrl/models/families/) that describes its vision tower (tensors and FLOPs: what
  the memory plan and the FLOP counter read, ``ModelFamily.vision_tower``) and its media
  processing (what the data path and the engines call, ``ModelFamily.media_spec``); every type a
  family claims is a row of the table.
- Every model type (text or vision-language) has its decoder described by the family that claims
  it (``ModelFamily.decoder_layout``: the layers' tensors, KV cache and FLOPs per token), of the
  kind its row declares (``dense`` or ``moe``, fitrl/models/decoder.py): without one the memory
  plan refuses the type, where it would otherwise have to guess a dense model.
- A model-holding role is registered twice as well: its workers in :data:`fitrl.roles.workers.ROLES`
  and its memory planner in :data:`fitrl.memory.roles.ROLE_PLANNERS`, under the same name (a role
  without a planner is also refused when a run builds it: fitrl/trainer/run.py, ``make_group``),
  and it has its line in the run layout (:data:`fitrl.config.layout.ROLE_LINES`: when a run
  builds it; without one no run would).
- A sharding backend is registered twice, in its own folder (fitrl/sharding/<name>/): its runtime
  in :data:`fitrl.distributed.sharding.SHARDING_BACKENDS` and its memory planner in
  :data:`fitrl.memory.sharding.SHARDING_PLANNERS`, under the same name.

It lives in the trainer layer, the lowest that sees the roles, the engines and the planners.
:func:`missing_counterparts` names each gap, so a new engine or family without its counterparts
fails a test rather than a user's plan.
"""

from __future__ import annotations


def missing_counterparts() -> list[str]:
    """One line per registered name that lacks a counterpart (empty: every extension is complete)."""
    return _engine_gaps() + _family_gaps() + _role_gaps() + _sharding_gaps()


def _engine_gaps() -> list[str]:
    import fitrl.rollout  # noqa: F401  (registers the built-in engines and their planners)
    from fitrl.config.rollout import DEFAULT_ENGINE
    from fitrl.core.engines import ENGINE_CAPABILITIES
    from fitrl.memory.engines import ENGINE_PLANNERS
    from fitrl.rollout.engine import ROLLOUT_ENGINES

    out = []
    for name in ROLLOUT_ENGINES:
        if name not in ENGINE_PLANNERS:
            out.append(f"rollout engine {name!r} has no memory planner (fitrl/memory/engines.py, ENGINE_PLANNERS)")
    for name in ENGINE_PLANNERS:
        if name not in ROLLOUT_ENGINES:
            out.append(f"engine planner {name!r} plans an engine that is not registered (ROLLOUT_ENGINES)")
    for name in ROLLOUT_ENGINES:  # (ROLLOUT_ENGINES.add enters them: a gap here is a table written by hand)
        if name not in ENGINE_CAPABILITIES or ENGINE_CAPABILITIES.get(name) != ROLLOUT_ENGINES.get(name).capabilities:
            out.append(f"rollout engine {name!r}: its capabilities in fitrl/core/engines.py (ENGINE_CAPABILITIES) are "
                       f"not the ones its class declares")
    for name in ENGINE_CAPABILITIES:
        if name not in ROLLOUT_ENGINES:
            out.append(f"engine capabilities {name!r} describe an engine that is not registered (ROLLOUT_ENGINES)")
    if DEFAULT_ENGINE in ENGINE_CAPABILITIES and ENGINE_CAPABILITIES.get(DEFAULT_ENGINE).holds_own_weights:
        out.append(f"the default rollout engine {DEFAULT_ENGINE!r} holds weights of its own; it must compute with "
                   f"the trained module (fitrl/config/rollout.py, RolloutConfig.trainer_engine)")
    return out


def _family_gaps() -> list[str]:
    """Every model type's family describes its decoder (of the row's kind), and a vision-language
    one its tower and media; every family claims only types that have a row."""
    from fitrl.core.model_types import MODEL_TYPES
    from fitrl.models.families import CAUSAL_LM, MODEL_FAMILIES, family_of_type

    out = []
    for row in MODEL_TYPES.values():
        family = family_of_type(row.name)
        out += _decoder_gap(row, family)
        if not row.vision:
            continue
        if family is CAUSAL_LM:
            out.append(f"vision-language model type {row.name!r} is claimed by no model family "
                       f"(fitrl/models/families/, ModelFamily.model_types)")
            continue
        out += _tower_gaps(row, family)
    for name in MODEL_FAMILIES:
        for kind in sorted(MODEL_FAMILIES.get(name).model_types - set(MODEL_TYPES)):
            out.append(f"model family {name!r} claims model type {kind!r}, which has no row in "
                       f"fitrl/core/model_types.py")
    return out


def _tower_gaps(row, family) -> list[str]:
    from fitrl.models.families import ModelFamily

    return [f"model family {family.name!r} describes no {what} of {row.name!r} (ModelFamily.{method})"
            for method, what in (("vision_tower", "vision tower (its tensors and FLOPs, for the memory plan)"),
                                 ("media_spec", "media processing (images to model inputs, for the data path)"))
            if getattr(type(family), method) is getattr(ModelFamily, method)]


def _decoder_gap(row, family) -> list[str]:
    layout = family.decoder_layout(row.name)
    if layout is not None and layout.kind == row.kind:
        return []
    described = "none" if layout is None else f"a {layout.kind} one"
    return [f"model type {row.name!r} has a {row.kind} decoder (fitrl/core/model_types.py) and model family "
            f"{family.name!r} describes {described} (ModelFamily.decoder_layout, fitrl/models/decoder.py)"]


def _role_gaps() -> list[str]:
    from fitrl.config.layout import ROLE_LINES
    from fitrl.memory.roles import ROLE_PLANNERS
    from fitrl.roles.workers import ROLES

    out = [f"role {name!r} has no memory planner (fitrl/memory/roles.py, ROLE_PLANNERS)"
           for name in ROLES if name not in ROLE_PLANNERS]
    out += [f"role planner {name!r} plans a role that is not registered (fitrl/roles/workers.py, ROLES)"
            for name in ROLE_PLANNERS if name not in ROLES]
    out += [f"role {name!r} has no line in the run layout (fitrl/config/layout.py, ROLE_LINES): no run would "
            f"build it" for name in ROLES if name not in ROLE_LINES]
    out += [f"run layout line {name!r} builds a role that is not registered (fitrl/roles/workers.py, ROLES)"
            for name in ROLE_LINES if name not in ROLES]
    return out


def _sharding_gaps() -> list[str]:
    import fitrl.sharding  # noqa: F401  (registers the built-in backends and their planners)
    from fitrl.distributed.sharding import SHARDING_BACKENDS
    from fitrl.memory.sharding import SHARDING_PLANNERS

    out = [f"sharding backend {name!r} has no memory planner (fitrl/memory/sharding.py, SHARDING_PLANNERS)"
           for name in SHARDING_BACKENDS if name not in SHARDING_PLANNERS]
    out += [f"sharding planner {name!r} plans a backend that is not registered (fitrl/distributed/sharding.py, "
            f"SHARDING_BACKENDS)" for name in SHARDING_PLANNERS if name not in SHARDING_BACKENDS]
    return out
